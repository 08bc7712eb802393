"""How a TPU kernel's arrays are laid out in its blocks.

Mosaic blocks the last two axes of an array in multiples of ``(8, 128)`` (or whole), so a
one-dimensional array of slots (a log-sum-exp per row of ``x``) is kept as a column
``(m, 1)``, the layout a reduction along a tile's rows leaves its result in, and a
one-dimensional array of rows of ``y`` (or a constant) as one row of lanes ``(1, n)``. Both
stay legal blocks when ``vmap`` adds a leading axis to the kernel's grid.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

LANES = 128


def lanes_up(a: int) -> int:
    """``a`` rounded up to whole lanes (at least one)."""
    return LANES * max(1, -(-a // LANES))


def pad_rows(a, total, axis=0):
    """``a`` with rows (along ``axis``) up to ``total``: copies of its last row."""
    a = jnp.moveaxis(a, axis, 0)
    extra = total - a.shape[0]
    if extra:
        a = jnp.concatenate([a, jnp.broadcast_to(a[-1:], (extra, *a.shape[1:]))], axis=0)
    return jnp.moveaxis(a, 0, axis)


def column_shape(shape):
    return (shape[0], 1) if len(shape) == 1 else tuple(shape)


def column(a):
    """A one-dimensional array of slots as a column ``(m, 1)``; others as they are."""
    return a.reshape(column_shape(a.shape))


def column_aval(shape, dtype):
    return jax.ShapeDtypeStruct(column_shape(shape), dtype)


def lanes(a):
    """A one-dimensional array of rows (or a constant) as one row of lanes ``(1, n)``."""
    return a.reshape(1, a.shape[0]) if a.ndim == 1 else a


def whole(a):
    return pl.BlockSpec(a.shape, lambda o, k, *table: (0,) * a.ndim)


def slot_block(a, size, at):
    """The block of ``size`` rows (axis 0) of ``a`` that ``at(o, k, *table)`` names."""
    rest = (0,) * (a.ndim - 1)
    return pl.BlockSpec((size, *a.shape[1:]), lambda o, k, *t: (at(o, k, *t), *rest))


def row_block(a, size, axis, at):
    """The block of ``size`` rows of ``a`` (rows on ``axis``, 0 or -1; a row of lanes, see
    :func:`lanes`, along its lanes) that ``at(o, k, *table)`` names."""
    if axis == -1 or a.shape[0] == 1:
        rest = (0,) * (a.ndim - 1)
        return pl.BlockSpec((*a.shape[:-1], size), lambda i, k, *t: (*rest, at(i, k, *t)))
    rest = (0,) * (a.ndim - 1)
    return pl.BlockSpec((size, *a.shape[1:]), lambda i, k, *t: (at(i, k, *t), *rest))


def reader_of(aval):
    return reader(aval.shape)


def reader(shape):
    """Read a ref holding an array of ``shape`` (kept as a column or a row of lanes)."""
    return lambda r: r[...].reshape(shape)


def write(r, v):
    r[...] = v.astype(r.dtype).reshape(r.shape)
