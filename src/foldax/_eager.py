"""Eager calls reuse their compilation.

A public function called outside every JAX transformation (no argument, and nothing its
``fn`` / ``kernel`` / ``mask`` closes over, is a tracer) runs as one cached ``jax.jit``. The
cache key is everything that decides the trace: the function, its static arguments (by value;
arrays among them, such as known ``segment_ids`` or ``sizes``, by content), the shapes and
dtypes of its array arguments, the memory budget and :func:`foldax.debug_checks` in force, and
the *structure* of every user callable.

A user callable is traced afresh on every call (so it never runs with stale values) with the
arrays it closes over hoisted out as arguments of the executable: new parameter values run the
same executable, and the same ``fn`` object, or a new ``lambda`` with the same code, hits the
cache. Two traces are the same structure when their equations, parameters, literals and
shapes agree (:func:`jaxpr_key`); sub-jaxprs are compared the same way.

Anything the cache cannot key (a tracer, an array on several devices, an unhashable static
argument, a callable that fails to trace) runs the call as it is: the cache changes speed,
never results or errors.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import enum
import functools
import hashlib
import inspect
import threading
import weakref
from collections.abc import Callable

import jax
import jax.extend
import numpy as np

from . import _checks
from ._engine import current_budget

#: Executables kept (least recently used first out); each holds one compiled program.
MAX_ENTRIES = 256


class _Bypass(Exception):
    """This call cannot be keyed: run it uncached."""


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
        closed = jax.extend.core.ClosedJaxpr(self.jaxpr, list(consts))
        out = jax.extend.core.jaxpr_as_fun(closed)(*self.in_tree.flatten_up_to(args))
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

    closed = jax.make_jaxpr(flat)(*leaves)
    return Closed(closed.jaxpr, in_tree, out_tree[0]), list(closed.consts)


#: Parameters that only say how to *differentiate* an equation (custom_jvp / custom_vjp rules,
#: a new function object on every trace). A cached eager executable is only ever run (its
#: inputs are concrete arrays), never transformed, so they are not part of its key.
_RULE_PARAMS = frozenset(
    {"jvp_jaxpr_fun", "jvp_jaxpr_thunk", "fwd_jaxpr_thunk", "bwd", "out_trees"}
)


def jaxpr_key(jaxpr) -> tuple:
    """A hashable key equal for two jaxprs exactly when they compute the same thing: variables
    by position, literals and array parameters by value, sub-jaxprs by their own keys, every
    other parameter by its own equality (a function by identity), except differentiation rules
    (:data:`_RULE_PARAMS`: the key is for running, not transforming). Source lines are ignored."""
    ids: dict = {}

    def bind(vs):
        for v in vs:
            ids[v] = len(ids)
        return tuple(v.aval for v in vs)

    def ref(v):
        if isinstance(v, jax.extend.core.Literal):
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


def _effects_key(effects):
    try:
        return frozenset(effects)
    except TypeError:
        raise _Bypass from None


def _param_key(p):
    if isinstance(p, jax.extend.core.ClosedJaxpr):
        return ("closed", jaxpr_key(p.jaxpr), tuple(value_key(c) for c in p.consts))
    if isinstance(p, jax.extend.core.Jaxpr):
        return ("jaxpr", jaxpr_key(p))
    if isinstance(p, tuple | list):
        return (type(p).__name__, *(_param_key(q) for q in p))
    if isinstance(p, dict):
        return ("dict", *((k, _param_key(v)) for k, v in sorted(p.items())))
    if isinstance(p, np.ndarray | np.generic | jax.Array):
        return value_key(p)
    return static_key(p)


#: Digests of the jax.Arrays seen, by identity: they are immutable, so an array's content is
#: read once (known segment ids of 100,000 rows take ~0.3 ms to digest).
_DIGESTS: dict[int, tuple] = {}


def value_key(v):
    """An array-like by value: dtype, shape and a digest of its bytes (never a tracer)."""
    if isinstance(v, jax.core.Tracer):
        raise _Bypass
    if isinstance(v, jax.Array):
        seen = _DIGESTS.get(id(v))
        if seen is not None and seen[0]() is v:
            return seen[1]
        key = _digest(v)
        i = id(v)
        try:
            ref = weakref.ref(v, lambda _: _DIGESTS.pop(i, None))
        except TypeError:
            return key
        _DIGESTS[i] = (ref, key)
        return key
    return _digest(v)


def _digest(v):
    try:
        a = np.asarray(v)
    except Exception:
        raise _Bypass from None
    if a.dtype == object:
        raise _Bypass
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
        raise _Bypass from None
    return (type(v), v)


# ----------------------------------------------------------------------------------------------
# The cache


@dataclasses.dataclass(frozen=True)
class Hoist:
    """How to take a callable argument apart: ``examples(arguments)`` (the avals it is traced
    on, from the call's other arguments) and ``replay(closed, consts)`` (a callable to pass in
    its place inside the cached executable)."""

    examples: Callable
    replay: Callable = lambda closed, consts: functools.partial(closed, consts)
    #: raises if the trace is not one the call accepts (the uncached call then explains)
    check: Callable = lambda closed: None


class _Call:
    """The key of an executable, and what it needs to rebuild the call's arguments from the
    dynamic ones (static values are the first call's, equal by key to every later one's).
    ``entries``: per argument ``(name, kind, key, payload)``."""

    def __init__(self, impl, entries, context):
        self.impl, self.entries = impl, entries
        self.key = (impl, tuple(e[:3] for e in entries), context)
        self._hash = hash(self.key)

    def __eq__(self, other):
        return isinstance(other, _Call) and self.key == other.key

    def __hash__(self):
        return self._hash

    def frozen(self):
        """This call with copies of its mutable static values (NumPy arrays, lists): the
        executable may be traced again later (e.g. under another ``jax.config``), from the
        values its key was made of."""
        own = lambda v: copy.deepcopy(v) if isinstance(v, np.ndarray | list) else v  # noqa: E731
        entries = tuple(
            (n, kind, key, own(p) if kind == "static" else p) for n, kind, key, p in self.entries
        )
        return _Call(self.impl, entries, self.key[2])


def _is_dynamic_leaf(x) -> bool:
    return isinstance(x, jax.Array | np.ndarray)


def _aval_key(x):
    if isinstance(x, jax.core.Tracer):
        raise _Bypass
    if isinstance(x, jax.Array):
        if len(x.sharding.device_set) > 1:  # a mesh's array: its sharding decides the plan
            raise _Bypass
        return ("array", jax.typeof(x))
    return ("numpy", x.shape, x.dtype.str)


def _entry(name, value, arguments, dynamic_names, hoists, dynamic):
    """``(name, kind, key, payload)`` for one argument; its dynamic arrays appended."""
    if name in hoists and value is not None and callable(value):
        try:
            closed, consts = trace(value, *hoists[name].examples(arguments))
            hoists[name].check(closed)
        except _Bypass:
            raise
        except Exception:  # let the uncached call raise its own, clear, error
            raise _Bypass from None
        if any(isinstance(c, jax.core.Tracer) for c in consts):
            raise _Bypass
        dynamic.extend(consts)
        return (name, "hoisted", closed, (closed, len(consts)))
    if name in dynamic_names:
        leaves, tree = jax.tree.flatten(value)
        keys = []
        for leaf in leaves:
            if _is_dynamic_leaf(leaf):
                keys.append(_aval_key(leaf))
                dynamic.append(leaf)
            else:
                keys.append(("static", static_key(leaf)))
        is_dynamic = [_is_dynamic_leaf(x) for x in leaves]
        static = [None if d else x for x, d in zip(leaves, is_dynamic, strict=True)]
        return (name, "tree", (tree, tuple(keys)), (tree, static, is_dynamic))  # no user data
    return (name, "static", static_key(value), value)


def _rebuild(call, dynamic):
    """The call's arguments, from its key's payloads and the executable's dynamic inputs."""
    it = iter(dynamic)
    arguments = {}
    for name, kind, _, payload in call.entries:
        if kind == "hoisted":
            closed, count = payload
            consts = [next(it) for _ in range(count)]
            arguments[name] = call.impl.__foldax_hoists__[name].replay(closed, consts)
        elif kind == "tree":
            tree, static, is_dynamic = payload
            leaves = [next(it) if d else x for x, d in zip(static, is_dynamic, strict=True)]
            arguments[name] = jax.tree.unflatten(tree, leaves)
        else:
            arguments[name] = payload
    return arguments


