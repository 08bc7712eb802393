"""The extrema's lane-dense kernel states (``foldax._reductions._lanes``): each of a tile's
128-lane chunks updates its lane's state, the lanes reduced after the last tile. Their states
equal the per-row kernel form's (``reduce_in_kernel`` then ``combine_in_kernel``, tile after
tile), with ties within and across lanes and tiles, NaN, infinities, masked cells, empty rows
and integers; and a kernel that keeps them (interpreted) equals the XLA fold."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_allclose, data_scale

import foldax
from foldax import _engine
from foldax._kernels.tpu import _contracting
from foldax._reductions import _extremum, _lanes
from foldax._reductions._base import NO_INDEX
from foldax._reductions._kmin import KMin

ROWS, COLS, TILES = 24, 384, 3  # three chunks of 128 lanes a tile


def _tiles(rng, dtype):
    """``TILES`` tiles ``(ROWS, COLS)`` of few distinct values (ties everywhere), masks and
    their columns' global indices; row 0 empty, row 1 all +inf (or the largest integer), rows
    2-4 with NaN (first in a later tile, twice, in the first cell), rows 6-9 with one or two
    extremes."""
    floats = np.issubdtype(dtype, np.floating)
    v = rng.integers(0, 6, (TILES, ROWS, COLS)).astype(dtype)
    mask = rng.random((TILES, ROWS, COLS)) < 0.8
    mask[:, 0] = False
    v[:, 1] = np.inf if floats else np.iinfo(dtype).max
    # rows 6-9: distinct values, one least (row 6) or two: in one lane of two tiles (7), two
    # lanes of one chunk (8), two tiles' chunks (9); the most, once or twice, likewise
    v[:, 6:10] = 10 + rng.permutation(TILES * COLS * 4).reshape(TILES, 4, COLS)
    mask[:, 6:10] = True
    v[1, 6, 50] = v[0, 7, 9] = v[2, 7, 9] = v[1, 8, 3] = v[1, 8, 77] = 0
    v[0, 9, 130] = v[2, 9, 260] = 0
    v[2, 6, 0] = v[0, 7, 1] = v[0, 7, 129] = v[1, 9, 383] = 10**5
    if floats:
        v[:, 5, 7] = -np.inf
        v[1, 2, 300], v[2, 3, 5], v[0, 3, 200], v[0, 4, 0] = (np.nan,) * 4
        mask[:, 2:5] = True
    index = np.arange(TILES * COLS, dtype=np.int32).reshape(TILES, COLS)
    return v, mask, index


def _per_row(mon, v, mask, index):
    """The per-row kernel form's state after every tile."""
    state = mon.init_aval(ROWS, jax.ShapeDtypeStruct((), v.dtype))
    for t in range(TILES):
        args = (index[t],) if getattr(mon, "needs_index", False) else ()
        tile = mon.reduce_in_kernel(jnp.asarray(v[t]), jnp.asarray(mask[t]), None, *args)
        state = mon.combine_in_kernel(state, tile)
    return state


def _by_lanes(mon, v, mask, index):
    form = mon.lane_form(jax.ShapeDtypeStruct((), v.dtype))
    state = form.init(ROWS, jax.ShapeDtypeStruct((), v.dtype))
    for t in range(TILES):
        state = form.add(state, jnp.asarray(v[t]), jnp.asarray(mask[t]), jnp.asarray(index[t]))
    return form.finish(state)


