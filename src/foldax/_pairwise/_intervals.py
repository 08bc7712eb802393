"""Which blocks of pairs a mask may keep, from the mask's own formula, in O(1) per block.

``mask(i, j)`` is traced once on a pair of int32 scalars. Its jaxpr is evaluated again here on
*intervals*: ``i`` ranging over a block of rows of ``x``, ``j`` over a block of rows of ``y``.
Every number becomes a range ``[lo, hi]`` that contains it for every pair of the block, every
boolean a pair ``(may_be_false, may_be_true)``. A block is live when the mask *may be true*
somewhere in it; the answer is conservative (a live block may still hold no kept pair, the
step masks those pairs), never wrong.

Every rule computes its bounds in the value's own dtype, as the mask does, and knows where
that dtype's arithmetic stops being monotone:

* integers wrap: a bound whose computation wrapped (``+``, ``-``, ``*``, negation and ``abs``
  of the least value, ``MIN // -1``, a power) widens the result to every value of its dtype;
  so does a cast whose range does not fit the target dtype in one piece (``(t - s)`` cast to
  ``uint32`` where ``t - s`` may be negative or not, ``(i * 40)`` cast to ``int16`` across a
  multiple of ``2**16``). A cast from a float is bounded only where the whole range is
  representable in the integer dtype (XLA leaves the others to the implementation).
* floats round monotonically and overflow to ``inf``; a float that may be NaN has the range
  ``[-inf, inf]`` (every comparison on it may be false, ``!=`` true), and so has any result of
  an operand that may be NaN, or of ``inf - inf``, ``0 * inf`` or a divisor that may be 0.
  Compiled, the mask's float arithmetic may round otherwise than its jaxpr says: XLA fuses
  ``a * b + c`` into one multiply-add, computes ``x / c`` as ``x * (1 / c)``, and may keep a
  float16 (or bfloat16) result at float32 precision; so the bounds of a product or a quotient,
  and of any rounded result narrower than 32 bits, are widened by a float or two.
* booleans and numbers convert into each other (``True`` is 1; a number is true where it is not
  0), and booleans compare as 0 and 1.

For the masks users write most it is exact: causal ``j <= i``, a sliding window
``(j <= i) & (j > i - w)`` (or ``(i - j).astype(jnp.uint32) < w``), padding ``j < n`` (``n``
traced or not), block-diagonal ``i // b == j // b``, and their combinations. A value the
analysis cannot bound (an array read at ``i``, e.g. ``doc[i] == doc[j]``; a primitive or dtype
without a rule here: shifts, bitwise ``&`` on integers, ``exp``, complex numbers) is *unknown*:
it may be anything, and the analysis says whether any unknown reached the result (then the
exact test on every pair of a block is still worth running, see :mod:`foldax._pairwise._masks`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _jax


@dataclasses.dataclass(frozen=True)
class Range:
    """A number: ``lo <= value <= hi`` for every pair of the block (a float that may be NaN:
    ``[-inf, inf]``)."""

    lo: Any
    hi: Any


@dataclasses.dataclass(frozen=True)
class Truth:
    """A boolean: whether it may be false, whether it may be true, somewhere in the block."""

    false: Any
    true: Any


#: A value the analysis cannot bound.
UNKNOWN = None


# ----------------------------------------------------------------------------------------------
# Dtypes


def _kind(dtype):
    """``"bool"``, ``"int"`` (signed or not), ``"float"``, or ``None`` (no rules here)."""
    if dtype == jnp.bool_:
        return "bool"
    if jnp.issubdtype(dtype, jnp.integer):
        return "int"
    if jnp.issubdtype(dtype, jnp.floating):
        return "float"
    return None


def _signed(dtype):
    return jnp.issubdtype(dtype, jnp.signedinteger)


def _full(dtype):
    """Every value of a numeric ``dtype`` (for a float, NaN too)."""
    if _kind(dtype) == "int":
        info = jnp.iinfo(dtype)
        return Range(np.asarray(info.min, dtype), np.asarray(info.max, dtype))
    return Range(np.asarray(-np.inf, dtype), np.asarray(np.inf, dtype))


def _may_be_nan(r):
    """Whether a float range may hold NaN (its bounds are ``[-inf, inf]``)."""
    if _kind(r.lo.dtype) != "float":
        return np.False_
    return (r.lo == -jnp.inf) & (r.hi == jnp.inf)


def _widen(r, bad):
    """``r``, or every value of its dtype where ``bad``."""
    whole = _full(r.lo.dtype)
    return Range(jnp.where(bad, whole.lo, r.lo), jnp.where(bad, whole.hi, r.hi))


def _point(v, dtype=None):
    """A constant: a literal of the jaxpr or an array the mask closes over (a scalar is
    bounded by itself, a float NaN by ``[-inf, inf]``; the elements of an array it reads by
    index are not bounded here)."""
    v = jnp.asarray(v, dtype)
    kind = _kind(v.dtype)
    if v.ndim or kind is None:
        return UNKNOWN
    if kind == "bool":
        return Truth(~v, v)
    if kind == "float":
        return _widen(Range(v, v), jnp.isnan(v))
    return Range(v, v)


# ----------------------------------------------------------------------------------------------
# Integer arithmetic that knows when it wrapped


def _div(x, y):
    """``lax.div`` with a divisor of 0 replaced by 1 (the callers widen that case)."""
    return jax.lax.div(x, jnp.where(y == 0, jnp.ones_like(y), y))


def _checked(op, x, y):
    """``(op(x, y), wrapped)`` for ``op`` one of ``jnp.add``, ``jnp.subtract``,
    ``jnp.multiply`` on two bounds of one dtype; ``wrapped``: the exact result is not a value
    of the dtype (always ``False`` for floats, whose overflow is ``inf``)."""
    r = op(x, y)
    if _kind(r.dtype) != "int":
        return r, np.False_
    if op is jnp.add:  # x + y moves x the way y points, unless it wrapped
        return r, (r < x) != (y < 0)
    if op is jnp.subtract:
        return r, (r > x) != (y < 0)
    wrapped = (x != 0) & (_div(r, x) != y)  # exact: a wrapped product is off by >= 2**bits
    if _signed(r.dtype):  # -1 * MIN wraps to MIN, and MIN / -1 is the implementation's
        wrapped |= (x == -1) & (y == jnp.iinfo(r.dtype).min)
    return r, wrapped


def _corners(op, a, b):
    """``(Range, wrapped)`` of ``op`` (a function giving ``(value, wrapped)``) monotone in each
    argument over the box ``a x b``: its extremes are at the corners."""
    vals = [op(x, y) for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
    lo = hi = vals[0][0]
    wrapped = vals[0][1]
    for v, w in vals[1:]:
        lo, hi, wrapped = jnp.minimum(lo, v), jnp.maximum(hi, v), wrapped | w
    return Range(lo, hi), wrapped


# ----------------------------------------------------------------------------------------------
# Rules: numbers


def _arith(name, args, params):
    """The range of one numeric primitive (``UNKNOWN`` where it has no rule here), widened to
    every value of its dtype wherever the bounds are not: an integer bound that wrapped, a
    float result that may be NaN."""
    dtypes = {a.lo.dtype for a in args}
    if len(dtypes) != 1 or _kind(next(iter(dtypes))) not in ("int", "float"):
        return UNKNOWN
    if _ARITY.get(name) != len(args):
        return UNKNOWN
    out = _arith_bounds(name, args, params)
    if out is UNKNOWN:
        return UNKNOWN
    r, bad = out
    bad = bad | (r.lo > r.hi)
    if _kind(r.lo.dtype) == "float":
        bad = bad | jnp.isnan(r.lo) | jnp.isnan(r.hi)
        for a in args:
            bad = bad | _may_be_nan(a)
        r = _round_out(r, _slack(name, r.lo.dtype))
    return _widen(r, bad)


def _narrow(dtype):
    """Whether XLA may carry a float ``dtype``'s values at a higher precision (float32) between
    operations, rounding them (or not) where it chooses."""
    return jnp.finfo(dtype).bits < 32


def _slack(name, dtype):
    """How many floats outward a rounded float result is widened, for what XLA may compute
    instead of the mask's own roundings: a product fused into a following add (one rounding
    instead of two), ``x / c`` as ``x * (1 / c)`` (the same, with ``1 / c`` rounded), and, for
    a float narrower than 32 bits, any result kept at float32 precision."""
    if name in ("mul", "integer_pow", "square"):
        return 1
    if name == "div":
        return 2
    return 1 if name in ("add", "sub") and _narrow(dtype) else 0


def _round_out(r, steps):
    """``r`` widened by ``steps`` floats on each side (infinities stay)."""
    lo, hi = r.lo, r.hi
    for _ in range(steps):
        lo = jax.lax.nextafter(lo, jnp.full_like(lo, -jnp.inf))
        hi = jax.lax.nextafter(hi, jnp.full_like(hi, jnp.inf))
    return Range(lo, hi)


_ARITY = {
    "add": 2, "sub": 2, "mul": 2, "div": 2, "rem": 2, "max": 2, "min": 2, "neg": 1, "abs": 1,
    "sign": 1, "floor": 1, "ceil": 1, "round": 1, "not": 1, "integer_pow": 1, "square": 1,
    "clamp": 3,
}  # fmt: skip


def _arith_bounds(name, args, params):
    """``(Range, wrapped)`` of one numeric primitive, computed in the operands' dtype."""
    a = args[0]
    b = args[-1]
    no = np.False_
    if name in ("add", "sub"):
        op = jnp.add if name == "add" else jnp.subtract
        lo, w_lo = _checked(op, a.lo, b.lo if name == "add" else b.hi)
        hi, w_hi = _checked(op, a.hi, b.hi if name == "add" else b.lo)
        return Range(lo, hi), w_lo | w_hi
    if name == "neg":
        zero = jnp.zeros_like(a.lo)
        return _arith_bounds("sub", [Range(zero, zero), a], params)
    if name == "mul":
        return _corners(functools.partial(_checked, jnp.multiply), a, b)
    if name in ("max", "min"):
        f = jnp.maximum if name == "max" else jnp.minimum
        return Range(f(a.lo, b.lo), f(a.hi, b.hi)), no
    if name == "clamp":  # clamp(low, x, high) = min(max(x, low), high)
        x = args[1]
        lo = jnp.minimum(jnp.maximum(x.lo, a.lo), b.lo)
        return Range(lo, jnp.minimum(jnp.maximum(x.hi, a.hi), b.hi)), no
    if name in ("floor", "ceil", "sign", "round"):  # monotone, never leave the dtype
        f = getattr(jax.lax, name)
        if name == "round":
            f = functools.partial(jax.lax.round, rounding_method=params["rounding_method"])
        return Range(f(a.lo), f(a.hi)), no
    if name == "not":  # bitwise: -x - 1 (signed) or MAX - x (unsigned), decreasing
        integer = _kind(a.lo.dtype) == "int"
        return (Range(jnp.invert(a.hi), jnp.invert(a.lo)), no) if integer else UNKNOWN
    if name == "abs":
        return _abs(a)
    if name in ("integer_pow", "square"):
        return _power(a, 2 if name == "square" else params["y"])
    if name == "div":
        return _divide(a, b)
    if name == "rem":
        return _rem(a, b)
    return UNKNOWN


