"""The ``foldax_fold`` primitive: how JAX sees a fold.

One ordinary ``jax.extend.core.Primitive`` whose only parameter is the fold's rule object
(:class:`Primitive` below; ``Fold`` and ``Batched`` in :mod:`._primitive`), registered with
JAX's classic rule tables: abstract evaluation, lowering (the rule's ``expand``, a
``lax.scan``), forward mode (``jvp``), transposition (``transpose``), batching (``batch``, with
the ``vmap``'s axis data) and an eager implementation (a cached ``jax.jit``).

Why not a higher-level extension point: a jaxpr holding a ``jax.experimental.hijax``
primitive is *high*, and JAX then keeps every ``jax.jit`` containing it off its C++ dispatch
path (each call re-traces the parameters and lowers the jaxpr again in Python, 250-350 µs a
call). A jaxpr of ordinary primitives is low, so a jitted function with folds in it dispatches
as fast as one with ``jax.ops`` in their place. ``jax.grad`` is ``jvp`` then ``transpose``.

A rule object's equality decides JAX's cache hits (of tracing, lowering, compilation and the
eager implementation): it is hashed by its ``params``.
"""

from __future__ import annotations

import functools

import jax
from jax.tree_util import tree_flatten, tree_unflatten

from .._jax import Primitive as _JaxPrimitive
from .._jax import ad, batching, mlir
from .._kernels import tpu as tpu_kernels

fold_p = _JaxPrimitive("foldax_fold")
fold_p.multiple_results = True


class Primitive:
    """Base of a fold's rule object: set ``in_avals``, ``out_aval`` (pytrees of avals) and
    ``params`` (a dict of hashable values that identifies the rule), then call ``__init__``.
    Subclasses provide ``expand(*args)``, ``jvp(primals, tangents)``, ``transpose(out_ct,
    *args)`` (undefined arguments are :class:`Accumulator` s) and ``batch(axis_data, args,
    dims)``."""

    def __init__(self):
        self.in_avals_flat, self.in_tree = tree_flatten(self.in_avals)
        self.out_avals_flat, self.out_tree = tree_flatten(self.out_aval)
        self.__dict__.update(self.params)

    def __call__(self, *args):
        flat = self.in_tree.flatten_up_to(args)
        return tree_unflatten(self.out_tree, fold_p.bind(*flat, fold_rule=self))

    def __hash__(self):
        return hash((type(self).__name__, tuple(self.params.items())))

    def __eq__(self, other):
        return type(self) is type(other) and self.params == other.params

    def __repr__(self):
        spec = getattr(self, "spec", None)
        return f"{type(self).__name__}({getattr(spec, 'name', '')})"


class Accumulator:
    """An argument being transposed: ``accum`` adds a cotangent, ``freeze`` reads the sum."""

    def __init__(self, aval):
        self.aval, self.ct = aval, None

    def accum(self, x):
        self.ct = x if self.ct is None else self.ct + x

    def freeze(self):
        return self.ct


def _unflatten_in(rule, flat):
    return tree_unflatten(rule.in_tree, flat)


def _flatten_out(rule, out):
    return rule.out_tree.flatten_up_to(out)


def _abstract_eval(*avals, fold_rule):
    return fold_rule.out_avals_flat


def _expand(*args, fold_rule, platform=None):
    out = fold_rule.expand(*_unflatten_in(fold_rule, args), platform=platform)
    return _flatten_out(fold_rule, out)


@functools.lru_cache(maxsize=64)
def _compiled(rule):
    return jax.jit(lambda *args: fold_p.bind(*args, fold_rule=rule))


def _impl(*args, fold_rule):
    return _compiled(fold_rule)(*args)


def _jvp(primals, tangents, *, fold_rule):
    out, t_out = fold_rule.jvp(
        _unflatten_in(fold_rule, primals), _unflatten_in(fold_rule, tangents)
    )
    return _flatten_out(fold_rule, out), _flatten_out(fold_rule, t_out)


def _transpose(cts, *args, fold_rule):
    args = [Accumulator(a.aval) if ad.is_undefined_primal(a) else a for a in args]
    fold_rule.transpose(
        tree_unflatten(fold_rule.out_tree, list(cts)), *_unflatten_in(fold_rule, args)
    )
    return [a.freeze() if isinstance(a, Accumulator) else None for a in args]


def _batch(axis_data, args, dims, *, fold_rule):
    out, out_dims = fold_rule.batch(
        axis_data, _unflatten_in(fold_rule, args), _unflatten_in(fold_rule, dims)
    )
    return _flatten_out(fold_rule, out), _flatten_out(fold_rule, out_dims)


fold_p.def_abstract_eval(_abstract_eval)
fold_p.def_impl(_impl)
mlir.register_lowering(fold_p, mlir.lower_fun(_expand, multiple_results=True))
mlir.register_lowering(
    fold_p,
    mlir.lower_fun(functools.partial(_expand, platform="cpu"), multiple_results=True),
    platform="cpu",
)
_lower_tpu = mlir.lower_fun(functools.partial(_expand, platform="tpu"), multiple_results=True)


def _tpu_lowering(ctx, *args, fold_rule):
    """On a TPU: the fold with its kernels where they serve it; a kernel Pallas fails to lower
    (a body it has no rule for: a gather, say) leaves the fold to the XLA loop, lowered in its
    place (found by lowering it once, not by a check of its own)."""
    try:
        return _lower_tpu(ctx, *args, fold_rule=fold_rule)
    except Exception as error:  # any failure to lower a kernel: the loop instead
        with tpu_kernels.refusing(error):
            return _lower_tpu(ctx, *args, fold_rule=fold_rule)


mlir.register_lowering(fold_p, _tpu_lowering, platform="tpu")
ad.primitive_jvps[fold_p] = _jvp
ad.primitive_transposes[fold_p] = _transpose
batching.fancy_primitive_batchers[fold_p] = _batch
