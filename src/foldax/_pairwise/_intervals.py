"""Which blocks of pairs a mask may keep, from the mask's own formula, in O(1) per block.

``mask(i, j)`` is traced once on a pair of int32 scalars. Its jaxpr is evaluated again here on
*intervals*: ``i`` ranging over a block of rows of ``x``, ``j`` over a block of rows of ``y``.
Every value becomes a range ``[lo, hi]`` that contains it for every pair of the block, every
boolean a pair ``(may_be_false, may_be_true)``. A block is live when the mask *may be true*
somewhere in it; the answer is conservative (a live block may still hold no kept pair, the
step masks those pairs), never wrong.

For the masks users write most it is exact: causal ``j <= i``, a sliding window
``(j <= i) & (j > i - w)``, padding ``j < n`` (``n`` traced or not), block-diagonal
``i // b == j // b``, and their combinations. A value the analysis cannot bound (an array read
at ``i``, e.g. ``doc[i] == doc[j]``; a primitive without a rule here) is *unknown*: it may be
anything, and the analysis says whether any unknown reached the result (then the exact test on
every pair of a block is still worth running, see :mod:`foldax._pairwise._masks`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from .. import _jax


@dataclasses.dataclass(frozen=True)
class Range:
    """A number: ``lo <= value <= hi`` for every pair of the block."""

    lo: Any
    hi: Any


@dataclasses.dataclass(frozen=True)
class Truth:
    """A boolean: whether it may be false, whether it may be true, somewhere in the block."""

    false: Any
    true: Any


#: A value the analysis cannot bound.
UNKNOWN = None


def _point(v):
    v = jnp.asarray(v)
    if v.ndim:  # an array the mask reads by index: its elements are not bounded here
        return UNKNOWN
    return Truth(~v, v) if v.dtype == jnp.bool_ else Range(v, v)


def _corners(f, a, b):
    vals = [f(x, y) for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
    lo = hi = vals[0]
    for v in vals[1:]:
        lo, hi = jnp.minimum(lo, v), jnp.maximum(hi, v)
    return Range(lo, hi)


def _compare(op, a, b):
    if op in ("gt", "ge"):  # b < a, b <= a
        return _compare({"gt": "lt", "ge": "le"}[op], b, a)
    if op == "lt":
        return Truth(a.hi >= b.lo, a.lo < b.hi)
    if op == "le":
        return Truth(a.hi > b.lo, a.lo <= b.hi)
    overlap = (a.lo <= b.hi) & (b.lo <= a.hi)
    single = (a.lo == a.hi) & (b.lo == b.hi) & (a.lo == b.lo)
    eq = Truth(~single, overlap)
    return eq if op == "eq" else Truth(eq.true, eq.false)


def _int_div(a, b):
    """``lax.div`` rounds toward zero: monotone in each argument while ``b`` keeps its sign, so
    the extremes are at the corners (unbounded where ``b`` may be 0)."""
    r = _corners(_div, a, b)
    whole, nonzero = _full(a.lo), (b.lo > 0) | (b.hi < 0)
    return Range(jnp.where(nonzero, r.lo, whole.lo), jnp.where(nonzero, r.hi, whole.hi))


def _div(x, y):
    """``lax.div`` with a divisor of 0 replaced by 1 (the caller widens that case)."""
    return jax.lax.div(x, jnp.where(y == 0, jnp.ones_like(y), y))


def _full(like):
    dt = jnp.result_type(like)
    if jnp.issubdtype(dt, jnp.integer):
        info = jnp.iinfo(dt)
        return Range(jnp.asarray(info.min, dt), jnp.asarray(info.max, dt))
    return Range(jnp.asarray(-jnp.inf, dt), jnp.asarray(jnp.inf, dt))


def _rem(a, b):
    """``a % b`` (sign of ``a``) for a divisor known to be positive: the operand's own range
    where one block of ``b`` holds it, else ``[0, b - 1]`` (or its mirror)."""
    b_pos = b.lo > 0
    top = b.hi - 1
    same_block = (a.lo >= 0) & (_div(a.lo, b.hi) == _div(a.hi, b.hi)) & (b.lo == b.hi)
    lo = jnp.where(
        same_block, jax.lax.rem(a.lo, jnp.maximum(b.hi, 1)), jnp.where(a.lo >= 0, 0, -top)
    )
    hi = jnp.where(
        same_block, jax.lax.rem(a.hi, jnp.maximum(b.hi, 1)), jnp.where(a.hi <= 0, 0, top)
    )
    whole = _full(a.lo)
    return Range(jnp.where(b_pos, lo, whole.lo), jnp.where(b_pos, hi, whole.hi))


def _arith(name, args, params):
    """The range of one numeric primitive (``UNKNOWN`` where it has no rule here), widened to
    every value of its dtype wherever the bounds themselves are not exact: an integer bound
    that overflowed, a float bound that is NaN (``inf - inf``). A wrapped bound could otherwise
    rule out a block that holds kept pairs."""
    out = _arith_bounds(name, args, params)
    if out is UNKNOWN or name in _NO_OVERFLOW:
        return out
    lo, hi = out.lo, out.hi
    if jnp.issubdtype(lo.dtype, jnp.integer):
        as_float = [Range(a.lo.astype(jnp.float32), a.hi.astype(jnp.float32)) for a in args]
        approx = _arith_bounds(name, as_float, params)
        info = jnp.iinfo(lo.dtype)
        limit = 0.99 * min(-float(info.min), float(info.max))
        wrapped = (jnp.abs(approx.lo) > limit) | (jnp.abs(approx.hi) > limit) | (lo > hi)
    else:
        wrapped = jnp.isnan(lo) | jnp.isnan(hi) | (lo > hi)
    whole = _full(lo)
    return Range(jnp.where(wrapped, whole.lo, lo), jnp.where(wrapped, whole.hi, hi))


#: primitives whose bounds never leave the range of their operands or of the dtype
_NO_OVERFLOW = {"max", "min", "convert_element_type", "floor", "ceil", "round", "sign", "rem"}


def _arith_bounds(name, args, params):
    """The bounds of one numeric primitive, computed in the operands' dtype."""
    a = args[0]
    b = args[1] if len(args) > 1 else None
    if name == "add":
        return Range(a.lo + b.lo, a.hi + b.hi)
    if name == "sub":
        return Range(a.lo - b.hi, a.hi - b.lo)
    if name == "neg":
        return Range(-a.hi, -a.lo)
    if name == "mul":
        return _corners(jnp.multiply, a, b)
    if name == "max":
        return Range(jnp.maximum(a.lo, b.lo), jnp.maximum(a.hi, b.hi))
    if name == "min":
        return Range(jnp.minimum(a.lo, b.lo), jnp.minimum(a.hi, b.hi))
    if name == "abs":
        lo = jnp.where(
            (a.lo <= 0) & (a.hi >= 0), jnp.zeros_like(a.lo), jnp.minimum(abs(a.lo), abs(a.hi))
        )
        return Range(lo, jnp.maximum(abs(a.lo), abs(a.hi)))
    if name in ("floor", "ceil", "round", "sign"):
        f = getattr(jax.lax, name)
        return Range(f(a.lo), f(a.hi))
    if name == "convert_element_type":
        dt = params["new_dtype"]
        return Range(a.lo.astype(dt), a.hi.astype(dt))
    if name == "div":
        if jnp.issubdtype(a.lo.dtype, jnp.inexact):
            nonzero = (b.lo > 0) | (b.hi < 0)
            r = _corners(lambda x, y: x / y, a, b)
            whole = _full(a.lo)
            return Range(jnp.where(nonzero, r.lo, whole.lo), jnp.where(nonzero, r.hi, whole.hi))
        return _int_div(a, b)
    if name == "rem" and jnp.issubdtype(a.lo.dtype, jnp.integer):
        return _rem(a, b)
    return UNKNOWN


