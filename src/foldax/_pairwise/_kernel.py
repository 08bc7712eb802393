"""What a kernel is to a pairwise reduction: the monoid a reduction name stands for, the
checks of what the kernel returns, a tile of kernel values, and a softmax's values packed into one
vector."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from .. import _checks
from .._reductions import BY_NAME, KMin, SoftmaxSum, WeightedLogSumExp
from .._reductions._base import promote

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
        return BY_NAME[reduction]
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
