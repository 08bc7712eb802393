"""Shared test helpers: the tolerance table, the one comparison helper, partitions and data,
calling a reduction with a partition in each of its forms, and many reductions per compilation.

The reductions and their references (float64 NumPy/SciPy for values, dense plain-``jnp`` for
derivatives) are in :mod:`registry`; they are re-exported here."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import registry
from registry import (  # noqa: F401  (re-exported: the references live in the registry)
    NO_INDEX,
    PAIRWISE,
    SEGMENT,
    SHIFTS,
    dense,
    dense_matrix,
    identity,
    pairwise_dense,
    pairwise_reference,
    reference,
)

# ----------------------------------------------------------------------------------------------
# Tolerances: the ONLY place where tolerances live.
#
# rtol / atol: comparing a foldax result in ``dtype`` with a float64 reference (or with a dense
#   jnp computation in the same dtype). ``atol`` is multiplied by the magnitude of the inputs
#   (``scale``), since e.g. ``x - logsumexp(x)`` loses absolute, not relative, precision when
#   ``|x| ~ 1000``.
# fd_eps / fd_tol: step and tolerance of finite-difference gradient checks
#   (``jax.test_util.check_grads``).

TOL: dict[np.dtype, dict[str, float]] = {
    np.dtype(np.float32): {"rtol": 2e-5, "atol": 2e-6, "fd_eps": 1e-3, "fd_tol": 2e-2},
    np.dtype(np.float64): {"rtol": 1e-11, "atol": 1e-12, "fd_eps": 1e-6, "fd_tol": 1e-6},
    np.dtype(jnp.float16): {"rtol": 5e-3, "atol": 5e-3},
    np.dtype(jnp.bfloat16): {"rtol": 4e-2, "atol": 4e-2},
}


def tol(dtype) -> dict[str, float]:
    return TOL[np.dtype(dtype)]


def assert_allclose(actual, desired, *, dtype, scale=1.0, err_msg=""):
    """``actual`` (any array, complex ones by real and imaginary part) against ``desired`` with
    the tolerance of ``dtype``.

    NaNs must match NaNs and infinities must match infinities of the same sign, exactly.
    ``scale`` is the magnitude of the inputs the result was computed from (see :data:`TOL`).
    """
    t = tol(dtype)
    if np.iscomplexobj(actual) or np.iscomplexobj(desired):  # real and imaginary parts
        actual, desired = (np.asarray(a, np.complex128) for a in (actual, desired))
        actual, desired = (np.stack([a.real, a.imag], -1) for a in (actual, desired))
    actual = np.asarray(actual, dtype=np.float64)
    desired = np.asarray(desired, dtype=np.float64)
    assert actual.shape == desired.shape, f"shape {actual.shape} != {desired.shape}. {err_msg}"
    np.testing.assert_array_equal(
        np.isnan(actual), np.isnan(desired), err_msg=f"NaN pattern. {err_msg}"
    )
    np.testing.assert_array_equal(
        np.where(np.isinf(actual), actual, 0.0),
        np.where(np.isinf(desired), desired, 0.0),
        err_msg=f"inf pattern. {err_msg}",
    )
    np.testing.assert_allclose(
        actual,
        desired,
        rtol=t["rtol"],
        atol=t["atol"] * float(scale),
        equal_nan=True,
        err_msg=err_msg,
    )


def data_scale(*arrays) -> float:
    """The magnitude of the finite entries of ``arrays`` (at least 1), for ``assert_allclose``."""
    m = 1.0
    for a in arrays:
        a = np.asarray(a, dtype=np.float64)
        fin = a[np.isfinite(a)]
        if fin.size:
            m = max(m, float(np.max(np.abs(fin))))
    return m


# ----------------------------------------------------------------------------------------------
# The public API: names by group (the reductions themselves are in registry.py)

REDUCTIONS = ("sum", "mean", "max", "min", "logsumexp", "logmeanexp")
NORMALIZERS = registry.NORMALIZERS
ALL = REDUCTIONS + NORMALIZERS
#: the reductions beyond those of ``jax.ops`` and ``jax.nn``'s softmax family
MORE = ("prod", "var", "std", "argmax", "argmin")
EVERY = registry.EVERY
DIFFERENTIABLE = registry.DIFFERENTIABLE
INDEX = registry.INDEX  # argmax, argmin
LOG_FAMILY = ("logsumexp", "logmeanexp", "softmax", "log_softmax")
INT_OK = tuple(n for n in ALL if SEGMENT[n].int_ok)
PUBLIC_NAMES = {name: SEGMENT[name].public_name for name in EVERY}


def op(name):
    return SEGMENT[name].fn


# ----------------------------------------------------------------------------------------------
# Random partitions and data


@dataclasses.dataclass(frozen=True)
class Partition:
    """A contiguous partition of ``n`` rows into ``len(sizes)`` segments, in every form."""

    sizes: np.ndarray  # (S,) int64

    @property
    def num_segments(self) -> int:
        return len(self.sizes)

    @property
    def n(self) -> int:
        return int(self.sizes.sum())

    @property
    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)

    @property
    def ids(self) -> np.ndarray:
        """Sorted segment ids ``(N,)``."""
        return np.repeat(np.arange(self.num_segments), self.sizes).astype(np.int32)


def random_partition(rng, num_segments=12, max_size=20) -> Partition:
    """Random sizes with empty and size-1 segments (at least one of each when ``S >= 2``) and
    segments larger than the small chunk sizes used in the tests."""
    s = num_segments
    sizes = rng.integers(2, max_size + 1, size=s)
    kind = rng.random(s)
    sizes[kind < 0.25] = 0
    sizes[(kind >= 0.25) & (kind < 0.4)] = 1
    if s >= 2:
        sizes[rng.choice(s, size=2, replace=False)] = [0, 1]
    if s >= 3 and sizes.max() < max_size:
        sizes[rng.choice(np.flatnonzero(sizes > 1)) if np.any(sizes > 1) else 0] = max_size
    if sizes.sum() == 0:
        sizes[0] = max_size
    return Partition(sizes.astype(np.int64))


def segment_data(rng, ids, num_segments, feature_shape=(), dtype=np.float32, shifts=SHIFTS):
    """Standard normal data ``(N, *feature_shape)`` plus a random shift per segment."""
    shift = rng.choice(np.asarray(shifts), size=num_segments + 1)
    ids = np.asarray(ids)
    seg_shift = shift[np.clip(ids, 0, num_segments)]
    x = rng.standard_normal((len(ids), *feature_shape))
    x = x + seg_shift.reshape((-1,) + (1,) * len(feature_shape))
    return x.astype(dtype)


def sample(rng, names, ids, num_segments, feature_shape=(), dtype=np.float32):
    """``{name: data}``: :func:`segment_data` with the shifts each reduction's data may take, in
    its domain (:class:`registry.SegmentReduction`); one draw for all the names that take the
    same shifts (for names that all take :data:`SHIFTS`: the one draw of ``segment_data(rng,
    ids, num_segments, feature_shape, dtype)``)."""
    drawn = {}
    for name in names:
        shifts = SEGMENT[name].shifts
        if shifts not in drawn:
            drawn[shifts] = segment_data(rng, ids, num_segments, feature_shape, dtype, shifts)
    return {n: np.asarray(SEGMENT[n].domain(drawn[SEGMENT[n].shifts]), dtype) for n in names}


def normal_rows(rng, n, feat=(), scale=1.0, shift=0.0):
    """Float32 rows ``(n, *feat)``: standard normal, times ``scale``, plus ``shift``."""
    return (rng.standard_normal((n, *feat)) * scale + shift).astype(np.float32)


def weights(rng, shape):
    """Normal weights ``shape`` scaled by ``1 / shape[-2]``: ``x @ w`` stays of order ``x``."""
    return (rng.standard_normal(shape) / shape[-2]).astype(np.float32)


def fn_inputs(rng, ids, num_segments, features=5, outputs=3, shift=1000.0):
    """Rows ``x`` and params ``w`` such that ``x @ w`` has per-segment scales -shift / 0 / +shift.

    The shift comes from the last column of ``x`` (-1, 0 or 1 per segment) times the last row of
    ``w`` (``shift``), not from ``x`` being ~1000: the gradient wrt ``w`` is then a
    well-conditioned sum (with ``|x| ~ 1000`` it would cancel to ~1e-3 of its terms, beyond
    float32).
    """
    x = rng.standard_normal((len(ids), features)).astype(np.float32)
    x[:, -1] = rng.choice([-1.0, 0.0, 1.0], size=num_segments + 1)[np.clip(ids, 0, num_segments)]
    w = weights(rng, (features, outputs))
    w[-1] = shift
    return x, w


# ----------------------------------------------------------------------------------------------
# Calling foldax with a partition in one of its forms

#: How the partition is passed. ``unsorted`` forms expect the caller to have permuted the rows.
FORMS = (
    "sizes",
    "offsets",
    "sorted_ids",
    "unsorted_ids",
    "jit_sizes",
    "jit_offsets",
    "jit_sorted_ids",
    "jit_unsorted_ids",
)


def permute_rows(rng, ids, *trees):
    """Permute the rows of ``ids`` and of every pytree in ``trees`` by one random permutation."""
    perm = rng.permutation(len(ids))
    return (np.asarray(ids)[perm], *(jax.tree.map(lambda a: a[perm], t) for t in trees))


def apply(name, data, ids, num_segments, form, *, chunk_size=7, fn=None, **kw):
    """``segment_<name>(data, ...)`` with the partition of row ids ``ids`` passed as ``form``
    (``kw``: more keywords, e.g. ``ddof``)."""
    f = op(name)
    kw = {"fn": fn, "chunk_size": chunk_size, **kw}
    ids = np.asarray(ids)
    if form in ("sizes", "offsets", "jit_sizes", "jit_offsets", "sorted_ids", "jit_sorted_ids"):
        assert np.all(np.diff(ids) >= 0), f"form {form!r} needs sorted ids"
    sizes = np.bincount(ids[(ids >= 0) & (ids < num_segments)], minlength=num_segments)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    if form in ("sizes", "offsets", "jit_sizes", "jit_offsets"):
        assert sizes.sum() == len(ids), f"form {form!r} needs in-range ids"
    if form == "sizes":
        return f(data, sizes=[int(s) for s in sizes], **kw)
    if form == "offsets":
        return f(data, offsets=[int(o) for o in offsets], **kw)
    if form in ("sorted_ids", "unsorted_ids"):
        return f(data, jnp.asarray(ids, jnp.int32), num_segments, **kw)
    if form == "jit_sizes":
        return jax.jit(lambda d, s: f(d, sizes=s, **kw))(data, jnp.asarray(sizes, jnp.int32))
    if form == "jit_offsets":
        return jax.jit(lambda d, o: f(d, offsets=o, **kw))(data, jnp.asarray(offsets, jnp.int32))
    if form == "jit_sorted_ids":
        g = jax.jit(lambda d, i: f(d, i, num_segments, indices_are_sorted=True, **kw))
        return g(data, jnp.asarray(ids, jnp.int32))
    if form == "jit_unsorted_ids":
        return jax.jit(lambda d, i: f(d, i, num_segments, **kw))(data, jnp.asarray(ids, jnp.int32))
    raise ValueError(form)


# ----------------------------------------------------------------------------------------------
# Checking a result against the registry's float64 reference


def expect(
    name, out, values, ids, num_segments, *, dtype=np.float32, scale=None, ddof=0, err_msg=""
):
    """``out`` of ``segment_<name>`` against the float64 reference computed from ``values``
    (= fn(data)): indices exactly (and int32), values with the tolerance of ``dtype`` and
    ``scale`` (by default the magnitude of ``values``)."""
    ref = reference(name, values, ids, num_segments, ddof=ddof)
    if SEGMENT[name].index:
        assert out.dtype == jnp.int32, f"{out.dtype}. {err_msg}"
        np.testing.assert_array_equal(out, ref, err_msg=err_msg)
        return
    scale = data_scale(values) if scale is None else scale
    assert_allclose(out, ref, dtype=dtype, scale=scale, err_msg=err_msg)


def expect_each(outs, values, ids, num_segments, err_msg=""):
    """:func:`expect` for every ``{name: out}`` of ``outs`` (float32); ``values``: one array for
    all, or ``{name: values}``; one report for all that fail."""

    def check(n):
        v = values[n] if isinstance(values, dict) else values
        expect(n, outs[n], v, ids, num_segments, err_msg=err_msg)

    check_each(outs, check)


# ----------------------------------------------------------------------------------------------
# Many reductions per test (one compilation) with one report for all of them


def jit_each(names, call):
    """``jax.jit`` of ``lambda *args: {name: call(name, *args) for name in names}``.

    One compilation for all reductions: compiling is what dominates the test time.
    """
    return jax.jit(lambda *args: {name: call(name, *args) for name in names})


def check_each(names, check, prefix="segment_"):
    """Run ``check(name)`` for every name; fail once, listing every name that failed."""
    failures = []
    for name in names:
        try:
            check(name)
        except AssertionError as e:
            failures.append(f"--- {prefix}{name}:\n{e}")
    if failures:
        failed = [f.split(":", 1)[0][4:] for f in failures]
        raise AssertionError(f"failed for {failed}\n" + "\n".join(failures))
