"""User callables traced into jaxprs, replayed with their closed-over arrays passed in, and
compared by structure.

:func:`trace` traces a user's ``fn`` / ``kernel`` / ``mask`` afresh (never from a cache that
would hold a previous call's values), the arrays it closes over taken out as ``consts``;
:class:`Closed` replays it from them, and two are equal when their traces have the same
structure (:func:`jaxpr_key`), which the eager cache (:mod:`foldax._eager`) keys on.

An equation of a foldax fold (a user's ``fn`` that calls a foldax function) holds a rule object
made afresh by every trace; it is compared by what it computes: its static description and the
jaxpr of its implementation (:meth:`foldax._engine._primitive._Rules.structure`), keyed like
any sub-jaxpr.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import weakref

import jax
import numpy as np

from . import _jax


class Unkeyable(Exception):
    """A value that cannot be part of a key (a tracer, an object array, an unhashable object)."""


# ----------------------------------------------------------------------------------------------
# Traced user callables, compared by structure


class Closed:
    """A user callable traced on example inputs, the arrays it closes over taken out
    (``consts``): ``closed(consts, *args)`` runs it. Equal to another when the traces have the
    same structure (:func:`jaxpr_key`)."""

    def __init__(self, jaxpr, in_tree, out_tree):
        self.jaxpr, self.in_tree, self.out_tree = jaxpr, in_tree, out_tree

    @functools.cached_property
    def key(self):
        return (self.in_tree, self.out_tree, jaxpr_key(self.jaxpr))

    @functools.cached_property
    def _hash(self):
        return hash(self.key)

    def __eq__(self, other):
        return isinstance(other, Closed) and self.key == other.key

    def __hash__(self):
        return self._hash

    def __call__(self, consts, *args):
        out = _jax.eval_jaxpr(self.jaxpr, consts, *self.in_tree.flatten_up_to(args))
        return jax.tree.unflatten(self.out_tree, out)


def trace(fn, *examples) -> tuple[Closed, list]:
    """``fn`` traced on ``examples`` (avals or arrays), every time (never a cached trace, which
    would hold the values of a previous call): ``(Closed, consts)``."""
    leaves, in_tree = jax.tree.flatten(examples)
    out_tree = []

    def flat(*xs):
        out = fn(*jax.tree.unflatten(in_tree, xs))
        out_leaves, tree = jax.tree.flatten(out)
        out_tree.append(tree)
        return out_leaves

    jaxpr, consts = _jax.open_jaxpr(jax.make_jaxpr(flat)(*leaves))
    return Closed(jaxpr, in_tree, out_tree[0]), list(consts)


#: Parameters that only say how to *differentiate* an equation (custom_jvp / custom_vjp rules,
#: a new function object on every trace). A cached eager executable that is only run (its inputs
#: concrete arrays) does not need them in its key; one called under an eager grad or vmap is
#: transformed, and the cache leaves such callables out (:func:`has_rules`).
_RULE_PARAMS = frozenset(
    {"jvp_jaxpr_fun", "jvp_jaxpr_thunk", "fwd_jaxpr_thunk", "bwd", "out_trees"}
)


def jaxpr_key(jaxpr) -> tuple:
    """A hashable key equal for two jaxprs exactly when they compute the same thing: variables
    by position, literals and array parameters by value, sub-jaxprs by their own keys, a foldax
    fold's rule object by its structure (:func:`_structure`), every other parameter by its own
    equality (a function by identity), except differentiation rules (:data:`_RULE_PARAMS`: the
    key is for running, not transforming). Source lines are ignored."""
    ids: dict = {}

    def bind(vs):
        for v in vs:
            ids[v] = len(ids)
        return tuple(v.aval for v in vs)

    def ref(v):
        if isinstance(v, _jax.Literal):
            return ("literal", value_key(v.val), v.aval)
        return ids[v]

    parts = [bind(jaxpr.constvars), bind(jaxpr.invars)]
    for eqn in jaxpr.eqns:
        params = tuple(
            (k, _param_key(p)) for k, p in sorted(eqn.params.items()) if k not in _RULE_PARAMS
        )
        ins = tuple(ref(v) for v in eqn.invars)
        parts.append((eqn.primitive, ins, params, bind(eqn.outvars), _effects_key(eqn.effects)))
    parts.append(tuple(ref(v) for v in jaxpr.outvars))
    return tuple(parts)


def has_rules(jaxpr) -> bool:
    """Whether ``jaxpr`` (or one nested in it) holds an equation with a differentiation rule
    (:data:`_RULE_PARAMS`), which :func:`jaxpr_key` leaves out; a foldax fold differentiates by
    its own rules, which its structure decides unless its implementation holds such a rule, or
    it is itself a derivative (transposed by its parent's rules)."""
    for eqn in jaxpr.eqns:
        if _RULE_PARAMS.intersection(eqn.params):
            return True
        for p in eqn.params.values():
            for q in p if isinstance(p, tuple | list) else (p,):
                if _jax.is_jaxpr(q) and has_rules(_jax.open_jaxpr(q)[0]):
                    return True
                if _is_rule(q) and (q.derived or has_rules(_structure(q)[1])):
                    return True
    return False


def _is_rule(p) -> bool:
    """Whether ``p`` is a foldax fold's rule object (an equation's parameter)."""
    return callable(getattr(p, "structure", None)) and hasattr(p, "derived")


def _structure(rule) -> tuple:
    """``(static, jaxpr)`` of a fold's rule object (:meth:`structure`), traced once per object;
    :class:`Unkeyable` if its implementation does not trace here."""
    found = rule.__dict__.get("_structure")
    if found is None:
        try:
            static, closed = rule.structure()
        except Exception:
            raise Unkeyable from None
        found = rule.__dict__["_structure"] = (static, *_jax.open_jaxpr(closed))
    return found


def _effects_key(effects):
    try:
        return frozenset(effects)
    except TypeError:
        raise Unkeyable from None


def _param_key(p):
    if _jax.is_jaxpr(p):
        jaxpr, consts = _jax.open_jaxpr(p)
        return ("jaxpr", jaxpr_key(jaxpr), tuple(value_key(c) for c in consts))
    if _is_rule(p):  # a new object on every trace: compared by what it computes
        static, jaxpr, consts = _structure(p)
        key = (_param_key(static), jaxpr_key(jaxpr), tuple(value_key(c) for c in consts))
        return ("rule", type(p), *key)
    if isinstance(p, tuple | list):
        return (type(p).__name__, *(_param_key(q) for q in p))
    if isinstance(p, dict):
        return ("dict", *((k, _param_key(v)) for k, v in sorted(p.items())))
    if isinstance(p, np.ndarray | np.generic | jax.Array):
        return value_key(p)
    return static_key(p)


#: What was read of the jax.Arrays seen (:func:`read_once`), by identity while they live.
_READ: dict[int, tuple] = {}


def read_once(v, what, read):
    """``read(v)`` for a jax.Array ``v``, computed once per array (by identity, while it lives)
    and ``what``: arrays are immutable, so their content is read once (a digest of 100,000
    known segment ids takes ~0.3 ms). Anything else is read every time."""
    if not isinstance(v, jax.Array) or isinstance(v, _jax.Tracer):
        return read(v)
    i = id(v)
    seen = _READ.get(i)
    if seen is None or seen[0]() is not v:
        try:
            ref = weakref.ref(v, lambda _: _READ.pop(i, None))
        except TypeError:
            return read(v)
        seen = _READ[i] = (ref, {})
    if what not in seen[1]:
        seen[1][what] = read(v)
    return seen[1][what]


def value_key(v):
    """An array-like by value: dtype, shape and a digest of its bytes (never a tracer)."""
    if isinstance(v, _jax.Tracer):
        raise Unkeyable
    return read_once(v, "digest", _digest)


def _digest(v):
    try:
        a = np.asarray(v)
    except Exception:
        raise Unkeyable from None
    if a.dtype == object:
        raise Unkeyable
    digest = hashlib.blake2b(np.ascontiguousarray(a).view(np.uint8), digest_size=16).digest()
    return ("array", a.dtype.str, a.shape, digest)


def static_key(v):
    """A static argument by value: scalars by type and value (floats by ``repr``, so NaN equals
    NaN), arrays and lists of numbers by content, other objects by their own hash / equality."""
    if v is None or isinstance(v, bool | int | str | enum.Enum):
        return (type(v), v)
    if isinstance(v, float | complex):
        return (type(v), repr(v))
    if isinstance(v, np.ndarray | np.generic | jax.Array):
        return value_key(v)
    if isinstance(v, list | tuple):
        if all(isinstance(x, bool | int | float | np.integer | np.floating) for x in v):
            return (type(v).__name__, value_key(v))
        return (type(v).__name__, *(static_key(x) for x in v))
    try:
        hash(v)
    except TypeError:
        raise Unkeyable from None
    return (type(v), v)


__all__ = [
    "Closed",
    "Unkeyable",
    "has_rules",
    "jaxpr_key",
    "read_once",
    "static_key",
    "trace",
    "value_key",
]
