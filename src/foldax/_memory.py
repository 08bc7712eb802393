"""XLA's compiled memory analysis of a function: :func:`report` and :class:`MemoryReport`, and
:func:`lower`, how ``foldax.memory`` compiles any callable (array leaves traced, the rest fixed)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import jax
import numpy as np


def format_bytes(n: int) -> str:
    """``1536 -> '1.5 KB'``, in decimal units (KB = 1000 B)."""
    n = int(n)
    for unit, scale in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """XLA's memory figures for one compiled program, in bytes.

    Attributes:
      temp_bytes: scratch buffers live during execution (the figure foldax keeps flat).
      argument_bytes: the program's inputs.
      output_bytes: the program's outputs.
      alias_bytes: outputs that reuse (donated) input buffers.
      generated_code_bytes: size of the compiled code.
      name: the function's name, for printing.
    """

    temp_bytes: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    generated_code_bytes: int
    name: str = "fn"

    @property
    def peak_bytes(self) -> int:
        """An upper estimate of device memory while it runs: arguments + outputs + temps - aliases."""
        return self.argument_bytes + self.output_bytes + self.temp_bytes - self.alias_bytes

    def __str__(self) -> str:
        return f"{self.name}: {self.figures()}"

    def figures(self) -> str:
        """The figures without the name: ``'temp 6.6 MB, arguments 2.1 MB, ...'``."""
        f = format_bytes
        return (
            f"temp {f(self.temp_bytes)}, arguments {f(self.argument_bytes)}, "
            f"output {f(self.output_bytes)}, alias {f(self.alias_bytes)}, "
            f"code {f(self.generated_code_bytes)}"
        )


def _name(fn) -> str:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", None) or type(fn).__name__


def _is_array(x) -> bool:
    """A leaf that is traced: a JAX or NumPy array or scalar, or a ``jax.ShapeDtypeStruct``."""
    return isinstance(x, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct)


def _split(tree):
    """``(dynamic, merge)``: ``tree`` with every leaf that is not an array set to ``None``, and
    ``merge(traced)``, which puts them back into a tree of ``dynamic``'s structure."""
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [_is_array(x) for x in leaves]
    dynamic = treedef.unflatten([x if a else None for x, a in zip(leaves, arrays, strict=True)])

    def merge(traced):
        new = treedef.flatten_up_to(traced)
        return treedef.unflatten(
            [t if a else x for t, x, a in zip(new, leaves, arrays, strict=True)]
        )

    return dynamic, merge


def _signature(fn, extra: str | None):
    """``fn``'s signature with a keyword-only parameter ``extra`` added (for the arrays ``fn``
    itself holds), so that the program's arguments keep their names; ``None`` if it has none."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    if extra is None:
        return sig
    params = list(sig.parameters.values())
    if extra in sig.parameters:
        return None
    at = next((i for i, p in enumerate(params) if p.kind is p.VAR_KEYWORD), len(params))
    params.insert(at, inspect.Parameter(extra, inspect.Parameter.KEYWORD_ONLY))
    return sig.replace(parameters=params)


def jit_any(fn: Callable, args: tuple, kwargs: dict, name: str):
    """``(jitted, args, kwargs)``: ``fn(*args, **kwargs)`` as a ``jax.jit`` function of the
    array leaves only, whatever callable ``fn`` is, and the arguments to call or lower it with.

    Every array leaf of ``args`` and ``kwargs`` (``jax.Array``, NumPy arrays and scalars,
    ``jax.ShapeDtypeStruct``) is an argument of the program; every other leaf (Python numbers,
    strings, functions, an Equinox module's static fields) is fixed, as ``eqx.filter_jit`` does.
    ``fn`` itself is closed over as ``jax.jit`` does, except for the arrays of a pytree callable
    (an Equinox module, or a method bound to one), which are arguments named ``self``. ``fn`` is
    never hashed, so an unhashable callable (``eqx.filter_grad(loss)``) compiles too; the
    arguments keep the names of ``fn``'s parameters.
    """
    func, owner = fn, fn
    if hasattr(fn, "__self__") and hasattr(fn, "__func__"):  # a bound method: split off self
        func, owner = fn.__func__, fn.__self__
    owned = any(_is_array(x) for x in jax.tree.leaves(owner))
    key = next(k for k in ("self", "_self", "__self") if k not in kwargs)
    (dyn_self, dyn_args, dyn_kwargs), merge = _split((owner if owned else None, args, kwargs))
    method = owned and owner is not fn

    def staged(*traced_args, **traced_kwargs):
        traced_self = traced_kwargs.pop(key, None) if owned else None
        self_, a, k = merge((traced_self, traced_args, traced_kwargs))
        if method:
            return func(self_, *a, **k)
        return (self_ if owned else fn)(*a, **k)

    staged.__name__ = staged.__qualname__ = name
    signature = _signature(fn, key if owned else None)
    if signature is not None:
        staged.__signature__ = signature
    if owned:
        dyn_kwargs = {**dyn_kwargs, key: dyn_self}
    return jax.jit(staged), dyn_args, dyn_kwargs


def lower(fn: Callable, args: tuple, kwargs: dict, name: str) -> jax.stages.Lowered:
    """``fn(*args, **kwargs)`` lowered with ``jax.jit``, whatever callable ``fn`` is (see
    :func:`jit_any`)."""
    jitted, dyn_args, dyn_kwargs = jit_any(fn, args, kwargs, name)
    return jitted.lower(*dyn_args, **dyn_kwargs)


def report(fn: Callable, *args: Any, **kwargs: Any) -> MemoryReport:
    """Compile ``fn(*args, **kwargs)`` with ``jax.jit`` and return XLA's memory figures.

    ``fn`` is any callable: a function, a jitted one, a ``functools.partial``, a bound method,
    an Equinox-transformed function (``eqx.filter_grad(loss)``) or module. The array leaves of
    ``args`` and ``kwargs`` (arrays, or ``jax.ShapeDtypeStruct``s, which are compiled without
    being allocated) are the program's arguments; every other leaf (Python numbers, strings,
    ``None``, a module's static fields) is fixed, closed over. The arrays of a pytree callable
    (an Equinox module, or a method bound to one) are arguments too. Nothing is executed.

    Args:
      fn: the callable to compile.
      *args: its positional arguments, pytrees of any leaves.
      **kwargs: its keyword arguments, pytrees of any leaves.

    Returns:
      The :class:`MemoryReport` of the compiled program, named after ``fn``.

    Raises:
      RuntimeError: naming ``fn`` if the backend provides no memory analysis.

    Example:
      >>> import functools, jax.numpy as jnp, foldax
      >>> def f(x, scale, how):
      ...     return jnp.exp(x * scale).sum() if how == "exp" else x.sum()
      >>> foldax.memory.report(functools.partial(f, how="exp"), jnp.ones(1000), 2.0).argument_bytes
      4000
    """
    name = _name(fn)
    return report_from_compiled(lower(fn, args, kwargs, name).compile(), name)


def report_from_compiled(compiled, name: str = "fn") -> MemoryReport:
    """The :class:`MemoryReport` of an already compiled ``jax.stages.Compiled``."""
    stats = compiled.memory_analysis()
    if stats is None:
        raise RuntimeError(
            f"foldax.memory.report({name}): the {jax.default_backend()} backend gives no compiled "
            f"memory analysis; measure on CPU or GPU."
        )
    return MemoryReport(
        temp_bytes=int(stats.temp_size_in_bytes),
        argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        alias_bytes=int(stats.alias_size_in_bytes),
        generated_code_bytes=int(stats.generated_code_size_in_bytes),
        name=name,
    )
