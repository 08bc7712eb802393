"""Sums and moments: ``segment_sum``, ``segment_mean``, ``segment_prod``, ``segment_var``,
``segment_std``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax

from .._reductions import MEAN, PROD, SUM
from .._reductions._var import Var
from ._core import _ddof, _eager_call, _segment
from ._docs import _documented

if TYPE_CHECKING:
    from jaxtyping import Array, ArrayLike, Int


@_eager_call
@_documented()
def segment_sum(
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
    r"""Per-segment sum of ``fn(data)`` (or ``data``), streamed.

    .. math:: \mathrm{out}_s = \sum_{i \in s} v_i

    Args: {partition}

    Returns:
      ``(num_segments, *F)`` where ``F`` is the trailing shape of the values.

    Numerics:
      an empty segment sums to 0. NaN or inf propagate to their segment only.

    Memory: {memory}

    Example:
      >>> import jax.numpy as jnp, foldax
      >>> x = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0])
      >>> foldax.segment_sum(x, sizes=[2, 0, 3])
      Array([ 3.,  0., 12.], dtype=float32)
    """
    return _segment("foldax.segment_sum", SUM, **locals())


@_eager_call
@_documented()
def segment_mean(
    data: ArrayLike | Any,
    segment_ids: Int[Array, " N"] | None = None,
    num_segments: int | None = None,
    indices_are_sorted: bool = False,
    unique_indices: bool = False,
    bucket_size: int | None = None,
    mode: str | jax.lax.GatherScatterMode | None = None,
    *,
    empty: float | complex = 0.0,
    sizes: Any = None,
    offsets: Any = None,
    fn: Callable | None = None,
    chunk_size: int | None = None,
    axis_name: str | tuple[str, ...] | None = None,
) -> Array:
    r"""Per-segment mean of ``fn(data)`` (or ``data``), streamed.

    .. math:: \mathrm{out}_s = \frac{1}{n_s} \sum_{i \in s} v_i

    Args: {partition}

    Returns:
      ``(num_segments, *F)`` where ``F`` is the trailing shape of the values.

    Numerics:
      an empty segment (a node with no incoming edge) gives ``empty`` (keyword, a static
      number; default 0, as in jraph, PyTorch Geometric and TensorFlow; ``empty=float("nan")``
      for ``0 / 0``), with a zero gradient: nothing reaches the other segments. NaN propagates
      to its segment only. Real or complex values.

    Memory: {memory}

    Example:
      >>> import jax.numpy as jnp, foldax
      >>> x = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0])
      >>> foldax.segment_mean(x, sizes=[2, 0, 3])
      Array([1.5, 0. , 4. ], dtype=float32)
      >>> foldax.segment_mean(x, sizes=[2, 0, 3], empty=float("nan"))
      Array([1.5, nan, 4. ], dtype=float32)
    """
    return _segment("foldax.segment_mean", MEAN, **locals())


@_eager_call
@_documented()
def segment_prod(
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
    r"""Per-segment product of ``fn(data)`` (or ``data``), streamed.

    .. math:: \mathrm{out}_s = \prod_{i \in s} v_i

    Args: {partition}

    Returns:
      ``(num_segments, *F)`` where ``F`` is the trailing shape of the values.

    Numerics:
      an empty segment gives 1. The state is the product of the non-zero values and the
      number of zeros (half precision multiplies in float32), so the gradient never divides
      by 0: with no zero it is ``out / v_i``, with one zero the product of the others at that
      zero (0 elsewhere), with two or more zeros 0. A zero with NaN or inf in its segment
      gives NaN (0 * inf), like ``jnp.prod``. Unlike ``jax.ops.segment_prod``, the gradient
      is defined for repeated and unsorted ids. Integers wrap on overflow, like ``jnp.prod``.

    Memory: {memory}

    Example:
      >>> import jax.numpy as jnp, foldax
      >>> x = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0])
      >>> foldax.segment_prod(x, sizes=[2, 0, 3])
      Array([ 2.,  1., 60.], dtype=float32)
    """
    return _segment("foldax.segment_prod", PROD, **locals())


@_eager_call
@_documented()
def segment_var(
    data: ArrayLike | Any,
    segment_ids: Int[Array, " N"] | None = None,
    num_segments: int | None = None,
    indices_are_sorted: bool = False,
    unique_indices: bool = False,
    bucket_size: int | None = None,
    mode: str | jax.lax.GatherScatterMode | None = None,
    *,
    ddof: int | float = 0,
    sizes: Any = None,
    offsets: Any = None,
    fn: Callable | None = None,
    chunk_size: int | None = None,
    axis_name: str | tuple[str, ...] | None = None,
) -> Array:
    r"""Per-segment variance of ``fn(data)`` (or ``data``), streamed and numerically stable.

    .. math:: \mathrm{out}_s = \frac{1}{n_s - \mathrm{ddof}} \sum_{i \in s} (v_i - \bar v_s)^2

    Args: {partition}

    Returns:
      ``(num_segments, *F)`` where ``F`` is the trailing shape of the values.

    Numerics:
      The state is ``(count, mean, M2)`` merged with Chan et al.'s update (each tile's mean
      and squared deviations are exact two-pass sums), never ``E[v^2] - E[v]^2``: at a mean
      of 1e4 float32 keeps ~1e-6 relative precision. Half precision accumulates in float32.
      ``ddof`` (keyword, a static number >= 0) divides by ``n - ddof``; a segment with ``n <=
      ddof`` (an empty one included) gives NaN (NumPy gives NaN or inf) and a zero gradient.
      Gradient: ``2 (v_i - mean) / (n - ddof)``.

    Memory: {memory}

    Example:
      >>> import jax.numpy as jnp, foldax
      >>> x = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0])
      >>> foldax.segment_var(x, sizes=[2, 0, 3], ddof=1)
      Array([0.5, nan, 1. ], dtype=float32)
    """
    kw = locals()
    op = Var(_ddof("foldax.segment_var", kw.pop("ddof")), std=False)
    return _segment("foldax.segment_var", op, **kw)


@_eager_call
@_documented()
def segment_std(
    data: ArrayLike | Any,
    segment_ids: Int[Array, " N"] | None = None,
    num_segments: int | None = None,
    indices_are_sorted: bool = False,
    unique_indices: bool = False,
    bucket_size: int | None = None,
    mode: str | jax.lax.GatherScatterMode | None = None,
    *,
    ddof: int | float = 0,
    sizes: Any = None,
    offsets: Any = None,
    fn: Callable | None = None,
    chunk_size: int | None = None,
    axis_name: str | tuple[str, ...] | None = None,
) -> Array:
    r"""Per-segment standard deviation of ``fn(data)`` (or ``data``): ``sqrt(segment_var)``.

    .. math:: \mathrm{out}_s = \Big(\frac{1}{n_s - \mathrm{ddof}} \sum_{i \in s} (v_i - \bar v_s)^2\Big)^{1/2}

    Args: {partition}

    Returns:
      ``(num_segments, *F)`` where ``F`` is the trailing shape of the values.

    Numerics:
      The state is ``(count, mean, M2)`` merged with Chan et al.'s update (each tile's mean
      and squared deviations are exact two-pass sums), never ``E[v^2] - E[v]^2``: at a mean
      of 1e4 float32 keeps ~1e-6 relative precision. Half precision accumulates in float32.
      ``ddof`` (keyword, a static number >= 0) divides by ``n - ddof``; a segment with ``n <=
      ddof`` (an empty one included) gives NaN (NumPy gives NaN or inf) and a zero gradient.
      Where the standard deviation is 0 the gradient is 0 (not NaN).

    Memory: {memory}

    Example:
      >>> import jax.numpy as jnp, foldax
      >>> x = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0])
      >>> foldax.segment_std(x, sizes=[2, 0, 3]).round(4)
      Array([0.5   ,    nan, 0.8165], dtype=float32)
    """
    kw = locals()
    op = Var(_ddof("foldax.segment_std", kw.pop("ddof")), std=True)
    return _segment("foldax.segment_std", op, **kw)
