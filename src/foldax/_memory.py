"""XLA's compiled memory analysis of a function: :func:`report` and :class:`MemoryReport`."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax


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
        f = format_bytes
        return (
            f"{self.name}: temp {f(self.temp_bytes)}, arguments {f(self.argument_bytes)}, "
            f"output {f(self.output_bytes)}, alias {f(self.alias_bytes)}, "
            f"code {f(self.generated_code_bytes)}"
        )


def _name(fn) -> str:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", type(fn).__name__)


def report(fn: Callable, *args: Any, **kwargs: Any) -> MemoryReport:
    """Compile ``fn(*args, **kwargs)`` with ``jax.jit`` and return XLA's memory figures.

    Positional ``args`` are traced (arrays, pytrees of arrays or ``jax.ShapeDtypeStruct``s, which
    are compiled without being allocated); keyword ``kwargs`` are bound statically with
    ``functools.partial``. Nothing is executed.

    Raises:
      RuntimeError: naming ``fn`` if the backend provides no memory analysis.
    """
    name = _name(fn)
    target = functools.partial(fn, **kwargs) if kwargs else fn
    return report_from_compiled(jax.jit(target).lower(*args).compile(), name)


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
