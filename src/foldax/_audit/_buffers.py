"""The buffer audit of a compiled program: :func:`audit`, its :class:`AuditReport` of
:class:`Buffer` s (printed by :func:`foldax._table.table`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .._memory import MemoryReport, _name, format_bytes, report_from_compiled
from .._table import table
from ._dump import (
    _allocations,
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
    _xla_source,
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
      source: ``file:line`` of the user's code that made it (relative to the working directory
        when inside it; a buffer foldax's engine made is put on the user's line that called
        foldax); ``"argument NAME"`` for an input of the program; ``"constant (used at
        file:line)"`` for a constant of the function (an array it closes over, or one XLA
        folded), with the first line that uses it; ``"loop state"`` for a value a loop carries
        from one iteration to the next; ``"made by XLA (used at file:line)"`` for a buffer XLA's
        optimizations made with no Python line of its own (a stage of a split reduction), with
        the line that uses it (or ``from file:line``, that made its inputs); ``""`` when unknown.
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


_PLURAL = {"argument": "arguments", "constant": "constants"}
#: What each kind of source means, printed under a table that shows it.
_LEGEND = (
    (
        "made by XLA",
        "made by XLA: a buffer XLA's optimizations made, with no line of Python of its own; shown "
        "with the line that uses it (or that made its inputs)",
    ),
    ("?", "?: no line of Python recorded for it in the compiled program"),
)


def legend(sources) -> str:
    """The lines that explain the sources that need it (``made by XLA``, ``?``), or ``""``."""
    shown = [text for key, text in _LEGEND if any(s.startswith(key) for s in sources)]
    return "\n".join(shown)


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """The largest buffers live at the memory peak, and the totals of :func:`report`.

    ``peak_bytes``: the memory of the buffers live at the peak (two that share memory, one
    updated in place into the other, count once); ``peak_kinds`` splits it by kind
    (``(("temp", bytes), ("argument", bytes), ...)``). ``fold_steps``: how many steps the
    longest foldax fold of the program takes (1: it holds the whole problem in one step, so its
    memory still grows with the problem); ``None`` when the program has no foldax fold, or XLA
    does not know a loop's trip count.
    """

    name: str
    totals: MemoryReport
    peak_bytes: int
    buffers: tuple[Buffer, ...]
    fold_steps: int | None = None
    peak_kinds: tuple[tuple[str, int], ...] = ()

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
        kinds = ", ".join(f"{_PLURAL.get(k, k)} {format_bytes(n)}" for k, n in self.peak_kinds)
        lines = [
            f"{self.name}: the {len(self.buffers)} largest buffers live at the memory peak",
            f"live at the peak: {format_bytes(self.peak_bytes)}" + (f" ({kinds})" if kinds else ""),
            f"XLA's totals: {self.totals.figures()}",
            "(live at the peak: the buffers live at the program's busiest moment, arguments and "
            "outputs included; XLA's temp total: all its scratch memory, which also holds buffers "
            "live at other moments)",
            table(rows, head),
        ]
        explained = legend([r[4] for r in rows])
        return "\n".join(lines + ([explained] if explained else []))


def audit(fn: Callable, *args: Any, top: int = 10, **kwargs: Any) -> AuditReport:
    """Compile ``fn(*args, **kwargs)`` and list the largest buffers live at its memory peak.

    Each buffer comes with its shape, dtype, bytes, the HLO instruction that defines it, the JAX
    primitive and the user's ``file:line`` (from the HLO metadata; what foldax's own code made
    is put on the user's line that called foldax), and whether it is an argument, an output, a
    constant or a temp. ``fn`` is any callable and its arguments any pytrees, as for
    :func:`foldax.memory.report`: array leaves (arrays or ``jax.ShapeDtypeStruct``) are traced,
    the rest fixed. Nothing is executed.

    Args:
      fn: the callable to compile.
      *args: its positional arguments.
      top: how many of the largest buffers to keep.
      **kwargs: its keyword arguments.

    Returns:
      An :class:`AuditReport`; printed, a table of the buffers under the memory live at the
      peak and XLA's totals.

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
    compiled, live, hlo, allocations, constants = _compile_with_dump(fn, args, kwargs, name)
    program = _Program.read(hlo, allocations, constants)
    peak = _peak(live)
    buffers = [program.buffer(*p) for p in peak]
    peak_bytes, peak_kinds = program.live_memory(peak, buffers)
    return AuditReport(
        name=name,
        totals=report_from_compiled(compiled, name),
        peak_bytes=peak_bytes,
        buffers=tuple(sorted(buffers, key=lambda b: -b.nbytes)[:top]),
        fold_steps=_fold_steps(program.instrs, program.frames),
        peak_kinds=peak_kinds,
    )