def _abs(a):
    """``(Range, wrapped)`` of ``|a|``: ``abs`` of a signed dtype's least value wraps."""
    dt = a.lo.dtype
    if _kind(dt) == "int" and not _signed(dt):
        return a, np.False_
    m_lo, m_hi = jnp.abs(a.lo), jnp.abs(a.hi)
    straddles = (a.lo <= 0) & (a.hi >= 0)
    lo = jnp.where(straddles, jnp.zeros_like(a.lo), jnp.minimum(m_lo, m_hi))
    wrapped = (a.lo == jnp.iinfo(dt).min) if _kind(dt) == "int" else np.False_
    return Range(lo, jnp.maximum(m_lo, m_hi)), wrapped


#: the highest ``integer_pow`` exponent with a rule here (a higher one is unknown)
_MAX_POWER = 8


def _power(a, k):
    """``(Range, wrapped)`` of ``a ** k`` for a whole ``1 <= k <= _MAX_POWER``: monotone in
    ``a`` (odd ``k``) or in ``|a|`` (even ``k``); the bounds computed by ``integer_pow``
    itself (rounded as the mask's own), wrapping found by exact products."""
    if not 1 <= k <= _MAX_POWER:
        return UNKNOWN
    base, wrapped = (a, np.False_) if k % 2 else _abs(a)
    if _kind(a.lo.dtype) == "int":
        for x in (base.lo, base.hi):
            p = x
            for _ in range(k - 1):
                p, w = _checked(jnp.multiply, p, x)
                wrapped = wrapped | w
    pw = functools.partial(jax.lax.integer_pow, y=k)
    return Range(pw(base.lo), pw(base.hi)), wrapped


