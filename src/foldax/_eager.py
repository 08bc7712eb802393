"""Eager calls reuse their compilation.

A public function called outside every ``jax.jit`` (eagerly, or under an eager ``jax.grad``,
``jax.vmap``, ``jax.jvp``: their tracers are the executable's inputs like arrays, and JAX
differentiates or batches the cached ``jax.jit`` as it does any) runs as one cached
``jax.jit``. Its inputs are the arrays of the arguments named ``dynamic`` (the segment
reductions' ``data`` and ``segment_ids``, the pairwise and SSM functions' operands) and the
arrays user callables close over: keyed by shape and dtype, never by value, so new values (new
ids for every batch of a loop) run the same executable. The key holds everything else that
decides the trace: the function, its static arguments by value (numbers, strings, and the
segment reductions' ``sizes`` / ``offsets`` and ids given as a Python list: a new value compiles
anew), the memory budget and :func:`foldax.debug_checks` in force, the *structure* of every user
callable, and the cheap facts a function's ``prepare`` reads from its inputs (for segment ids:
whether they are sorted, and their largest id where ``num_segments`` is left out; see
:func:`foldax._segment._core._eager_arguments`). A key holds no array of the call: static arrays
by a digest; an entry keeps its static values (``O(S)`` sizes at most), never an input.

A user callable is traced afresh on every call (so it never runs with stale values) with the
arrays it closes over hoisted out as arguments of the executable: new parameter values run the
same executable, and the same ``fn`` object, or a new ``lambda`` with the same code, hits the
cache. Two traces are the same structure when their equations, parameters, literals and
shapes agree (:func:`foldax._closure.jaxpr_key`); sub-jaxprs are compared the same way, and so
is a fold of a foldax function that the callable calls (by its static description and the
jaxpr of its implementation).

Anything the cache cannot key (an array on several devices, an unhashable static
argument, a callable that fails to trace) runs the call as it is: the cache changes speed,
never results or errors. A bad call's error is raised once, by the uncached call, outside the
cache's own exception handling: no chained exception, and one frame of this module (named after
the public function) between the caller's line and the function's code.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import inspect
import threading
from collections.abc import Callable

import jax
import numpy as np

from . import _checks, _jax
from ._closure import Unkeyable, has_rules, static_key, trace
from ._engine import current_budget

#: Executables kept (least recently used first out); each holds one compiled program.
MAX_ENTRIES = 256


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


def _aval_key(x, context):
    if isinstance(x, _jax.Tracer):  # of an eager grad / vmap / jvp (_jax.trace_kind)
        if context != "eager":
            raise Unkeyable
        return ("tracer", jax.typeof(x))
    if isinstance(x, jax.Array):
        if len(x.sharding.device_set) > 1:  # a mesh's array: its sharding decides the plan
            raise Unkeyable
        return ("array", jax.typeof(x))
    if _narrowed(x):  # as an input JAX would wrap them: the call reads them itself
        raise Unkeyable
    return ("numpy", x.shape, x.dtype.str)


def _narrowed(x: np.ndarray) -> bool:
    """Whether NumPy integers change value as an input of a ``jax.jit`` (64-bit values beyond
    32 bits without ``jax_enable_x64``): ids ``7`` and ``7 + 2**32`` would become one."""
    held = jax.dtypes.canonicalize_dtype(x.dtype)
    if x.dtype.kind not in "iu" or held == x.dtype or not x.size:
        return False
    info = np.iinfo(held)
    return bool(x.min() < info.min or x.max() > info.max)


def _entry(name, value, arguments, dynamic_names, hoists, dynamic, context):
    """``(name, kind, key, payload)`` for one argument; its dynamic arrays appended."""
    if name in hoists and value is not None and callable(value):
        hoist = hoists[name]
        try:
            closed, consts = trace(value, *hoist.examples(arguments))
            hoist.check(closed)
        except Exception:  # let the uncached call raise its own, clear, error
            raise Unkeyable from None
        if any(isinstance(c, _jax.Tracer) for c in consts) and context != "eager":
            raise Unkeyable
        if context != "eval" and has_rules(closed.jaxpr):
            # transformed, the executable would differentiate by the rules of the trace that
            # made it, which the key leaves out (a new function object on every trace)
            raise Unkeyable
        dynamic.extend(consts)
        return (name, "hoisted", closed, (hoist.replay, closed, len(consts)))
    if name in dynamic_names and _is_dynamic_leaf(value):  # one array (the common case)
        dynamic.append(value)
        return (name, "array", _aval_key(value, context), None)
    leaves, tree = jax.tree.flatten(value) if name in dynamic_names else ((), None)
    is_dynamic = [_is_dynamic_leaf(x) for x in leaves]
    if any(is_dynamic):
        keys = tuple(
            _aval_key(x, context) if d else ("static", static_key(x))
            for x, d in zip(leaves, is_dynamic, strict=True)
        )
        dynamic.extend(x for x, d in zip(leaves, is_dynamic, strict=True) if d)
        static = [None if d else x for x, d in zip(leaves, is_dynamic, strict=True)]
        return (name, "tree", (tree, keys), (tree, static, is_dynamic))  # no user data kept
    return (name, "static", static_key(value), value)


def _rebuild(call, dynamic):
    """The call's arguments, from its key's payloads and the executable's dynamic inputs."""
    it = iter(dynamic)
    arguments = {}
    for name, kind, _, payload in call.entries:
        if kind == "hoisted":
            replay, closed, count = payload
            arguments[name] = replay(closed, [next(it) for _ in range(count)])
        elif kind == "array":
            arguments[name] = next(it)
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