@dataclasses.dataclass(frozen=True)
class _Program:
    """What an audit reads of a compiled program from XLA's dump (and its lowering: which entry
    parameters are hoisted constants): its instructions, entry
    computation, frames (``stack_frame_id -> file:line chain``), where each buffer is placed
    (:func:`._dump._allocations`), the entry's outputs, its loops' computations, and each
    instruction's consumers."""

    instrs: dict
    entry: str
    frames: dict
    places: dict
    outputs: set
    loops: set
    consumers: dict
    constants: frozenset = frozenset()

    @classmethod
    def read(cls, hlo: str, allocations: str, constants=frozenset()) -> _Program:
        instrs, entry = _instructions(hlo)
        consumers: dict[str, list[str]] = {}
        for n, i in instrs.items():
            for o in i.operands:
                consumers.setdefault(o, []).append(n)
        return cls(
            instrs=instrs,
            entry=entry,
            frames=_frames(hlo),
            places=_allocations(allocations),
            outputs=_entry_outputs(instrs, entry),
            loops={c for i in instrs.values() for c in i.loop_computations},
            consumers=consumers,
            constants=constants,
        )

    def buffer(self, name: str, index: tuple[int, ...], nbytes: int) -> Buffer:
        """The :class:`Buffer` of the element ``index`` of instruction ``name``'s value."""
        inst = self.instrs.get(name)
        if inst is None:
            return Buffer(name, (), "?", nbytes, "", "", "", "temp")
        shape, dtype = _parse_shape(inst.shape, index)
        primitive, source = _primitive(inst.op_name), _line(inst, self.frames)
        place = self.places.get((name, index))
        kind = place[0] if place else ("output" if name in self.outputs else "temp")
        if inst.opcode == "parameter":
            primitive = ""
            if inst.computation == self.entry and inst.parameter in self.constants:
                used = _used_at(name, self.instrs, self.consumers, self.frames)
                kind, source = "constant", f"constant (used at {used})" if used else "constant"
            elif inst.computation == self.entry:
                kind, source = "argument", f"argument {inst.op_name}".strip()
            elif inst.computation in self.loops:
                source = "loop state"
        elif not source and _is_constant(name, self.instrs):
            used = _used_at(name, self.instrs, self.consumers, self.frames)
            source = f"constant (used at {used})" if used else "constant"
        elif not source and not primitive:
            source = _xla_source(name, self.instrs, self.consumers, self.frames)
        return Buffer(name, shape, dtype, nbytes, primitive, inst.op_name, source, kind)

    def live_memory(self, peak, buffers) -> tuple[int, tuple[tuple[str, int], ...]]:
        """The bytes live at the peak, and by kind: buffers at the same place (one updated in
        place into the other) share their memory and are counted once."""
        places: dict[tuple, tuple[str, int]] = {}
        for (name, index, nbytes), b in zip(peak, buffers, strict=True):
            place = self.places.get((name, index))
            key = place[1:] if place else (name, index)
            if key not in places or places[key][1] < nbytes:
                places[key] = (b.kind, nbytes)
        kinds: dict[str, int] = {}
        for kind, nbytes in places.values():
            kinds[kind] = kinds.get(kind, 0) + nbytes
        order = ("temp", "argument", "output", "constant")
        split = tuple((k, kinds[k]) for k in sorted(kinds, key=order.index))
        return sum(kinds.values()), split