def _divide(a, b):
    """``(Range, wrapped)`` of ``lax.div`` (floats: ``/``; integers: rounded toward zero):
    monotone in each argument while ``b`` keeps its sign, so the extremes are at the corners
    (unbounded where ``b`` may be 0, and for ``MIN / -1``, which wraps)."""
    nonzero = (b.lo > 0) | (b.hi < 0)
    if _kind(a.lo.dtype) == "float":
        r, _ = _corners(lambda x, y: (jnp.divide(x, y), np.False_), a, b)
        return r, ~nonzero
    r, _ = _corners(lambda x, y: (_div(x, y), np.False_), a, b)
    wrapped = ~nonzero
    if _signed(a.lo.dtype):
        wrapped |= (a.lo == jnp.iinfo(a.lo.dtype).min) & (b.lo <= -1) & (b.hi >= -1)
    return r, wrapped


def _rem(a, b):
    """``(Range, wrapped)`` of ``lax.rem`` (the sign of ``a``, ``|a % b| < |b|`` and
    ``<= |a|``) for a divisor known to be positive (otherwise every value); an integer
    operand's own range where one block of ``b`` holds it; a float operand must be finite
    (``inf % b`` is NaN)."""
    integer = _kind(a.lo.dtype) == "int"
    top = b.hi - 1 if integer else b.hi  # the largest |a % b|
    lo = jnp.where(a.lo >= 0, jnp.zeros_like(a.lo), jnp.maximum(-top, a.lo))
    hi = jnp.where(a.hi <= 0, jnp.zeros_like(a.hi), jnp.minimum(top, a.hi))
    ok = b.lo > 0
    if integer:
        d = jnp.maximum(b.hi, jnp.ones_like(b.hi))
        one_block = (a.lo >= 0) & (b.lo == b.hi) & (_div(a.lo, d) == _div(a.hi, d))
        lo = jnp.where(one_block, jax.lax.rem(a.lo, d), lo)
        hi = jnp.where(one_block, jax.lax.rem(a.hi, d), hi)
    else:
        ok &= jnp.isfinite(a.lo) & jnp.isfinite(a.hi)
    return Range(lo, hi), ~ok


