"""One pairwise reduction as one engine fold: the rows of ``x`` its slots, blocks of ``y`` its
rows, the kernel's values of a block pair its tile; and what no rows give."""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
import numpy as np

from .. import _checks, _engine, _jax, _shard
from .._engine._plan import GEMM_TILE
from .._reductions import SUM, SoftmaxSum, SumOfProducts
from . import _distances, _factor
from ._kernel import _has_dot, _row_avals


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


def pairwise(
    name, kernel, x, y, monoid, block, axes=(), ring=(), mask=None, raw=False, widen=False
):
    """``monoid``-reduce ``kernel(x[i], y[j])`` over ``j`` for every ``i``: one engine fold.

    The rows of ``x`` are the fold's slots, the rows of ``y`` (walked transposed, see ``tile``)
    its rows, the arrays ``kernel`` closes over its constants; ``block`` is ``(bi, bj)`` or
    ``None`` (planned from the memory budget). On a mesh, ``axes`` are the mesh axes that split
    the rows of ``y`` (inside ``shard_map``; ``x`` is the same on every device along them, the
    states are all-reduced and indices are global), ``ring`` the axes that split both: the blocks
    of ``y`` go round the devices (``ppermute``) and come home with their cotangents.
    ``mask``: a :class:`._masks.Masking` or ``None``; ``raw``: the monoid's outputs, not its
    public result (a softmax's log-sum-exps too); ``widen``: the kernel's first act is to widen
    its half-precision inputs to float32 (see :class:`foldax._engine.Spec`).
    """
    m, n = _num_rows(name, "x", x), _num_rows(name, "y", y)
    if m == 0 or n == 0:
        return _empty(monoid, kernel, x, y, m, raw)
    if axes and _shard.types_checked(axes):
        # x meets rows of y that differ per device: make it varying here, outside the fold, so
        # that its cotangent is accumulated locally and summed once (the cast's transpose).
        x = _shard.to_varying(x, axes)
    xi = jax.tree.map(lambda a: _shard.example(a, jnp.shape(a)[1:], axes), x)
    yj = jax.tree.map(lambda a: _shard.example(a, jnp.shape(a)[1:], axes), y)
    replay, consts = _shard.replayable(kernel, xi, yj)
    conv = lambda a, b, *c: replay(c)(a, b)  # noqa: E731
    fold_of = lambda kernel: functools.partial(  # noqa: E731
        _fold, name, xi, yj, block, axes, ring, kernel, widen=widen
    )
    run = fold_of(conv)
    if not axes and not ring:  # min-family reductions of squared distances in high dimension
        run = _distances.nearest(conv, tuple(consts), xi, yj, monoid, fold_of) or run
    outs, monoid = run(monoid, tuple(consts), x, y, mask)
    return tuple(outs) if raw else monoid.result(outs)


def _fold(
    name, xi, yj, block, axes, ring, conv, monoid, consts, x, y, mask, rows_first=False, widen=False
):
    """``(outputs, monoid)``: the engine fold of ``conv(x[i], y[j], *consts)`` (the monoid
    :func:`_tile_fn` reduces with, which may be ``monoid``'s shared form); ``rows_first``:
    never walk ``y`` transposed (no copy of it)."""
    m, n = _num_rows(name, "x", x), _num_rows(name, "y", y)
    tile, monoid, cols, lanes_tile = _tile_fn(
        conv, consts, xi, yj, monoid, rows_first, mask is not None
    )
    x_leaves, x_tree = jax.tree.flatten(x)
    y_leaves, y_tree = jax.tree.flatten(y)
    nk = len(consts)
    pair_mask = block_live = None
    keyed = ()
    if mask is not None:  # the arrays the mask reads follow the kernel's
        pair_mask, block_live, keyed = mask.pair_mask(nk), mask.block_live(nk), mask.keyed(nk)
        consts = (*consts, *mask.consts)

    def body(consts, slots, rows, mask, index):
        xb, yb = jax.tree.unflatten(x_tree, slots), jax.tree.unflatten(y_tree, rows)
        return tile(consts[:nk], xb, yb), (), ()

    def lanes_body(consts, slots, rows, mask, index):
        xb, yb = jax.tree.unflatten(x_tree, slots), jax.tree.unflatten(y_tree, rows)
        return lanes_tile(consts[:nk], xb, yb), (), ()

    # a kernel that contracts is a matrix product per tile: tiles long both ways (unless the
    # monoid asks for its own, as the k smallest do; smaller where a mask skips more of their
    # pairs, in the forward fold and in the gradient's, see Masking.gemm_tiles)
    gemm = not cols and getattr(monoid, "dense_tile", None) is None
    preferred = gradient = GEMM_TILE if gemm else None
    if gemm and mask is not None and block is None:
        forward, gradient = mask.gemm_tiles(m, n)
        preferred, gradient = forward or preferred, gradient or preferred
    axis = -1 if cols else 0
    plan = _engine.PlanSpec(
        "dense", n, m, None, block, row_axis=axis, tile=preferred,
        grad_tile=None if gradient == preferred else gradient,
    )  # fmt: skip
    spec = _engine.Spec(
        plan,
        body,
        monoid,
        _engine.current_budget(),
        axes=axes,
        ring=ring,
        name=name,
        pair_mask=pair_mask,
        block_live=block_live,
        widen=widen,
        implementation=_engine.current_implementation(),
        lanes_body=None if lanes_tile is None else lanes_body,
        keyed=keyed,
    )
    # y is walked transposed (rows last) unless the kernel contracts: one O(N) copy per call.
    rows = [jnp.moveaxis(a, 0, -1) for a in y_leaves] if cols else y_leaves
    outs, _, _ = _engine.fold(spec, (), tuple(consts), x_leaves, rows)
    return tuple(outs), monoid


