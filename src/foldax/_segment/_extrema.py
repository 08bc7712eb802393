"""Extrema and their rows: ``segment_max``, ``segment_min``, ``segment_argmax``,
``segment_argmin``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from .._reductions import ARGMAX, ARGMIN, MAX, MIN, NO_INDEX
from ._core import _eager_call, _segment
from ._docs import _BWD_EXTREMUM, _BWD_INDEX, _documented

if TYPE_CHECKING:
    from jaxtyping import Array, ArrayLike, Int


@_eager_call
@_documented(_BWD_EXTREMUM)
def segment_max(
    data: ArrayLike | Any,
    segment_ids: Int[Array, " N"] | None = None,
    num_segments: int | None = None,
    indices_are_sorted: bool = False,
    unique_indices: bool = False,
    bucket_size: int | None = None,
    mode: str | jax.lax.GatherScatterMode | None = None,
    *,
    sizes: Any = None,
    offsets: Any = None,
    fn: Callable | None = None,
    chunk_size: int | None = None,
    axis_name: str | tuple[str, ...] | None = None,
) -> Array:
    r"""Per-segment maximum of ``fn(data)`` (or ``data``), streamed.

    .. math:: \mathrm{out}_s = \max_{i \in s} v_i

    Args: {partition}

    Returns:
      ``(num_segments, *F)`` where ``F`` is the trailing shape of the values.

    Numerics:
      an empty segment gives -inf (the dtype's minimum for integers). NaN propagates to its
      segment. The gradient is split evenly among tied maxima, like ``jnp.max``. Bool values
      give a bool result (any / all; an empty segment gives False), as in ``jax.ops``.

    Memory: {memory}

    Example:
      >>> import jax.numpy as jnp, foldax
      >>> x = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0])
      >>> foldax.segment_max(x, sizes=[2, 0, 3])
      Array([  2., -inf,   5.], dtype=float32)
    """
    return _segment("foldax.segment_max", MAX, **locals())


@_eager_call
@_documented(_BWD_EXTREMUM)
def segment_min(
    data: ArrayLike | Any,
    segment_ids: Int[Array, " N"] | None = None,
    num_segments: int | None = None,
    indices_are_sorted: bool = False,
    unique_indices: bool = False,
    bucket_size: int | None = None,
    mode: str | jax.lax.GatherScatterMode | None = None,
    *,
    sizes: Any = None,
    offsets: Any = None,
    fn: Callable | None = None,
    chunk_size: int | None = None,
    axis_name: str | tuple[str, ...] | None = None,
) -> Array:
    r"""Per-segment minimum of ``fn(data)`` (or ``data``), streamed.

    .. math:: \mathrm{out}_s = \min_{i \in s} v_i

    Args: {partition}

    Returns:
      ``(num_segments, *F)`` where ``F`` is the trailing shape of the values.

    Numerics:
      an empty segment gives +inf (the dtype's maximum for integers). NaN propagates to its
      segment. The gradient is split evenly among tied minima, like ``jnp.min``. Bool values
      give a bool result (any / all; an empty segment gives True), as in ``jax.ops``.

    Memory: {memory}

    Example:
      >>> import jax.numpy as jnp, foldax
      >>> x = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0])
      >>> foldax.segment_min(x, sizes=[2, 0, 3])
      Array([ 1., inf,  3.], dtype=float32)
    """
    return _segment("foldax.segment_min", MIN, **locals())


@_eager_call
@_documented(_BWD_INDEX)
def segment_argmax(
    data: ArrayLike | Any,
    segment_ids: Int[Array, " N"] | None = None,
    num_segments: int | None = None,
    indices_are_sorted: bool = False,
    unique_indices: bool = False,
    bucket_size: int | None = None,
    mode: str | jax.lax.GatherScatterMode | None = None,
    *,
    sizes: Any = None,
    offsets: Any = None,
    fn: Callable | None = None,
    chunk_size: int | None = None,
    axis_name: str | tuple[str, ...] | None = None,
) -> Array:
    r"""Per-segment argmax of ``fn(data)`` (or ``data``): the row of each segment's maximum.

    .. math:: \mathrm{out}_s = \min \{\, i \in s : v_i = \max_{j \in s} v_j \,\}

    Args: {partition}

    Returns:
      ``(num_segments, *F)`` int32: the global row (index into the leading axis of ``data``)
      of each segment's extreme, per trailing element; -1 for an empty segment.

    Numerics:
      the first row of ties, like ``jnp.argmax``; NaN counts as the maximum (its first row),
      like NumPy. An empty segment (and every segment of an empty ``data``) gives -1.

    Memory: {memory}

    Example:
      >>> import jax.numpy as jnp, foldax
      >>> x = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0])
      >>> foldax.segment_argmax(x, jnp.array([1, 0, 1, 0, 3]), 3)  # id 3: dropped
      Array([ 3,  2, -1], dtype=int32)
    """
    return _no_row_is_minus_one(_segment("foldax.segment_argmax", ARGMAX, **locals()))


@_eager_call
@_documented(_BWD_INDEX)
def segment_argmin(
    data: ArrayLike | Any,
    segment_ids: Int[Array, " N"] | None = None,
    num_segments: int | None = None,
    indices_are_sorted: bool = False,
    unique_indices: bool = False,
    bucket_size: int | None = None,
    mode: str | jax.lax.GatherScatterMode | None = None,
    *,
    sizes: Any = None,
    offsets: Any = None,
    fn: Callable | None = None,
    chunk_size: int | None = None,
    axis_name: str | tuple[str, ...] | None = None,
) -> Array:
    r"""Per-segment argmin of ``fn(data)`` (or ``data``): the row of each segment's minimum.

    .. math:: \mathrm{out}_s = \min \{\, i \in s : v_i = \min_{j \in s} v_j \,\}

    Args: {partition}

    Returns:
      ``(num_segments, *F)`` int32: the global row (index into the leading axis of ``data``)
      of each segment's extreme, per trailing element; -1 for an empty segment.

    Numerics:
      the first row of ties, like ``jnp.argmin``; NaN counts as the minimum (its first row),
      like NumPy. An empty segment (and every segment of an empty ``data``) gives -1.

    Memory: {memory}

    Example:
      >>> import jax.numpy as jnp, foldax
      >>> x = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0])
      >>> foldax.segment_argmin(x, jnp.array([1, 0, 1, 0, 3]), 3)
      Array([ 1,  0, -1], dtype=int32)
    """
    return _no_row_is_minus_one(_segment("foldax.segment_argmin", ARGMIN, **locals()))


def _no_row_is_minus_one(index):
    """The arg-extremum of an empty segment is -1 (the fold's no-index is int32 max)."""
    return jnp.where(index == NO_INDEX, jnp.int32(-1), index)