# ----------------------------------------------------------------------------------------------
# Rules: casts


def _convert(a, dtype):
    """``convert_element_type``: exact where the cast is monotone on the whole range, every
    value of the target dtype elsewhere; booleans are 0 and 1, a number is true where not 0."""
    src, dst = _operand_kind(a), _kind(dtype)
    if src is None or dst is None:
        return UNKNOWN
    if src == "bool":
        if dst == "bool":
            return a
        lo, hi = jnp.where(a.false, 0, 1), jnp.where(a.true, 1, 0)
        return Range(lo.astype(dtype), hi.astype(dtype))
    if dst == "bool":
        zero = (a.lo <= 0) & (a.hi >= 0)
        only_zero = (a.lo == 0) & (a.hi == 0)
        return Truth(zero, ~only_zero | _may_be_nan(a))
    lo, hi = a.lo.astype(dtype), a.hi.astype(dtype)
    if dst == "float":  # rounds monotonically; overflows to inf, NaN stays NaN
        out, rounds = _round_out(Range(lo, hi), 1), _cast_rounds(a, dtype)
        return Range(jnp.where(rounds, out.lo, lo), jnp.where(rounds, out.hi, hi))
    if src == "int":
        return _widen(Range(lo, hi), ~_int_cast_fits(a, dtype) | (lo > hi))
    return _widen(Range(lo, hi), ~_float_cast_fits(a, dtype))


def _operand_kind(a):
    if isinstance(a, Truth):
        return "bool"
    return _kind(a.lo.dtype) if isinstance(a, Range) else None


def _cast_rounds(a, dtype):
    """Whether a cast to a float ``dtype`` narrower than 32 bits (whose result XLA may keep at
    float32 precision, unrounded) may round: from a float with more digits or range, or from
    an integer beyond the float's consecutive integers."""
    if not _narrow(dtype):
        return np.False_
    dst = jnp.finfo(dtype)
    if _kind(a.lo.dtype) == "float":
        src = jnp.finfo(a.lo.dtype)
        return np.bool_(src.nmant > dst.nmant or src.maxexp > dst.maxexp or src.minexp < dst.minexp)
    exact, info = 2 ** (dst.nmant + 1), jnp.iinfo(a.lo.dtype)
    below = (a.lo < -exact) if info.min < -exact else np.False_
    above = (a.hi > exact) if info.max > exact else np.False_
    return below | above