_COMPARE = {"lt", "le", "gt", "ge", "eq", "ne"}
_PASS = {"broadcast_in_dim", "reshape", "squeeze", "copy", "copy_p", "expand_dims"}
_CALLS = {"pjit", "closed_call", "core_call", "jit", "custom_jvp_call", "custom_vjp_call"}


def _logic(name, args):
    if name == "not":
        a = args[0]
        return Truth(a.true, a.false)
    a, b = args
    if name == "and":
        return Truth(a.false | b.false, a.true & b.true)
    if name == "or":
        return Truth(a.false & b.false, a.true | b.true)
    if name == "xor":
        return Truth(
            (a.true & b.true) | (a.false & b.false), (a.true & b.false) | (a.false & b.true)
        )
    return UNKNOWN


def _union(values):
    if any(v is UNKNOWN for v in values) or len({type(v) for v in values}) != 1:
        return UNKNOWN
    if isinstance(values[0], Truth):
        false = true = values[0].false & False
        for v in values:
            false, true = false | v.false, true | v.true
        return Truth(false, true)
    lo, hi = values[0].lo, values[0].hi
    for v in values[1:]:
        lo, hi = jnp.minimum(lo, v.lo), jnp.maximum(hi, v.hi)
    return Range(lo, hi)


def _select(args):
    """``select_n(pred, case0, case1)``: the cases the predicate can pick, per block."""
    pred, *cases = args
    if not (isinstance(pred, Truth) and len(cases) == 2) or _union(cases) is UNKNOWN:
        return _union(cases)
    if isinstance(cases[0], Truth):
        f0, t0 = cases[0].false & pred.false, cases[0].true & pred.false
        f1, t1 = cases[1].false & pred.true, cases[1].true & pred.true
        return Truth(f0 | f1, t0 | t1)
    both = _union(cases)
    pick = lambda f: jnp.where(  # noqa: E731
        pred.true & pred.false, f(both), jnp.where(pred.true, f(cases[1]), f(cases[0]))
    )
    return Range(pick(lambda r: r.lo), pick(lambda r: r.hi))


