"""Multi-device checks on 8 host CPU devices. ``test_shard.py`` runs this file in a subprocess
with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (the flag must be set before JAX
starts, so these tests cannot share a process with the others).

Every check compares a distributed computation with the same foldax call on one device
(whose correctness against float64 references the other test files establish), values and
gradients, and inspects the compiled program: no all-gather or all-to-all, and per-device
memory that is a share of the single-device figure.
"""

from __future__ import annotations

import functools
import os
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import ALL, assert_allclose, check_each, data_scale, op, random_partition, segment_data
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import foldax
from foldax._tools import workloads as w

if jax.device_count() != 8:  # pragma: no cover - guarded by test_shard.py
    pytest.skip("needs XLA_FLAGS=--xla_force_host_platform_device_count=8", allow_module_level=True)

assert "device_count=8" in os.environ.get("XLA_FLAGS", "")

EXPLICIT = jax.make_mesh((8,), ("d",))
AUTO = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
GRID = jax.make_mesh((2, 4), ("a", "b"))
ROWS = {"explicit": (EXPLICIT, P("d")), "auto": (AUTO, P("d")), "grid": (GRID, P(("a", "b")))}


def put(x, mesh, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def collectives(compiled) -> set[str]:
    return set(re.findall(r"\b(all-gather|all-to-all|all-reduce|collective-permute)", compiled))


def assert_no_gather(text):
    found = collectives(text) & {"all-gather", "all-to-all"}
    assert not found, f"the compiled program moves data between devices with {found}"


def shared_rng(key: str) -> np.random.Generator:
    """The data of the cases that share ``key``, so that their one-device reference compiles
    (and runs) once: seeded from ``key`` xor ``FOLDAX_TEST_SEED``, as the ``rng`` fixture is
    from a test's node id."""
    base = int(os.environ.get("FOLDAX_TEST_SEED", "0"))
    s = zlib.crc32(key.encode()) ^ base
    print(f"rng seed: {s} (key {key!r}, FOLDAX_TEST_SEED={base})")
    return np.random.default_rng(s)


def mesh_partition(rng):
    """A random partition (empty and size-1 segments) padded to a multiple of 8 rows, whose
    segments span the boundaries between the devices' rows."""
    part = random_partition(rng, num_segments=12, max_size=30)
    sizes = part.sizes.copy()
    sizes[-1] += (-sizes.sum()) % 8
    return sizes


# ----------------------------------------------------------------------------------------------
# Segment reductions under jit


def segment_call(form, sizes, fn=None):
    """``(data, theta, ids, traced sizes) -> {name: (out, d data, d theta)}`` for every name."""
    s = len(sizes)

    def one(name, x, theta, ids, tsizes):
        f = op(name)
        model = (lambda r: r @ theta) if fn else None

        def run(x, theta):
            if form == "sizes":
                return f(x * theta[0], sizes=sizes)
            if form == "traced_sizes":
                return f(x * theta[0], sizes=tsizes)
            if form == "sorted_ids":
                return f(x * theta[0], ids, s, indices_are_sorted=True)
            if form == "unsorted_ids":
                return f(x * theta[0], ids, s)
            return f(x, sizes=sizes, fn=model)

        out, pull = jax.vjp(run, x, theta)
        ct = jnp.cos(jnp.arange(out.size, dtype=out.dtype)).reshape(out.shape)
        ct = jnp.where(jnp.isfinite(out), ct, 0)
        return (out, *pull(ct))

    return jax.jit(lambda *a: {name: one(name, *a) for name in ALL})


@functools.cache  # the meshes of a form share its data and its one-device program and values
def segment_case(form):
    """``(args, call, one-device values)`` of ``form``'s case: a partition whose segments span
    the devices' rows, ties across a device boundary."""
    rng = shared_rng(f"segment on mesh {form}")
    sizes = mesh_partition(rng)
    s, n = len(sizes), int(sizes.sum())
    ids = np.repeat(np.arange(s), sizes).astype(np.int32)
    feature = (3,) if form == "fn" else (2,)
    x = segment_data(rng, ids, s, feature)
    x[ids == ids[n // 2]] = x[ids == ids[n // 2]].max()  # ties across a device boundary
    if form == "unsorted_ids":
        perm = rng.permutation(n)
        x, ids = x[perm], ids[perm]
    theta = rng.standard_normal(3).astype(np.float32)
    args = (x, theta, ids, sizes.astype(np.int32))
    call = segment_call(form, sizes, fn=form == "fn")
    return args, call, call(*args)


@pytest.mark.parametrize(
    "mesh_name, form",
    [
        ("explicit", "sizes"),
        ("explicit", "traced_sizes"),
        ("explicit", "sorted_ids"),
        ("explicit", "unsorted_ids"),
        ("explicit", "fn"),
        ("auto", "sizes"),
        ("auto", "fn"),
        ("grid", "unsorted_ids"),
    ],
)
def test_segment_on_mesh_equals_one_device(mesh_name, form):
    mesh, spec = ROWS[mesh_name]
    (x, theta, ids, sizes), call, want = segment_case(form)
    dist = (put(x, mesh, spec), theta, put(ids, mesh, spec), sizes)
    got = call(*dist)
    assert_no_gather(call.lower(*dist).compile().as_text())
    scale = data_scale(x) * (4 if form == "fn" else 1)
    # d theta sums every row's contribution: its magnitude is their sum's, not one row's (the
    # log-softmax's cancels to ~5 from rows summing to ~3e5 in absolute value; the one-device
    # and the mesh program each land within float32's rounding of that of the float64 value)
    rows = float(np.abs(x[np.isfinite(x)]).sum()) * (4 if form == "fn" else 1)
    scales = {"value": scale * 10, "d data": scale * 10, "d theta": max(scale * 10, rows)}

    def check(name):
        for a, b, what in zip(got[name], want[name], scales, strict=True):
            assert_allclose(a, b, dtype=np.float32, scale=scales[what], err_msg=what)

    check_each(ALL, check)


def test_segment_nan_and_inf_cross_devices(rng):
    """NaN and +inf on one device must win over the other devices' finite values."""
    sizes = np.array([40, 40, 0, 48], np.int64)  # segments 0, 1, 3 span devices (16 rows each)
    x = rng.standard_normal(128).astype(np.float32)
    x[5] = np.nan  # segment 0, device 0
    x[60] = np.inf  # segment 1, device 3
    call = jax.jit(lambda x: {n: op(n)(x, sizes=sizes) for n in ALL})
    want, got = call(x), call(put(x, EXPLICIT, P("d")))
    check_each(ALL, lambda n: assert_allclose(got[n], want[n], dtype=np.float32, scale=4))


def test_segment_vmap_over_theta_nested(rng):
    """The seed pattern: vmap (twice) over parameters, the rows split over the mesh."""
    sizes = mesh_partition(rng)
    x = rng.standard_normal((int(sizes.sum()), 5)).astype(np.float32)
    thetas = rng.standard_normal((2, 3, 5)).astype(np.float32)

    def per_theta(theta, x):
        return foldax.segment_logmeanexp(x, sizes=sizes, fn=lambda r: w.model(theta, r))

    def grad_one(theta, x):
        return jax.grad(lambda t: jnp.sum(per_theta(t, x)))(theta)

    both = jax.jit(
        lambda t, x: (
            jax.vmap(jax.vmap(per_theta, (0, None)), (0, None))(t, x),
            jax.vmap(jax.vmap(grad_one, (0, None)), (0, None))(t, x),
        )
    )
    want, got = both(thetas, x), both(thetas, put(x, EXPLICIT, P("d", None)))
    for a, b in zip(got, want, strict=True):
        assert_allclose(a, b, dtype=np.float32, scale=100)


def test_segment_empty_partition_on_mesh():
    x = put(np.ones((16, 2), np.float32), EXPLICIT, P("d"))
    out = jax.jit(lambda x: foldax.segment_max(x, jnp.zeros((16,), jnp.int32), 0))(x)
    assert out.shape == (0, 2)


# ----------------------------------------------------------------------------------------------
# Segment reductions inside shard_map (axis_name)


def axis_name_run(form, sizes, s):
    """``run(name, x, theta, ids, axis)``: reduction ``name`` of ``form``'s case, inside a
    shard_map over ``axis`` (or on one device, ``axis=None``)."""

    def run(name, x, theta, ids, axis):
        f, kw = op(name), {"axis_name": axis} if axis else {}
        if form == "sizes":
            return f(x * theta[None, :], sizes=sizes, **kw)
        if form == "unsorted_ids":
            return f(x * theta[None, :], ids, s, **kw)
        # A model with a Python-scalar constant: it must replay inside shard_map.
        return f(x, sizes=sizes, fn=lambda r: -0.5 * jnp.sum((r - theta[None, :]) ** 2, -1), **kw)

    return run


def axis_name_program(f):
    """``(loss and its gradient, every reduction's values)`` of ``f(name, x, theta, ids)``, in
    one program (one compilation). The loss is ``sum(where(isfinite(o), o, 0) ** 2)`` over the
    reductions' outputs ``o``; its gradient is the pullback of ``o``'s VJP (one trace of every
    reduction gives both the values and the gradient) of the loss's cotangent
    ``2 * where(isfinite(o), o, 0)``: what ``jax.value_and_grad`` of the loss computes."""

    def run(x, theta, ids):
        outs, pull = jax.vjp(lambda x, t: [f(name, x, t, ids) for name in ALL], x, theta)
        kept = [jnp.where(jnp.isfinite(o), o, 0) for o in outs]
        total = sum(jnp.sum(o**2) for o in kept)
        return (total, pull([2 * o for o in kept])), dict(zip(ALL, outs, strict=True))

    return jax.jit(run)


@functools.cache  # check_vma True and False share the data and the one-device results
def axis_name_case(form):
    """``(args, sizes, s, one-device loss and gradient, one-device values)`` of ``form``."""
    rng = shared_rng(f"segment axis_name {form}")
    sizes = mesh_partition(rng)
    s, n = len(sizes), int(sizes.sum())
    ids = np.repeat(np.arange(s), sizes).astype(np.int32)
    if form == "unsorted_ids":
        ids = ids[rng.permutation(n)]
    x = segment_data(rng, ids, s, (3,), shifts=(-5.0, 0.0, 5.0))
    theta = rng.standard_normal(3).astype(np.float32)
    args = (x, theta, ids)
    run = axis_name_run(form, sizes, s)
    want, ref = axis_name_program(lambda name, x, t, i: run(name, x, t, i, None))(*args)
    return args, sizes, s, want, ref


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("form", ["sizes", "unsorted_ids", "fn"])
def test_segment_axis_name_inside_shard_map(check_vma, form):
    args, sizes, s, want, ref = axis_name_case(form)
    run = axis_name_run(form, sizes, s)

    def dist(name, x, theta, ids):
        x = jax.reshard(x, NamedSharding(EXPLICIT, P("d")))
        ids = jax.reshard(ids, NamedSharding(EXPLICIT, P("d")))
        out = P("d") if name in ("softmax", "log_softmax") else P()
        body = lambda x, t, i: run(name, x, t, i, "d")  # noqa: E731
        spec = (P("d"), P(), P("d"))
        sm = jax.shard_map(body, mesh=EXPLICIT, in_specs=spec, out_specs=out, check_vma=check_vma)
        return sm(x, theta, ids)

    got, values = axis_name_program(dist)(*args)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_allclose(a, b, dtype=np.float32, scale=float(np.abs(b).max()) + 1)
    check_each(ALL, lambda nm: assert_allclose(values[nm], ref[nm], dtype=np.float32, scale=10))


@pytest.mark.parametrize(
    "axis, match",
    [
        ("nope", r"foldax\.segment_sum: axis_name='nope' is not a mesh"),
        ("d", r"sizes sum to 16 but data has N = 128"),  # sizes describe all rows
    ],
)
def test_segment_axis_name_errors(axis, match):
    sm = jax.shard_map(
        lambda x: foldax.segment_sum(x, sizes=[16], axis_name=axis),
        mesh=EXPLICIT,
        in_specs=P("d"),
        out_specs=P(),
    )
    with pytest.raises(ValueError, match=match):
        jax.jit(sm)(put(np.ones(128, np.float32), EXPLICIT, P("d")))


# ----------------------------------------------------------------------------------------------
# Memory and communication of the seed workload


def test_seed_workload_per_device_memory():
    """Per device: arguments are 1/8 of one device's, temp memory the same up to O(S) bytes;
    the only collective is an all-reduce."""
    prob = w.seed_problem(repeat=1)
    s = len(prob.sizes)
    n = prob.n + (-prob.n) % 8  # padding rows carry the id S: dropped, the ids stay sorted
    x = jax.ShapeDtypeStruct((n, 5), jnp.float32)
    x8 = jax.ShapeDtypeStruct((n, 5), jnp.float32, sharding=NamedSharding(EXPLICIT, P("d")))
    thetas = jax.ShapeDtypeStruct((10, 5), jnp.float32)
    fwd, grad = w.forward_and_grad(w.way_foldax_padded(prob.sizes, n))
    for f in (fwd, grad):
        one = jax.jit(f).lower(thetas, x).compile()
        eight = jax.jit(f).lower(thetas, x8).compile()
        r1 = foldax.memory.report_from_compiled(one)
        r8 = foldax.memory.report_from_compiled(eight)
        assert r8.argument_bytes <= r1.argument_bytes / 8 + thetas.size * 4, (r1, r8)
        # The streaming bound holds per device: the same chunk buffers. What a device adds is
        # O(S): its share of the segment bounds (three (S,) int32 slices of the per-device
        # tables, constants on one device) and an (S,) collective buffer.
        assert r8.temp_bytes <= r1.temp_bytes + 5 * 4 * s, (r1, r8)
        text = eight.as_text()
        assert_no_gather(text)
        assert "all-reduce" in collectives(text)


# ----------------------------------------------------------------------------------------------
# Pairwise reductions


PAIR_REDUCTIONS = ("sum", "logsumexp", "max", "min", "argmax", "argmin", "kmin", "softmax")
PAIR_SPLITS = {
    "y": (EXPLICIT, P(), P("d")),
    "x": (EXPLICIT, P("d"), P()),
    "grid": (GRID, P("a"), P("b")),
    "auto": (AUTO, P("d"), P()),
    "ring": (EXPLICIT, P("d"), P("d")),  # both over the same axis: y's blocks go round
    "ring_grid": (GRID, P(("a", "b")), P("b")),
}


@functools.cache  # one program per width: the splits' one-device reference compiles once
def pair_call(width):
    def one(red, x, y, t):
        if red == "softmax":
            kernel = lambda a, b: (-jnp.sum((a - b) ** 2) * t, b * 2.0)  # noqa: E731
        else:
            kernel = lambda a, b: -jnp.sum((a - b) ** 2) * t  # noqa: E731
        kw = {"k": 3} if red == "kmin" else {}

        def run(x, y, t):
            out = foldax.pairwise_reduce(kernel, x, y, reduction=red, block_size=width, **kw)
            return out[0] if red == "kmin" else out

        if red in ("argmax", "argmin"):
            return (run(x, y, t),)
        out, pull = jax.vjp(run, x, y, t)
        return (out, *pull(jnp.sin(jnp.arange(out.size, dtype=out.dtype)).reshape(out.shape)))

    return jax.jit(lambda *a: {r: one(r, *a) for r in PAIR_REDUCTIONS})


@pytest.mark.parametrize("split", list(PAIR_SPLITS))
def test_pairwise_on_mesh_equals_one_device(rng, split):
    mesh, px, py = PAIR_SPLITS[split]
    x = rng.standard_normal((40, 3)).astype(np.float32)
    y = rng.standard_normal((56, 3)).astype(np.float32)
    y[7] = y[50]  # a tie across devices: argmin/kmin keep the lower index
    t = np.float32(1.3)
    call = pair_call((8, 4))
    want = call(x, y, t)
    args = (put(x, mesh, px), put(y, mesh, py), t)
    got = call(*args)
    assert_no_gather(call.lower(*args).compile().as_text())

    def check(red):
        for a, b in zip(got[red], want[red], strict=True):
            if jnp.issubdtype(a.dtype, jnp.integer):
                np.testing.assert_array_equal(a, b)
            else:
                assert_allclose(a, b, dtype=np.float32, scale=50)

    check_each(PAIR_REDUCTIONS, check, prefix="pairwise ")


def test_pairwise_partly_shared_axes_are_an_error():
    x = put(np.ones((16, 2), np.float32), GRID, P("a"))
    y = put(np.ones((16, 2), np.float32), GRID, P(("a", "b")))
    with pytest.raises(ValueError, match=r"foldax\.pairwise_reduce: y's rows are split over"):
        jax.jit(lambda x, y: foldax.pairwise_reduce(lambda a, b: a @ b, x, y))(x, y)


PAIR_AXIS_REDUCTIONS = ("sum", "logsumexp", "max", "kmin")


def pair_axis_run(red, x, y, t, axis=None):
    k = lambda a, b: -0.5 * jnp.sum((a - b) ** 2) * t  # noqa: E731
    kw = {"k": 2} if red == "kmin" else {}
    out = foldax.pairwise_reduce(k, x, y, reduction=red, block_size=(8, 4), axis_name=axis, **kw)
    return out[0] if red == "kmin" else out


def pair_axis_total(f):
    """The loss (every reduction's outputs against fixed weights) and its gradient."""

    def weights(out):  # a fixed linear functional: well conditioned, unlike sin(out)
        return out * jnp.cos(jnp.arange(out.size, dtype=out.dtype)).reshape(out.shape)

    return jax.jit(
        jax.value_and_grad(
            lambda x, y, t: sum(jnp.sum(weights(f(r, x, y, t))) for r in PAIR_AXIS_REDUCTIONS),
            (0, 1, 2),
        )
    )


@functools.cache  # check_vma True and False share the data and the one-device results
def pair_axis_case():
    rng = shared_rng("pairwise axis_name")
    x = rng.standard_normal((24, 3)).astype(np.float32)
    y = rng.standard_normal((64, 3)).astype(np.float32)
    return x, y, pair_axis_total(pair_axis_run)(x, y, np.float32(0.9))


@pytest.mark.parametrize("check_vma", [True, False])
def test_pairwise_axis_name_inside_shard_map(check_vma):
    x, y, want = pair_axis_case()

    def dist(red, x, y, t):
        y = jax.reshard(y, NamedSharding(EXPLICIT, P("d")))
        body = lambda x, y, t: pair_axis_run(red, x, y, t, "d")  # noqa: E731
        spec = (P(), P("d"), P())
        sm = jax.shard_map(body, mesh=EXPLICIT, in_specs=spec, out_specs=P(), check_vma=check_vma)
        return sm(x, y, t)

    got = pair_axis_total(dist)(x, y, np.float32(0.9))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_allclose(a, b, dtype=np.float32, scale=20)
    if check_vma:
        body = lambda x, y: foldax.pairwise_reduce(lambda a, b: a @ b, x, y, axis_name="d")  # noqa: E731
        sm = jax.shard_map(body, mesh=EXPLICIT, in_specs=(P("d"), P("d")), out_specs=P("d"))
        with pytest.raises(ValueError, match=r"x varies along axis_name \('d',\)"):
            jax.jit(sm)(put(x[:16], EXPLICIT, P("d")), put(y, EXPLICIT, P("d")))


def test_pairwise_cross_entropy_with_the_vocabulary_split():
    """``linear_cross_entropy`` with ``w``'s vocabulary split over 8 devices (``axis_name``,
    labels global): values, log-sum-exps and gradients equal one device's, with ignored
    tokens, a soft cap, label smoothing and z-loss; only per-token statistics cross devices
    (no all-gather, no collective of a ``(T, V)`` or ``(V, D)`` array)."""
    rng = shared_rng("cross entropy vocabulary")
    t, v, d = 24, 8 * 40, 8
    h = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    wv = jnp.asarray(0.5 * rng.standard_normal((v, d)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, v, t), jnp.int32).at[jnp.asarray([2, 7])].set(-100)
    opts = dict(logit_soft_cap=4.0, label_smoothing=0.1, z_loss=1e-3, return_lse=True)

    def loss(h, w, axis_name=None):
        out, lse = foldax.linear_cross_entropy(h, w, labels, axis_name=axis_name, **opts)
        return out + 1e-3 * jnp.sum(lse), (out, lse)

    def split(h, w):
        body = lambda h, w: loss(h, w, "d")  # noqa: E731
        specs = dict(in_specs=(P(), P("d")), out_specs=(P(), (P(), P())))
        return jax.shard_map(body, mesh=EXPLICIT, **specs)(h, w)

    one = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(h, wv)
    w8 = put(wv, EXPLICIT, P("d"))
    eight = jax.jit(jax.value_and_grad(split, (0, 1), has_aux=True))
    got = eight(h, w8)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(one), strict=True):
        assert_allclose(a, b, dtype=np.float32, scale=20)
    text = eight.lower(h, w8).compile().as_text()
    assert_no_gather(text)
    for line in text.splitlines():
        if re.search(r"all-reduce(-start)?\(", line):
            shape = re.search(r"f32\[([0-9,]*)\]", line)
            sizes = [int(n) for n in shape.group(1).split(",") if n] if shape else []
            assert np.prod(sizes, dtype=np.int64) <= t * d, line  # per token, or dh


def test_pairwise_per_device_memory():
    """y split over 8 devices: per-device arguments shrink, temp memory does not grow."""
    m, n = 512, 1 << 14
    x = jax.ShapeDtypeStruct((m, 3), jnp.float32)
    y = jax.ShapeDtypeStruct((n, 3), jnp.float32)
    y8 = jax.ShapeDtypeStruct((n, 3), jnp.float32, sharding=NamedSharding(EXPLICIT, P("d")))

    def f(x, y):
        k = lambda a, b: jnp.exp(-jnp.sum((a - b) ** 2))  # noqa: E731
        return jax.grad(lambda x, y: jnp.sum(foldax.pairwise_reduce(k, x, y)), (0, 1))(x, y)

    one = jax.jit(f).lower(x, y).compile()
    eight = jax.jit(f).lower(x, y8).compile()
    r1, r8 = (foldax.memory.report_from_compiled(c) for c in (one, eight))
    assert r8.argument_bytes <= m * 3 * 4 + n * 3 * 4 / 8, (r1, r8)
    assert r8.temp_bytes <= r1.temp_bytes, (r1, r8)
    assert_no_gather(eight.as_text())
    # x and y both split over the same axis: the ring. Per device, a share of both.
    x8 = jax.ShapeDtypeStruct((m, 3), jnp.float32, sharding=NamedSharding(EXPLICIT, P("d")))
    ring = jax.jit(f).lower(x8, y8).compile()
    rr = foldax.memory.report_from_compiled(ring)
    assert rr.argument_bytes <= (m + n) * 3 * 4 / 8, (r1, rr)
    assert rr.temp_bytes <= r1.temp_bytes, (r1, rr)
    assert_no_gather(ring.as_text())
    assert "collective-permute" in collectives(ring.as_text())


# ----------------------------------------------------------------------------------------------
# S4 kernels


@pytest.mark.parametrize("split", ["H", "N", "L"])
def test_cauchy_and_vandermonde_on_mesh(rng, split):
    h, n, length = 8, 16, 24
    v = (rng.standard_normal((h, n)) + 1j * rng.standard_normal((h, n))).astype(np.complex64)
    wp = (-0.5 + 1j * rng.standard_normal((h, n))).astype(np.complex64)
    z = np.exp(2j * np.pi * np.arange(length) / length).astype(np.complex64)
    pole = {"H": P("d", None), "N": P(None, "d"), "L": P()}[split]
    node = P("d") if split == "L" else P()

    def both(v, wp, z):
        def loss(v, wp, z):
            k = foldax.cauchy(v, z, wp, conjugate=True)
            kv = foldax.vandermonde(v, wp, length, conjugate=True)
            return jnp.sum(jnp.abs(k) ** 2) + jnp.sum(kv**2)

        return jax.value_and_grad(loss, (0, 1, 2))(v, wp, z)

    call = jax.jit(both)
    want = call(v, wp, z)
    args = (put(v, EXPLICIT, pole), put(wp, EXPLICIT, pole), put(z, EXPLICIT, node))
    got = call(*args)
    assert_no_gather(call.lower(*args).compile().as_text())
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert_allclose(np.abs(a), np.abs(b), dtype=np.float32, scale=float(np.abs(b).max()))
        assert_allclose(np.real(a), np.real(b), dtype=np.float32, scale=float(np.abs(b).max()))


@pytest.mark.parametrize("check_vma", [True, False])
def test_cauchy_axis_name_inside_shard_map(rng, check_vma):
    h, n, length = 4, 32, 16
    v = (rng.standard_normal((h, n)) + 1j * rng.standard_normal((h, n))).astype(np.complex64)
    wp = (-0.5 + 1j * rng.standard_normal((h, n))).astype(np.complex64)
    z = np.exp(2j * np.pi * np.arange(length) / length).astype(np.complex64)

    def dist(v, wp, z):
        v = jax.reshard(v, NamedSharding(EXPLICIT, P(None, "d")))
        wp = jax.reshard(wp, NamedSharding(EXPLICIT, P(None, "d")))
        body = lambda v, wp, z: foldax.cauchy(v, z, wp, axis_name="d")  # noqa: E731
        spec = (P(None, "d"), P(None, "d"), P())
        return jax.shard_map(
            body, mesh=EXPLICIT, in_specs=spec, out_specs=P(), check_vma=check_vma
        )(v, wp, z)

    def vg(f):
        return jax.jit(jax.value_and_grad(lambda *a: jnp.sum(jnp.abs(f(*a)) ** 2), (0, 1, 2)))

    want = vg(lambda v, wp, z: foldax.cauchy(v, z, wp))(v, wp, z)
    with jax.set_mesh(EXPLICIT):  # the loss is a scalar on the mesh: its gradient's seed too
        got = vg(dist)(v, wp, z)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert_allclose(np.real(a), np.real(b), dtype=np.float32, scale=float(np.abs(b).max()))
        assert_allclose(np.imag(a), np.imag(b), dtype=np.float32, scale=float(np.abs(b).max()))


def test_replicated_inputs_on_a_mesh():
    """Inputs replicated on an Explicit mesh (nothing split) give the one-device results."""
    x = np.linspace(-2, 2, 24, dtype=np.float32).reshape(12, 2)
    ids = (np.arange(12) % 3).astype(np.int32)
    v = (np.linspace(1, 2, 16) + 0.5j).astype(np.complex64).reshape(2, 8)
    xr, idr, vr = (put(a, EXPLICIT, P()) for a in (x, ids, v))

    def all_three(x, ids, v):
        soft = foldax.segment_softmax(x, ids, 3)
        pair = foldax.pairwise_reduce(lambda a, b: jnp.sum(a * b), x, x, reduction="logsumexp")
        vand = foldax.vandermonde(v, v - 2.0, 5, conjugate=True)
        return soft, pair, vand

    call = jax.jit(jax.value_and_grad(lambda *a: sum(jnp.sum(o) for o in all_three(*a)), (0, 2)))
    for a, b in zip(
        jax.tree.leaves(call(xr, idr, vr)), jax.tree.leaves(call(x, ids, v)), strict=True
    ):
        assert_allclose(np.real(a), np.real(b), dtype=np.float32, scale=100)


def test_set_mesh_context_replicated_and_split():
    """Inside ``with jax.set_mesh(mesh)`` (Explicit axes), calls whose ``fn`` / kernel closes over
    an array, on split and replicated inputs, give the one-device values and gradients."""
    x = np.linspace(-2, 2, 64 * 3, dtype=np.float32).reshape(64, 3)
    w = np.asarray([0.5, -1.0, 2.0], np.float32)

    def both(x, w):
        seg = foldax.segment_logsumexp(x, sizes=[20, 44], fn=lambda r: jnp.sin(r @ w))
        pair = foldax.pairwise_reduce(lambda a, b: jnp.sum(a * b * w), x[:8], x)
        return jnp.sum(seg) + jnp.sum(pair)

    call = jax.jit(jax.value_and_grad(both, (0, 1)))
    want = call(x, w)
    with jax.set_mesh(EXPLICIT):
        for spec in (P("d"), P()):
            got = call(put(x, EXPLICIT, spec), put(w, EXPLICIT, P()))
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                assert_allclose(a, b, dtype=np.float32, scale=100)
