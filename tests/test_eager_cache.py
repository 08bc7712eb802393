"""Eager calls: what the cache reads as values and what it leaves to the executable's inputs.

New segment ids (a loop over graph batches), ids under an eager ``vmap`` and a ``fn`` that calls
another foldax function run the executable of the first call; errors come once, from the call.

A cache hit runs no trace of the foldax function; traces are counted (the engine behind every
``segment_*`` entered), as well as XLA compilations. The test run shares a persistent
compilation cache, which serves a program compiled before without a compilation, so traces
are what each test asserts on."""

from __future__ import annotations

import gc
import sys
import traceback
import weakref
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_allclose

import foldax
from foldax import _eager

F32 = jnp.float32
S = 7
RNG = np.random.default_rng(0)
X = jnp.asarray(RNG.standard_normal((60, 3)), F32)


class _Counts:
    """While active: ``traces``, the calls of the engine behind every ``segment_*`` (a trace
    of a cached executable, or an uncached call), and ``compiles``, XLA's compilations."""

    def __enter__(self):
        self.traces = self.compiles = 0
        self._listener = lambda event, *a, **k: self._seen(event)
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        sys.setprofile(self._profile)
        return self

    def _profile(self, frame, event, arg):
        if event == "call" and frame.f_code.co_name == "_segment":
            self.traces += 1

    def _seen(self, event):
        if event == "/jax/core/compile/backend_compile_duration":
            self.compiles += 1

    def __exit__(self, *exc):
        sys.setprofile(None)
        jax.monitoring.unregister_event_duration_listener(self._listener)


def _ids(sorted_, n=60, lo=0, hi=S, dtype=np.int32):
    a = RNG.integers(lo, hi, n).astype(dtype)
    return np.sort(a) if sorted_ else a


@pytest.mark.parametrize("sorted_", [True, False], ids=["sorted", "unsorted"])
def test_new_id_arrays_run_one_executable(sorted_):
    """A loop over batches: a new jax.Array of ids on every call (some dropped) runs the first
    call's executable, with the right sums."""
    foldax.segment_sum(X, jnp.asarray(_ids(sorted_)), S)
    entries = len(_eager.CACHE)
    batches = [jnp.asarray(_ids(sorted_, lo=-2, hi=S + 2)) for _ in range(5)]
    with _Counts() as c:
        got = [foldax.segment_sum(X, ids, S) for ids in batches]
    assert (c.traces, c.compiles) == (0, 0)
    assert len(_eager.CACHE) == entries
    for ids, out in zip(batches, got, strict=True):
        assert_allclose(out, jax.ops.segment_sum(X, ids, S), dtype=F32)


def test_numpy_ids_and_left_out_num_segments():
    """NumPy ids (int64, narrowed when they fit) are inputs too; with ``num_segments`` left out,
    the largest id gives it, so ids of the same largest id share the executable. Ids that do not
    fit in int32 run uncached (and are dropped, as ever)."""
    first = _ids(False, dtype=np.int64)
    first[0] = S - 1
    foldax.segment_max(X, first)
    batches = []
    for _ in range(3):
        ids = _ids(False, dtype=np.int64)
        ids[0] = S - 1
        batches.append(ids)
    with _Counts() as c:
        got = [foldax.segment_max(X, ids) for ids in batches]
    assert c.traces == 0
    for ids, out in zip(batches, got, strict=True):
        assert_allclose(out, jax.ops.segment_max(X, jnp.asarray(ids, jnp.int32), S), dtype=F32)
    huge = _ids(False, dtype=np.int64)
    huge[:3] = [2**40, -(2**40), 2**33]
    want = jax.ops.segment_sum(X, jnp.asarray(np.where(np.abs(huge) > S, -1, huge), jnp.int32), S)
    assert_allclose(foldax.segment_sum(X, huge, S), want, dtype=F32)


def test_a_broken_promise_of_sorted_ids_still_raises():
    ids = jnp.asarray(_ids(False))
    with pytest.raises(ValueError, match="not sorted"):
        foldax.segment_sum(X, ids, S, indices_are_sorted=True)


def test_cache_entries_hold_no_ids():
    """No executable keeps the ids of its calls alive (nor a copy: a digest at most): NumPy or
    jax.Array, sorted or not, passed once or again."""
    n, s = 2048, 4  # long segments: ids passed again are planned from their bounds
    x = jnp.asarray(RNG.standard_normal(n), F32)
    refs = []
    for ids in (_ids(True, n, hi=s), _ids(False, n, hi=s)):
        for a in (jnp.asarray(ids), ids):
            for _ in range(2):
                foldax.segment_sum(x, a, s)
            refs.append(weakref.ref(a))
            del a
    del ids
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)