def _equation(eqn, args, unknowns=None):
    """The abstract values of one equation's outputs (``UNKNOWN`` where it has no rule)."""
    name = eqn.primitive.name
    if name in _CALLS:
        inner = next((eqn.params[k] for k in ("jaxpr", "call_jaxpr") if k in eqn.params), None)
        if inner is None:
            return [UNKNOWN] * len(eqn.outvars)
        inner, consts = _jax.open_jaxpr(inner)
        return evaluate(inner, [_point(c) for c in consts], args, unknowns)
    if len(eqn.outvars) != 1 or any(a is UNKNOWN for a in args):
        return [UNKNOWN]
    if name in _PASS:
        return [args[0]]
    if name == "select_n":
        return [_select(args)]
    if all(isinstance(a, Truth) for a in args):
        return [_logic(name, args)]
    if not all(isinstance(a, Range) for a in args):
        return [UNKNOWN]
    if name in _COMPARE:
        return [_compare(name, *args)]
    return [_arith(name, args, eqn.params)]


def evaluate(jaxpr, consts, args, unknowns=None):
    """Abstract values of ``jaxpr``'s outputs for abstract ``consts`` and ``args``. A boolean
    the analysis cannot bound may be either (so the result stays a conservative answer);
    ``unknowns``, a list, collects ``True`` for each such value."""
    env = {}

    def read(v):
        val = _point(v.val) if isinstance(v, _jax.Literal) else env.get(v, UNKNOWN)
        if val is UNKNOWN and v.aval.dtype == jnp.bool_:
            if unknowns is not None:
                unknowns.append(True)
            return Truth(jnp.bool_(True), jnp.bool_(True))
        return val

    for var, val in zip(jaxpr.constvars, consts, strict=True):
        env[var] = val
    for var, val in zip(jaxpr.invars, args, strict=True):
        env[var] = val
    for eqn in jaxpr.eqns:
        outs = _equation(eqn, [read(v) for v in eqn.invars], unknowns)
        for var, val in zip(eqn.outvars, outs, strict=True):
            env[var] = val
    return [read(v) for v in jaxpr.outvars]


def block_test(closed):
    """``(live, exact)`` for a mask's closed jaxpr (traced on ``(i, j)``; the arrays it closes
    over are its ``constvars``).

    ``live(consts, i_lo, i_hi, j_lo, j_hi)``: for broadcasting arrays of inclusive block bounds,
    whether the mask may keep a pair in each block. ``exact``: whether no value the mask
    computes was unbounded; then, for the masks in this module's docstring, a block is live
    exactly when it holds a kept pair. Otherwise ``live`` is a superset (and may be every
    block)."""
    jaxpr = closed.jaxpr
    unknowns = []
    zeros = [_point(jnp.zeros(v.aval.shape, v.aval.dtype)) for v in jaxpr.constvars]
    evaluate(jaxpr, zeros, [Range(jnp.int32(0), jnp.int32(1))] * 2, unknowns)

    def live(consts, i_lo, i_hi, j_lo, j_hi):
        bounds = jnp.broadcast_arrays(i_lo, i_hi, j_lo, j_hi)

        def one(a, b, c, d):
            args = [Range(a, b), Range(c, d)]
            return evaluate(jaxpr, [_point(x) for x in consts], args)[0].true

        flat = [x.reshape(-1) for x in bounds]
        return jax.vmap(one)(*flat).reshape(bounds[0].shape)

    return live, not unknowns
