"""A batch of dense folds that share their rows is one fold over every element's slots.

Under ``vmap`` of a pairwise reduction whose ``y`` (and consts) are not batched -- a batch of
sequences against one vocabulary, queries against one set of points -- element ``b``'s slot ``i``
meets the same rows as slot ``i`` of every other element. The batch is then the fold of
``B * M`` slots against the ``N`` rows: the same tiles, each as large as the budget allows
(``vmap`` of the loop would shrink them ``B``-fold), and in its cotangent fold the rows' sums
(``y``'s gradient) are summed over the batch inside the fold -- one accumulator for ``y``, not
one per element, and (for half-precision ``y``) rounded once, not once per element.

Only where nothing in the fold reads a slot's index: no pair mask (whose ``i`` is the slot's).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ._spec import _shaped


def flattenable(inner, dims) -> bool:
    """Whether a batch (``dims``: the batch axis, 0 or ``None``, of each argument) of the fold
    ``inner`` (a :class:`~._primitive.Fold`) is one fold over the batch's slots."""
    spec = getattr(inner, "spec", None)
    if spec is None or spec.plan.kind != "dense" or spec.axes or spec.ring:
        return False
    if spec.pair_mask is not None or spec.direct is not None:
        return False
    arrays_d, consts_d, slots_d, rows_d = dims
    if any(d is not None for d in (*arrays_d, *consts_d, *rows_d)):
        return False
    return any(d is not None for d in slots_d)


def flat_avals(avals, size):
    """The fold's input avals with its ``size`` elements' slots as one axis."""
    arrays, consts, slots, rows = avals
    merged = tuple(_shaped(a, (size * a.shape[0], *a.shape[1:])) for a in slots)
    return arrays, consts, merged, rows


def flat_spec(spec, size):
    """``spec`` for ``size`` times its slots."""
    plan = dataclasses.replace(spec.plan, num_slots=size * spec.plan.num_slots)
    return spec.replace(plan=plan)


def merge(a, d, size):
    """A per-slot array (an argument, a cotangent, an output's info; batched on axis 0 where
    ``d`` is 0, else shared) as ``(size * M, ...)``."""
    if d is None:
        a = jnp.broadcast_to(a, (size, *a.shape))
    return a.reshape((size * a.shape[1], *a.shape[2:]))


def split(a, size):
    """A slot output ``(size * M, ...)`` as ``(size, M, ...)``."""
    return a.reshape((size, a.shape[0] // size, *a.shape[1:]))


def merge_args(args, dims, size):
    """The fold's arguments with the slots merged (everything else is shared)."""
    arrays, consts, slots, rows = args
    merged = tuple(merge(a, d, size) for a, d in zip(slots, dims[2], strict=True))
    return tuple(arrays), tuple(consts), merged, tuple(rows)
