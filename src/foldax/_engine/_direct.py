"""Folds that lower to one XLA operation: nothing is gained by streaming them.

A sum of rows that already exist (plain data, no ``fn``) under arbitrary ``segment_ids`` needs
no working memory at all: XLA's scatter-add reads each row once and adds it into its segment
in place, and fuses the rows' producer into itself. The tile walk would add the same rows in
the same order, in steps, with a masked copy of each step: the same numbers, slower (``jax.ops``
is this scatter). Such a fold carries ``Spec.direct``; :class:`foldax._engine._primitive.Fold`
lowers it here, and its derived folds are direct too (the tangent of a scatter-add is the
scatter-add of the tangent rows, its transpose the gather of the cotangent).

Only a fold that is not batched, and lowered for CPU, is lowered directly (XLA:GPU's scatter-add
into few segments has been reported far slower than the walk; the primitive registers a CPU
lowering of its own, :mod:`._registration`). Under ``vmap`` XLA's scatter wants the
scattered axis outermost and copies the whole batch of rows to get it (``(B, N) -> (N, B)``),
where the tile walk stays within the budget and is faster too; a batched fold keeps the walk.

Kinds (the fold's arguments are ``(arrays, consts, slots, rows)``; ``arrays = (ids,)`` of a
``"rows"`` plan, int32; every id outside ``[0, S)`` is dropped):

* ``"scatter"``: outputs ``((sum of rows[0] per slot,), (), ())`` -- the primal fold;
* ``"scatter_tangent"``: the same of the tangent rows, ``rows[-1]`` (its tangent fold);
* ``"gather"``: outputs ``((), (), (cotangent per row,))`` from ``slots[-1]``, 0 on rows
  dropped (its cotangent fold).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

#: The kind of each derived fold of a direct fold: ``DERIVED[kind][derivative]``.
DERIVED = {
    "scatter": {"jvp": "scatter_tangent", "vjp": "gather"},
    "scatter_tangent": {},
    "gather": {},
}


def _segment_sum(x, ids, num_slots, dtype):
    return jax.ops.segment_sum(x, ids, num_slots, mode="drop").astype(dtype)


def lower(kind, out_avals, num_slots, arrays, consts, slots, rows):
    """The fold's outputs ``(slot outs, tots, row outs)``, matching ``out_avals``."""
    (ids,) = arrays
    slot_avals, _, row_avals = out_avals
    if kind in ("scatter", "scatter_tangent"):
        x = rows[0] if kind == "scatter" else rows[-1]
        return ((_segment_sum(x, ids, num_slots, slot_avals[0].dtype),), (), ())
    (g,) = slots[-1:]
    # (jnp.take wraps negative indices: they are moved past the end first, where they fill)
    ct = jnp.take(g, jnp.where(ids < 0, num_slots, ids), axis=0, mode="fill", fill_value=0)
    return ((), (), (ct.astype(row_avals[0].dtype),))


def applies(kind, spec, platform) -> bool:
    """Whether a fold of ``kind`` (or ``None``) lowers directly: unbatched, on one device, on
    CPU (XLA:GPU's scatter-add into few segments has been reported far slower than the walk:
    there the walk stays until a device measurement says otherwise)."""
    return (
        kind is not None
        and platform == "cpu"
        and spec.scale == 1
        and not (spec.axes or spec.ring)
        and spec.pair_mask is None
        and spec.plan.kind == "rows"
    )


__all__ = ["DERIVED", "applies", "lower"]
