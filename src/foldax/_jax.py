"""The parts of JAX outside its compatibility policy that foldax uses, in one place.

JAX's API compatibility policy does not cover ``jax.core``, ``jax.extend``, ``jax.interpreters``
or ``jax._src``; a library that defines a primitive has no other way in. Every such import of
foldax is here, with what it is for, so that a new JAX is checked against one file. Checked
with jax 0.10.2 (Python 3.11) and jax 0.12.0 / 0.12.1 (Python 3.12, 3.13); the tests run on both.

* The primitive and its rule tables (:mod:`foldax._engine._registration`): ``Primitive``,
  ``ad.primitive_jvps`` / ``primitive_transposes`` / ``is_undefined_primal``, ``Zero`` (a
  symbolic zero tangent), ``batching.fancy_primitive_batchers``, ``mlir.register_lowering`` /
  ``lower_fun``. Unchanged from 0.10 to 0.12.
* Avals and tracers: ``ShapedArray``, ``Tracer``. Unchanged.
* Jaxprs, read to key the eager cache and to bound masks (:mod:`foldax._closure`,
  :mod:`foldax._pairwise._intervals`): up to jax 0.10, ``jax.make_jaxpr`` returns a
  ``ClosedJaxpr`` pairing an open ``Jaxpr`` with the values of its ``constvars``; from 0.11 a
  ``Jaxpr`` carries its constants itself and ``ClosedJaxpr`` is another name for it (its
  two-argument constructor and the ``.jaxpr`` accessor are kept only for old callers). foldax
  reads both through :func:`open_jaxpr` and runs one through :func:`eval_jaxpr`, which both
  versions have, never through the legacy forms.
* What is being traced (:func:`trace_kind`, for :mod:`foldax._eager`): ``jax._src``'s trace
  context and trace classes, present in 0.10.2 and 0.12.0; on a JAX where they moved, the
  eager cache keys no tracer (a transformed call is traced as JAX would), never wrong.
* Which outputs of a traced function depend on which of its inputs (:func:`depends_on`, for
  the tangent fold's symbolic zeros, :mod:`foldax._engine._derived`): ``partial_eval.dce_jaxpr``,
  the dead-code elimination JAX runs on every jaxpr, with its rules for nested calls (``pjit``,
  ``custom_jvp``). Same signature in 0.10.2 and 0.12; where it is missing, every output is taken
  to depend on every input (zeros are then formed, as ``jax.jvp`` forms them).
* JAX's persistent compilation cache, which a user may turn on (:func:`compiled_here`, for the
  memory audit): ``jax.experimental.compilation_cache.compilation_cache.reset_cache``, in
  0.10.2 and 0.12.0. The cache decides once per process whether it is used; resetting it
  makes it read ``jax_enable_compilation_cache`` again.
"""

from __future__ import annotations

import contextlib

import jax
from jax.core import ShapedArray as ShapedArray
from jax.core import Tracer as Tracer
from jax.experimental.compilation_cache import compilation_cache as _compilation_cache
from jax.extend.core import Jaxpr as Jaxpr
from jax.extend.core import Literal as Literal
from jax.extend.core import Primitive as Primitive
from jax.interpreters import ad as ad
from jax.interpreters import batching as batching
from jax.interpreters import mlir as mlir
from jax.interpreters.ad import Zero as Zero

try:  # jax <= 0.10: a closed jaxpr is its own class; from 0.11 the name of Jaxpr
    from jax.extend.core import ClosedJaxpr as _ClosedJaxpr
except ImportError:  # pragma: no cover - a JAX that dropped the name
    _ClosedJaxpr = Jaxpr


def is_jaxpr(p) -> bool:
    """Whether ``p`` is a jaxpr of either form (an equation's sub-jaxpr parameter, a trace)."""
    return isinstance(p, Jaxpr | _ClosedJaxpr)


