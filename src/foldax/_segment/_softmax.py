"""Log-sum-exps and softmaxes: ``segment_logsumexp``, ``segment_logmeanexp``,
``segment_log_softmax``, ``segment_softmax``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax

from .._reductions import LOGMEANEXP, LOGSUMEXP
from ._core import _eager_call, _segment
from ._docs import _BWD_NORM, _documented

if TYPE_CHECKING:
    from jaxtyping import Array, ArrayLike, Int


@_eager_call
@_documented()
def segment_logsumexp(
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
    r"""Per-segment log-sum-exp of ``fn(data)`` (or ``data``), each segment shifted by its own max.

    .. math:: \mathrm{out}_s = m_s + \log \sum_{i \in s} e^{v_i - m_s},\quad m_s = \max_{i \in s} v_i

    Args: {partition}

    Returns:
      ``(num_segments, *F)`` where ``F`` is the trailing shape of the values.

    Numerics:
      an empty segment gives -inf; -inf entries contribute nothing; +inf gives +inf; NaN
      gives NaN for its segment only. Segments far below the others (e.g. by 1000) keep full
      precision: there is no global shift. Gradients are ``softmax`` weights, 0 for empty
      segments and -inf entries (never NaN).

    Memory: {memory}

    Example:
      >>> import jax.numpy as jnp, foldax
      >>> x = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0])
      >>> foldax.segment_logsumexp(jnp.log(x), sizes=[2, 0, 3]).round(4)
      Array([1.0986,   -inf, 2.4849], dtype=float32)
    """
    return _segment("foldax.segment_logsumexp", LOGSUMEXP, **locals())


@_eager_call
@_documented()
def segment_logmeanexp(
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
    r"""Per-segment log-mean-exp of ``fn(data)`` (or ``data``): ``logsumexp - log(size)``.

    .. math:: \mathrm{out}_s = \log \frac{1}{n_s} \sum_{i \in s} e^{v_i}

    Args: {partition}

    Returns:
      ``(num_segments, *F)`` where ``F`` is the trailing shape of the values.

    Numerics:
      an empty segment gives NaN; otherwise as :func:`segment_logsumexp`.

    Memory: {memory}

    Example:
      >>> import jax.numpy as jnp, foldax
      >>> x = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0])
      >>> foldax.segment_logmeanexp(jnp.log(x), sizes=[2, 0, 3]).round(4)
      Array([0.4055,    nan, 1.3863], dtype=float32)
    """
    return _segment("foldax.segment_logmeanexp", LOGMEANEXP, **locals())


@_eager_call
@_documented(_BWD_NORM)
def segment_log_softmax(
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
    r"""Per-row log-softmax of ``fn(data)`` (or ``data``) within each segment.

    .. math:: \mathrm{out}_i = v_i - \log \sum_{j \in s(i)} e^{v_j}

    Args: {partition}

    Returns:
      ``(N, *F)``: one value per row, like ``fn(data)``.

    Numerics:
      rows whose segment id is out of range, and every row of a segment that is all -inf or
      holds a +inf or NaN (as ``jax.nn.softmax``), give NaN and take no gradient. The result
      is written chunk by chunk; its temp memory does not grow with ``N``.

    Memory: {memory}

    Example:
      >>> import jax.numpy as jnp, foldax
      >>> x = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0])
      >>> out = foldax.segment_log_softmax(jnp.log(x), sizes=[2, 0, 3])
      >>> [round(v, 4) for v in out.tolist()]
      [-1.0986, -0.4055, -1.3863, -1.0986, -0.8755]
    """
    return _segment("foldax.segment_log_softmax", "log_softmax", **locals())


@_eager_call
@_documented(_BWD_NORM)
def segment_softmax(
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
    r"""Per-row softmax of ``fn(data)`` (or ``data``) within each segment.

    .. math:: \mathrm{out}_i = e^{v_i} / \sum_{j \in s(i)} e^{v_j}

    Args: {partition}

    Returns:
      ``(N, *F)``: one value per row, like ``fn(data)``.

    Numerics:
      rows whose segment id is out of range, and every row of a segment that is all -inf or
      holds a +inf or NaN (as ``jax.nn.softmax``), give NaN and take no gradient. Each segment's rows sum to 1.

    Memory: {memory}

    Example:
      >>> import jax.numpy as jnp, foldax
      >>> x = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0])
      >>> out = foldax.segment_softmax(jnp.log(x), sizes=[2, 0, 3])
      >>> [round(v, 4) for v in out.tolist()]
      [0.3333, 0.6667, 0.25, 0.3333, 0.4167]

      With a model evaluated chunk by chunk (``fn``), differentiable in its parameters:

      >>> w = jnp.array([0.5, -1.0])
      >>> rows = jnp.stack([x, x**2], axis=1)               # (N, 2) features
      >>> fn = lambda r: r @ w                              # (C, 2) -> (C,)
      >>> foldax.segment_softmax(rows, sizes=[2, 3], fn=fn).sum().round(4)
      Array(2., dtype=float32)
    """
    return _segment("foldax.segment_softmax", "softmax", **locals())
