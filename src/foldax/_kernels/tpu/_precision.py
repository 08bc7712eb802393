"""Products of half-precision operands at Mosaic's default precision.

A product of bfloat16 (or float16) operands accumulated in float32 is exact at any precision,
but Mosaic compiles a product with a half-precision operand only at its default precision: a
kernel traced under ``jax.default_matmul_precision("highest")`` (or with ``precision=HIGHEST``
in the user's kernel) carries that precision into its ``dot_general`` s and fails to compile.
The body a kernel runs is rewritten so that such products ask for the default precision (for
a float32 operand met with a half-precision one, as a derivative's cotangent meets a key, that
is how the MXU multiplies them anyway); products of float32 operands keep theirs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ... import _jax


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
        return jax.tree.unflatten(tree, _jax.eval_jaxpr(jaxpr, consts, *jax.tree.leaves(args)))

    return run