def cached(
    *,
    dynamic: tuple[str, ...],
    hoist: dict[str, Hoist] | None = None,
    prepare: Callable | None = None,
):
    """Decorate a public function: its eager calls run one cached ``jax.jit`` (see the module
    docstring). ``dynamic``: the arguments whose arrays are the executable's inputs (every
    other argument is static); ``hoist``: the callable arguments to trace and take apart;
    ``prepare(arguments)``: the bound arguments to key and call with instead (the same call,
    told cheap facts of its inputs; raises :class:`Unkeyable` to run the call uncached)."""
    hoists = dict(hoist or {})

    def wrap(impl):
        signature = inspect.signature(impl)
        how = (impl, signature, dynamic, hoists, prepare)

        @functools.wraps(impl)
        def call(*args, **kwargs):
            context = _jax.trace_kind()
            found = None if context == "staged" else _lookup(how, args, kwargs, context)
            if found is not None:
                key, inputs = found
                try:
                    return CACHE.get(key)(inputs)
                except Exception:  # bad input: raised below, by the uncached call, once
                    CACHE.discard(key)
            # (outside every except block: the user's error comes alone, not chained)
            return impl(*args, **kwargs)

        # a traceback names the public function (this frame calls its body, nothing else)
        call.__code__ = call.__code__.replace(co_name=impl.__name__, co_qualname=impl.__qualname__)
        return call

    return wrap


def _lookup(how, args, kwargs, context):
    """``(key, dynamic inputs)`` of an eager call, or ``None`` where the cache cannot key it
    (JAX's JIT or the uncached call then does what it does)."""
    impl, signature, dynamic, hoists, prepare = how
    try:
        arguments = signature.bind(*args, **kwargs).arguments
        if prepare is not None:
            told = prepare(arguments)
            if len(told) != len(arguments):  # (those it added in the signature's order)
                told = {n: told[n] for n in signature.parameters if n in told}
            arguments = told
        found = []
        entries = tuple(
            _entry(n, v, arguments, dynamic, hoists, found, context) for n, v in arguments.items()
        )
        return _Call(impl, entries, (current_budget(), _checks.enabled())), found
    except (Unkeyable, TypeError):
        return None


__all__ = ["CACHE", "Hoist", "cached"]
