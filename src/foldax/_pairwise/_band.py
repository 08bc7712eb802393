"""The tile a contracting kernel (attention, a linear layer's logits) takes under a mask that
skips blocks: small tiles skip more of the pairs a causal mask or a window removes, but each
pair costs more in them. Chosen when the call is traced, in NumPy: from a band the caller
states (``dot_product_attention``'s ``is_causal`` / ``local_window_size``), else from the
mask's formula evaluated on a grid of sampled pairs (a mask of the indices alone: no arrays).

The choice is an estimate (which blocks to skip is still decided exactly by the engine's block
test); a mask the sampler cannot read keeps the default tile."""

from __future__ import annotations

import numpy as np

from .. import _jax

#: The cost per pair of a contracting kernel's square tile of each side, relative to 1024 x 1024,
#: in the forward pass and in the gradient's folds (measured on XLA:CPU, 2 cores: attention at
#: 4,096^2, D = 64: forward 1.17-1.3x / 1.9-2.35x at 512 / 256; gradient 0.99-1.02x / 1.75x, and
#: the same at D = 128 and at 2,048^2): smaller tiles skip more of a mask's pairs, but each pair
#: costs more in them -- in the forward pass; a gradient's pair costs the same in tiles of 512.
FORWARD_COST = {1024: 1.0, 512: 1.2, 256: 2.0}
GRADIENT_COST = {1024: 1.0, 512: 1.0, 256: 1.75}

#: The gradient's tile under a mask whose kept pairs cannot be read when the call is traced (a
#: boolean array, segment ids, a formula reading arrays): a block of 512 x 512 costs what one of
#: 1024 x 1024 costs per pair, and skips what a mask removes at a finer grain (a causal boolean
#: array at 4,096^2, D = 64: gradient 0.56-0.58x of no mask, against 0.63-0.64x in blocks of
#: 1,024; an all-true array 1.06-1.08x against 1.10-1.15x).
MASKED_GRADIENT_TILE = (512, 512)

#: The most sampled rows (and columns) of the grid a mask's formula is evaluated on.
SAMPLES = 512


def gemm_tile(m, n, band=None, closed=None, cost=FORWARD_COST):
    """The square tile ``(side, side)`` whose live blocks, times ``cost`` (:data:`FORWARD_COST`
    or :data:`GRADIENT_COST`), cost least, for ``band`` (``(left, right)``: at most the pairs
    ``i - left <= j <= i + right``; ``None`` on a side: unbounded) or else the mask ``closed``
    (a :class:`foldax._closure.Closed` of the indices alone); ``None`` where neither tells, or
    no tile would skip anything."""
    if max(m, n) <= min(cost):
        return None
    rows = _samples(m)
    cols = _samples(n)
    if band is not None:
        kept = _in_band(band, rows[:, None], cols[None, :])
    elif closed is not None:
        kept = _evaluate(closed.jaxpr, rows[:, None], cols[None, :])
        if kept is None:
            return None
        kept = np.broadcast_to(kept, (rows.size, cols.size))
    else:
        return None
    scores = {
        side: _live_fraction(kept, rows, cols, min(side, m), min(side, n)) * per_pair
        for side, per_pair in cost.items()
    }
    side = min(scores, key=scores.get)  # the first of equals: the largest tile
    return (side, side)


