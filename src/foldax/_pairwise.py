"""Pairwise reductions ``out[i] = reduce_j kernel(x[i], y[j])`` in tiles, KeOps-style.

The ``(M, N)`` matrix of kernel values is never formed: one engine fold (:mod:`foldax._engine`)
walks blocks of ``bi`` rows of ``x`` by ``bj`` rows of ``y``, folding each tile into a monoid
state per row of ``x``; every derivative is another such fold, recomputing each tile. Memory is
``O(bi * bj + M + N)``, forward, backward and forward-mode.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from . import _checks, _closure, _eager, _engine, _shard
from ._reductions import LOGSUMEXP, MAX, MIN, SUM
from ._reductions._base import (
    promote,
)
from ._reductions._extremum import ArgExtremum, ExtremumWithIndex
from ._reductions._kmin import KMin
from ._reductions._logsumexp import WeightedLogSumExp
from ._reductions._softmax import SoftmaxSum

if TYPE_CHECKING:
    from jaxtyping import Array

# ----------------------------------------------------------------------------------------------
# Monoids that only pairwise reductions use (they need the column index or a pytree value).


REDUCTIONS = (
    "sum",
    "logsumexp",
    "max",
    "min",
    "argmax",
    "argmin",
    "max_argmax",
    "min_argmin",
    "kmin",
    "softmax",
)


#: hints for reduction names that are not foldax's, but whose meaning is near one of them
_REDUCTION_HINTS = {
    "kmax": " (for the k largest, reduce the negated kernel with reduction='kmin')",
    "topk": " (for the k smallest, reduction='kmin'; the k largest: of the negated kernel)",
}


def _monoid_for(name, reduction, k, n):
    """The monoid of ``reduction`` (``k``: its static argument, kmin's only), after checking
    them in that order: the name first, so that a wrong one is named as such."""
    known = ", ".join(repr(r) for r in REDUCTIONS)
    if not isinstance(reduction, str):
        raise TypeError(
            f"{name}: reduction must be a string, got {type(reduction).__name__} "
            f"{reduction!r:.40}; pass one of {known}."
        )
    if reduction not in REDUCTIONS:
        raise ValueError(
            f"{name}: reduction={reduction!r:.40} is not a reduction foldax knows"
            f"{_REDUCTION_HINTS.get(reduction, '')}; choose one of {known}."
        )
    if reduction != "kmin":
        if k is not None:
            raise ValueError(
                f"{name}: k={k!r:.40} is only used with reduction='kmin', got "
                f"reduction={reduction!r}; drop k, or pass reduction='kmin'."
            )
        return {
            "sum": SUM,
            "logsumexp": LOGSUMEXP,
            "max": MAX,
            "min": MIN,
            "argmax": ArgExtremum(True),
            "argmin": ArgExtremum(False),
            "max_argmax": ExtremumWithIndex(True),
            "min_argmin": ExtremumWithIndex(False),
            "softmax": SoftmaxSum(),
        }[reduction]
    fix = f"pass an int with 0 < k <= N = {n} (the rows of y)"
    if k is None:
        raise ValueError(f"{name}: k is missing, and reduction='kmin' needs it; {fix}.")
    k = _checks.static_int(name, "k", k, fix)
    if not 0 < k <= n:
        fix = f"pass k <= {n}, or more rows of y" if n else "pass y with at least k rows"
        fix = "pass k >= 1" if k <= 0 else fix
        raise ValueError(
            f"{name}: k must satisfy 0 < k <= N = {n} (the rows of y), got k = {k}; {fix}."
        )
    return KMin(k)


# ----------------------------------------------------------------------------------------------
# The double loop


def _num_rows(name, argname, tree):
    leaves = jax.tree.leaves(tree)
    if not leaves:
        raise TypeError(f"{name}: {argname} is empty; pass an array or a pytree of arrays.")
    sizes = [jnp.shape(a)[0] if jnp.ndim(a) else None for a in leaves]
    if any(s is None for s in sizes):
        raise ValueError(
            f"{name}: every leaf of {argname} needs a leading axis (rows), got a scalar."
        )
    if len(set(sizes)) != 1:
        raise ValueError(
            f"{name}: the leaves of {argname} must share their leading size, got {sizes}."
        )
    return _checks.concrete_rows(name, f"the leading axis of {argname}", sizes[0])


def _block_sizes(name, block_size, m, n):
    if block_size is None:
        return None
    bs = (block_size, block_size) if isinstance(block_size, int | np.integer) else block_size
    if isinstance(bs, tuple | list) and len(bs) != 2:
        raise ValueError(
            f"{name}: block_size must be an int or a pair (bi, bj), got {len(bs)} values {block_size!r}."
        )
    try:
        if isinstance(block_size, bool) or any(isinstance(b, bool) for b in bs):
            raise TypeError
        bi, bj = (operator.index(b) for b in bs)
    except TypeError:
        raise TypeError(
            f"{name}: block_size must be a static int or a pair (bi, bj) of ints, got {block_size!r}."
        ) from None
    if bi <= 0 or bj <= 0:
        raise ValueError(f"{name}: block_size must be positive, got {block_size!r}.")
    return min(bi, m), min(bj, n)


def pairwise(name, kernel, x, y, monoid, block, axes=(), ring=(), mask=None):
    """``monoid``-reduce ``kernel(x[i], y[j])`` over ``j`` for every ``i``: one engine fold.

    The rows of ``x`` are the fold's slots, the rows of ``y`` (walked transposed, see ``tile``)
    its rows, the arrays ``kernel`` closes over its constants; ``block`` is ``(bi, bj)`` or
    ``None`` (planned from the memory budget). On a mesh, ``axes`` are the mesh axes that split
    the rows of ``y`` (inside ``shard_map``; ``x`` is the same on every device along them, the
    states are all-reduced and indices are global), ``ring`` the axes that split both: the blocks
    of ``y`` go round the devices (``ppermute``) and come home with their cotangents.
    """
    m, n = _num_rows(name, "x", x), _num_rows(name, "y", y)
    if m == 0 or n == 0:
        return _empty(monoid, kernel, x, y, m)
    if axes and _shard.types_checked(axes):
        # x meets rows of y that differ per device: make it varying here, outside the fold, so
        # that its cotangent is accumulated locally and summed once (the cast's transpose).
        x = _shard.to_varying(x, axes)
    xi = jax.tree.map(lambda a: _shard.example(a, jnp.shape(a)[1:], axes), x)
    yj = jax.tree.map(lambda a: _shard.example(a, jnp.shape(a)[1:], axes), y)
    replay, consts = _shard.replayable(kernel, xi, yj)
    tile, monoid, cols = _tile_fn(lambda a, b, *c: replay(c)(a, b), tuple(consts), xi, yj, monoid)
    x_leaves, x_tree = jax.tree.flatten(x)
    y_leaves, y_tree = jax.tree.flatten(y)
    nk = len(consts)
    if mask is not None:  # the arrays the mask closes over follow the kernel's
        closed, mask_consts = mask
        mask = _pair_mask(closed, nk, len(mask_consts))
        consts = [*consts, *mask_consts]

    def body(consts, slots, rows, mask, index):
        xb, yb = jax.tree.unflatten(x_tree, slots), jax.tree.unflatten(y_tree, rows)
        return tile(consts[:nk], xb, yb), (), ()

    plan = _engine.PlanSpec("dense", n, m, None, block, row_axis=-1 if cols else 0)
    spec = _engine.Spec(
        plan,
        body,
        monoid,
        _engine.current_budget(),
        axes=axes,
        ring=ring,
        name=name,
        pair_mask=mask,
    )
    # y is walked transposed (rows last) unless the kernel contracts: one O(N) copy per call.
    rows = [jnp.moveaxis(a, 0, -1) for a in y_leaves] if cols else y_leaves
    outs, _, _ = _engine.fold(spec, (), tuple(consts), x_leaves, rows)
    return monoid.result(outs)


def _tile_fn(conv, consts, xi, yj, monoid):
    """``(tile, monoid, cols)``: ``tile(consts, xb, yb)`` the kernel values ``(bi, bj, *F)`` of a
    block of ``x`` (rows first) and one of ``y`` (rows last if ``cols``, else first).

    ``y`` holds its rows along the *last* axis (``(*f, bj)``), so the kernel's feature axes (e.g.
    ``D`` of a distance) are outer and ``j`` is the innermost, contiguous axis of every
    intermediate: XLA vectorises along ``j`` instead of along a short ``D`` (10x faster for a 3-D
    Gaussian kernel on CPU). Kernels with a dot product (attention) use the classic double
    ``vmap``, which JAX batches into one GEMM per tile; for ``reduction="softmax"``, values
    independent of ``x`` (attention's ``V``) stay ``(bj, *Fv)`` so that ``P @ V`` is a GEMM
    (the monoid is switched to its shared form).
    """
    contracts = _has_dot(jax.make_jaxpr(conv)(xi, yj, *consts).jaxpr)
    shared = False
    if isinstance(monoid, SoftmaxSum) and contracts:

        def shared_tile(c, xb, yb):
            pair = lambda a, b: conv(a, b, *c)  # noqa: E731
            return jax.vmap(jax.vmap(pair, (None, 0)), (0, None), out_axes=(0, None))(xb, yb)

        blk = lambda t, b: jax.tree.map(lambda a: jax.ShapeDtypeStruct((b, *a.shape), a.dtype), t)  # noqa: E731
        try:
            jax.eval_shape(shared_tile, consts, blk(xi, 2), blk(yj, 3))
            shared, monoid = True, SoftmaxSum(shared=True)
        except ValueError:
            pass

    def tile(c, xb, yb):
        pair = lambda a, b: conv(a, b, *c)  # noqa: E731
        if contracts:  # y's rows first: no transpose
            out_axes = (0, None) if shared else 0
            return jax.vmap(jax.vmap(pair, (None, 0)), (0, None), out_axes=out_axes)(xb, yb)
        bi, bj = jax.tree.leaves(xb)[0].shape[0], jax.tree.leaves(yb)[0].shape[-1]
        # Both operands broadcast to (bi, *f, bj), with i batched at axis 0 and j at the last
        # axis for both: JAX's batching rules keep batch axes where they are when all operands
        # agree, so every intermediate is (bi, *f, bj) and the innermost axis is j.
        xs = jax.tree.map(lambda a: jnp.broadcast_to(a[..., None], (*a.shape, bj)), xb)
        ys = jax.tree.map(lambda a: jnp.broadcast_to(a[None], (bi, *a.shape)), yb)
        return jax.vmap(jax.vmap(pair, (-1, -1)), (0, 0))(xs, ys)

    return tile, monoid, not contracts


def _row_avals(tree):
    """Shape/dtype of one row of every leaf (the leading axis dropped)."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(jnp.shape(a)[1:], jnp.result_type(a)), tree)


def _has_dot(jaxpr) -> bool:
    """Whether a jaxpr (or one nested in it) contracts with ``dot_general``."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            return True
        for p in eqn.params.values():
            sub = getattr(p, "jaxpr", p)
            if hasattr(sub, "eqns") and _has_dot(sub):
                return True
    return False


def _is_pair(aval) -> bool:
    return isinstance(aval, tuple | list) and len(aval) == 2


def _kernel_aval(name, kernel, x, y):
    """What ``kernel`` returns for one row of ``x`` and one of ``y`` (traced once, abstractly)."""
    xi, yj = _row_avals(x), _row_avals(y)
    try:
        return jax.eval_shape(kernel, xi, yj)
    except Exception as e:  # the user's kernel failed on one (x[i], y[j]) pair
        raise TypeError(
            f"{name}: kernel(xi, yj) failed on one row of x and one row of y "
            f"(shapes {jax.tree.map(lambda a: a.shape, xi)}, {jax.tree.map(lambda a: a.shape, yj)}): {e}"
        ) from e


def _check_kernel_output(name, monoid, aval):
    if isinstance(monoid, WeightedLogSumExp):
        if any(jnp.shape(a) != jnp.shape(aval[0]) for a in aval):
            raise TypeError(
                f"{name}: a weighted logsumexp kernel returns (logit, weight) of one shape, "
                f"got {aval}."
            )
        for part, what in zip(aval, ("logit", "weight"), strict=True):
            monoid.check_dtype(name, f"the kernel's {what}", part.dtype)
        return
    if isinstance(monoid, SoftmaxSum):
        if not _is_pair(aval) or jnp.shape(aval[0]) != ():
            raise TypeError(
                f"{name}: with reduction='softmax' the kernel must return a pair (logit, value) "
                f"with a scalar logit, got {aval}."
            )
        monoid.check_dtype(name, "the kernel's logit", aval[0].dtype)
        for leaf in jax.tree.leaves(aval[1]):
            monoid.check_dtype(name, "the kernel's value", leaf.dtype)
        return
    if not isinstance(aval, jax.ShapeDtypeStruct):
        raise TypeError(f"{name}: kernel must return one array (scalar or small), got {aval}.")
    if isinstance(monoid, KMin) and aval.shape != ():
        raise ValueError(
            f"{name}: reduction='kmin' needs a scalar kernel, but kernel returned shape {aval.shape}."
        )
    monoid.check_dtype(name, "the kernel's output", aval.dtype)


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
    dynamic=("x", "y"),
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
    axis_name: str | tuple[str, ...] | None = None,
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
        (fold both row indices in, passing ``jnp.arange`` with ``x`` and ``y``).
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
      block_size: static int or pair ``(bi, bj)``: rows of ``x`` and ``y`` per tile, per
        element of an enclosing ``vmap`` (default: chosen when the computation is compiled, from
        the memory budget and the batch of every enclosing ``vmap``; see
        :func:`foldax.memory_budget`).
      axis_name: inside ``jax.shard_map`` only: the mesh axis (or tuple) over which the rows of
        ``y`` are split; ``y`` is this device's share, ``x`` must be the same on every device
        along it, and the states are all-reduced (indices are global). Under ``jax.jit``,
        sharded ``x`` and ``y`` are distributed without it: over different mesh axes, or over
        the same ones as a ring (the blocks of ``y`` go round the devices).

    Returns:
      ``(M, *F)`` for sum / logsumexp / max / min / softmax (``F`` of the value); ``(M, *F)``
      int32 indices for argmax / argmin (first occurrence, NaN counts as extreme, like NumPy;
      ``2**31 - 1`` when ``N = 0``); a pair ``(values, indices)`` for max_argmax / min_argmin;
      for ``"kmin"`` a pair ``(values (M, k), indices (M, k) int32)``, ascending, ties by the
      lower index, NaN last (like ``np.argsort(kind="stable")``).

    Memory: ``O(bi * bj + M + N)`` temp, forward and backward. Derivatives (``jax.grad``,
    ``jax.jvp``, ``jax.jacfwd``, ``jax.hessian``) are streamed folds too: they save the inputs and
    an ``(M, ...)`` summary (e.g. the log-sum-exp) and recompute every tile; they reach ``x``,
    ``y`` and the arrays ``kernel`` closes over.

    Example:
      >>> import jax.numpy as jnp, foldax
      >>> x = jnp.array([[0.0], [1.0]]); y = jnp.array([[0.0], [2.0], [3.0]])
      >>> foldax.pairwise_reduce(lambda a, b: jnp.sum((a - b) ** 2), x, y, reduction="min")
      Array([0., 1.], dtype=float32)
      >>> foldax.pairwise_reduce(lambda a, b: jnp.sum((a - b) ** 2), x, y, reduction="argmin")
      Array([0, 0], dtype=int32)
    """
    name = "foldax.pairwise_reduce"
    if not callable(kernel):
        raise TypeError(f"{name}: kernel must be callable, got {type(kernel).__name__}.")
    m, n = _num_rows(name, "x", x), _num_rows(name, "y", y)
    monoid = _monoid_for(name, reduction, k, n)
    aval = _kernel_aval(name, kernel, x, y)
    if reduction == "logsumexp" and _is_pair(aval):
        monoid = WeightedLogSumExp()
    _check_kernel_output(name, monoid, aval)
    unpack = None
    if isinstance(monoid, SoftmaxSum):
        kernel, unpack = _packed_values(kernel, aval[1])
    axes = _shard.axis_tuple(name, axis_name)
    split = None if axes else _mesh_split(name, x, y, m, n)
    if mask is not None:
        mask = _check_mask(name, mask, split is not None or bool(axes))
    if split is None:
        out = _local(name, kernel, x, y, monoid, block_size, m, n, axes, mask=mask)
    else:
        out = _on_mesh(name, kernel, x, y, monoid, block_size, *split)
    return out if unpack is None else unpack(out)


def _check_mask(name, mask, on_mesh):
    """``mask`` traced on one pair of indices: ``(Closed, consts)`` (see :func:`_pair_mask`)."""
    if not callable(mask):
        raise TypeError(f"{name}: mask must be a callable mask(i, j) -> bool, got {mask!r:.60}.")
    if on_mesh:
        raise ValueError(
            f"{name}: mask is not supported with sharded x / y or axis_name yet; call it on "
            f"one device, or fold the mask into the kernel (a -inf logit, a 0 weight)."
        )
    index = jax.ShapeDtypeStruct((), jnp.int32)
    try:
        closed, consts = _closure.trace(mask, index, index)
    except Exception as e:
        raise TypeError(
            f"{name}: mask(i, j) failed on a pair of int32 indices (write it elementwise with "
            f"jnp operations, e.g. lambda i, j: j <= i): {e}"
        ) from e
    out = closed.jaxpr.outvars
    if len(out) != 1 or out[0].aval.dtype != jnp.bool_ or out[0].aval.shape != ():
        got = ", ".join(v.aval.str_short() for v in out) or "nothing"
        raise TypeError(
            f"{name}: mask(i, j) must return one boolean per pair of indices, got {got} for "
            f"int32 scalars i, j (compare them, e.g. lambda i, j: j <= i)."
        )
    return closed, consts


def _pair_mask(closed, start, count):
    """The engine's ``pair_mask(consts, i, j)``: the user's mask (traced on one pair of
    indices), on broadcasting index arrays, reading the arrays it closes over from the fold's
    consts ``[start, start + count)``: whatever they are (jit arguments, vmapped arrays), they
    are the fold's inputs, never constants of its implementation."""

    def pair_mask(consts, i, j):
        own = tuple(consts[start : start + count])
        return jnp.vectorize(lambda a, b: closed(own, a, b))(i, j)

    return pair_mask


def _packed_values(kernel, val):
    """A softmax kernel whose values (``val``: their avals, any pytree, any float dtypes) come
    packed as one vector, and the function that turns the ``(M, F)`` result back into the values'
    tree and dtypes."""
    leaves, tree = jax.tree.flatten(val)
    if isinstance(val, jax.ShapeDtypeStruct):  # one array: only the result's dtype to restore
        return kernel, lambda out: out.astype(val.dtype)
    dtype = promote(*(leaf.dtype for leaf in leaves))
    ends = np.cumsum([math.prod(leaf.shape) for leaf in leaves])[:-1]

    def packed(a, b):
        logit, v = kernel(a, b)
        return logit, jnp.concatenate([jnp.ravel(t).astype(dtype) for t in jax.tree.leaves(v)])

    def unpack(out):
        parts = jnp.split(out, ends, axis=-1)
        shaped = [
            p.reshape((*out.shape[:-1], *leaf.shape)).astype(leaf.dtype)
            for p, leaf in zip(parts, leaves, strict=True)
        ]
        return jax.tree.unflatten(tree, shaped)

    return packed, unpack


def _local(name, kernel, x, y, monoid, block_size, m, n, axes, ring=(), mask=None):
    """On one device, or inside ``shard_map`` with the rows of ``y`` split over ``axes`` (its
    states all-reduced) or over ``ring`` (axes that split ``x`` too: its blocks go round)."""
    block = _block_sizes(name, block_size, m, n)
    if m == 0 or n == 0:
        return _empty(monoid, kernel, x, y, m)
    if axes and _shard.types_checked(axes):
        split_x = [ax for ax in axes if any(ax in _shard.varying(a) for a in jax.tree.leaves(x))]
        if split_x:
            raise ValueError(
                f"{name}: x varies along axis_name {tuple(split_x)}, but axis_name splits the "
                f"rows of y (the reduced axis) and every device must hold the same rows of x; "
                f"replicate x along it (in_specs P() for x), or split x over another mesh axis."
            )
    return pairwise(name, kernel, x, y, monoid, block, axes, ring, mask)


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


def _on_mesh(name, kernel, x, y, monoid, block_size, mesh, x_axes, y_axes):
    """Under ``jit``: ``shard_map`` over the mesh, rows of ``x`` split over ``x_axes`` (no
    communication), rows of ``y`` over ``y_axes`` (states all-reduced). The kernel is traced
    once for a pair of rows and replayed inside with its closed-over arrays passed in (the
    ``shard_map`` runs with ``check_vma=False``; see :func:`foldax._segment._core._on_mesh`)."""
    dx = math.prod(mesh.shape[a] for a in x_axes)
    dy = math.prod(mesh.shape[a] for a in y_axes)
    m, n = _num_rows(name, "x", x) // dx, _num_rows(name, "y", y) // dy
    replay, consts = _shard.replayable(kernel, _row_avals(x), _row_avals(y))

    def body(x, y, consts):
        k = replay(consts)
        if y_axes and set(y_axes) <= set(x_axes):  # y's blocks go round the devices that split x
            return _local(name, k, x, y, monoid, block_size, m, n, (), y_axes)
        return _local(name, k, x, y, monoid, block_size, m, n, y_axes)

    specs = tuple(jax.tree.map(_shard.rows_spec(a), t) for a, t in ((x_axes, x), (y_axes, y)))
    out = P(x_axes or None)
    out = (out, out) if isinstance(monoid, KMin | ExtremumWithIndex) else out
    return _shard.run_replayed(body, mesh, x_axes + y_axes, (x, y), specs, consts, out)


def _empty(monoid, kernel, x, y, m):
    """No rows of ``x`` or of ``y``: the reduction's identity for each row of ``x`` (0 for sums,
    -inf for a log-sum-exp, the dtype's lowest / highest for extrema, index ``2**31 - 1``; see
    :func:`pairwise_reduce`), in the kernel's dtype, from the states the engine would start from."""
    aval = jax.eval_shape(kernel, _row_avals(x), _row_avals(y))
    row = monoid.value_aval(
        jax.tree.map(lambda a: jax.ShapeDtypeStruct((1, 1, *a.shape), a.dtype), aval)
    )
    outs = monoid.outputs(monoid.init_aval(m, row))
    first, dtype = outs[0], getattr(row, "dtype", None)
    if dtype is not None and jnp.issubdtype(first.dtype, jnp.floating) and first.dtype != dtype:
        first = first.astype(dtype)
    return monoid.result((first, *outs[1:]))
