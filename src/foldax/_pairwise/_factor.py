"""Kernels that are a weight of the pair times values carried on ``y``.

``kernel(a, b) = w(a, b) * v(b)`` with a scalar weight and values that do not depend on the row
of ``x`` (``k(a, b[0]) * b[1]``: a kernel matrix times many right-hand sides; a softmax's
``(logit, value)`` whose values are rows of ``y``: attention) reduces a tile as one matrix
product of the ``(bi, bj)`` weights with the ``(bj, *F)`` values, instead of ``bi * bj * F``
products one by one. :func:`split` reads that structure from the kernel's jaxpr.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from .. import _jax


@dataclasses.dataclass(frozen=True)
class Parts:
    """``weight(a, b, *consts)``: the scalar weight of a pair (a softmax's logit);
    ``values(b, *consts)``: what it multiplies, of one row of ``y`` (any shape ``F``)."""

    weight: Callable
    values: Callable


def _x_dependent(jaxpr, num_x):
    """The variables of ``jaxpr`` that depend on its first ``num_x`` inputs (the row of x)."""
    dep = set(jaxpr.invars[:num_x])
    for eqn in jaxpr.eqns:
        if any(not isinstance(v, _jax.Literal) and v in dep for v in eqn.invars):
            dep.update(eqn.outvars)
    return dep


def _only(jaxpr, var):
    """``jaxpr`` computing ``var`` alone: the equations it needs, in order."""
    needed, eqns = {var}, []
    for eqn in reversed(jaxpr.eqns):
        if any(v in needed for v in eqn.outvars):
            eqns.append(eqn)
            needed.update(v for v in eqn.invars if not isinstance(v, _jax.Literal))
    return jaxpr.replace(eqns=eqns[::-1], outvars=[var])


def _product_parts(jaxpr, dep):
    """``(weight var, values var)`` where the one output is their product, else ``None``."""
    (out,) = jaxpr.outvars
    if isinstance(out, _jax.Literal) or out not in dep:
        return None
    made = next((e for e in jaxpr.eqns if out in e.outvars), None)
    if made is None or made.primitive.name != "mul":
        return None
    for w, v in (made.invars, made.invars[::-1]):
        scalar = not isinstance(w, _jax.Literal) and math.prod(w.aval.shape) == 1
        if (
            scalar
            and w in dep
            and not isinstance(v, _jax.Literal)
            and v not in dep
            and v.aval.shape == out.aval.shape
            and v.aval.dtype == out.aval.dtype == w.aval.dtype
        ):
            return w, v
    return None


def split(traced, xi, softmax=False) -> Parts | None:
    """A kernel ``conv(a, b, *consts)`` as :class:`Parts`, or ``None`` if it is not a weight
    times values of ``y``; ``traced``: ``jax.make_jaxpr(conv)(xi, yj, *consts)``. A sum's
    kernel qualifies when its one output is a product ``w * v`` with ``w`` a scalar of the pair
    and ``v`` independent of ``a``; a softmax's ``(logit, value)`` when its value is
    independent of ``a``."""
    jaxpr, closed = _jax.open_jaxpr(traced)
    num_x = len(jax.tree.leaves(xi))
    dep = _x_dependent(jaxpr, num_x)
    if softmax:
        logit, value = jaxpr.outvars
        if isinstance(value, _jax.Literal) or value in dep:
            return None
        w_var, v_var = logit, value
    else:
        found = _product_parts(jaxpr, dep)
        if found is None:
            return None
        w_var, v_var = found
    w_jaxpr, v_jaxpr = _only(jaxpr, w_var), _only(jaxpr, v_var)
    x_zeros = [jnp.zeros(a.shape, a.dtype) for a in jax.tree.leaves(xi)]  # unused by v_jaxpr

    def weight(a, b, *c):
        flat = [*jax.tree.leaves(a), *jax.tree.leaves(b), *c]
        return _jax.eval_jaxpr(w_jaxpr, closed, *flat)[0].reshape(())

    def values(b, *c):
        return _jax.eval_jaxpr(v_jaxpr, closed, *x_zeros, *jax.tree.leaves(b), *c)[0]

    return Parts(weight, values)
