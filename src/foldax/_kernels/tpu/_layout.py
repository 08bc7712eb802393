"""How a TPU kernel's arrays are laid out in its blocks.

Mosaic blocks the last two axes of an array in multiples of ``(8, 128)`` (or whole), and an
array in HBM is tiled so too: a column ``(m, 1)`` would take 128 times its size. So every
one-dimensional array (a log-sum-exp per row of ``x``, a value per row of ``y``, a constant)
is kept as one row of lanes ``(1, n)``, a legal block also when ``vmap`` adds a leading axis
to the kernel's grid. A tile's reduction along its rows leaves its result in a column's
layout, ``(bi,)`` down the sublanes: :func:`to_column` and :func:`to_lanes` turn one into the
other (a transpose on the cross-lane unit, which Mosaic lowers where it reshapes none).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

LANES = 128


def lanes_up(a: int) -> int:
    """``a`` rounded up to whole lanes (at least one)."""
    return LANES * max(1, -(-a // LANES))


def vmem_bytes(aval) -> int:
    """The bytes an array of ``aval`` takes in VMEM: its last two axes in tiles of 128 lanes by
    8 sublanes of 32-bit words, 16 of 16-bit values packed in pairs (a value ``(bi, bj, 3)``
    takes 43 times its size; a boolean, a 32-bit mask)."""
    if not hasattr(aval, "shape"):  # (a token, say)
        return 0
    dtype = jnp.dtype(aval.dtype)
    size = 4 if dtype == jnp.bool_ else dtype.itemsize
    shape = (1, 1, *aval.shape)
    rows = 8 * max(1, 4 // size)
    sub, lane = -(-shape[-2] // rows) * rows, lanes_up(shape[-1])
    return math.prod(shape[:-2]) * sub * lane * size


def pad_rows(a, total, axis=0):
    """``a`` with rows (along ``axis``) up to ``total``: copies of its last row."""
    a = jnp.moveaxis(a, axis, 0)
    extra = total - a.shape[0]
    if extra:
        a = jnp.concatenate([a, jnp.broadcast_to(a[-1:], (extra, *a.shape[1:]))], axis=0)
    return jnp.moveaxis(a, 0, axis)


def column_shape(shape):
    return (shape[0], 1) if len(shape) == 1 else tuple(shape)


def narrow(shape) -> bool:
    """Whether an array of slots (rows first) holds one value per slot: kept as lanes."""
    return len(shape) == 1 or math.prod(shape[1:]) == 1


def slot_lanes(a):
    """An array of slots holding one value each as a row of lanes ``(1, m)``."""
    return a.reshape(1, a.shape[0]) if narrow(a.shape) else a


def lanes(a):
    """A one-dimensional array of rows (or a constant) as one row of lanes ``(1, n)``."""
    return a.reshape(1, a.shape[0]) if a.ndim == 1 else a


def whole(a):
    """The whole of ``a`` in every step: in VMEM, or a scalar (``(1,)``, see :func:`const`)
    in SMEM, where the scalar unit reads it."""
    if a.ndim == 1 and a.shape[0] == 1:
        return pl.BlockSpec(memory_space=pltpu.SMEM)
    return pl.BlockSpec(a.shape, lambda o, k, *table: (0,) * a.ndim)


def const(a):
    """A constant as the kernel takes it: a scalar as ``(1,)`` of 32 bits (a word of SMEM), a
    one-dimensional array as a row of lanes."""
    if a.ndim == 0:
        return _as32(a)[0].reshape(1)
    return lanes(a)


def const_reader(aval):
    """Read a constant of ``aval`` from its ref (see :func:`const`)."""
    if aval.ndim == 0:
        back = _from32(aval.dtype)
        return lambda r: back(r[0])
    return reader(aval.shape)


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


def _as32(v):
    """``v`` in a 32-bit type (what the TPU transposes and SMEM holds), and the way back."""
    dtype = jnp.dtype(v.dtype)
    wide = jnp.int32 if dtype == jnp.bool_ else jnp.float32 if dtype.itemsize < 4 else dtype
    return v.astype(wide), _from32(dtype)


def _from32(dtype):
    """The way back from :func:`_as32` to ``dtype``."""
    dtype = jnp.dtype(dtype)
    return (lambda w: w != 0) if dtype == jnp.bool_ else (lambda w: w.astype(dtype))


def keyed(a):
    """A const read at each pair's slot or row (``Spec.keyed``) as 32-bit lanes ``(1, n)``."""
    return _as32(a)[0].reshape(1, a.shape[0])


def keyed_reader(aval, side):
    """Read a block of a keyed const (see :func:`keyed`): ``(bi,)`` down a column for the
    slots' side (0), ``(bj,)`` along the lanes for the rows' (1)."""
    back = _from32(aval.dtype)
    if side == 0:
        return lambda r: back(to_column(r[...]))
    return lambda r: back(r[...].reshape(aval.shape))


def take_block(block, index):
    """``pair_mask``'s ``take`` in a kernel: a keyed const comes as the block of the pairs'
    indices, already in their order."""
    return block.reshape(index.shape)


def to_column(v):
    """A row of lanes ``(1, b)`` as ``(b,)`` in a column's layout."""
    w, back = _as32(v)
    b = w.shape[-1]
    return back(jnp.broadcast_to(w, (LANES, b)).T[:, :1].reshape(b))


def to_lanes(v):
    """``(b,)`` in a column's layout as a row of lanes ``(1, b)``."""
    w, back = _as32(v)
    b = w.shape[0]
    return back(jnp.broadcast_to(w.reshape(b, 1), (b, LANES)).T[:1])
