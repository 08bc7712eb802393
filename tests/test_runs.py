"""A log-sum-exp of plain values over contiguous segments read once (``foldax._engine._runs``):
the program ``segment_logsumexp`` / ``segment_logmeanexp`` take on CPU, unbatched, for one value
per row under static or traced ``sizes`` / ``offsets`` and sorted ids. Each tile is shifted by a
sampled value of its segment and taken again with its max where that is not safe; these tests
hold it to the float64 reference where values rise, fall or spread far past the sample, on NaN
and infinities, in half precision, and in its derivatives (which walk).
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_allclose, data_scale, reference
from jax.test_util import check_grads

import foldax
from foldax._engine import _runs

SIZES = [0, 1, 9000, 3, 0, 20000, 17, 5000, 1]


@pytest.fixture
def runs_taken(monkeypatch):
    """How many folds were lowered by the one-read program while the test ran (taken here at
    any number of rows: it waits for millions in use, where it repays its compile)."""
    monkeypatch.setattr(_runs, "MIN_ROWS", 0)
    calls = []
    lower = _runs.lower

    def spy(*args):
        calls.append(1)
        return lower(*args)

    monkeypatch.setattr(_runs, "lower", spy)
    return calls


def _ids(sizes):
    return np.repeat(np.arange(len(sizes)), sizes)


def _reference(name, x, sizes, block=256):
    """The registry's float64 reference of contiguous segments, ``block`` segments at a time
    (each block's rows are its own; one call over thousands of segments would compare every
    row's id with every segment)."""
    sizes = np.asarray(sizes)
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    parts = []
    for k in range(0, len(sizes), block):
        sub = sizes[k : k + block]
        rows = x[bounds[k] : bounds[k + len(sub)]]
        parts.append(reference(name, rows, _ids(sub), len(sub)))
    return np.concatenate(parts)


def _check(x, sizes, name="logsumexp", dtype=np.float32, **kw):
    got = jax.jit(lambda v: getattr(foldax, f"segment_{name}")(v, sizes=sizes, **kw))(x)
    want = _reference(name, np.asarray(x, np.float64), sizes)
    assert_allclose(got, want, dtype=dtype, scale=data_scale(x))


def _spread(rng, n, width):
    """``n`` values rising from ``-width`` to 0, plus noise."""
    return (np.linspace(-width, 0.0, n) + rng.standard_normal(n)).astype(np.float32)


@pytest.mark.parametrize(
    "case", ["normal", "scales_apart", "near_1e5", "rising", "falling", "wide", "one_spike"]
)
def test_values_against_float64(case, rng, runs_taken):
    n = sum(SIZES)
    x = rng.standard_normal(n).astype(np.float32)
    if case == "scales_apart":  # segments 1000 apart
        x = x + np.repeat(rng.choice([-1000.0, 0.0, 1000.0], len(SIZES)), SIZES)
    elif case == "near_1e5":
        x = x + np.float32(1e5) * np.repeat(rng.choice([-1.0, 1.0], len(SIZES)), SIZES)
    elif case == "rising":
        x = np.concatenate([_spread(rng, s, 300.0) for s in SIZES])
    elif case == "falling":
        x = np.concatenate([_spread(rng, s, 300.0)[::-1] for s in SIZES])
    elif case == "wide":  # values far above any sampled shift: tiles are taken again
        x = x * 100.0
    elif case == "one_spike":  # one value 500 above the rest of its tile
        x[np.flatnonzero(_ids(SIZES) == 5)[4321]] = 500.0
    _check(x.astype(np.float32), SIZES)
    _check(x.astype(np.float32), SIZES, "logmeanexp")
    assert runs_taken


@pytest.mark.parametrize(
    "special", ["nan", "posinf", "neginf_first", "all_neginf", "neginf_some", "mixed"]
)
def test_nan_and_infinities(special, rng, runs_taken):
    n, ids = sum(SIZES), _ids(SIZES)
    x = rng.standard_normal(n).astype(np.float32)
    big = np.flatnonzero(ids == 5)  # the 20,000-row segment
    if special == "nan":
        x[big[12345]] = np.nan
    elif special == "posinf":
        x[big[777]] = np.inf
    elif special == "neginf_first":  # a tile's first value is -inf: its shift is unusable
        x[big[0]] = -np.inf
    elif special == "all_neginf":
        x[big] = -np.inf
    elif special == "neginf_some":
        x[big[::3]] = -np.inf
    else:
        x[big[5]], x[np.flatnonzero(ids == 2)[0]], x[np.flatnonzero(ids == 7)] = (
            np.inf,
            np.nan,
            -1e30,
        )
    _check(x, SIZES)
    assert runs_taken


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_half_precision_accumulates_in_float32(dtype, rng, runs_taken):
    x = (rng.standard_normal(sum(SIZES)) * 3).astype(np.float32)
    got = foldax.segment_logsumexp(jnp.asarray(x, dtype), sizes=SIZES)
    assert got.dtype == dtype
    want = reference("logsumexp", np.asarray(jnp.asarray(x, dtype), np.float64), _ids(SIZES), 9)
    assert_allclose(got, want, dtype=dtype, scale=data_scale(x))
    assert runs_taken


@pytest.mark.parametrize("form", ["traced_sizes", "offsets", "sorted_ids", "traced_sorted_ids"])
def test_every_form_of_contiguous_segments(form, rng, runs_taken):
    x = _spread(rng, sum(SIZES), 200.0)
    sizes, ids = np.asarray(SIZES), _ids(SIZES)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    f = {
        "traced_sizes": lambda v, s: foldax.segment_logsumexp(v, sizes=s),
        "offsets": lambda v, s: foldax.segment_logsumexp(v, offsets=offsets),
        "sorted_ids": lambda v, s: foldax.segment_logsumexp(v, ids, 9, indices_are_sorted=True),
        "traced_sorted_ids": lambda v, s: foldax.segment_logsumexp(
            v, jnp.asarray(ids), 9, indices_are_sorted=True
        ),
    }[form]
    got = jax.jit(f)(x, jnp.asarray(sizes, jnp.int32))
    assert_allclose(got, reference("logsumexp", x, ids, 9), dtype=np.float32, scale=200.0)
    assert runs_taken


def test_batched_walks_and_agrees(rng, runs_taken):
    """Under vmap the fold is batched: it walks (no run), and gives the same numbers."""
    x = _spread(rng, sum(SIZES), 50.0)
    batch = np.stack([x, -x, x + 7.0])
    got = jax.jit(jax.vmap(lambda v: foldax.segment_logsumexp(v, sizes=SIZES)))(batch)
    assert not runs_taken
    for b in range(3):
        want = foldax.segment_logsumexp(batch[b], sizes=SIZES)
        assert_allclose(got[b], want, dtype=np.float32, scale=57.0)
    assert runs_taken


def test_derivatives_against_dense(rng, runs_taken):
    """The gradient (a softmax per segment) and the tangent, from the run's outputs (its shift
    is not the max), against the dense ``jax.nn.logsumexp`` per segment; and finite
    differences, forward and reverse, to second order."""
    sizes = [0, 1, 3000, 5, 9000]
    x = jnp.asarray(_spread(rng, sum(sizes), 40.0))
    w = jnp.asarray(rng.standard_normal(len(sizes)).astype(np.float32))
    bounds = np.concatenate([[0], np.cumsum(sizes)])

    def dense(v):
        parts = itertools.pairwise(bounds)
        return jnp.stack([jax.nn.logsumexp(v[a:b]) if b > a else -jnp.inf for a, b in parts])

    def loss(f):
        return lambda v: jnp.sum(jnp.where(jnp.isfinite(o := f(v)), o, 0.0) * w)

    ours = lambda v: foldax.segment_logsumexp(v, sizes=sizes)  # noqa: E731
    t = jnp.asarray(rng.standard_normal(x.shape).astype(np.float32))
    grad, grad_dense, got, want = jax.jit(  # one program (the dense side not op by op)
        lambda x, t: (
            jax.grad(loss(ours))(x),
            jax.grad(loss(dense))(x),
            jax.jvp(ours, (x,), (t,))[1],
            jax.jvp(dense, (x,), (t,))[1],
        )
    )(x, t)
    assert_allclose(grad, grad_dense, dtype=np.float32)
    assert_allclose(got[1:], want[1:], dtype=np.float32, scale=data_scale(x))
    small = [1, 7, 0, 12]
    f = jax.jit(lambda v: foldax.segment_logsumexp(v, sizes=small))
    v = jnp.asarray(rng.standard_normal(20).astype(np.float32) * 30.0)
    # check_grads passes NaNs matching NaNs: -inf only for the empty segment
    np.testing.assert_array_equal(np.isfinite(f(v)), np.asarray(small) > 0)
    check_grads(
        f,
        (v,),
        order=2,
        modes=("fwd", "rev"),
        eps=1e-2,
        atol=5e-2,
        rtol=5e-2,
    )
    assert runs_taken


def test_small_inputs_walk(rng, monkeypatch):
    """Below ``MIN_ROWS`` the fold walks (the one read would cost more to compile than it
    saves)."""
    calls = []
    monkeypatch.setattr(_runs, "lower", lambda *a: calls.append(1))
    x = rng.standard_normal(sum(SIZES)).astype(np.float32)
    _check(x, SIZES)
    assert not calls


def test_temp_memory_does_not_grow_with_the_rows(runs_taken):
    """The run holds per-tile states only: temp bytes stay flat from 1 M to 8 M rows."""
    temps = []
    for n in (1_000_000, 8_000_000):
        sizes = [n // 4] * 4
        x = jax.ShapeDtypeStruct((n,), jnp.float32)
        r = foldax.memory.report(lambda v, s=sizes: foldax.segment_logsumexp(v, sizes=s), x)
        temps.append(r.temp_bytes)
    assert temps[1] <= temps[0] + 64 * 1024, temps


def test_many_segments_sample_fewer_values_each(rng, runs_taken):
    """Past ``MAX_SAMPLED / SAMPLE`` segments each segment's shift comes from fewer samples;
    the sums stay exact (a segment whose values rise past its shift is taken again)."""
    sizes = rng.integers(200, 400, 6000)
    sizes[::7] = 0
    x = (rng.standard_normal(int(sizes.sum())) * 8.0).astype(np.float32)
    _check(x, sizes.tolist())
    assert runs_taken
