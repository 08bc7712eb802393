"""The mask analysis (:mod:`foldax._pairwise._intervals`) never skips a block that holds a kept
pair: the casts and conversions it once got wrong (wrapping integer casts, booleans used as
numbers), the fused float arithmetic XLA may compute, and random formulas over every
elementwise operation it has a rule for (and some it has none for), checked on every pair.

The random formulas are checked without compiling anything per formula: each is traced once,
its analysis traced once, and both jaxprs are run by a NumPy reference of XLA's elementwise
semantics (:func:`_run`; itself checked against XLA primitive by primitive)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_allclose

import foldax
from foldax import _closure, _jax
from foldax._pairwise import _intervals
from foldax._pairwise._intervals import Range, _point, block_test, evaluate

_INDEX = jax.ShapeDtypeStruct((), jnp.int32)


def _trace(mask):
    return _closure.trace(mask, _INDEX, _INDEX)


def _pairs(mask, m, n):
    """``mask`` on every pair of an ``m x n`` grid, compiled on whole tiles as the engine runs
    it (where XLA may fuse its float arithmetic)."""
    rows = jnp.arange(m, dtype=jnp.int32)[:, None] + jnp.zeros((1, n), jnp.int32)
    cols = jnp.arange(n, dtype=jnp.int32)[None, :] + jnp.zeros((m, 1), jnp.int32)
    return np.asarray(jax.jit(mask)(rows, cols))


def _block_grid(n_rows, n_cols, b):
    """Inclusive bounds ``(i_lo, i_hi, j_lo, j_hi)`` of every ``b x b`` block, each ``(R, C)``."""
    i0 = np.arange(0, n_rows, b)[:, None] + np.zeros((1, -(-n_cols // b)), np.int64)
    j0 = np.arange(0, n_cols, b)[None, :] + np.zeros((-(-n_rows // b), 1), np.int64)
    bounds = (i0, np.minimum(i0 + b, n_rows) - 1, j0, np.minimum(j0 + b, n_cols) - 1)
    return tuple(x.astype(np.int32) for x in bounds)


def _kept_per_block(keep, b):
    """Kept pairs in each ``b x b`` block of a dense ``(M, N)`` boolean matrix."""
    m, n = keep.shape
    padded = np.zeros((-(-m // b) * b, -(-n // b) * b), np.int64)
    padded[:m, :n] = keep
    return padded.reshape(padded.shape[0] // b, b, padded.shape[1] // b, b).sum(axis=(1, 3))


def _check_blocks(mask, m, n, b, exact_blocks=False):
    """The analysis (``block_test``'s ``live``, compiled) on every ``b x b`` block of an
    ``m x n`` grid against every pair: never a skipped kept pair (and, with ``exact_blocks``,
    a live block exactly where one is kept). Returns ``(bounded, live per block)``."""
    closed, consts = _trace(mask)
    live, bounded = block_test(closed)
    kept = _kept_per_block(_pairs(mask, m, n), b)
    got = np.asarray(jax.jit(live)(consts, *_block_grid(m, n, b)))
    skipped = np.argwhere((kept > 0) & ~got)
    assert not len(skipped), f"blocks {skipped[:5].tolist()} hold kept pairs and were skipped"
    if exact_blocks:
        np.testing.assert_array_equal(got, kept > 0)
    return bounded, got


def _masks(**masks):
    return pytest.mark.parametrize(
        "mask", [pytest.param(m, id=name.replace("_", " ")) for name, m in masks.items()]
    )


# ----------------------------------------------------------------------------------------------
# Regressions: casts that wrap, booleans as numbers


def test_unsigned_causal_window_matches_jax_nn(rng):
    """``(t - s)`` cast to uint32 wraps where ``s > t``: the unsigned idiom for a causal window
    (every row once came out wrong, row 0 as 0); its blocks are listed exactly."""
    t, n, h = 300, 2, 8
    q, k, v = (jnp.asarray(rng.standard_normal((1, t, n, h)), np.float32) for _ in range(3))
    mask = lambda t, s: (t - s).astype(jnp.uint32) < 256  # noqa: E731
    got = foldax.dot_product_attention(q, k, v, mask=mask, block_size=32)
    want = jax.nn.dot_product_attention(q, k, v, mask=jnp.asarray(_pairs(mask, t, t))[None, None])
    assert_allclose(got, want, dtype=np.float32)
    bounded, live = _check_blocks(mask, t, t, 32, exact_blocks=True)
    assert bounded and not live.all()  # blocks were skipped: exactly those without a kept pair


def test_int16_cast_counts_every_kept_pair():
    """The user's report: at 2,333 x 3,001, 3,601,170 pairs were kept instead of 3,847,819."""
    mask = lambda i, j: (i * 40).astype(jnp.int16) > (j * 40).astype(jnp.int16)  # noqa: E731
    m, n = 2333, 3001
    x, y = jnp.zeros((m, 1), np.float32), jnp.zeros((n, 1), np.float32)
    count = foldax.pairwise_reduce(
        lambda a, b: jnp.float32(1), x, y, reduction="sum", mask=mask, block_size=128
    )
    assert int(np.asarray(count, np.float64).sum()) == 3_847_819
    bounded, _ = _check_blocks(mask, m, n, 128)
    assert bounded


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "uint16", "uint32", "int32"])
@pytest.mark.parametrize("scale", [40, 5000])
def test_narrowing_and_sign_changing_casts(dtype, scale):
    """A block's values wrap inside it (its ends out of order), or span more than the target
    dtype holds (its ends in order, values missing between them: ``scale`` 5000)."""
    mask = lambda i, j: (i * scale - 3000).astype(dtype) > (j * 77 - 9000).astype(dtype)  # noqa: E731
    bounded, _ = _check_blocks(mask, 700, 500, 16)
    assert bounded


