"""A fold's static description (:class:`Spec`) and the small helpers on avals and tangents
that every part of the engine shares."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .._jax import ShapedArray, Zero
from ._budget import DEFAULT_BUDGET
from ._plan import PlanSpec


def take_at(a, i):
    """A pair mask's ``take`` where none is given (see :class:`Spec`'s ``keyed``): ``a[i]``."""
    return a[i]


@dataclasses.dataclass(frozen=True, eq=False)
class Spec:
    """Everything static about a fold (hashed by identity).

    ``body(consts, slots, rows, mask, index) -> (vals, tots, rowvals)``: for a monoid fold
    ``vals`` are the tile's values ``(G, T, *F)`` (a pytree for pairs of values), reduced by
    ``monoid``; for an additive fold (``monoid=None``) a tuple of per-slot partial sums
    ``(G, ...)``. ``fill``: the value of row outputs on rows that no step owns.
    ``axes``: mesh axes splitting the rows (slot states are all-reduced); ``ring``: mesh axes
    splitting rows and slots (the rows go round the devices). ``slot_psum``: psum an additive
    fold's slot sums over ``axes`` (the tangent of an all-reduced output). ``pair_mask``
    (dense plans): ``pair_mask(consts, i, j) -> bool`` of the fold's consts (a derived fold's
    begin with its parent's) and global slot and row indices ``i`` ``(bi, 1)``, ``j`` ``(1, bj)``,
    each a run of consecutive indices within range when the block fits the array;
    pairs where it is false take no part, and a tile where it is false everywhere is skipped
    (not computed), in this fold and in every fold derived from it. ``block_live`` (with a
    ``pair_mask``): ``block_live(consts, i0, j0, bi, bj) -> bool`` of the first slot ``i0`` of a
    block of ``bi`` slots and the first rows ``j0`` (an array) of blocks of ``bj`` rows: whether
    each block may hold a kept pair (a superset is fine, the steps mask the rest); without it
    the mask itself is evaluated on every pair to find the live blocks. ``origin``: for a tangent
    fold (``derive("jvp", shape)``), ``(parent rule, shape)``: transposed in all its tangents,
    it is the parent's cotangent fold. ``direct``: the one XLA operation the fold is, when it
    is not batched (:mod:`._direct`; its derived folds are direct too). ``widen``: ``body``
    gives the same values when its half-precision inputs come widened to float32 (its kernel
    widens them first): the cotangent folds pull each tile back from float32 inputs, so that a
    tile's share is never rounded to half precision before the float32 sum (derived folds
    inherit it). ``out_dtypes`` (additive folds): the dtypes ``((slot), (tot), (row))`` its
    outputs are returned in, where the body's sums are wider (a cotangent fold sums
    half-precision cotangents in float32): each sum is narrowed once, when it is complete, so
    a walk that completes the row sums block by block never holds all of them wide (the tangent
    folds of such a fold inherit it). ``implementation``: the lowering asked for
    (:mod:`._implementation`: ``None`` per platform, ``"xla"``, ``"pallas"``). ``lanes_body``
    (dense plans walking the rows last): ``body`` taking the slots' arrays with their slots
    last too, so that every intermediate of a tile is ``(*f, bi, bj)``: what an accelerator
    kernel's vector registers want (derived folds have none). ``keyed``: ``(index, side)`` of
    the consts that ``pair_mask`` reads only at the pairs' slots (side 0: a value per slot) or
    rows (side 1: a value per row), through its ``take`` argument: ``pair_mask(consts, i, j,
    take)``, ``take(a, i)`` being ``a[i]`` where none is given; a kernel hands it those consts
    block by block, with a ``take`` that reads the block.
    """

    plan: PlanSpec
    body: Callable
    monoid: Any = None
    budget: int = DEFAULT_BUDGET
    scale: int = 1
    fill: float = 0.0
    axes: tuple = ()
    ring: tuple = ()
    slot_psum: bool = False
    name: str = "foldax"
    pair_mask: Callable | None = None
    block_live: Callable | None = None
    origin: Any = None
    direct: str | None = None
    widen: bool = False
    out_dtypes: tuple | None = None
    implementation: str | None = None
    lanes_body: Callable | None = None
    keyed: tuple = ()

    def replace(self, **kw):
        return dataclasses.replace(self, **kw)


def _aval(x):
    return jax.typeof(x)


def _is_float(aval) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


def _zero_tangent(aval):
    """The tangent of an output nothing perturbs: zeros (``float0`` for integer outputs)."""
    if _is_float(aval):
        return jnp.zeros(aval.shape, aval.dtype)
    return np.zeros(aval.shape, jax.dtypes.float0)


def _is_zero(t) -> bool:
    return isinstance(t, Zero)


def _with_rows(shape, row_axis, r):
    """``shape`` with its rows axis (``row_axis``: 0 or -1) of size ``r``."""
    return (*shape[:-1], r) if row_axis == -1 else (r, *shape[1:])


def _shaped(aval, shape):
    return aval.update(shape=shape) if hasattr(aval, "update") else ShapedArray(shape, aval.dtype)


def _index(spec, index):
    return (index,) if getattr(spec.monoid, "needs_index", False) else ()
