"""``pairwise_reduce``, the public function: arguments checked, the monoid chosen, one device or
a mesh; eager calls run one cached executable."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _eager, _engine, _shard
from .._engine._implementation import check as check_implementation
from .._reductions import Monoid, SoftmaxSum, WeightedLogSumExp
from ._kernel import (
    _check_kernel_output,
    _is_pair,
    _kernel_aval,
    _monoid_for,
    _packed_values,
    _row_avals,
)
from ._masks import check_masking
from ._mesh import _mesh_split, _on_mesh
from ._tiles import _local, _num_rows

if TYPE_CHECKING:
    from jaxtyping import Array


def _kernel_examples(arguments):
    """What ``kernel`` is traced on: one row of ``x`` and one of ``y`` (pytrees of arrays)."""
    rows = [arguments["x"], arguments["y"]]
    if not all(isinstance(a, jax.Array | np.ndarray) and a.ndim for a in jax.tree.leaves(rows)):
        raise TypeError("not pytrees of arrays")  # the uncached call explains
    return tuple(_row_avals(r) for r in rows)


def _mask_examples(arguments):
    """What ``mask`` is traced on: one slot index and one row index."""
    return (jax.ShapeDtypeStruct((), jnp.int32),) * 2


#: Eager calls run one cached executable (:mod:`foldax._eager`): ``x``, ``y`` and the arrays
#: ``kernel`` / ``mask`` close over are its inputs; every other argument is static.
_eager_call = _eager.cached(
    dynamic=("x", "y", "segment_ids"),
    hoist={
        "kernel": _eager.Hoist(_kernel_examples),
        "mask": _eager.Hoist(_mask_examples),
    },
)


@_eager_call
def pairwise_reduce(
    kernel: Callable[[Any, Any], Any],
    x: Any,
    y: Any,
    *,
    reduction: str = "sum",
    k: int | None = None,
    block_size: int | tuple[int, int] | None = None,
    mask: Callable[[Any, Any], Any] | None = None,
    segment_ids: Any = None,
    axis_name: str | tuple[str, ...] | None = None,
    implementation: str | None = None,
) -> Array | tuple[Array, Array]:
    """Reduce ``kernel(x[i], y[j])`` over ``j`` for every ``i``, without the ``(M, N)`` matrix.

    .. math:: \\mathrm{out}_i = \\bigoplus_{j<N} \\kappa(x_i, y_j)

    Args:
      kernel: ``kernel(xi, yj)`` of one row of ``x`` and one row of ``y`` (pytrees allowed; real
        or complex), returning a scalar or a small array ``F``; for ``reduction="softmax"`` a
        pair ``(logit, value)`` with a scalar real logit (``value`` any pytree of arrays, of
        any float dtypes: mixed precision is fine); for ``reduction="logsumexp"`` it may return
        a pair ``(logit, weight)`` (weights ``>= 0``): ``log sum_j w_ij exp(logit_ij)``. It may
        close over arrays; gradients flow to them. A random draw needs its own key per pair
        (fold both row indices in, passing ``jnp.arange`` with ``x`` and ``y``). The kernel's
        output dtype is the values' dtype: with half-precision rows, ``jnp.dot(a, b)`` rounds
        each logit to bfloat16 / float16 before it is reduced, and the result is half
        precision too; ``jnp.dot(a, b, preferred_element_type=jnp.float32)`` keeps the logits,
        the states and the result in float32. States of half-precision values are float32
        either way, and derivative folds sum half-precision cotangents in float32.
      x: array or pytree of arrays with leading axis ``M`` (the rows that are kept).
      y: array or pytree of arrays with leading axis ``N`` (the rows reduced over).
      reduction: ``"sum"``, ``"logsumexp"``, ``"max"``, ``"min"``, ``"argmax"``, ``"argmin"``,
        ``"max_argmax"`` / ``"min_argmin"`` (value and index in one pass), ``"kmin"`` (the
        ``k`` smallest) or ``"softmax"`` (softmax-weighted sum of values: exact attention).
        Static.
      k: static int, ``0 < k <= N``, for ``"kmin"`` only.
      mask: optional ``mask(i, j) -> bool`` of the global row indices of ``x`` and ``y``: one
        boolean for one pair of int32 indices, written elementwise with ``jnp`` operations
        (e.g. ``lambda i, j: j <= i`` for causal attention, ``lambda i, j: (j <= i) & (j > i -
        256)`` for a sliding window, ``lambda i, j: doc[i] == doc[j]`` for packed sequences);
        it is applied to whole tiles of indices. It may close over any arrays, also traced ones
        (arguments of a ``jax.jit``, ``vmap`` ped arrays: each batch element its own mask). Pairs where it is false
        take no part, and a tile where it is false everywhere is skipped, forward and
        backward, so a sparse mask costs what it keeps. A row of ``x`` with every pair masked
        gives the reduction's identity (0 for sum and softmax, -inf for logsumexp, +inf / -inf
        for min / max) with zero gradients. Not with sharded inputs or ``axis_name``.
        The blocks to visit come from the mask's formula where it can be bounded on a block
        (causal, sliding window, ``j < n``, ``i // b == j // b`` and their combinations: no
        pair is looked at); a mask that reads arrays by index is evaluated on every pair
        once to list them, so pass document ids as ``segment_ids`` instead.
      segment_ids: optional integer array ``(M,)`` when ``x`` and ``y`` have the same rows
        (self-attention), or a pair ``(ids_x (M,), ids_y (N,))``: only pairs with
        ``ids_x[i] == ids_y[j]`` take part (packed sequences: each document attends within
        itself), combined with ``mask`` by *and*. Traced or vmapped ids are fine. With sorted
        ids, the blocks with no pair in a common segment are skipped, listed from each block's
        range of ids (``O(M + N)`` work per block of ``x``, no pair looked at); unsorted ids
        give the same values, with fewer blocks skipped.
      block_size: static int or pair ``(bi, bj)``: rows of ``x`` and ``y`` per tile, per
        element of an enclosing ``vmap`` (default: chosen when the computation is compiled, from
        the memory budget and the batch of every enclosing ``vmap``; see
        :func:`foldax.memory_budget`).
      axis_name: inside ``jax.shard_map`` only: the mesh axis (or tuple) over which the rows of
        ``y`` are split; ``y`` is this device's share, ``x`` must be the same on every device
        along it, and the states are all-reduced (indices are global). Under ``jax.jit``,
        sharded ``x`` and ``y`` are distributed without it: over different mesh axes, or over
        the same ones as a ring (the blocks of ``y`` go round the devices).
      implementation: ``None``: the fastest for the platform (Pallas kernels on a TPU for the
        reductions they serve, the streamed XLA fold elsewhere); ``"xla"``: the XLA fold
        everywhere; ``"pallas"``: the kernels wherever one serves the reduction (in Pallas'
        interpret mode off a TPU: slow, for tests), the XLA fold where none does.

    Returns:
      ``(M, *F)`` for sum / logsumexp / max / min / softmax (``F`` of the value); ``(M, *F)``
      int32 indices for argmax / argmin (first occurrence, NaN counts as extreme, like NumPy;
      ``2**31 - 1`` when ``N = 0``); a pair ``(values, indices)`` for max_argmax / min_argmin;
      for ``"kmin"`` a pair ``(values (M, k), indices (M, k) int32)``, ascending, ties by the
      lower index, NaN last (like ``np.argsort(kind="stable")``).

    Speed: a kernel that is a weight of the pair times values carried on ``y``
    (``lambda a, b: k(a, b[0]) * b[1]`` with ``y = (points, values)``, values ``(N, R)``: a
    kernel matrix times ``R`` vectors) or a softmax whose values are rows of ``y`` reduces each
    tile as one matrix product, so ``R`` right-hand sides cost little more than one. A min,
    argmin, min_argmin or kmin of ``jnp.sum((a - b) ** 2)`` over ``D >= 32`` float32 / float64
    features finds candidates by matrix products (``|a|^2 + |b|^2 - 2 a.b``), ranks them by
    the kernel as written and certifies that no other row of ``y`` ranks before them (rows it
    cannot certify, e.g. near ties, are reduced again the plain way): the results are the
    kernel's own, values and indices.

    Memory: ``O(bi * bj + M + N)`` temp, forward and backward. Derivatives (``jax.grad``,
    ``jax.jvp``, ``jax.jacfwd``, ``jax.hessian``) are streamed folds too: they save the inputs and
    an ``(M, ...)`` summary (e.g. the log-sum-exp) and recompute every tile; they reach ``x``,
    ``y`` and the arrays ``kernel`` closes over. Those of max, min, min_argmin / max_argmax and
    kmin are the kernel's at the pairs they pick, gathered (``O(M)`` kernel evaluations, no
    second pass over the pairs); three or more tied values of a max or min split its gradient
    evenly, recomputed for those rows only.

    Example:
      >>> import jax.numpy as jnp, foldax
      >>> x = jnp.array([[0.0], [1.0]]); y = jnp.array([[0.0], [2.0], [3.0]])
      >>> foldax.pairwise_reduce(lambda a, b: jnp.sum((a - b) ** 2), x, y, reduction="min")
      Array([0., 1.], dtype=float32)
      >>> foldax.pairwise_reduce(lambda a, b: jnp.sum((a - b) ** 2), x, y, reduction="argmin")
      Array([0, 0], dtype=int32)
    """
    options = dict(locals())
    chosen = check_implementation("foldax.pairwise_reduce", options.pop("implementation"))
    with _engine.implementation(chosen or _engine.current_implementation()):
        return reduce_pairs("foldax.pairwise_reduce", **options)


def reduce_pairs(
    name,
    kernel,
    x,
    y,
    *,
    reduction,
    k,
    block_size,
    mask,
    segment_ids,
    axis_name,
    residual=False,
    pairs=None,
    band=None,
    widen=False,
):
    """:func:`pairwise_reduce` for the public function ``name``; with ``residual`` (softmax on
    one device) the pair ``(out, log-sum-exp of each row's logits)``; ``pairs``: a boolean
    ``(M, N)`` array of the pairs kept, besides ``mask`` (its blocks without one are skipped);
    ``band``: static bounds of the pairs ``mask`` keeps (see :func:`._masks.check_masking`);
    ``widen``: ``kernel`` widens its half-precision inputs to float32 first (its tiles'
    cotangents are then formed in float32, see :class:`foldax._engine.Spec`)."""
    if not callable(kernel):
        raise TypeError(f"{name}: kernel must be callable, got {type(kernel).__name__}.")
    m, n = _num_rows(name, "x", x), _num_rows(name, "y", y)
    # a monoid instance: a public function's own reduction (its values checked by it)
    own = isinstance(reduction, Monoid)
    monoid = reduction if own else _monoid_for(name, reduction, k, n)
    aval = _kernel_aval(name, kernel, x, y)
    if reduction == "logsumexp" and _is_pair(aval):
        monoid = WeightedLogSumExp()
    if not own:
        _check_kernel_output(name, monoid, aval)
    unpack = None
    if isinstance(monoid, SoftmaxSum):
        kernel, unpack = _packed_values(kernel, aval[1])
    axes = _shard.axis_tuple(name, axis_name)
    split = None if axes else _mesh_split(name, x, y, m, n)
    on_mesh = split is not None or bool(axes)
    mask = check_masking(name, mask, segment_ids, m, n, on_mesh, pairs, band)
    if split is None:
        out = _local(
            name, kernel, x, y, monoid, block_size, m, n, axes, mask=mask, raw=residual, widen=widen
        )
    elif residual:
        raise ValueError(f"{name}: return_residual is not supported with sharded inputs yet.")
    else:
        out = _on_mesh(name, kernel, x, y, monoid, block_size, *split, widen=widen)
    if residual:
        out, lse = out
        return unpack(out), lse
    return out if unpack is None else unpack(out)
