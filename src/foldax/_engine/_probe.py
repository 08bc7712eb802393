"""The planner's probe: a step's body traced at two sizes, its live bytes per unit of work
(rows, or pairs) read from the jaxpr, and from them the step size within the budget."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from .._jax import ShapedArray
from ._budget import CPU_STEP, FUSED_PAIR_BYTES, TPU_FUSED_STEP
from ._plan import preferred_tile
from ._spec import _index, _shaped, _with_rows


def _probe_grid(kind, g, t):
    """``(G, T, R)``: slots, columns and rows of a probe step."""
    if kind == "dense":
        return g, t, t
    if kind == "rows":
        return g, 1, g
    return g, t, g * t


def _probe_avals(spec, avals, g, t):
    """Abstract inputs of ``body`` for a ``(g, t)`` tile grid (typed like the real ones: on a
    mesh a replayed ``fn`` needs its operands' varying axes)."""
    _, consts, slots, rows = avals
    g, t, r = _probe_grid(spec.plan.kind, g, t)
    tile_slots = tuple(_shaped(a, (g, *a.shape[1:])) for a in slots)
    chunk = tuple(_shaped(a, _with_rows(a.shape, spec.plan.row_axis, r)) for a in rows)
    consts = tuple(_shaped(a, a.shape) for a in consts)
    return consts, tile_slots, chunk, ShapedArray((g, t), jnp.bool_), ShapedArray((t,), jnp.int32)


def _step_fn(spec, only=False):
    """One step's computation (body, then the monoid's tile reduction and, for a dense plan,
    its merge into the block's states, as the loop does; with ``only``, the state of a fold of
    that one step, :meth:`~foldax._reductions.Monoid.only`) for probing."""

    def f(consts, slots, rows, mask, index):
        vals, tots, rowvals = spec.body(consts, slots, rows, mask, index)
        if spec.monoid is not None:
            row = spec.monoid.value_aval(vals)
            vals = spec.monoid.reduce(vals, mask, *_index(spec, index))
            if spec.plan.kind == "dense":  # e.g. a k-min merges a whole tile here
                merge = spec.monoid.only if only else spec.monoid.combine
                vals = merge(spec.monoid.init_aval(mask.shape[0], row), vals)
        return vals, tots, rowvals

    return f


@functools.cache
def _itemsize(dtype) -> int:
    """Bytes per element, also for extended dtypes (``jax.random`` keys: their key data's)."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct((), dtype))
        return math.prod(data.shape) * np.dtype(data.dtype).itemsize
    return np.dtype(dtype).itemsize


def _nbytes(aval) -> int:
    if not (hasattr(aval, "shape") and hasattr(aval, "dtype")):
        return 0
    return math.prod(aval.shape) * _itemsize(aval.dtype)


def _subjaxprs(eqn):
    for p in eqn.params.values():
        for sub in p if isinstance(p, tuple | list) else (p,):
            inner = getattr(sub, "jaxpr", sub)
            if hasattr(inner, "eqns"):
                yield inner


#: Primitives XLA fuses into their consumers: their results are not counted as buffers.
_FUSED = frozenset(
    {
        *("abs", "add", "and", "broadcast_in_dim", "convert_element_type", "copy", "copy_p"),
        *("cos", "div", "eq", "exp", "exp2", "expand_dims", "ge", "gt", "imag", "integer_pow"),
        *("is_finite", "le", "log", "log1p", "logistic", "lt", "max", "min", "mul", "ne"),
        *("neg", "not", "or", "pjit", "pow", "real", "reshape", "rsqrt", "select_n", "sign"),
        *("sin", "sqrt", "square", "squeeze", "sub", "tanh"),
    }
)


#: ... and, on a TPU (where XLA fuses every elementwise operation into its reduction), these
#: too: a complex number's parts put together (jnp's complex division, from jax 0.12), the
#: other elementwise functions
_FUSED_ON_TPU = _FUSED | frozenset(
    {
        *("acos", "acosh", "asin", "asinh", "atan", "atan2", "atanh", "cbrt", "ceil", "clamp"),
        *("complex", "conj", "cosh", "erf", "erfc", "expm1", "floor", "nextafter", "rem"),
        *("round", "sinh", "tan", "xor", "shift_left", "shift_right_logical"),
        "shift_right_arithmetic",
    }
)


def _fuses(eqn, fused, calls) -> bool:
    """Whether XLA fuses ``eqn``'s results into their consumers: a ``fused`` primitive, or
    where ``calls``, a call (``jit``, such as ``jnp.where``; a custom derivative's) of such
    primitives alone."""
    if eqn.primitive.name in fused:
        return True
    subs = list(_subjaxprs(eqn)) if calls else []
    return len(subs) == 1 and all(_fuses(e, fused, calls) for e in subs[0].eqns)


def peak_bytes(jaxpr, nbytes=_nbytes, fused=_FUSED, calls=False) -> int:
    """The most bytes a jaxpr keeps live at once (inputs excluded): a value is live from its
    equation to its last use. The results of ``fused`` primitives (by default the elementwise
    ones) are taken as fused into their consumers (as XLA does), unless the jaxpr returns them;
    with ``calls``, so are those of calls of them alone, bodies included (as XLA:TPU fuses a
    tile into its reduction; XLA:CPU keeps a complex one whole); ``nbytes(aval)``: a value's
    size (a kernel's layout, see ``foldax._kernels.tpu``)."""
    is_var = lambda v: not hasattr(v, "val")  # noqa: E731
    last = {}
    for i, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if is_var(v):
                last[v] = i
    for v in jaxpr.outvars:
        if is_var(v):
            last[v] = len(jaxpr.eqns)
    live, peak, sizes = 0, 0, {}
    outs = {v for v in jaxpr.outvars if is_var(v)}
    for i, eqn in enumerate(jaxpr.eqns):
        dropped = _fuses(eqn, fused, calls)
        subs = () if dropped and calls else _subjaxprs(eqn)
        inner = max((peak_bytes(sub, nbytes, fused, calls) for sub in subs), default=0)
        kept = [v for v in eqn.outvars if not dropped or v in outs]
        out = sum(nbytes(v.aval) for v in kept)
        peak = max(peak, live + out + inner)
        for v in kept:
            sizes[v] = nbytes(v.aval)
            live += sizes[v]
        for v in [*eqn.invars, *eqn.outvars]:
            if is_var(v) and last.get(v, -1) <= i and v in sizes:
                live -= sizes.pop(v)
    return peak


def unit_bytes(spec, avals, only=False) -> float:
    """Bytes one unit of work (a row; a pair for dense plans) keeps live in a step, for one
    batch element: measured on the traced step at two sizes (so that what does not grow with
    the step is not counted)."""
    small, big = ((1, 128), (4, 128)) if spec.plan.kind == "dense" else ((1, 64), (1, 256))
    if spec.plan.kind == "rows":
        small, big = (64, 1), (256, 1)

    tpu = jax.default_backend() == "tpu"

    def measure(g, t):
        probe = _probe_avals(spec, avals, g, t)
        jaxpr = jax.make_jaxpr(_step_fn(spec, only))(*probe).jaxpr
        ins = sum(_nbytes(a) for a in jax.tree.leaves(probe))
        _, tt, r = _probe_grid(spec.plan.kind, g, t)
        units = g * tt if spec.plan.kind == "dense" else r
        fused = _FUSED_ON_TPU if tpu else _FUSED
        return peak_bytes(jaxpr, fused=fused, calls=tpu) + ins, units

    (b0, u0), (b1, u1) = measure(*small), measure(*big)
    return max((b1 - b0) / (u1 - u0), 1.0)


def plan_units(spec, avals) -> int:
    """Rows (pairs for dense plans) per step: the budget over the batch and the bytes per unit,
    capped on CPU at a cache-friendly step size, on a TPU as large as a fused step may be (see
    :data:`TPU_FUSED_STEP`); a power of two."""
    if spec.plan.chunk is not None:
        return 0
    step, cap = spec.budget, math.inf
    tile = preferred_tile(spec.plan, spec.monoid) if spec.plan.kind == "dense" else None
    if jax.default_backend() == "cpu":
        step_bytes, cap = CPU_STEP["pairs" if spec.plan.kind == "dense" else "rows"]
        if tile is not None:
            # A fold with a preferred tile (min, argmin, k-min; a matrix product per tile)
            # takes steps of up to that many pairs within the budget: XLA:CPU spreads a step
            # that large over its threads, 1.9x faster on 2 cores than an 8192-pair step.
            cap = max(cap, math.prod(tile))
        else:
            step = min(step, step_bytes)
    per_unit = unit_bytes(spec, avals)
    if _fused_on_tpu(spec, per_unit):
        step, cap = math.inf, TPU_FUSED_STEP
    units = min(step / (per_unit * spec.scale), cap)
    return 1 << max(0, math.floor(math.log2(max(units, 1))))


def _fused_on_tpu(spec, per_unit) -> bool:
    """Whether a TPU step keeps no value per pair (its tile fuses into its reduction), for
    a dense fold without a preferred tile: then its steps are :data:`TPU_FUSED_STEP`."""
    dense = spec.plan.kind == "dense" and preferred_tile(spec.plan, spec.monoid) is None
    return dense and per_unit <= FUSED_PAIR_BYTES and jax.default_backend() == "tpu"


def whole_rows(spec, avals) -> int:
    """Rows of ``x`` per step where a dense fold whose monoid asks for it
    (``whole_when_small``) takes every column in one step: a problem of at most one
    :attr:`dense_tile` of pairs, each block of rows reduced by the monoid's one-step state
    (:meth:`~foldax._reductions.Monoid.only`) within the budget for the whole batch; 0 where
    the fold walks blocks of its tile instead."""
    mon, plan = spec.monoid, spec.plan
    if not getattr(mon, "whole_when_small", False) or plan.kind != "dense":
        return 0
    if plan.chunk is not None or plan.row_axis != -1 or spec.ring:
        return 0
    if plan.num_slots * plan.n > math.prod(mon.dense_tile):
        return 0
    rows = int(spec.budget / (plan.n * unit_bytes(spec, avals, only=True) * spec.scale))
    if rows < 1:
        return 0
    blocks = -(-plan.num_slots // rows)
    return -(-plan.num_slots // blocks)  # blocks as even as they come: little overlap