def _run(call, dynamic):
    return call.impl(**_rebuild(call, dynamic))


class _Cache:
    def __init__(self, size):
        self.size, self.entries, self.lock = size, collections.OrderedDict(), threading.Lock()

    def get(self, call):
        with self.lock:
            f = self.entries.get(call)
            if f is not None:
                self.entries.move_to_end(call)
                return f
            call = call.frozen()
            f = jax.jit(functools.partial(_run, call))
            self.entries[call] = f
            while len(self.entries) > self.size:
                self.entries.popitem(last=False)
            return f

    def discard(self, call):
        with self.lock:
            self.entries.pop(call, None)

    def clear(self):
        with self.lock:
            self.entries.clear()

    def __len__(self):
        return len(self.entries)


CACHE = _Cache(MAX_ENTRIES)


def _top_level() -> bool:
    """Whether nothing is being traced (an eager call)."""
    try:
        from jax._src import core

        return isinstance(core.trace_ctx.trace, core.EvalTrace)
    except (ImportError, AttributeError):  # another JAX: rely on the tracer checks alone
        return True


def cached(*, dynamic: tuple[str, ...], hoist: dict[str, Hoist] | None = None):
    """Decorate a public function: its eager calls run one cached ``jax.jit`` (see the module
    docstring). ``dynamic``: the arguments whose arrays are the executable's inputs (every
    other argument is static); ``hoist``: the callable arguments to trace and take apart."""
    hoists = dict(hoist or {})

    def wrap(impl):
        signature = inspect.signature(impl)
        impl.__foldax_hoists__ = hoists

        @functools.wraps(impl)
        def call(*args, **kwargs):
            if not _top_level():  # inside a transformation: JAX caches the enclosing trace
                return impl(*args, **kwargs)
            try:
                arguments = signature.bind(*args, **kwargs).arguments
                found = []
                entries = tuple(
                    _entry(n, v, arguments, dynamic, hoists, found) for n, v in arguments.items()
                )
            except (_Bypass, TypeError):
                return impl(*args, **kwargs)
            key = _Call(impl, entries, (current_budget(), _checks.enabled()))
            try:
                return CACHE.get(key)(found)
            except Exception:  # bad input: the error as the uncached call raises it
                CACHE.discard(key)
                return impl(*args, **kwargs)

        return call

    return wrap


__all__ = ["CACHE", "Closed", "Hoist", "cached", "jaxpr_key", "trace"]