@pytest.mark.parametrize("mode", [None, "clip"])
def test_sorted_ids_passed_again_are_planned_as_known_ids(mode):
    """The same sorted ids on every call (a loop over one graph, long segments): from the second
    call, an executable planned from their bounds (as known ids are), then no trace; values
    right (ids dropped or clipped, wide rows, a softmax), and other ids of the same shape get
    their own bounds."""
    n, s = 2048, 4
    x = jnp.asarray(RNG.standard_normal((n, 8)), F32)
    ids = jnp.asarray(_ids(True, n, lo=-1, hi=s + 1))
    other = jnp.asarray(_ids(True, n, hi=s))
    calls = {
        "sum": (lambda x, i: foldax.segment_sum(x[:, 0], i, s, mode=mode), jax.ops.segment_sum),
        "max": (lambda x, i: foldax.segment_max(x, i, s, mode=mode), jax.ops.segment_max),
        "softmax": (lambda x, i: foldax.segment_softmax(x, i, s, mode=mode), None),
    }
    for name, (f, peer) in calls.items():
        for i in (ids, ids, other, other):
            got = f(x, i)
            if peer is not None:
                arg = x[:, 0] if name == "sum" else x
                assert_allclose(got, peer(arg, i, s, mode=mode), dtype=F32, err_msg=name)
        with _Counts() as c:
            assert_allclose(f(x, other), got, dtype=F32, err_msg=name)
        assert c.traces == 0, name
    work = np.clip(np.asarray(ids), 0, s - 1) if mode == "clip" else np.asarray(ids)
    ex = np.exp(np.asarray(x, np.float64))
    for seg in range(s):
        rows = work == seg
        want = ex[rows] / ex[rows].sum(0)
        assert_allclose(calls["softmax"][0](x, ids)[rows], want, dtype=F32)


def test_eager_vmap_over_ids_runs_one_executable():
    """A batch of graphs under an eager ``jax.vmap`` (the ids batched too): the second call,
    with the same arrays or new ones, traces nothing; an eager grad with new ids neither."""
    xs = jnp.stack([X, 2 * X, -X, X + 1])
    idss = jnp.stack([jnp.asarray(_ids(k % 2 == 0)) for k in range(4)])
    batched = jax.vmap(lambda x, i: foldax.segment_sum(x, i, S))
    grad = jax.grad(lambda x, i: foldax.segment_max(x, i, S).sum())
    batched(xs, idss), grad(X, idss[1])  # (unsorted ids, as the new ones below)
    new = jnp.stack([jnp.asarray(_ids(False)) for _ in range(4)])
    with _Counts() as c:
        same, other = batched(xs, idss), batched(xs, new)
        g = grad(X, new[1])
    assert (c.traces, c.compiles) == (0, 0)
    for out, ids in ((same, idss), (other, new)):
        want = jax.vmap(lambda x, i: jax.ops.segment_sum(x, i, S))(xs, ids)
        assert_allclose(out, want, dtype=F32)
    want = jax.grad(lambda x: jax.ops.segment_max(x, new[1], S).sum())(X)
    assert_allclose(g, want, dtype=F32)


def _lse_reference(v, ids):
    """Per-segment log-sum-exp of ``v`` ``(N,)`` with jax.ops (no segment empty here)."""
    m = jax.ops.segment_max(v, ids, S)
    return m + jnp.log(jax.ops.segment_sum(jnp.exp(v - m[ids]), ids, S))


def test_fn_with_a_fold_inside_reuses_its_executable():
    """``fn`` calling ``pairwise_reduce``: keyed by what its fold computes, so the same ``fn``
    (or new values of the arrays it reads) runs the first call's executable, and a new kernel
    (here a new Python number in it) a new one, never a stale one."""
    ids = jnp.asarray(np.arange(60) % S, jnp.int32)
    y = jnp.asarray(RNG.standard_normal((9, 3)), F32)
    scale = 1.0

    def fn(rows):
        kernel = lambda a, b: scale * jnp.sum((a - b) ** 2)  # noqa: E731
        return foldax.pairwise_reduce(kernel, rows, y, reduction="min")

    def want():
        d = scale * jnp.sum((X[:, None, :] - y[None, :, :]) ** 2, -1)
        return _lse_reference(d.min(1), ids)

    first = foldax.segment_logsumexp(X, ids, S, fn=fn)
    moved_y = y + 1.0
    with _Counts() as c:
        again = foldax.segment_logsumexp(X, ids, S, fn=fn)
        y = moved_y  # read by fn: a new input value, the same executable
        moved = foldax.segment_logsumexp(X, ids, S, fn=fn)
    assert (c.traces, c.compiles) == (0, 0)
    assert_allclose(again, first, dtype=F32)
    assert_allclose(moved, want(), dtype=F32)
    scale = 3.0  # a literal of the kernel: a new structure
    assert_allclose(foldax.segment_logsumexp(X, ids, S, fn=fn), want(), dtype=F32)


