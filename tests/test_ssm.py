"""foldax.cauchy / foldax.vandermonde (S4 / S4D kernels) against complex128 NumPy references,
dense jnp gradients, finite differences and XLA's memory figures."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_allclose, data_scale, tol
from helpers import check_each as _check_each_segment
from jax.test_util import check_grads

import foldax
from foldax.memory import report


def check_each(names, check):
    """``helpers.check_each`` with plain names in its failure messages."""
    _check_each_segment(names, check, prefix="")


F32 = np.float32
C64 = np.complex64
H, N, L = 3, 11, 23  # L, N: multiples of no block size


def _ri(a):
    """Real and imaginary parts stacked on a new leading axis (float64), for assert_allclose."""
    a = np.asarray(a)
    return np.stack([a.real, a.imag]).astype(np.float64)


def assert_close_complex(actual, desired, *, scale, err_msg=""):
    assert np.asarray(actual).shape == np.asarray(desired).shape, err_msg
    assert_allclose(_ri(actual), _ri(desired), dtype=F32, scale=scale, err_msg=err_msg)


# ----------------------------------------------------------------------------------------------
# Data and references


def cauchy_data(rng, complex_=True, v_shape=(H, N), z_shape=(L,), w_shape=(H, N)):
    """Poles in the left half-plane, nodes on (or right of) the imaginary axis: |z - w| >= 0.2."""
    if complex_:
        v = rng.standard_normal(v_shape) + 1j * rng.standard_normal(v_shape)
        w = -rng.uniform(0.2, 1.0, w_shape) + 3j * rng.standard_normal(w_shape)
        z = 1j * rng.uniform(-5.0, 5.0, z_shape) + rng.uniform(0.0, 0.1, z_shape)
        return v.astype(C64), z.astype(C64), w.astype(C64)
    v = rng.standard_normal(v_shape)
    w = -rng.uniform(0.2, 2.0, w_shape)
    z = rng.uniform(0.0, 3.0, z_shape)
    return v.astype(F32), z.astype(F32), w.astype(F32)


def np_cauchy(v, z, w, conjugate=False):
    v, z, w = (np.asarray(a).astype(np.complex128) for a in (v, z, w))
    terms = v[..., None, :] / (z[..., :, None] - w[..., None, :])
    if conjugate:
        terms = terms + np.conj(v)[..., None, :] / (z[..., :, None] - np.conj(w)[..., None, :])
    return terms.sum(-1), np.abs(terms).sum(-1).max()


def _same_rank(*arrays):
    """The arrays with leading singleton axes up to the largest rank (explicit broadcasting)."""
    rank = max(a.ndim for a in arrays)
    return [a.reshape((1,) * (rank - a.ndim) + a.shape) for a in arrays]


def dense_cauchy(v, z, w, conjugate=False):
    v, z, w = _same_rank(v, z, w)
    terms = v[..., None, :] / (z[..., :, None] - w[..., None, :])
    if conjugate:
        terms = terms + jnp.conj(v)[..., None, :] / (z[..., :, None] - jnp.conj(w)[..., None, :])
    return jnp.sum(terms, axis=-1)


def vandermonde_data(rng, complex_=True, v_shape=(H, N), x_shape=(H, N)):
    """Decaying exponents (S4D: ``dt * A`` with ``Re A < 0``)."""
    if complex_:
        v = rng.standard_normal(v_shape) + 1j * rng.standard_normal(v_shape)
        x = -rng.uniform(0.01, 0.3, x_shape) + 1j * rng.uniform(-1.0, 1.0, x_shape)
        return v.astype(C64), x.astype(C64)
    return rng.standard_normal(v_shape).astype(F32), -rng.uniform(0.01, 0.3, x_shape).astype(F32)


def np_vandermonde(v, x, length, conjugate=False):
    v, x = (np.asarray(a).astype(np.complex128) for a in (v, x))
    ls = np.arange(length)
    terms = v[..., None, :] * np.exp(x[..., None, :] * ls[:, None])
    out = terms.sum(-1)
    return (2 * out.real if conjugate else out), 2 * np.abs(terms).sum(-1).max()


def dense_vandermonde(v, x, length, conjugate=False):
    ls = jnp.arange(length).astype(x.dtype)
    v, x, ls = _same_rank(v[..., None, :], x[..., None, :], ls[:, None])
    out = jnp.sum(v * jnp.exp(x * ls), axis=-1)
    return 2 * jnp.real(out) if conjugate else out


BLOCKS = {"5x4": (5, 4), "default": None, "larger": 64, "1": 1}


# ----------------------------------------------------------------------------------------------
# Values


@pytest.mark.parametrize("conjugate", [False, True])
def test_cauchy_values(conjugate, rng):
    """H = 3 channels with a shared z, several tilings, against complex128 NumPy."""
    v, z, w = cauchy_data(rng)
    ref, scale = np_cauchy(v, z, w, conjugate)
    outs = jax.jit(
        lambda v, z, w: {
            name: foldax.cauchy(v, z, w, conjugate=conjugate, block_size=bs)
            for name, bs in BLOCKS.items()
        }
    )(v, z, w)

    def check(name):
        assert outs[name].dtype == jnp.complex64
        assert_close_complex(outs[name], ref, scale=scale, err_msg=name)

    check_each(list(outs), check)


def test_cauchy_broadcasting_and_real(rng):
    """Batch dims broadcast ((2, 1) x (3,) -> (2, 3)); real float32 inputs give a real kernel."""
    v, z, w = cauchy_data(rng, v_shape=(2, 1, N), z_shape=(3, L), w_shape=(N,))
    vr, zr, wr = cauchy_data(rng, complex_=False)
    vs, zs, ws = cauchy_data(rng, v_shape=(N,), z_shape=(L,), w_shape=(N,))
    out = jax.jit(
        lambda *a: (
            foldax.cauchy(*a[:3], block_size=(5, 4)),
            foldax.cauchy(*a[3:6], block_size=(5, 4)),
            foldax.cauchy(*a[6:], block_size=(5, 4), conjugate=True),
        )
    )(v, z, w, vr, zr, wr, vs, zs, ws)
    ref, scale = np_cauchy(v, z, w)
    assert out[0].shape == (2, 3, L)
    assert_close_complex(out[0], ref, scale=scale)
    ref, scale = np_cauchy(vr, zr, wr)
    assert out[1].dtype == jnp.float32 and out[1].shape == (H, L)
    assert_allclose(out[1], ref.real, dtype=F32, scale=scale)
    ref, scale = np_cauchy(vs, zs, ws, conjugate=True)
    assert out[2].shape == (L,)  # no batch dims at all
    assert_close_complex(out[2], ref, scale=scale)


@pytest.mark.parametrize("conjugate", [False, True])
def test_vandermonde_values(conjugate, rng):
    v, x = vandermonde_data(rng)
    ref, scale = np_vandermonde(v, x, L, conjugate)
    outs = jax.jit(
        lambda v, x: {
            name: foldax.vandermonde(v, x, L, conjugate=conjugate, block_size=bs)
            for name, bs in BLOCKS.items()
        }
    )(v, x)

    def check(name):
        out = outs[name]
        if conjugate:
            assert out.dtype == jnp.float32
            assert_allclose(out, ref, dtype=F32, scale=scale, err_msg=name)
        else:
            assert out.dtype == jnp.complex64
            assert_close_complex(out, ref, scale=scale, err_msg=name)

    check_each(list(outs), check)


def test_vandermonde_broadcasting_and_real(rng):
    v, x = vandermonde_data(rng, v_shape=(2, 1, N), x_shape=(3, N))
    vr, xr = vandermonde_data(rng, complex_=False)
    out = jax.jit(
        lambda v, x, vr, xr: (
            foldax.vandermonde(v, x, L, block_size=(5, 4)),
            foldax.vandermonde(vr, xr, 1, block_size=(5, 4)),
            foldax.vandermonde(vr, xr, L),
        )
    )(v, x, vr, xr)
    ref, scale = np_vandermonde(v, x, L)
    assert out[0].shape == (2, 3, L)
    assert_close_complex(out[0], ref, scale=scale)
    assert out[1].dtype == jnp.float32 and out[1].shape == (H, 1)
    assert_allclose(out[1], vr.astype(np.float64).sum(-1, keepdims=True), dtype=F32, scale=10)
    ref, scale = np_vandermonde(vr, xr, L)
    assert_allclose(out[2], ref.real, dtype=F32, scale=scale)


def test_vandermonde_complex_under_strict_promotion():
    v = jnp.asarray([1.0 + 0j, 0.5j], jnp.complex64)
    x = jnp.asarray([-0.5 + 1j, -0.1 + 0j], jnp.complex64)
    out = foldax.vandermonde(v, x, 5)
    ref, scale = np_vandermonde(v, x, 5)
    assert_close_complex(out, ref, scale=scale)


@pytest.mark.slow
def test_transformations(rng):
    """jit(vmap) over a leading axis equals the batched call; vmap of grad per channel."""
    v, z, w = cauchy_data(rng)

    def one(v, w):
        return foldax.cauchy(v, z, w, conjugate=True, block_size=(5, 4))

    def loss(v, w):
        return jnp.sum(jnp.abs(one(v, w)) ** 2)

    out, (gv, gw) = jax.jit(
        lambda v, w: (jax.vmap(one)(v, w), jax.vmap(jax.grad(loss, (0, 1)))(v, w))
    )(v, w)
    ref, scale = np_cauchy(v, z, w, True)
    assert_close_complex(out, ref, scale=scale)

    def dense_loss(v, w):
        return jnp.sum(jnp.abs(dense_cauchy(v, z, w, True)) ** 2)

    rv, rw = jax.vmap(jax.grad(dense_loss, (0, 1)))(v, w)
    assert_close_complex(gv, rv, scale=10 * data_scale(np.abs(rv)))
    assert_close_complex(gw, rw, scale=10 * data_scale(np.abs(rw)))


# ----------------------------------------------------------------------------------------------
# Gradients


def _complex_grads_close(got, want, names, err=""):
    for g, r, n in zip(got, want, names, strict=True):
        assert g.dtype == r.dtype, (n, g.dtype, r.dtype)
        assert_close_complex(g, r, scale=10 * data_scale(np.abs(r)), err_msg=f"{err} d/d{n}")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["complex", "conjugate", "real"])
def test_cauchy_grads_vs_dense(case, rng):
    """d/dv, d/dz, d/dw of ``sum |k|^2`` (and of ``sum Re k + Im k``) against dense jnp."""
    v, z, w = cauchy_data(rng, complex_=case != "real")
    conj = case == "conjugate"

    def losses(fn):
        def sq(v, z, w):
            return jnp.sum(jnp.abs(fn(v, z, w)) ** 2)

        def lin(v, z, w):
            k = fn(v, z, w)
            return jnp.sum(jnp.real(k) + 2 * jnp.imag(k))

        return jax.jit(lambda *a: [jax.grad(f, argnums=(0, 1, 2))(*a) for f in (sq, lin)])

    got = losses(lambda *a: foldax.cauchy(*a, conjugate=conj, block_size=(5, 4)))(v, z, w)
    want = losses(lambda *a: dense_cauchy(*a, conjugate=conj))(v, z, w)
    for g, r, what in zip(got, want, ("|k|^2", "Re+Im"), strict=True):
        _complex_grads_close(g, r, "vzw", what)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["complex", "conjugate", "real"])
def test_vandermonde_grads_vs_dense(case, rng):
    v, x = vandermonde_data(rng, complex_=case != "real")
    conj = case == "conjugate"

    def losses(fn):
        def sq(v, x):
            return jnp.sum(jnp.abs(fn(v, x)) ** 2)

        def lin(v, x):
            k = fn(v, x)
            return jnp.sum(jnp.real(k) + 2 * jnp.imag(k))

        return jax.jit(lambda *a: [jax.grad(f, argnums=(0, 1))(*a) for f in (sq, lin)])

    got = losses(lambda v, x: foldax.vandermonde(v, x, L, conjugate=conj, block_size=(5, 4)))(v, x)
    want = losses(lambda v, x: dense_vandermonde(v, x, L, conjugate=conj))(v, x)
    for g, r, what in zip(got, want, ("|k|^2", "Re+Im"), strict=True):
        _complex_grads_close(g, r, "vx", what)


@pytest.mark.slow
def test_check_grads_float64(rng):
    """Reverse-mode gradients against complex128 finite differences (jax.test_util)."""
    t = tol(np.float64)
    v, z, w = cauchy_data(rng, v_shape=(2, 5), z_shape=(7,), w_shape=(2, 5))
    vv, xv = vandermonde_data(rng, v_shape=(2, 5), x_shape=(2, 5))
    with jax.enable_x64(True):
        c128 = lambda a: jnp.asarray(a, jnp.complex128)  # noqa: E731
        args = tuple(map(c128, (v, z, w, vv, xv)))

        def f(v, z, w, vv, xv):
            return (
                foldax.cauchy(v, z, w, block_size=(3, 2)),
                foldax.cauchy(v, z, w, conjugate=True, block_size=(3, 2)),
                foldax.vandermonde(vv, xv, 7, block_size=(3, 2)),
                foldax.vandermonde(vv, xv, 7, conjugate=True, block_size=(3, 2)),
            )

        f = jax.jit(f)
        assert f(*args)[0].dtype == jnp.complex128
        assert all(np.isfinite(a).all() for a in f(*args))  # check_grads passes NaNs matching NaNs
        check_grads(
            f, args, order=1, modes=["rev"], eps=t["fd_eps"], atol=t["fd_tol"], rtol=t["fd_tol"]
        )


# ----------------------------------------------------------------------------------------------
# Memory: the S4 check (compiled only)

MB = 10**6


def _memory(n, which):
    c = jax.ShapeDtypeStruct
    v, w = c((256, n), jnp.complex64), c((256, n), jnp.complex64)
    if which == "cauchy":
        z = c((1024,), jnp.complex64)

        def fwd(v, z, w):
            return foldax.cauchy(v, z, w)

        args = (v, z, w)
    else:

        def fwd(v, w):
            return foldax.vandermonde(v, w, 1024)

        args = (v, w)

    def loss(*a):
        return jnp.sum(jnp.abs(fwd(*a)))

    grad = jax.grad(loss, argnums=tuple(range(len(args))))
    return report(fwd, *args).temp_bytes, report(grad, *args).temp_bytes


@pytest.mark.slow
@pytest.mark.parametrize("which", ["cauchy", "vandermonde"])
def test_memory_s4(which):
    """H = 256 channels, L = 1024, complex64: forward and gradient temp memory does not grow
    with N (64 -> 512) and stays far below the (H, L, N) tensor (1 GB at N = 512)."""
    small, big = _memory(64, which), _memory(512, which)
    for what, s, b in zip(("forward", "grad"), small, big, strict=True):
        assert b <= 1.15 * s, (what, small, big)
        assert b <= 16 * MB, (what, small, big)


# ----------------------------------------------------------------------------------------------
# Errors


def _c(*shape):
    return jnp.zeros(shape, jnp.complex64)


def _r(*shape):
    return jnp.zeros(shape, jnp.float32)


ERRORS = {
    "cauchy_conjugate_real": (
        TypeError,
        "foldax.cauchy",
        ("conjugate",),
        lambda: foldax.cauchy(_r(4), _r(5), _r(4), conjugate=True),
    ),
    "cauchy_conjugate_real_w": (
        TypeError,
        "foldax.cauchy",
        ("conjugate", "w"),
        lambda: foldax.cauchy(_c(4), _c(5), _r(4), conjugate=True),
    ),
    "cauchy_v_w_sizes": (
        ValueError,
        "foldax.cauchy",
        ("v", "w", "(3, 4)", "(3, 5)"),
        lambda: foldax.cauchy(_c(3, 4), _c(6), _c(3, 5)),
    ),
    "cauchy_batch": (
        ValueError,
        "foldax.cauchy",
        ("batch", "z"),
        lambda: foldax.cauchy(_c(3, 4), _c(2, 6), _c(3, 4)),
    ),
    "cauchy_scalar_z": (
        ValueError,
        "foldax.cauchy",
        ("z",),
        lambda: foldax.cauchy(_c(4), 1j, _c(4)),
    ),
    "cauchy_int_v": (
        TypeError,
        "foldax.cauchy",
        ("v",),
        lambda: foldax.cauchy(jnp.zeros(4, jnp.int32), _c(5), _c(4)),
    ),
    "cauchy_block_size_zero": (
        ValueError,
        "foldax.cauchy",
        ("block_size",),
        lambda: foldax.cauchy(_c(4), _c(5), _c(4), block_size=(0, 2)),
    ),
    "cauchy_block_size_triple": (
        ValueError,
        "foldax.cauchy",
        ("block_size",),
        lambda: foldax.cauchy(_c(4), _c(5), _c(4), block_size=(1, 2, 3)),
    ),
    "vandermonde_length_zero": (
        ValueError,
        "foldax.vandermonde",
        ("length",),
        lambda: foldax.vandermonde(_r(4), _r(4), 0),
    ),
    "vandermonde_length_negative": (
        ValueError,
        "foldax.vandermonde",
        ("length",),
        lambda: foldax.vandermonde(_r(4), _r(4), -3),
    ),
    "vandermonde_length_float": (
        TypeError,
        "foldax.vandermonde",
        ("length",),
        lambda: foldax.vandermonde(_r(4), _r(4), 5.0),
    ),
    "vandermonde_length_none": (
        TypeError,
        "foldax.vandermonde",
        ("length",),
        lambda: foldax.vandermonde(_r(4), _r(4), None),
    ),
    "vandermonde_v_x_sizes": (
        ValueError,
        "foldax.vandermonde",
        ("v", "x"),
        lambda: foldax.vandermonde(_r(4), _r(5), 3),
    ),
    "vandermonde_conjugate_real": (
        TypeError,
        "foldax.vandermonde",
        ("conjugate",),
        lambda: foldax.vandermonde(_r(4), _r(4), 3, conjugate=True),
    ),
    "vandermonde_batch": (
        ValueError,
        "foldax.vandermonde",
        ("batch",),
        lambda: foldax.vandermonde(_r(2, 4), _r(3, 4), 3),
    ),
    "vandermonde_int_x": (
        TypeError,
        "foldax.vandermonde",
        ("x",),
        lambda: foldax.vandermonde(_r(4), jnp.zeros(4, jnp.int32), 3),
    ),
    "vandermonde_block_size_negative": (
        ValueError,
        "foldax.vandermonde",
        ("block_size",),
        lambda: foldax.vandermonde(_r(4), _r(4), 3, block_size=-1),
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors(case):
    exc, name, words, call = ERRORS[case]
    with pytest.raises(exc) as info:
        call()
    msg = str(info.value)
    assert name in msg, msg
    for word in words:
        assert word in msg, f"{word!r} not in {msg!r}"


def test_cauchy_numpy_int_block_size(rng):
    v, z, w = cauchy_data(rng)
    out = foldax.cauchy(v, z, w, block_size=np.int64(4))
    ref, scale = np_cauchy(v, z, w)
    assert_close_complex(out, ref, scale=scale)


# ----------------------------------------------------------------------------------------------
# vandermonde_transpose: out[n] = v[n] sum_l u[l] exp(x[n] l)


def _vt_reference(u, v, x):
    u, v, x = (np.asarray(a, np.complex128) for a in (u, v, x))
    e = np.exp(x[..., :, None] * np.arange(u.shape[-1]))  # (..., N, L)
    return v * np.sum(e * u[..., None, :], axis=-1)


def _vt_inputs(rng, batch_u, batch_v, n, length):
    u = rng.standard_normal((*batch_u, length)).astype(np.float32)
    c = lambda *s: (rng.standard_normal(s) + 1j * rng.standard_normal(s)).astype(np.complex64)  # noqa: E731
    v = c(*batch_v, n)
    x = -0.01 - rng.uniform(0, 0.1, (*batch_v, n)) + 1j * rng.standard_normal((*batch_v, n))
    return u, v, x.astype(np.complex64)


@pytest.mark.parametrize(
    ("batch_u", "batch_v", "n", "length", "block"),
    [
        ((), (), 7, 33, None),
        ((3,), (), 16, 100, (4, 16)),
        ((2, 1), (1, 5), 9, 70, 8),
        ((), (4,), 1, 1, None),
    ],
)
def test_vandermonde_transpose_matches_complex128(rng, batch_u, batch_v, n, length, block):
    u, v, x = _vt_inputs(rng, batch_u, batch_v, n, length)
    got = jax.jit(lambda u, v, x: foldax.vandermonde_transpose(u, v, x, block_size=block))(u, v, x)
    want = _vt_reference(u, v, x)
    assert got.shape == want.shape and got.dtype == jnp.complex64
    assert_allclose(got, want, dtype=np.float32, scale=float(np.max(np.abs(want))))


@pytest.mark.slow
def test_vandermonde_transpose_gradients_and_vmap(rng):
    u, v, x = _vt_inputs(rng, (), (), 6, 40)

    def loss(u, v, x):
        return jnp.sum(jnp.abs(foldax.vandermonde_transpose(u, v, x)) ** 2)

    def dense(u, v, x):
        e = jnp.exp(x[:, None] * jnp.arange(u.shape[-1]).astype(x.dtype)[None, :])
        return jnp.sum(jnp.abs(v * (e @ u.astype(x.dtype))) ** 2)

    got = jax.grad(loss, argnums=(0, 1, 2))(u, v, x)
    with jax.enable_x64(True):
        want = jax.grad(dense, argnums=(0, 1, 2))(
            *(
                jnp.asarray(a, np.complex128 if np.iscomplexobj(a) else np.float64)
                for a in (u, v, x)
            )
        )
    for g, w in zip(got, want, strict=True):
        assert_allclose(g, np.asarray(w), dtype=np.float32, scale=float(np.max(np.abs(w))))
    transpose = jax.jit(lambda u: foldax.vandermonde_transpose(u, v, x))
    assert np.isfinite(transpose(u)).all()  # check_grads passes NaNs matching NaNs
    check_grads(
        transpose,
        (u,),
        order=2,
        modes=("fwd", "rev"),
        atol=2e-2,
        rtol=2e-2,
    )
    us = rng.standard_normal((5, 40)).astype(np.float32)
    batched = jax.vmap(lambda u: foldax.vandermonde_transpose(u, v, x))(us)
    assert_allclose(batched, _vt_reference(us, v[None], x[None]), dtype=np.float32, scale=100)
    assert_allclose(foldax.vandermonde_transpose(u[:0], v, x), np.zeros(6), dtype=np.float32)


def test_vandermonde_transpose_inside_shard_map(rng):
    u, v, x = _vt_inputs(rng, (), (), 5, 64)
    mesh = jax.make_mesh((1,), ("l",))
    u = jax.device_put(u, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("l")))
    f = jax.shard_map(
        lambda u, v, x: foldax.vandermonde_transpose(u, v, x, axis_name="l"),
        mesh=mesh,
        in_specs=(
            jax.sharding.PartitionSpec("l"),
            jax.sharding.PartitionSpec(),
            jax.sharding.PartitionSpec(),
        ),
        out_specs=jax.sharding.PartitionSpec(),
    )
    assert_allclose(jax.jit(f)(u, v, x), _vt_reference(u, v, x), dtype=np.float32, scale=100)


@pytest.mark.slow
def test_memory_vandermonde_transpose_flat():
    """H = 256, complex64: temp memory O(tile + N + L) when N grows 64 -> 512 or L grows 4x
    (at most one more (H, N) or (H, L) buffer; never the (H, L, N) tensor: 2 GB here)."""

    def mem(n, length):
        c = jax.ShapeDtypeStruct
        args = (
            c((256, length), jnp.float32),
            c((256, n), jnp.complex64),
            c((256, n), jnp.complex64),
        )
        f = foldax.vandermonde_transpose
        g = jax.grad(lambda *a: jnp.sum(jnp.abs(f(*a))), argnums=(0, 1, 2))
        return report(f, *args).temp_bytes, report(g, *args).temp_bytes

    base, more_n, more_l = mem(64, 1024), mem(512, 1024), mem(64, 4096)
    for b, s in zip(more_n, base, strict=True):  # O(N) at most: one (H, N) complex64 buffer
        assert b <= 1.15 * s + 256 * (512 - 64) * 8, (base, more_n)
    for b, s in zip(more_l, base, strict=True):  # O(L) at most: one (H, L) complex64 buffer
        assert b <= 1.15 * s + 256 * (4096 - 1024) * 8, (base, more_l)
        assert b <= 16 * MB