@_masks(
    saturates=lambda i, j: (i.astype(jnp.float32) * 3e6).astype(jnp.int32) < j * 4_000_000,
    negative_to_uint8=lambda i, j: (
        (i.astype(jnp.float32) - 100.5).astype(jnp.uint8) > j.astype(jnp.uint8)
    ),
    float16=lambda i, j: (
        (i.astype(jnp.float16) * 500).astype(jnp.int16) >= (j * 300).astype(jnp.int16)
    ),
    nan=lambda i, j: (jnp.float32(jnp.nan) * i.astype(jnp.float32)).astype(jnp.int32) == j - 300,
)
def test_float_to_int_casts_out_of_range(mask):
    """Out of range (and NaN) float to int casts are left to the implementation (XLA
    saturates): bounded only where the whole range is representable."""
    bounded, _ = _check_blocks(mask, 800, 800, 32)
    assert bounded


def test_implementation_defined_casts_are_not_assumed():
    """XLA on the CPU saturates float to int casts out of range, and rounds a float16 cast
    even where it keeps float16 arithmetic at float32: neither is promised, so a float range
    out of an integer dtype's is unbounded, and a float16 cast that may round is widened."""
    info = np.iinfo(np.int32)
    out = _intervals._convert(Range(jnp.float32(1e10), jnp.float32(2e10)), jnp.int32)
    assert (int(out.lo), int(out.hi)) == (info.min, info.max)
    inside = _intervals._convert(
        Range(jnp.float32(-(2.0**31)), jnp.float32(2.0**31 - 128)), jnp.int32
    )
    assert (int(inside.lo), int(inside.hi)) == (info.min, 2**31 - 128)
    rounded = _intervals._convert(Range(jnp.int32(4001), jnp.int32(4003)), jnp.float16)
    assert float(rounded.lo) < 4000 and float(rounded.hi) > 4004
    exact = _intervals._convert(Range(jnp.int32(-2048), jnp.int32(2048)), jnp.float16)
    assert (float(exact.lo), float(exact.hi)) == (-2048, 2048)


