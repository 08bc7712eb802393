"""Pairwise reductions of inputs that live on a device mesh: which axes split the rows of ``x``
and ``y``, and one ``shard_map`` over them."""

from __future__ import annotations

import math

import jax
from jax.sharding import PartitionSpec as P

from .. import _shard
from .._reductions import ExtremumWithIndex, KMin
from ._kernel import _row_avals
from ._tiles import _local, _num_rows


def _mesh_split(name, x, y, m, n):
    """``(mesh, x_axes, y_axes)`` when ``x`` / ``y`` live on a mesh, else ``None``.

    Explicit axes: the axes that split each one's rows. Auto axes: the rows of ``x`` are split
    over them (no communication; the result is split the same way).
    """
    xs = _shard.row_axes(jax.tree.leaves(x), m, auto=True)
    ys = _shard.row_axes(jax.tree.leaves(y), n, auto=False)
    if xs is None and ys is None:
        # Replicated on a mesh: run there (unsplit) rather than mix mesh types.
        mesh = _shard.on_explicit_mesh(jax.tree.leaves((x, y)))
        return None if mesh is None else (mesh, (), ())
    mesh = (xs or ys)[0]
    x_axes, y_axes = (xs[1] if xs else ()), (ys[1] if ys else ())
    both = set(x_axes) & set(y_axes)
    if both and not set(y_axes) <= set(x_axes):
        raise ValueError(
            f"{name}: y's rows are split over mesh axes {y_axes}, of which x's rows are split "
            f"over {tuple(sorted(both))} too but not over all: split y over axes that x is split "
            f"over (its blocks then go round them), or over axes that x is not split over."
        )
    return mesh, x_axes, y_axes


def _on_mesh(name, kernel, x, y, monoid, block_size, mesh, x_axes, y_axes, widen=False):
    """Under ``jit``: ``shard_map`` over the mesh, rows of ``x`` split over ``x_axes`` (no
    communication), rows of ``y`` over ``y_axes`` (states all-reduced). The kernel is traced
    once for a pair of rows and replayed inside with its closed-over arrays passed in (the
    ``shard_map`` runs with ``check_vma=False``; see :func:`foldax._segment._core._on_mesh`).
    ``widen``: as :func:`._reduce.reduce_pairs`'."""
    dx = math.prod(mesh.shape[a] for a in x_axes)
    dy = math.prod(mesh.shape[a] for a in y_axes)
    m, n = _num_rows(name, "x", x) // dx, _num_rows(name, "y", y) // dy
    replay, consts = _shard.replayable(kernel, _row_avals(x), _row_avals(y))

    def body(x, y, consts):
        k = replay(consts)
        if y_axes and set(y_axes) <= set(x_axes):  # y's blocks go round the devices that split x
            return _local(name, k, x, y, monoid, block_size, m, n, (), y_axes, widen=widen)
        return _local(name, k, x, y, monoid, block_size, m, n, y_axes, widen=widen)

    specs = tuple(jax.tree.map(_shard.rows_spec(a), t) for a, t in ((x_axes, x), (y_axes, y)))
    out = P(x_axes or None)
    out = (out, out) if isinstance(monoid, KMin | ExtremumWithIndex) else out
    return _shard.run_replayed(body, mesh, x_axes + y_axes, (x, y), specs, consts, out)