def _int_cast_fits(a, dtype):
    """Whether an integer cast (modular: two's complement) keeps the order of the whole range:
    its width is below ``2**bits`` of the target, and the images of its ends are in order."""
    bits_src, bits_dst = jnp.iinfo(a.lo.dtype).bits, jnp.iinfo(dtype).bits
    if bits_dst >= bits_src:
        return np.True_
    unsigned = jnp.dtype(f"uint{bits_src}")
    width = a.hi.astype(unsigned) - a.lo.astype(unsigned)  # exact, modulo 2**bits_src
    return width < (1 << bits_dst)


def _float_cast_fits(a, dtype):
    """Whether every float in ``a`` truncates to a value of the integer ``dtype``: the range is
    inside ``[MIN, MAX + 1)`` (powers of two, exact where the float dtype reaches them; XLA
    leaves a value outside to the implementation)."""
    info, top = jnp.iinfo(dtype), float(jnp.finfo(a.lo.dtype).max)
    fits = jnp.isfinite(a.lo) & jnp.isfinite(a.hi)
    if float(info.max) + 1 <= top:
        fits &= a.hi < np.asarray(float(info.max) + 1, a.hi.dtype)
    if -float(info.min) <= top:
        fits &= a.lo >= np.asarray(float(info.min), a.lo.dtype)
    return fits


# ----------------------------------------------------------------------------------------------
# Rules: comparisons, logic, selection


def _compare(op, a, b):
    """A comparison of two ranges of one dtype; a float that may be NaN compares false."""
    if a.lo.dtype != b.lo.dtype:
        return UNKNOWN
    if op in ("gt", "ge"):  # b < a, b <= a
        return _compare({"gt": "lt", "ge": "le"}[op], b, a)
    nan = _may_be_nan(a) | _may_be_nan(b)
    if op == "lt":
        return Truth((a.hi >= b.lo) | nan, a.lo < b.hi)
    if op == "le":
        return Truth((a.hi > b.lo) | nan, a.lo <= b.hi)
    overlap = (a.lo <= b.hi) & (b.lo <= a.hi)
    single = (a.lo == a.hi) & (b.lo == b.hi) & (a.lo == b.lo)
    eq = Truth(~single | nan, overlap)
    return eq if op == "eq" else Truth(eq.true, eq.false)


def _as_number(t):
    """A boolean as the int32 0 / 1 it compares as."""
    return _convert(t, jnp.int32)


def _logic(name, args):
    """A primitive on booleans: logic, and ``max`` / ``min`` / comparisons (``False < True``)."""
    if name == "not" and len(args) == 1:
        return Truth(args[0].true, args[0].false)
    if len(args) != 2:
        return UNKNOWN
    a, b = args
    if name in ("and", "min"):
        return Truth(a.false | b.false, a.true & b.true)
    if name in ("or", "max"):
        return Truth(a.false & b.false, a.true | b.true)
    if name in ("xor", "ne", "eq"):
        xor = Truth(
            (a.true & b.true) | (a.false & b.false), (a.true & b.false) | (a.false & b.true)
        )
        return Truth(xor.true, xor.false) if name == "eq" else xor
    if name in _COMPARE:
        return _compare(name, _as_number(a), _as_number(b))
    return UNKNOWN


def _picks(pred, n):
    """For ``select_n(pred, *n cases)``: whether each case may be picked (a boolean picks case
    0 where false, 1 where true; an int32 its index, clamped to the cases)."""
    if isinstance(pred, Truth):
        return [pred.false, pred.true] if n == 2 else UNKNOWN
    if _kind(pred.lo.dtype) != "int":
        return UNKNOWN
    lo, hi = jnp.clip(pred.lo, 0, n - 1), jnp.clip(pred.hi, 0, n - 1)
    return [(lo <= k) & (k <= hi) for k in range(n)]


