"""Products of half-precision operands at Mosaic's default precision.

A product of bfloat16 (or float16) operands accumulated in float32 is exact at any precision,
but Mosaic compiles a product with a half-precision operand only at its default precision: a
kernel traced under ``jax.default_matmul_precision("highest")`` (or with ``precision=HIGHEST``
in the user's kernel) carries that precision into its ``dot_general`` s and fails to compile.
The body a kernel runs is rewritten so that such products ask for the default precision (for
a float32 operand met with a half-precision one, as a derivative's cotangent meets a key, that
is how the MXU multiplies them anyway); products of float32 operands keep theirs, and at a
precision of several passes keep IEEE arithmetic's infinities too (:func:`_ieee_product`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from ... import _jax

#: the matrix precisions of a float32 product that are one bfloat16 pass (which keeps an
#: infinity and NaN as they are)
_ONE_PASS = (None, "default", "bfloat16", "fastest", "DEFAULT")


def _half(var) -> bool:
    dtype = getattr(getattr(var, "aval", None), "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize <= 2


def _param(value):
    if _jax.is_jaxpr(value):
        return _rewrite(value)
    if isinstance(value, tuple) and value and all(_jax.is_jaxpr(v) for v in value):
        return tuple(map(_rewrite, value))  # the branches of a cond
    return value


def _rewrite(jaxpr):
    inner = getattr(jaxpr, "jaxpr", None)
    if inner is not None and inner is not jaxpr and _jax.is_jaxpr(inner):  # a closed jaxpr
        return jaxpr.replace(jaxpr=_rewrite(inner))
    eqns = []
    for eqn in jaxpr.eqns:
        params = {k: _param(v) for k, v in eqn.params.items()}
        if eqn.primitive.name == "dot_general" and any(map(_half, eqn.invars[:2])):
            params["precision"] = None
        eqns.append(eqn.replace(params=params))
    return jaxpr.replace(eqns=eqns)


def half_products_at_default(fn, *avals):
    """``fn`` (of arguments like ``avals``), its products of half-precision operands at the
    default precision, and what its outputs do not need left out (a kernel's pass that keeps
    part of what a derivative's body computes never computes the rest)."""
    traced, shape = jax.make_jaxpr(fn, return_shape=True)(*avals)
    jaxpr, consts = _jax.open_jaxpr(traced)
    jaxpr = _jax.dce(_rewrite(jaxpr))
    tree = jax.tree.structure(shape)

    def run(*args):
        return jax.tree.unflatten(tree, _evaluate(jaxpr, consts, *jax.tree.leaves(args)))

    return run


def _evaluate(jaxpr, consts, *args):
    """``jaxpr``'s outputs, its float32 products at a precision of several passes taken by
    :func:`_ieee_product` (``jax.core.eval_jaxpr`` otherwise)."""
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))
    read = lambda v: v.val if isinstance(v, _jax.Literal) else env[v]  # noqa: E731
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        if _several_passes(eqn):
            outs = [_ieee_product(*ins, **eqn.params)]
        else:
            with eqn.ctx.manager:
                outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
            outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def _several_passes(eqn) -> bool:
    """Whether ``eqn`` is a product of float32 operands that Mosaic computes in several
    bfloat16 passes (the precision ``"high"`` / ``"highest"``)."""
    if eqn.primitive.name != "dot_general":
        return False
    if any(v.aval.dtype != jnp.float32 for v in eqn.invars[:2]):
        return False
    precision = eqn.params.get("precision")
    if precision is None:
        return jax.config.jax_default_matmul_precision not in _ONE_PASS
    kinds = precision if isinstance(precision, tuple) else (precision,)
    return any(getattr(p, "name", p) not in _ONE_PASS for p in kinds)


def _ieee_product(a, b, **params):
    """``dot_general(a, b)`` of float32 operands at several passes, with IEEE arithmetic's
    infinities and NaN: Mosaic splits each operand into bfloat16 parts, and the low part of
    an infinity is NaN (``inf - inf``: a NaN in every output the operand meets, where IEEE
    arithmetic, and XLA, give an infinity). The finite entries take the product; where an
    operand of the tile is not finite, the terms' infinities and NaN are found by products of
    0 / 1 indicators (exact in one pass, the product's own shapes) and put in place."""
    fa, fb = jnp.isfinite(a), jnp.isfinite(b)
    zero = jnp.zeros((), jnp.float32)
    plain = lax.dot_general_p.bind(jnp.where(fa, a, zero), jnp.where(fb, b, zero), **params)
    bad = jnp.maximum(jnp.max(jnp.where(fa, zero, 1.0)), jnp.max(jnp.where(fb, zero, 1.0)))
    default = (lax.Precision.DEFAULT, lax.Precision.DEFAULT)
    counts = {**params, "precision": default, "preferred_element_type": jnp.float32}

    def hits(p, q):  # whether any term of the product has p on a's side and q on b's
        one = lambda m: jnp.where(m, jnp.float32(1), zero)  # noqa: E731
        return lax.dot_general_p.bind(one(p), one(q), **counts) > 0

    def special(a, b, plain):
        inf = jnp.float32(jnp.inf)
        up = hits(a == inf, b > 0) | hits(a == -inf, b < 0) | hits(a > 0, b == inf)
        up = up | hits(a < 0, b == -inf)
        down = hits(a == inf, b < 0) | hits(a == -inf, b > 0) | hits(a > 0, b == -inf)
        down = down | hits(a < 0, b == inf)
        nan = hits(a != a, jnp.ones(b.shape, bool)) | hits(jnp.ones(a.shape, bool), b != b)
        nan = nan | hits(jnp.isinf(a), b == 0) | hits(a == 0, jnp.isinf(b))
        nan = nan | (up & (down | (plain == -inf))) | (down & (plain == inf))
        out = jnp.where(up, inf, jnp.where(down, -inf, plain))
        return jnp.where(nan, jnp.float32(jnp.nan), out).astype(plain.dtype)

    return lax.cond(bad > 0, special, lambda a, b, plain: plain, a, b, plain)