@_masks(
    to_bool=lambda i, j: (i - j).astype(bool),
    from_bool=lambda i, j: (j <= i).astype(jnp.int32) + (i % 2) == 2,
    from_bool_to_float=lambda i, j: (
        ((j <= i).astype(jnp.float32) - 0.5) * (i - j).astype(jnp.float32) > 3
    ),
    both_ways=lambda i, j: (i // 16 - j // 16).astype(jnp.bool_).astype(jnp.uint8) == 0,
    compare_as_numbers=lambda i, j: (i < 30) == (j < 30),
    less_than=lambda i, j: (i < 30) < (j < 50),
    not_equal=lambda i, j: (i >= 30) != (j >= 40),
    max_min=lambda i, j: jnp.maximum(i < 8, j < 8) & jnp.minimum(i < 60, j > 20),
    where=lambda i, j: jnp.where(i > 40, (i < 60) ^ (j < 20), ~(j < 70)),
    select_n_index=lambda i, j: jax.lax.select_n(jnp.clip(i // 32, 0, 2), j < 10, j > i, i == j),
)
def test_booleans_as_numbers(mask):
    """Casts between booleans and numbers once crashed the analysis; booleans compare as 0 and
    1; ``select_n`` picks by an integer too. All exact."""
    bounded, _ = _check_blocks(mask, 96, 96, 8, exact_blocks=True)
    assert bounded


@_masks(
    # the least value of a signed dtype: its negation and abs wrap
    abs_of_min=lambda i, j: jnp.abs((i * 32 - 128).astype(jnp.int8)) < (j % 1).astype(jnp.int8),
    neg_of_min=lambda i, j: -(i + 2_147_483_600) > j,
    min_over_minus_one=lambda i, j: (
        (i - 64).astype(jnp.int8) // jnp.int8(-1) < (j - 64).astype(jnp.int8)
    ),
    # remainders by negative (or zero) divisors, unsigned arithmetic
    mod_negative=lambda i, j: i % (j - 40) == 3,
    rem_negative=lambda i, j: jax.lax.rem(i, j - 40) > 2,
    uint16_difference=lambda i, j: i.astype(jnp.uint16) - j.astype(jnp.uint16) < 8,
    uint8_product=lambda i, j: (i - j).astype(jnp.uint8) * jnp.uint8(3) < 30,
    # powers that overflow, clamps, signs
    cube=lambda i, j: (i * 1000) ** 3 > j,
    square_int8=lambda i, j: jnp.square((i - j).astype(jnp.int8) * jnp.int8(20)) < 50,
    clip_sign=lambda i, j: jnp.clip(i - j, -3, 3) == jnp.sign(j - 48) * 3,
    # NaN compares false (NaN constants, inf - inf, 0 * inf), even with infinities
    nan_constant=lambda i, j: ~(i.astype(jnp.float32) < jnp.float32(jnp.nan)),
    inf_minus_inf=lambda i, j: (
        ~((i - 50).astype(jnp.float32) * jnp.inf <= j.astype(jnp.float32) * jnp.inf)
    ),
    zero_times_inf=lambda i, j: (
        ~((i - 50).astype(jnp.float32) * jnp.inf + j.astype(jnp.float32) <= jnp.inf)
    ),
    abs_of_nan=lambda i, j: (
        ~(jnp.abs((i - 50).astype(jnp.float32) * jnp.inf) >= j.astype(jnp.float32))
    ),
    sign_of_nan=lambda i, j: jnp.sign((i - j).astype(jnp.float32) * jnp.inf) != 1,
)
def test_wrapping_and_nan_edges(mask):
    _check_blocks(mask, 96, 96, 8)


@_masks(
    shift=lambda i, j: i >> 2 == j >> 2,
    bitwise_and=lambda i, j: (i & 7) == (j & 7),
    exp=lambda i, j: jnp.exp(i.astype(jnp.float32) * 0.01) < j.astype(jnp.float32),
    complex=lambda i, j: (i.astype(jnp.complex64) * 1j).imag < j.astype(jnp.float32),
)
def test_unknown_operations_are_unbounded_not_errors(mask):
    bounded, _ = _check_blocks(mask, 64, 64, 8)
    assert not bounded


@_masks(
    multiply_add=lambda i, j: (
        i.astype(jnp.float32) * 0.1 + 0.3 <= (j + 3).astype(jnp.float32) * 0.1
    ),
    divide_by_constant=lambda i, j: (
        i.astype(jnp.float32) / 7.0 + 0.2 >= (j.astype(jnp.float32) + 1.4) / 7.0
    ),
    float16_multiply_add=lambda i, j: (
        i.astype(jnp.float16) * 0.1 + 0.3 >= (j + 3).astype(jnp.float16) * 0.1
    ),
    float16_sum=lambda i, j: (i.astype(jnp.float16) + 0.3) + 0.3 <= j.astype(jnp.float16) + 0.6,
)
def test_fused_float_arithmetic_is_covered(mask):
    """Compiled, ``a * b + c`` may be one multiply-add, ``x / c`` may be ``x * (1 / c)``, and a
    float16 may stay float32 between operations: each mask keeps pairs compiled that it does
    not op by op (on the CPU, with jax 0.10). Every pair is its own block; both ways of
    running the mask are covered."""
    n = 256
    bounded, live = _check_blocks(mask, n, n, 1)
    closed, consts = _trace(mask)
    rows = np.arange(n, dtype=np.int32)
    with np.errstate(all="ignore"):
        op_by_op = _run(closed.jaxpr, consts, [rows[:, None], rows[None, :]])[0]
    assert bounded and not np.any(op_by_op & ~live)


@_masks(
    causal=lambda i, j: j <= i,
    window=lambda i, j: (j <= i) & (j > i - jnp.int32(7)),
    unsigned_window=lambda i, j: (i - j).astype(jnp.uint32) < 7,
    block_diagonal=lambda i, j: i // 8 == j // 8,
    same_residue=lambda i, j: i % 8 == j % 8,
    two_sided=lambda i, j: jnp.abs(i - j) <= 3,
    float_slope=lambda i, j: i.astype(jnp.float32) * 0.5 >= j.astype(jnp.float32),
    float_to_int=lambda i, j: (i.astype(jnp.float32) * 0.75).astype(jnp.int32) >= j,
    square=lambda i, j: (i - j) ** 2 <= 9,
)
def test_common_masks_stay_exact(mask):
    """The rules that make the analysis safe do not cost exactness on the masks users write."""
    bounded, _ = _check_blocks(mask, 64, 64, 4, exact_blocks=True)
    assert bounded


# ----------------------------------------------------------------------------------------------
# A NumPy reference of XLA's elementwise primitives (what the engine compiles, op by op)


def _int_div(x, y):
    """XLA's integer division: toward zero; ``x / 0`` is -1 (all ones), ``MIN / -1`` is MIN."""
    zero = y == 0
    over = (x == np.iinfo(x.dtype).min) & (y == -1) if x.dtype.kind == "i" else zero & False
    safe = np.where(zero | over, np.ones_like(y), y)
    q = x // safe  # rounded down: up by one where inexact and negative
    q = np.where((x - q * safe != 0) & ((x < 0) != (safe < 0)), q + 1, q)
    return np.where(zero, np.array(-1).astype(x.dtype), np.where(over, x, q))


def _int_rem(x, y):
    """XLA's integer remainder: the sign of ``x``; ``x % 0`` is ``x``, ``MIN % -1`` is 0."""
    zero = y == 0
    minus_one = (y == -1) if y.dtype.kind == "i" else zero & False
    return np.where(zero, x, np.fmod(x, np.where(zero | minus_one, np.ones_like(y), y)))


def _div(x, y):
    return np.divide(x, y) if x.dtype.kind == "f" else _int_div(x, y)


def _rem(x, y):
    return np.fmod(x, y) if x.dtype.kind == "f" else _int_rem(x, y)


def _round(x, rounding_method):
    if int(rounding_method) == 1:  # to nearest even
        return np.rint(x)
    t = np.trunc(x)  # away from zero
    return np.where(np.abs(x - t) >= 0.5, t + np.sign(x), t)


def _integer_pow(x, y):
    """jax's lowering: repeated squaring."""
    acc, y = None, int(y)
    assert y > 0
    while y:
        if y & 1:
            acc = x if acc is None else acc * x
        y >>= 1
        if y:
            x = x * x
    return acc


def _convert(x, new_dtype, **_):
    """XLA's casts: a float to an integer saturates, NaN is 0 (left to the implementation)."""
    dt = np.dtype(new_dtype)
    if dt == np.bool_:
        return x != 0
    if x.dtype.kind == "f" and dt.kind in "iu":
        info = np.iinfo(dt)
        t = np.trunc(np.nan_to_num(x.astype(np.float64), nan=0.0, posinf=np.inf, neginf=-np.inf))
        return np.clip(t, info.min, info.max).astype(dt)
    return x.astype(dt)


def _shift(kind):
    """XLA's shifts: an amount outside ``[0, bits)`` shifts everything out."""

    def shift(x, n):
        bits = x.dtype.itemsize * 8
        unsigned = np.dtype(f"uint{bits}")
        out_of_range = n.astype(unsigned) >= bits
        s = np.where(out_of_range, 0, n.astype(unsigned)).astype(unsigned)
        if kind == "left":
            return np.where(out_of_range, 0, np.left_shift(x.astype(unsigned), s).astype(x.dtype))
        if kind == "logical":
            return np.where(out_of_range, 0, np.right_shift(x.astype(unsigned), s).astype(x.dtype))
        signed = x.astype(f"int{bits}")  # the bits of x, as two's complement
        shifted = np.where(
            out_of_range, np.where(signed < 0, -1, 0), signed >> s.astype(signed.dtype)
        )
        return shifted.astype(x.dtype)

    return shift


def _select_n(pred, *cases):
    index = np.clip(pred.astype(np.int64), 0, len(cases) - 1)
    return np.choose(index, np.broadcast_arrays(*cases))


def _scalar_shape(x, shape=(), **_):
    assert tuple(shape) == (), "the reference runs jaxprs of scalars only"
    return x


_UFUNCS = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "neg": np.negative, "abs": np.abs,
    "sign": np.sign, "floor": np.floor, "ceil": np.ceil, "max": np.maximum, "min": np.minimum,
    "not": np.invert, "and": np.bitwise_and, "or": np.bitwise_or, "xor": np.bitwise_xor,
    "lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
    "eq": np.equal, "ne": np.not_equal, "is_finite": np.isfinite, "nextafter": np.nextafter,
    "square": np.square, "div": _div, "rem": _rem, "select_n": _select_n,
    "shift_left": _shift("left"), "shift_right_logical": _shift("logical"),
    "shift_right_arithmetic": _shift("arithmetic"),
    "clamp": lambda lo, x, hi: np.minimum(np.maximum(x, lo), hi),
}  # fmt: skip
_PRIMITIVES = {
    "round": lambda x, rounding_method: _round(x, rounding_method),
    "integer_pow": _integer_pow,
    "convert_element_type": _convert,
    "broadcast_in_dim": _scalar_shape,
    "reshape": lambda x, new_sizes, **_: _scalar_shape(x, new_sizes),
    "squeeze": lambda x, **_: _scalar_shape(x),
    "copy": lambda x: x,
    "copy_p": lambda x: x,
}


def _run(jaxpr, consts, args):
    """``jaxpr`` (of scalars) run by NumPy on arrays that broadcast together: XLA's semantics,
    each operation rounded to its own dtype."""
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(v):
        return np.asarray(v.val, v.aval.dtype) if isinstance(v, _jax.Literal) else env[v]

    for eqn in jaxpr.eqns:
        ins, name = [read(v) for v in eqn.invars], eqn.primitive.name
        if "jaxpr" in eqn.params or "call_jaxpr" in eqn.params:
            inner, inner_consts = _jax.open_jaxpr(
                eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            )
            outs = _run(inner, [np.asarray(c) for c in inner_consts], ins)
        elif name in _UFUNCS:
            outs = [_UFUNCS[name](*ins)]
        else:
            outs = [_PRIMITIVES[name](*ins, **eqn.params)]
        for var, out in zip(eqn.outvars, outs, strict=True):
            env[var] = np.asarray(out).astype(var.aval.dtype, copy=False)
    return [read(v) for v in jaxpr.outvars]


def _reference_cases():
    """``(name, fn, args)``: each primitive of the reference on awkward values, per dtype."""
    ints = {
        "int8": [-128, -127, -1, 0, 1, 3, 7, 100, 127],
        "uint8": [0, 1, 3, 7, 128, 200, 255],
        "int32": [-(2**31), -(2**31) + 1, -7, -1, 0, 1, 7, 2**31 - 1],
        "uint32": [0, 1, 7, 2**31, 2**32 - 1],
    }
    floats = [-np.inf, -6e4, -2.5, -0.5, -0.0, 0.0, 0.49999997, 0.5, 1.5, 2.5, 3e4, np.inf, np.nan]
    cases = []
    for dt, values in ints.items():
        a = np.array(values, dt)
        x, y = np.repeat(a, len(a)), np.tile(a, len(a))
        cases += [(p, getattr(jax.lax, p), (x, y)) for p in ("div", "rem", "shift_left")]
        cases += [("shift_right_arithmetic", jax.lax.shift_right_arithmetic, (x, y))]
        cases += [("shift_right_logical", jax.lax.shift_right_logical, (x, y))]
        unary = ("neg", "abs", "sign") if dt[0] == "i" else ("neg", "sign")
        cases += [(p, getattr(jax.lax, p), (x,)) for p in unary]
        cases += [("integer_pow", lambda v: jax.lax.integer_pow(v, 3), (x,))]
        for to in ("int8", "uint16", "int32", "uint32", "float16", "float32", "bool"):
            cases += [("convert_element_type", lambda v, to=to: v.astype(to), (x,))]
    for dt, big in (("float16", 6e4), ("float32", 3e9)):
        f = np.array([*floats, big, -big], np.float32).astype(dt)
        x, y = np.repeat(f, len(f)), np.tile(f, len(f))
        cases += [(p, getattr(jax.lax, p), (x, y)) for p in ("div", "rem", "max", "nextafter")]
        cases += [(p, getattr(jax.lax, p), (x,)) for p in ("sign", "floor", "ceil")]
        cases += [("round", lambda v, m=m: jax.lax.round(v, m), (x,)) for m in (0, 1)]
        cases += [("integer_pow", lambda v: jax.lax.integer_pow(v, 5), (x,))]
        for to in ("int8", "uint8", "int16", "uint16", "int32", "uint32", "float16", "bool"):
            cases += [("convert_element_type", lambda v, to=to: v.astype(to), (x,))]
    return cases


def test_reference_matches_xla():
    """The NumPy reference against XLA on every primitive case, in one compiled program."""
    cases = _reference_cases()
    want = jax.jit(lambda args: [fn(*a) for (_, fn, _), a in zip(cases, args, strict=True)])(
        [a for _, _, a in cases]
    )
    for (name, fn, args), w in zip(cases, want, strict=True):
        jaxpr, consts = _jax.open_jaxpr(jax.make_jaxpr(fn)(*args))
        with np.errstate(all="ignore"):
            got = _run(jaxpr, consts, list(args))[0]
        np.testing.assert_array_equal(got, np.asarray(w), err_msg=f"{name} on {args[0].dtype}")


# ----------------------------------------------------------------------------------------------
# Random formulas

_INTS = ("int32", "int8", "int16", "uint8", "uint16", "uint32")
_FLOATS = ("float16", "float32")
_CMP = ("<", "<=", ">", ">=", "==", "!=")
_FLOAT_CONSTANTS = (0.0, -0.0, 0.5, 1.0, -1.0, 2.5, 3.0, -7.0, 0.1, 100.0, 1e4, 65504.0)
_SPECIAL = ("inf", "-inf", "nan")


class _Formulas:
    """Random masks as source text (readable in a failure): expression trees over ``i``, ``j``
    and constants of every dtype, ending in a boolean."""

    def __init__(self, rng):
        self.rng = rng

    def pick(self, options):
        return options[self.rng.integers(len(options))]

    def constant(self, dt):
        if dt in _FLOATS:
            if self.rng.random() < 0.25:
                return f"jnp.{dt}(float({self.pick(_SPECIAL)!r}))"
            big = 1e30 if dt == "float32" else 6e4
            c = self.pick((*_FLOAT_CONSTANTS, big, -big, round(float(self.rng.normal()) * 50, 2)))
            return f"jnp.{dt}({c!r})"
        info = np.iinfo(dt)
        edges = (info.min, info.min + 1, info.max - 1, info.max, info.max // 2 + 1)
        small = (0, 1, 2, 3, 5, 7, 16, 40, 200, 256, -1, -2, -3, -40)
        c = self.pick(edges + small) if self.rng.random() < 0.8 else self.rng.integers(-300, 300)
        return f"jnp.{dt}({int(np.clip(c, info.min, info.max))})"

    def leaf(self, dt):
        r, index = self.rng.random(), self.pick(("i", "j"))
        if r < 0.25:
            return self.constant(dt)
        if r < 0.5:  # a block of indices then spans many values: wraps, and floats' ties
            scale = self.pick((-1, 2, 3, 40, 256, 1000, 70_000))
            index = f"({index} * {scale} + {int(self.rng.integers(-300, 300))})"
        return index if dt == "int32" else f"{index}.astype(jnp.{dt})"

    def number(self, dt, depth):
        if depth <= 0 or self.rng.random() < 0.2:
            return self.leaf(dt)
        d = depth - 1
        n = lambda: self.number(dt, d)  # noqa: E731
        ops = ["arith", "arith", "divide", "unary", "minmax", "where", "clip", "cast", "cast"]
        ops += ["power", "select"] + (["bits"] if dt in _INTS else ["round", "true_divide"])
        op = self.pick(ops)
        if op == "arith":
            return f"({n()} {self.pick(('+', '-', '*'))} {n()})"
        if op == "divide":
            divisor = n() if self.rng.random() < 0.5 else self.constant(dt)
            return f"({n()} {self.pick(('//', '%'))} {divisor})"
        if op == "true_divide":
            return f"({n()} / {n()})"
        if op == "unary":
            return self.pick(("jnp.abs({})", "(-{})", "jnp.sign({})")).format(n())
        if op == "round":
            return self.pick(("jnp.floor({})", "jnp.ceil({})", "jnp.round({})")).format(n())
        if op == "minmax":
            return f"jnp.{self.pick(('minimum', 'maximum'))}({n()}, {n()})"
        if op == "where":
            return f"jnp.where({self.boolean(d)}, {n()}, {n()})"
        if op == "clip":
            low, high = self.constant(dt), self.constant(dt)
            if self.rng.random() < 0.5:
                return f"jnp.clip({n()}, {low}, {high})"
            return f"jax.lax.clamp({low}, {n()}, {high})"
        if op == "power":
            return self.pick(("({}) ** 2", "({}) ** 3", "jnp.square({})")).format(n())
        if op == "select":
            index = f"jnp.clip({self.number('int32', d)}, 0, 2)"
            return f"jax.lax.select_n({index}, {n()}, {n()}, {n()})"
        if op == "bits":
            return self.pick(("(~{})", "({} & {})", "({} | {})", "({} >> {})")).format(n(), n())
        if self.rng.random() < 0.25:
            return f"({self.boolean(d)}).astype(jnp.{dt})"
        return f"({self.number(self.pick(_INTS + _FLOATS), d)}).astype(jnp.{dt})"

    def boolean(self, depth):
        if depth <= 0:
            dt = self.pick(_INTS + _FLOATS)
            return f"({self.leaf(dt)} {self.pick(_CMP)} {self.leaf(dt)})"
        d = depth - 1
        b = lambda: self.boolean(d)  # noqa: E731
        op = self.pick(("compare", "compare", "compare", "logic", "logic", "not", "where"))
        op = op if self.rng.random() < 0.8 else self.pick(("cast", "compare_bools", "minmax"))
        if op == "compare":
            dt = self.pick(_INTS + _FLOATS)
            return f"({self.number(dt, d)} {self.pick(_CMP)} {self.number(dt, d)})"
        if op == "logic":
            return f"({b()} {self.pick(('&', '|', '^'))} {b()})"
        if op == "not":
            return f"(~{b()})"
        if op == "where":
            return f"jnp.where({b()}, {b()}, {b()})"
        if op == "cast":
            return f"({self.number(self.pick(_INTS + _FLOATS), d)}).astype(jnp.bool_)"
        if op == "compare_bools":
            return f"({b()} {self.pick(_CMP)} {b()})"
        return f"jnp.{self.pick(('minimum', 'maximum'))}({b()}, {b()})"


#: stretches of indices the random blocks are drawn from: 0..287 (int8 / uint8 wrap inside),
#: and 32 indices around each of int16's and uint16's wrap, int32's largest index and 0
_SEGMENTS = ((0, 288), (32_752, 32), (65_520, 32), (2**31 - 32, 32), (-16, 32))


def _random_blocks(rng, count):
    """``count`` blocks, each inside one stretch of rows and one of columns: positions in the
    concatenated stretches, inclusive ``(i_lo, i_hi, j_lo, j_hi)``."""
    sizes = np.array([n for _, n in _SEGMENTS])
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    out = []
    for _ in range(2):
        seg = rng.integers(len(_SEGMENTS), size=count)
        lo = rng.integers(0, sizes[seg])
        width = np.where(rng.random(count) < 0.1, 1, rng.integers(1, 40, size=count))
        whole = rng.random(count) < 0.05
        lo, hi = np.where(whole, 0, lo), np.where(whole, sizes[seg], lo + width) - 1
        out += [starts[seg] + lo, starts[seg] + np.minimum(hi, sizes[seg] - 1)]
    return out[0], out[1], out[2], out[3]


def _analysis(closed, consts):
    """The jaxpr of the analysis of one mask (what ``block_test``'s ``live`` runs per block)."""

    def may_be_true(consts, i_lo, i_hi, j_lo, j_hi):
        args = [Range(i_lo, i_hi), Range(j_lo, j_hi)]
        return evaluate(closed.jaxpr, [_point(c) for c in consts], args)[0].true

    return _jax.open_jaxpr(jax.make_jaxpr(may_be_true)(consts, *[_INDEX] * 4))


@pytest.mark.slow
def test_random_formulas_never_skip_a_kept_pair():
    rng = np.random.default_rng(20_240_611)
    gen = _Formulas(rng)
    namespace = {"jax": jax, "jnp": jnp}
    indices = np.concatenate([np.arange(s, s + n, dtype=np.int64) for s, n in _SEGMENTS])
    indices = indices.astype(np.int32)
    rows, cols = indices[:, None], indices[None, :]
    start, n_formulas, failures = time.perf_counter(), 500, []
    for _ in range(n_formulas):
        source = gen.boolean(int(rng.integers(1, 6)))
        a, b, c, d = _random_blocks(rng, 200)
        with np.errstate(all="ignore"):  # overflows of constants, as the mask computes them
            closed, consts = _trace(eval(f"lambda i, j: {source}", namespace))
            analysis, analysis_consts = _analysis(closed, consts)
            keep = _run(closed.jaxpr, [np.asarray(x) for x in consts], [rows, cols])[0]
            live = _run(
                analysis,
                [np.asarray(x) for x in analysis_consts],
                [*map(np.asarray, consts), indices[a], indices[b], indices[c], indices[d]],
            )[0]
        sums = np.zeros((len(indices) + 1,) * 2, np.int64)
        sums[1:, 1:] = np.broadcast_to(keep, (len(indices),) * 2).cumsum(0).cumsum(1)
        kept = sums[b + 1, d + 1] - sums[a, d + 1] - sums[b + 1, c] + sums[a, c]
        bad = np.flatnonzero((kept > 0) & ~np.broadcast_to(live, kept.shape))
        if len(bad):
            k = bad[0]
            failures.append(
                f"lambda i, j: {source}\n  skips i in [{indices[a[k]]}, {indices[b[k]]}], "
                f"j in [{indices[c[k]]}, {indices[d[k]]}] ({kept[k]} kept pairs)"
            )
    elapsed = time.perf_counter() - start
    print(f"{n_formulas} random formulas in {elapsed:.1f} s")
    assert not failures, f"{len(failures)} formulas skip kept pairs:\n" + "\n".join(failures[:5])


def test_a_mask_that_keeps_every_pair_is_left_out(rng):
    """A formula that cannot be false anywhere in the grid (bounded over the whole ranges of
    ``i`` and ``j``) is no mask at all: the fold is the unmasked one, with the same values; one
    that may be false somewhere, or reads an array, is kept."""
    from foldax._pairwise._masks import always_true, check_masking

    m, n = 40, 30
    starts = jnp.zeros(m, jnp.int32)
    kept = {
        "i >= 0": (lambda i, j: i >= 0, True),
        "j < n": (lambda i, j: j < n, True),
        "j < n - 1": (lambda i, j: j < n - 1, False),
        "causal": (lambda i, j: j <= i, False),
        "reads an array": (lambda i, j: j >= starts[i], False),
    }
    for name, (mask, everywhere) in kept.items():
        masking = check_masking("t", mask, None, m, n, False)
        assert (masking is None) == everywhere, name
        assert always_true(_trace(mask)[0], m, n) == everywhere, name
    x, y = (jnp.asarray(rng.standard_normal((r, 4)), jnp.float32) for r in (m, n))
    with_mask = foldax.pairwise_reduce(lambda a, b: a @ b, x, y, mask=lambda i, j: j < n)
    assert_allclose(with_mask, foldax.pairwise_reduce(lambda a, b: a @ b, x, y), dtype=np.float32)
    ids = jnp.asarray(np.sort(rng.integers(0, 3, m)), jnp.int32)
    assert check_masking("t", lambda i, j: i >= 0, (ids, ids[:n]), m, n, False).ids


# ----------------------------------------------------------------------------------------------
# The tile sampler (foldax._pairwise._band): a formula evaluated in NumPy when the call is traced


#: Masks that divide by zero or overflow at some pairs. A float ``t / s`` is compared with a
#: constant no quotient of indices below 300 comes within rounding of (``sqrt(3)``): compiled
#: in the engine's tiles, ``t / s`` may be ``t * (1 / s)``, which is not 2.0 at ``(82, 41)``.
_DIVIDING = dict(
    floor_divide_by_zero=lambda t, s: t // s == 2,
    true_divide_by_zero=lambda t, s: (t / s) < 1.7320508,
    remainder_by_zero=lambda t, s: jax.lax.rem(t, s - 7) > 3,
    float_remainder_by_zero=lambda t, s: jnp.fmod(t.astype(jnp.float32), s.astype(jnp.float32)) < 1,
    # inf and NaN cast to an integer: XLA saturates (NaN is 0), NumPy leaves it to the platform
    inf_to_int=lambda t, s: (t / s * 1.7320508).astype(jnp.int32) > 1,
    float_overflow=lambda t, s: (
        t.astype(jnp.float32) * jnp.float32(1e37) < s.astype(jnp.float32) * jnp.float32(1e37)
    ),
)


@_masks(**_DIVIDING)
def test_masks_that_divide_by_zero_raise_no_warning(rng, mask):
    """The tile sampler evaluates a formula of the indices in NumPy when the call is traced
    (at least 256 rows each way, a contracting kernel, no ``block_size``): a division by zero
    or an overflow at some pairs is the mask's own, fine in JAX, and must not make foldax warn
    (warnings are errors here). The values match a dense float64 reference over the pairs the
    mask keeps compiled, and the sampled pairs as XLA computes them."""
    from foldax._pairwise import _band

    m, n = 300, 280
    keep = _pairs(mask, m, n)
    assert keep.any() and not keep.all()
    rows, cols = _band._samples(m), _band._samples(n)
    sampled = _band._evaluate(_trace(mask)[0].jaxpr, rows[:, None], cols[None, :])
    np.testing.assert_array_equal(np.broadcast_to(sampled, keep.shape), keep[rows][:, cols])
    x = rng.standard_normal((m, 8)).astype(np.float32)
    y = rng.standard_normal((n, 8)).astype(np.float32)
    got = foldax.pairwise_reduce(lambda a, b: a @ b, x, y, mask=mask)
    want = np.where(keep, x.astype(np.float64) @ y.astype(np.float64).T, 0.0).sum(1)
    assert_allclose(got, want, dtype=np.float32, scale=50)


def test_attention_mask_that_divides_by_zero_raises_no_warning(rng):
    """The same through ``dot_product_attention``: ``t / s`` is NaN at ``(0, 0)`` and inf at
    ``s = 0``; every row keeps ``s = t`` (``s >= 1`` in row 0)."""
    t, heads, h = 300, 2, 8
    mask = _DIVIDING["true_divide_by_zero"]
    q, k, v = (rng.standard_normal((1, t, heads, h)).astype(np.float32) for _ in range(3))
    got = foldax.dot_product_attention(q, k, v, mask=mask)
    keep = _pairs(mask, t, t)
    assert keep.any(1).all()
    q64, k64, v64 = (a.astype(np.float64)[0] for a in (q, k, v))
    logits = np.einsum("tnh,snh->nts", q64, k64) / np.sqrt(h)
    logits = np.where(keep[None], logits, -np.inf)
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    want = np.einsum("nts,snh->tnh", weights, v64)[None]
    assert_allclose(got, want, dtype=np.float32, scale=10)