def _tile_fn(conv, consts, xi, yj, monoid, rows_first=False, pair_masked=False):
    """``(tile, monoid, cols, lanes_tile)``: ``tile(consts, xb, yb)`` the kernel values
    ``(bi, bj, *F)`` of a block of ``x`` (rows first) and one of ``y`` (rows last if ``cols``,
    else first); ``lanes_tile`` (with ``cols``): the same of a block of ``x`` with its rows
    last too, every intermediate ``(*f, bi, bj)`` (an accelerator's vector registers are its
    last two axes), else ``None``.

    ``y`` holds its rows along the *last* axis (``(*f, bj)``), so the kernel's feature axes (e.g.
    ``D`` of a distance) are outer and ``j`` is the innermost, contiguous axis of every
    intermediate: XLA vectorises along ``j`` instead of along a short ``D`` (10x faster for a 3-D
    Gaussian kernel on CPU). Kernels with a dot product (attention) use the classic double
    ``vmap``, which JAX batches into one GEMM per tile.

    A kernel that is a weight of the pair times values of ``y`` (:func:`._factor.split`: a sum
    of ``k(a, b[0]) * b[1]``, a softmax whose values are rows of ``y``) makes the pair
    ``(weights (bi, bj), values (bj, *F))`` instead, reduced as one matrix product per tile by
    the monoid's shared form (:class:`~foldax._reductions.SumOfProducts`, ``SoftmaxSum(shared=
    True)``).
    """
    traced = jax.make_jaxpr(conv)(xi, yj, *consts)
    jaxpr = _jax.open_jaxpr(traced)[0]
    contracts = rows_first or _has_dot(jaxpr)
    parts, shared = None, None
    if isinstance(monoid, SoftmaxSum):
        parts, shared = _factor.split(traced, xi, softmax=True), SoftmaxSum(shared=True)
    elif monoid == SUM and jaxpr.outvars[0].aval.shape != ():
        parts, shared = _factor.split(traced, xi), SumOfProducts(pair_masked)
    pair = conv if parts is None else parts.weight

    def pairs(c, xb, yb):
        fn = lambda a, b: pair(a, b, *c)  # noqa: E731
        if contracts:  # y's rows first: no transpose
            return jax.vmap(jax.vmap(fn, (None, 0)), (0, None))(xb, yb)
        bi, bj = jax.tree.leaves(xb)[0].shape[0], jax.tree.leaves(yb)[0].shape[-1]
        # Both operands broadcast to (bi, *f, bj), with i batched at axis 0 and j at the last
        # axis for both: JAX's batching rules keep batch axes where they are when all operands
        # agree, so every intermediate is (bi, *f, bj) and the innermost axis is j.
        xs = jax.tree.map(lambda a: jnp.broadcast_to(a[..., None], (*a.shape, bj)), xb)
        ys = jax.tree.map(lambda a: jnp.broadcast_to(a[None], (bi, *a.shape)), yb)
        return jax.vmap(jax.vmap(fn, (-1, -1)), (0, 0))(xs, ys)

    def lanes_pairs(c, xb, yb):
        fn = lambda a, b: pair(a, b, *c)  # noqa: E731
        bi, bj = jax.tree.leaves(xb)[0].shape[-1], jax.tree.leaves(yb)[0].shape[-1]
        xs = jax.tree.map(lambda a: jnp.broadcast_to(a[..., None], (*a.shape, bj)), xb)
        ys = jax.tree.map(lambda a: jnp.broadcast_to(a[..., None, :], (*a.shape[:-1], bi, bj)), yb)
        return jax.vmap(jax.vmap(fn, (-1, -1)), (-2, -2))(xs, ys)

    def with_values(pairs):
        def tile(c, xb, yb):
            values = jax.vmap(lambda b: parts.values(b, *c), 0 if contracts else -1)(yb)
            return pairs(c, xb, yb), values

        return tile

    lanes = None if contracts else lanes_pairs
    if parts is None:
        return pairs, monoid, not contracts, lanes
    return with_values(pairs), shared, not contracts, lanes and with_values(lanes)


def _local(
    name, kernel, x, y, monoid, block_size, m, n, axes, ring=(), mask=None, raw=False, widen=False
):
    """On one device, or inside ``shard_map`` with the rows of ``y`` split over ``axes`` (its
    states all-reduced) or over ``ring`` (axes that split ``x`` too: its blocks go round)."""
    block = _block_sizes(name, block_size, m, n)
    if m == 0 or n == 0:
        return _empty(monoid, kernel, x, y, m, raw)
    if axes and _shard.types_checked(axes):
        split_x = [ax for ax in axes if any(ax in _shard.varying(a) for a in jax.tree.leaves(x))]
        if split_x:
            raise ValueError(
                f"{name}: x varies along axis_name {tuple(split_x)}, but axis_name splits the "
                f"rows of y (the reduced axis) and every device must hold the same rows of x; "
                f"replicate x along it (in_specs P() for x), or split x over another mesh axis."
            )
    return pairwise(name, kernel, x, y, monoid, block, axes, ring, mask, raw, widen)


def _empty(monoid, kernel, x, y, m, raw=False):
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
    outs = (first, *outs[1:])
    return outs if raw else monoid.result(outs)