def open_jaxpr(p) -> tuple[Jaxpr, tuple]:
    """``(jaxpr, consts)``: the jaxpr whose ``constvars`` take ``consts``, of a traced function
    (``jax.make_jaxpr``'s result) or a sub-jaxpr parameter, in either JAX's form. An open jaxpr
    of jax <= 0.10 (no constants) gives ``()``."""
    if isinstance(p, Jaxpr):  # jax >= 0.11: everything; jax <= 0.10: an open jaxpr
        return p, tuple(getattr(p, "consts", ()))
    return p.jaxpr, tuple(p.consts)


try:
    from jax._src.interpreters.partial_eval import dce_jaxpr as _dce_jaxpr
except ImportError:  # pragma: no cover - another JAX
    _dce_jaxpr = None


def depends_on(f, *args) -> list[bool]:
    """For each output leaf of ``f(*args)``: whether it depends on any of ``args`` (a leaf that
    does not has a zero derivative, whatever the tangents of ``args``)."""
    jaxpr, _ = open_jaxpr(jax.make_jaxpr(f)(*args))
    n = len(jaxpr.outvars)
    if _dce_jaxpr is None:  # pragma: no cover - another JAX
        return [True] * n
    return [any(_dce_jaxpr(jaxpr, [i == k for i in range(n)])[1]) for k in range(n)]


def dce(jaxpr):
    """``jaxpr`` without the equations its outputs do not need (every input kept)."""
    if _dce_jaxpr is None:  # pragma: no cover - another JAX
        return jaxpr
    return _dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)[0]


def eval_jaxpr(jaxpr, consts, *args) -> list:
    """Run ``jaxpr`` with ``consts`` for its ``constvars``: a list of its outputs."""
    return jax.core.eval_jaxpr(jaxpr, list(consts), *args)


try:  # the trace classes trace_kind tells apart, looked up once (it runs on every eager call)
    from jax._src.core import EvalTrace as _EvalTrace
    from jax._src.core import trace_ctx as _trace_ctx
    from jax._src.interpreters.ad import JVPTrace as _JVPTrace
    from jax._src.interpreters.ad import LinearizeTrace as _LinearizeTrace
    from jax._src.interpreters.batching import BatchTrace as _BatchTrace

    _EAGER = (_JVPTrace, _LinearizeTrace, _BatchTrace)
except ImportError:  # pragma: no cover - another JAX
    _trace_ctx = None


def trace_kind() -> str:
    """What is being traced: ``"eval"`` (nothing: an eager call), ``"eager"`` (only eager
    ``jax.grad`` / ``jax.vmap`` / ``jax.jvp``, whose traces sit on the evaluation trace) or
    ``"staged"`` (a jit, ``jax.checkpoint``, ``lax.scan``: a jaxpr). On a JAX whose traces
    this cannot tell apart, ``"eval"`` (the caller then keys no tracer, and a call that meets
    one is traced as JAX would)."""
    trace = getattr(_trace_ctx, "trace", None)
    if trace is None or isinstance(trace, _EvalTrace):
        return "eval"
    while isinstance(trace, _EAGER):
        trace = trace.parent_trace
    return "eager" if isinstance(trace, _EvalTrace) else "staged"


@contextlib.contextmanager
def compiled_here():
    """Compile inside without JAX's persistent compilation cache: an executable loaded from it
    was not compiled in this process, so XLA writes none of the dumps asked for (its cache key
    leaves them out). Not thread-safe: the cache is off for the whole process meanwhile."""
    if not (jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir):
        yield
        return
    jax.config.update("jax_enable_compilation_cache", False)
    _compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        _compilation_cache.reset_cache()


__all__ = [
    "Jaxpr",
    "Literal",
    "Primitive",
    "ShapedArray",
    "Tracer",
    "Zero",
    "ad",
    "batching",
    "compiled_here",
    "dce",
    "depends_on",
    "eval_jaxpr",
    "is_jaxpr",
    "mlir",
    "open_jaxpr",
    "trace_kind",
]