def _samples(size):
    return np.arange(0, size, max(1, size // SAMPLES), dtype=np.int64)


def _in_band(band, i, j):
    left, right = band
    kept = np.ones(np.broadcast_shapes(i.shape, j.shape), bool)
    if left is not None:
        kept &= j >= i - left
    if right is not None:
        kept &= j <= i + right
    return kept


def _live_fraction(kept, rows, cols, bi, bj):
    """The fraction of ``(bi, bj)`` blocks holding a kept sampled pair (the blocks with a
    sample; each sample counted in the block it starts from)."""
    live = _any_per_group(kept, rows // bi, axis=0)
    return float(_any_per_group(live, cols // bj, axis=1).mean())


def _any_per_group(a, group, axis):
    starts = np.flatnonzero(np.diff(group, prepend=-1))
    return np.logical_or.reduceat(a, starts, axis=axis)


def _div(a, b):
    """``lax.div``: integers rounded toward zero, ``x / 0`` all ones (-1), as XLA computes
    them (``MIN / -1`` wraps in NumPy too); floats by IEEE rules (``x / 0``: inf or NaN)."""
    if np.issubdtype(np.result_type(a, b), np.floating):
        return np.true_divide(a, b)
    zero = b == 0
    safe = np.where(zero, np.ones_like(b), b)
    q = np.sign(a) * np.sign(safe) * (np.abs(a) // np.abs(safe))
    return np.where(zero, np.asarray(-1).astype(q.dtype), q)


def _rem(a, b):
    """``lax.rem``: the sign of ``a``; an integer ``x % 0`` is ``x``, as XLA computes it (a
    float's is NaN)."""
    if np.issubdtype(np.result_type(a, b), np.floating):
        return np.fmod(a, b)
    zero = b == 0
    return np.where(zero, a, np.fmod(a, np.where(zero, np.ones_like(b), b)))


def _convert(a, dtype):
    """``convert_element_type`` as XLA computes it: a float cast to an integer saturates, and
    NaN becomes 0 (NumPy's own cast leaves both to the platform)."""
    dtype = np.dtype(dtype)
    if a.dtype.kind == "f" and dtype.kind in "iu":
        info = np.iinfo(dtype)
        a = np.clip(np.trunc(np.nan_to_num(a.astype(np.float64), nan=0.0)), info.min, info.max)
    return a.astype(dtype)


#: NumPy forms of the primitives a mask of indices is written with.
_OPS = {
    "add": np.add,
    "sub": np.subtract,
    "mul": np.multiply,
    "neg": np.negative,
    "abs": np.abs,
    "floor": np.floor,
    "ceil": np.ceil,
    "sign": np.sign,
    "max": np.maximum,
    "min": np.minimum,
    "lt": np.less,
    "le": np.less_equal,
    "gt": np.greater,
    "ge": np.greater_equal,
    "eq": np.equal,
    "ne": np.not_equal,
    "and": np.bitwise_and,  # lax's and / or / xor / not: bitwise on integers, logical on bools
    "or": np.bitwise_or,
    "xor": np.bitwise_xor,
    "not": np.invert,
    "rem": _rem,
    "div": _div,
    "select_n": lambda p, *cases: np.choose(p.astype(np.int64), cases),
    "copy": lambda a: a,
}


def _evaluate(jaxpr, i, j):
    """The mask's jaxpr (no constants) on broadcasting integer arrays ``i``, ``j`` in NumPy,
    or ``None`` where it uses a primitive outside :data:`_OPS`.

    A formula may divide by zero, overflow or make NaNs at some pairs (``t // s`` at
    ``s = 0``), as it may in JAX: NumPy's warnings about them are not the caller's (they would
    raise where warnings are errors), so they are silenced. Where NumPy's value still differs
    from XLA's (float arithmetic XLA fuses or rewrites, ``t / s`` as ``t * (1 / s)``) only the
    estimate suffers: the tile chosen, never which blocks are skipped (the engine's block test
    and pair mask decide that, on the compiled formula)."""
    with np.errstate(all="ignore"):
        out = _run(jaxpr, [i, j])
    return None if out is None or len(out) != 1 else np.asarray(out[0], bool)


def _run(jaxpr, args):
    """The outputs of ``jaxpr`` (no constants) on ``args`` in NumPy, or ``None``; each value
    in its own dtype (the indices int32, as traced: products wrap as they do in XLA)."""
    jaxpr, consts = _jax.open_jaxpr(jaxpr)
    if consts or jaxpr.constvars or len(jaxpr.invars) != len(args):
        return None
    as_traced = lambda v, a: np.asarray(a).astype(v.aval.dtype, copy=False)  # noqa: E731
    env = {v: as_traced(v, a) for v, a in zip(jaxpr.invars, args, strict=True)}
    read = lambda v: as_traced(v, v.val) if hasattr(v, "val") else env[v]  # noqa: E731
    for eqn in jaxpr.eqns:
        name, ins = eqn.primitive.name, [read(v) for v in eqn.invars]
        inner = next((eqn.params[k] for k in ("jaxpr", "call_jaxpr") if k in eqn.params), None)
        if inner is not None:
            outs = _run(inner, ins)
        elif name == "convert_element_type":
            outs = [_convert(ins[0], eqn.params["new_dtype"])]
        elif name in _OPS:
            outs = [_OPS[name](*ins)]
        else:
            return None
        if outs is None or len(outs) != len(eqn.outvars):
            return None
        env.update((v, as_traced(v, out)) for v, out in zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]