def _select(args):
    """``select_n(pred, *cases)``: the cases the predicate may pick, per block."""
    pred, *cases = args
    if not cases or len({type(c) for c in cases}) != 1:
        return UNKNOWN
    picks = _picks(pred, len(cases))
    if picks is UNKNOWN:
        return UNKNOWN
    if isinstance(cases[0], Truth):
        false = true = np.False_
        for p, c in zip(picks, cases, strict=True):
            false, true = false | (p & c.false), true | (p & c.true)
        return Truth(false, true)
    if len({c.lo.dtype for c in cases}) != 1:
        return UNKNOWN
    top = functools.reduce(jnp.maximum, [c.hi for c in cases])
    bottom = functools.reduce(jnp.minimum, [c.lo for c in cases])
    lo, hi = top, bottom  # at least one case is picked: replaced below
    for p, c in zip(picks, cases, strict=True):
        lo, hi = jnp.where(p, jnp.minimum(lo, c.lo), lo), jnp.where(p, jnp.maximum(hi, c.hi), hi)
    return Range(lo, hi)


# ----------------------------------------------------------------------------------------------
# Jaxprs

_COMPARE = {"lt", "le", "gt", "ge", "eq", "ne"}
_PASS = {"broadcast_in_dim", "reshape", "squeeze", "copy", "copy_p", "expand_dims"}
_CALLS = {"pjit", "closed_call", "core_call", "jit", "custom_jvp_call", "custom_vjp_call"}


def _rule(name, args, params):
    """The abstract value of one primitive's output; ``UNKNOWN`` for a primitive, or kinds of
    operands, without a rule here."""
    if name in _PASS:
        return args[0] if len(args) == 1 else UNKNOWN
    if name == "select_n":
        return _select(args)
    if name == "convert_element_type":
        return _convert(args[0], params["new_dtype"]) if len(args) == 1 else UNKNOWN
    kinds = {type(a) for a in args}
    if kinds == {Truth}:
        return _logic(name, args)
    if kinds != {Range}:
        return UNKNOWN
    if name in _COMPARE:
        return _compare(name, *args) if len(args) == 2 else UNKNOWN
    return _arith(name, args, params)


def _equation(eqn, args, unknowns=None):
    """The abstract values of one equation's outputs (``UNKNOWN`` where it has no rule)."""
    name = eqn.primitive.name
    if name in _CALLS:
        inner = next((eqn.params[k] for k in ("jaxpr", "call_jaxpr") if k in eqn.params), None)
        if inner is None:
            return [UNKNOWN] * len(eqn.outvars)
        inner, consts = _jax.open_jaxpr(inner)
        return evaluate(inner, [_point(c) for c in consts], args, unknowns)
    if len(eqn.outvars) != 1 or not args or any(a is UNKNOWN for a in args):
        return [UNKNOWN] * len(eqn.outvars)
    return [_rule(name, args, eqn.params)]


def _checked_kind(val, dtype):
    """``val`` where it is the kind of value of ``dtype`` (a ``Truth`` for a boolean, a
    ``Range`` in ``dtype`` itself for a number), else ``UNKNOWN``: a rule that computed in
    another dtype than the mask's would not bound it."""
    if isinstance(val, Truth) and dtype == jnp.bool_:
        return val
    if isinstance(val, Range) and val.lo.dtype == dtype and val.hi.dtype == dtype:
        return val
    return UNKNOWN


def evaluate(jaxpr, consts, args, unknowns=None):
    """Abstract values of ``jaxpr``'s outputs for abstract ``consts`` and ``args``. A boolean
    the analysis cannot bound may be either (so the result stays a conservative answer);
    ``unknowns``, a list, collects ``True`` for each such value."""
    env = {}

    def read(v):
        literal = isinstance(v, _jax.Literal)
        val = _point(v.val, v.aval.dtype) if literal else env.get(v, UNKNOWN)
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
            env[var] = _checked_kind(val, var.aval.dtype)
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

    def dry_run(consts, lo, hi):  # traced, never run: which values are unknown is structural
        evaluate(jaxpr, [_point(c) for c in consts], [Range(lo, hi)] * 2, unknowns)

    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in jaxpr.constvars]
    index = jax.ShapeDtypeStruct((), jnp.int32)
    jax.eval_shape(dry_run, avals, index, index)

    def live(consts, i_lo, i_hi, j_lo, j_hi):
        bounds = jnp.broadcast_arrays(i_lo, i_hi, j_lo, j_hi)

        def one(a, b, c, d):
            args = [Range(a, b), Range(c, d)]
            return evaluate(jaxpr, [_point(x) for x in consts], args)[0].true

        flat = [x.reshape(-1) for x in bounds]
        return jax.vmap(one)(*flat).reshape(bounds[0].shape)

    return live, not unknowns
