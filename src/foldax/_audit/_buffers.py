"""The buffer audit of a compiled program: :func:`audit`, its :class:`AuditReport` of
:class:`Buffer` s (printed by :func:`foldax._table.table`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .._memory import MemoryReport, _name, format_bytes, report_from_compiled
from .._table import table
from ._dump import (
    _allocation_kinds,
    _compile_with_dump,
    _entry_outputs,
    _fold_steps,
    _frames,
    _instructions,
    _is_constant,
    _line,
    _parse_shape,
    _peak,
    _primitive,
    _used_at,
)


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One buffer live at the peak.

    Attributes:
      instruction: the HLO instruction that defines it (after XLA's optimizations).
      shape: its shape (``()`` for a tuple or a scalar), ``dtype`` its XLA element type.
      nbytes: its size in bytes.
      primitive: the JAX primitive that produced it (last part of the HLO ``op_name``; ``""``
        for an argument, a constant, and what XLA adds itself).
      op_name: the full JAX op name, e.g. ``jit(step)/transpose(jvp())/div``.
      source: ``file:line`` of the user's code that made it; ``"argument NAME"`` for an input of
        the program; ``"constant (used at file:line)"`` for a constant of the function (an array
        it closes over, or one XLA folded), with the first line that uses it; ``"loop state"``
        for a value a loop carries from one iteration to the next; ``""`` when unknown.
      kind: where XLA puts it: ``"argument"``, ``"output"`` (also a loop's state that shares
        the output's buffer), ``"constant"`` (not counted in temp memory) or ``"temp"``.
    """

    instruction: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    primitive: str
    op_name: str
    source: str
    kind: str


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """The largest buffers live at the memory peak, and the totals of :func:`report`.

    ``fold_steps``: how many steps the longest foldax fold of the program takes (1: it holds
    the whole problem in one step, so its memory still grows with the problem); ``None`` when
    the program has no foldax fold, or XLA does not know a loop's trip count.
    """

    name: str
    totals: MemoryReport
    peak_bytes: int
    buffers: tuple[Buffer, ...]
    fold_steps: int | None = None

    def __str__(self) -> str:
        rows = [
            (
                format_bytes(b.nbytes),
                b.kind,
                f"{b.dtype}[{','.join(map(str, b.shape))}]",
                b.primitive,
                b.source or "?",
                b.instruction,
            )
            for b in self.buffers
        ]
        head = ("bytes", "kind", "shape", "primitive", "source", "HLO instruction")
        return (
            f"{self.name}: {len(self.buffers)} largest buffers live at the peak "
            f"({format_bytes(self.peak_bytes)} live; {self.totals})\n" + table(rows, head)
        )


def audit(fn: Callable, *args: Any, top: int = 10, **kwargs: Any) -> AuditReport:
    """Compile ``fn(*args, **kwargs)`` and list the largest buffers live at its memory peak.

    Each buffer comes with its shape, dtype, bytes, the HLO instruction that defines it, the JAX
    primitive and the user's ``file:line`` (from the HLO metadata), and whether it is an
    argument, an output or a temp. ``args`` are traced (arrays or ``jax.ShapeDtypeStruct``);
    ``kwargs`` are bound statically. Nothing is executed.

    Raises:
      RuntimeError: naming ``fn`` when it fails to compile, or when the backend gives no memory
        analysis or live ranges.

    Example:
      >>> import jax, jax.numpy as jnp, foldax
      >>> def f(x):
      ...     return jnp.sort(jnp.outer(x, x), axis=0).sum()
      >>> a = foldax.memory.audit(f, jax.ShapeDtypeStruct((256,), jnp.float32), top=1)
      >>> a.buffers[0].shape, a.buffers[0].kind
      ((256, 256), 'temp')
    """
    name = _name(fn)
    compiled, live, hlo, allocations = _compile_with_dump(fn, args, kwargs, name)
    totals = report_from_compiled(compiled, name)
    frames = _frames(hlo)
    instrs, entry = _instructions(hlo)
    kinds = _allocation_kinds(allocations)
    outputs = _entry_outputs(instrs, entry)
    loop_computations = {c for i in instrs.values() for c in i.loop_computations}
    consumers: dict[str, list[str]] = {}
    for n, i in instrs.items():
        for o in i.operands:
            consumers.setdefault(o, []).append(n)
    peak = _peak(live)
    buffers = []
    for inst_name, index, nbytes in peak:
        inst = instrs.get(inst_name)
        if inst is None:
            shape, dtype, primitive, source, kind = (), "?", "", "", "temp"
        else:
            shape, dtype = _parse_shape(inst.shape, index)
            primitive, source = _primitive(inst.op_name), _line(inst, frames)
            kind = kinds.get((inst_name, index)) or ("output" if inst_name in outputs else "temp")
            if inst.opcode == "parameter":
                primitive = ""
                if inst.computation == entry:
                    kind, source = "argument", f"argument {inst.op_name}".strip()
                elif inst.computation in loop_computations:
                    source = "loop state"
            elif not source and _is_constant(inst_name, instrs):
                used = _used_at(inst_name, instrs, consumers, frames)
                source = f"constant (used at {used})" if used else "constant"
        buffers.append(
            Buffer(
                instruction=inst_name,
                shape=shape,
                dtype=dtype,
                nbytes=nbytes,
                primitive=primitive,
                op_name=inst.op_name if inst is not None else "",
                source=source,
                kind=kind,
            )
        )
    buffers.sort(key=lambda b: -b.nbytes)
    return AuditReport(
        name=name,
        totals=totals,
        peak_bytes=sum(b for _, _, b in peak),
        buffers=tuple(buffers[:top]),
        fold_steps=_fold_steps(instrs, frames),
    )