def test_eager_grad_through_a_nested_fold():
    """An eager grad of a call whose ``fn`` holds a fold: cached (the second call traces
    nothing) when the fold's derivatives follow from its structure; a custom rule in its kernel
    makes it run uncached, each kernel by its own rule."""
    ids = jnp.asarray(np.arange(60) % S, jnp.int32)
    y = jnp.asarray(RNG.standard_normal((9, 3)), F32)

    def loss(t, kernel=lambda a, b: jnp.sum((a - b) ** 2)):
        fn = lambda rows: t * foldax.pairwise_reduce(kernel, rows, y, reduction="min")  # noqa: E731
        return foldax.segment_logsumexp(X, ids, S, fn=fn).sum()

    def dense(t):
        d = jnp.sum((X[:, None, :] - y[None, :, :]) ** 2, -1).min(1)
        return _lse_reference(t * d, ids).sum()

    jax.grad(loss)(1.0)
    with _Counts() as c:
        got = jax.grad(loss)(2.0)
    assert c.traces == 0
    assert_allclose(got, jax.grad(dense)(2.0), dtype=F32)

    def with_rule(v, k):  # the kernel's distance with a custom rule: its tangent times k
        @jax.custom_jvp
        def f(d):
            return d

        f.defjvp(lambda p, t: (p[0], t[0] * k))
        kernel = lambda a, b: f(jnp.sum((a * v - b) ** 2))  # noqa: E731
        fn = lambda rows: foldax.pairwise_reduce(kernel, rows, y, reduction="min")  # noqa: E731
        return foldax.segment_logsumexp(X, ids, S, fn=fn).sum()

    def dense_v(v):
        d = jnp.sum((X[:, None, :] * v - y[None, :, :]) ** 2, -1).min(1)
        return _lse_reference(d, ids).sum()

    exact, none = (jax.grad(with_rule)(1.5, k) for k in (1.0, 0.0))
    assert_allclose(exact, jax.grad(dense_v)(1.5), dtype=F32)
    assert float(none) == 0.0


_EAGER = str(Path(_eager.__file__))
_BAD_CALLS = {
    "num_segments": lambda: foldax.segment_sum(X, jnp.zeros(60, jnp.int32), num_segments=-1),
    "ids shape": lambda: foldax.segment_sum(X, jnp.zeros(59, jnp.int32), S),
    "ids dtype": lambda: foldax.segment_sum(X, jnp.zeros(60, F32), S),
    "sizes": lambda: foldax.segment_sum(X, sizes=[1, 2]),
}


@pytest.mark.parametrize("name", list(_BAD_CALLS))
def test_eager_errors_come_once_from_the_call(name):
    """A bad call raises its error once: no chained exception, and between the caller's line
    and the public function's own code one frame (the cache's entry, named after the
    function), nothing of the cache's or JAX's."""
    with pytest.raises((ValueError, TypeError)) as info:
        _BAD_CALLS[name]()
    err = info.value
    assert err.__context__ is None and err.__cause__ is None
    text = "".join(traceback.format_exception(err))
    assert "During handling" not in text and "direct cause" not in text
    frames = traceback.extract_tb(err.__traceback__)
    first = next(k for k, f in enumerate(frames) if "foldax" in Path(f.filename).parts)
    assert frames[first - 1].filename == __file__  # the caller's line
    assert (frames[first].filename, frames[first].name) == (_EAGER, "segment_sum")
    assert frames[first + 1].filename.endswith(str(Path("_segment", "_sums.py")))
    later = frames[first + 1 :]
    assert not [f for f in later if f.filename == _EAGER or "jax" in Path(f.filename).parts]


def test_an_error_in_fn_comes_once():
    def fn(rows):
        raise RuntimeError("in the user's fn")

    with pytest.raises(RuntimeError, match="user's fn") as info:
        foldax.segment_sum(X, jnp.zeros(60, jnp.int32), S, fn=fn)
    assert "During handling" not in "".join(traceback.format_exception(info.value))