MONOIDS = {
    "min": lambda: _extremum.Min(),
    "max": lambda: _extremum.Max(),
    "argmin": lambda: _extremum.ArgExtremum(False),
    "argmax": lambda: _extremum.ArgExtremum(True),
    "min_for_derivatives": lambda: _extremum.Min().for_derivatives,
    "max_for_derivatives": lambda: _extremum.Max().for_derivatives,
    "kmin k=1": lambda: KMin(1),
    "kmin k=7": lambda: KMin(7),
}


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
@pytest.mark.parametrize("name", list(MONOIDS))
def test_lane_states_equal_the_per_row_states(rng, name, dtype):
    mon = MONOIDS[name]()
    v, mask, index = _tiles(rng, dtype)
    want = jax.jit(lambda v, m, i: _per_row(mon, v, m, i))(v, mask, index)
    got = jax.jit(lambda v, m, i: _by_lanes(mon, v, m, i))(v, mask, index)
    nan_rows = np.isnan(np.asarray(want[0], np.float64))
    if name.startswith("kmin"):  # the k smallest: NaN last, the lists equal
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
        assert np.asarray(got[1])[0].tolist() == [NO_INDEX] * mon.k  # the empty row
        return
    assert nan_rows[2:5].all() == np.issubdtype(dtype, np.floating)
    for k, (a, b) in enumerate(zip(got, want, strict=True)):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape == (ROWS,) and a.dtype == b.dtype, (k, a.dtype, b.dtype)
        if k == 4:  # the runner-up: not read where the extreme is NaN
            a, b = a[~nan_rows], b[~nan_rows]
        if k in (2, 3):  # the indices: read where one or two values attain the extreme
            read = np.isin(np.asarray(want[1]), (1, 2) if k == 2 else (2,))
            a, b = a[read], b[read]
        np.testing.assert_array_equal(a, b, err_msg=f"{name} state {k}")
    if "derivatives" in name:  # counts of 1, 2 and 3 or more, each seen
        assert {1, 2} <= set(np.asarray(got[1]).tolist()) and np.max(got[1]) > 2


def test_lane_states_are_what_a_kernel_keeps(monkeypatch):
    """Where a block's columns are whole lanes, the kernel folds the extrema lane by lane
    (interpreted here; compiled on a TPU)."""
    monkeypatch.setattr(_contracting, "DEFAULT_BLOCKS", _contracting.BlockSizes(128, 384))
    added = []
    real = _lanes.ExtremumLanes.add
    monkeypatch.setattr(_lanes.ExtremumLanes, "add", lambda *a: added.append(1) or real(*a))
    x = jax.ShapeDtypeStruct((300, 3), jnp.float32)
    sq = lambda a, b: jnp.sum((a - b) ** 2)  # noqa: E731
    with _engine.implementation("pallas"):
        jax.jit(lambda x: foldax.pairwise_reduce(sq, x, x, reduction="min")).trace(x).lower()
    assert added


@pytest.mark.parametrize("reduction", ["min", "argmax", "min_argmin", "kmin"])
def test_a_kernel_by_lanes_equals_the_xla_fold(rng, monkeypatch, reduction):
    """Blocks of three chunks of lanes, a partial last block, ties across lanes and blocks,
    NaN: the values, indices and (for the min) the gradient equal the XLA fold's."""
    monkeypatch.setattr(_contracting, "DEFAULT_BLOCKS", _contracting.BlockSizes(128, 384))
    x = rng.integers(-2, 3, (300, 3)).astype(np.float32)  # many equal distances
    y = rng.integers(-2, 3, (1000, 3)).astype(np.float32)
    x[299, 1] = np.nan
    sq = lambda a, b: jnp.sum((a - b) ** 2)  # noqa: E731
    kw = {"k": 5} if reduction == "kmin" else {}
    f = lambda x, y: foldax.pairwise_reduce(sq, x, y, reduction=reduction, **kw)  # noqa: E731
    g = jax.grad(
        lambda x, y: jnp.sum(foldax.pairwise_reduce(sq, x[:299], y, reduction="min") ** 2), (0, 1)
    )
    both = (lambda x, y: (f(x, y), g(x, y))) if reduction == "min" else f
    outs = {}
    for impl in ("pallas", "xla"):
        with _engine.implementation(impl):
            outs[impl] = jax.jit(lambda x, y: both(x, y))(x, y)
    for a, b in zip(*(jax.tree.leaves(outs[i]) for i in ("pallas", "xla")), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype.kind == "i":
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
            keep = ~np.isnan(b)
            assert_allclose(a[keep], b[keep], dtype=np.float32, scale=data_scale(b[keep]))
