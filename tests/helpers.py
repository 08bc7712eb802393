"""Shared test helpers: the tolerance table, the one comparison helper, data generators and
references (float64 NumPy/SciPy for values, dense plain-``jnp`` for gradients)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import scipy.special

import foldax

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
# The public API

REDUCTIONS = ("sum", "mean", "max", "min", "logsumexp", "logmeanexp")
NORMALIZERS = ("softmax", "log_softmax")
ALL = REDUCTIONS + NORMALIZERS
LOG_FAMILY = ("logsumexp", "logmeanexp", "softmax", "log_softmax")
INT_OK = ("sum", "max", "min")
PUBLIC_NAMES = {name: f"foldax.segment_{name}" for name in ALL}


def op(name):
    return getattr(foldax, f"segment_{name}")


# ----------------------------------------------------------------------------------------------
# Random partitions and data

#: Per-segment shifts of the generated data: the scales of neighbouring segments differ by 1000
#: (and a segment whose max is ~-1000 underflows ``exp`` in any dtype).
SHIFTS = (-1000.0, 0.0, 1000.0)


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


# ----------------------------------------------------------------------------------------------
# float64 NumPy / SciPy references, one segment at a time


def _identity(name, dtype):
    dtype = np.dtype(dtype)
    if name == "sum":
        return 0
    if name in ("max", "min") and np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return info.min if name == "max" else info.max
    return {
        "mean": np.nan,
        "max": -np.inf,
        "min": np.inf,
        "logsumexp": -np.inf,
        "logmeanexp": np.nan,
    }[name]


def _reduce_one(name, seg):
    n = seg.shape[0]
    with np.errstate(all="ignore"):
        if name == "sum":
            return seg.sum(0)
        if name == "mean":
            return seg.mean(0)
        if name == "max":
            return seg.max(0)
        if name == "min":
            return seg.min(0)
        lse = scipy.special.logsumexp(seg, axis=0)
        return lse if name == "logsumexp" else lse - np.log(n)


def reference(name, values, ids, num_segments, out_dtype=None):
    """Reference of ``segment_<name>`` on ``values`` ``(N, ...)`` with row ids ``ids``.

    Floating values are computed in float64; integer values keep ``out_dtype``.
    """
    values = np.asarray(values)
    ids = np.asarray(ids)
    is_int = np.issubdtype(values.dtype, np.integer)
    work = values.astype(np.int64 if is_int else np.float64)
    feat = values.shape[1:]
    if name in NORMALIZERS:
        out = np.full(values.shape, np.nan)
        for s in range(num_segments):
            idx = ids == s
            if not idx.any():
                continue
            with np.errstate(all="ignore"):
                z = work[idx] - scipy.special.logsumexp(work[idx], axis=0)
                out[idx] = z if name == "log_softmax" else np.exp(z)
        return out
    out_dtype = out_dtype or (values.dtype if is_int else np.float64)
    out = np.empty((num_segments, *feat), dtype=out_dtype)
    for s in range(num_segments):
        seg = work[ids == s]
        out[s] = _reduce_one(name, seg) if seg.shape[0] else _identity(name, out_dtype)
    return out


# ----------------------------------------------------------------------------------------------
# Dense plain-jnp references, differentiable (for gradients), one static segment at a time


def _dense_lse(seg):
    m = jax.lax.stop_gradient(jnp.max(seg, axis=0))
    m = jnp.where(jnp.isfinite(m), m, jnp.zeros_like(m))
    s = jnp.sum(jnp.exp(seg - m[None]), axis=0)
    pos = s > 0
    return jnp.where(pos, m + jnp.log(jnp.where(pos, s, jnp.ones_like(s))), -jnp.inf)


def _dense_one(name, seg):
    n = seg.shape[0]
    if name == "sum":
        return jnp.sum(seg, axis=0)
    if name == "mean":
        return jnp.mean(seg, axis=0)
    if name == "max":
        return jnp.max(seg, axis=0)
    if name == "min":
        return jnp.min(seg, axis=0)
    if name == "logsumexp":
        return _dense_lse(seg)
    if name == "logmeanexp":
        return _dense_lse(seg) - np.log(n).astype(seg.dtype)
    if name == "log_softmax":
        return seg - _dense_lse(seg)[None]
    return jnp.exp(seg - _dense_lse(seg)[None])


def dense(name, values, ids, num_segments):
    """Plain-jnp ``segment_<name>`` of ``values`` (a jnp array, may be traced) by static ``ids``."""
    ids = np.asarray(ids)
    feat = values.shape[1:]
    if name in NORMALIZERS:
        out = jnp.full(values.shape, jnp.nan, values.dtype)
        for s in range(num_segments):
            rows = np.flatnonzero(ids == s)
            if rows.size:
                out = out.at[rows].set(_dense_one(name, values[rows]))
        return out
    parts = []
    for s in range(num_segments):
        rows = np.flatnonzero(ids == s)
        if rows.size:
            parts.append(_dense_one(name, values[rows]))
        else:
            parts.append(jnp.full(feat, _identity(name, values.dtype), values.dtype))
    if not parts:
        return jnp.zeros((0, *feat), values.dtype)
    return jnp.stack(parts)


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


def apply(name, data, ids, num_segments, form, *, chunk_size=7, fn=None):
    """``segment_<name>(data, ...)`` with the partition of row ids ``ids`` passed as ``form``."""
    f = op(name)
    kw = {"fn": fn, "chunk_size": chunk_size}
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
