"""Which buffers are live at a compiled program's memory peak, and which line of code made them.

XLA decides where every buffer lives (its buffer assignment) and when (its live ranges); it can
dump both as text (``xla_dump_to``). :func:`audit` compiles a function with that dump switched on,
reads the peak's live buffers from the ``*-live-range.txt`` file, and resolves each buffer's HLO
instruction to its JAX primitive and the user's ``file:line`` through the HLO metadata
(``op_name`` and ``stack_frame_id`` -> ``StackFrames`` -> ``FileLocations`` -> ``FileNames``).
:func:`scaling` does that at several sizes and fits how each buffer grows.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import math
import os
import re
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ._memory import MemoryReport, _name, format_bytes, report_from_compiled

_SHAPE = re.compile(r"^(?P<dtype>[a-z]+[0-9]*)\[(?P<dims>[0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+) = (?P<shape>\S+) (?P<rest>.*)$")
_LIVE = re.compile(r"^\s*(?P<name>[\w.\-]+)\{(?P<index>[0-9,]*)\}: (?P<bytes>\d+) bytes")


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One buffer live at the peak.

    Attributes:
      instruction: the HLO instruction that defines it (after XLA's optimizations).
      shape: its shape (``()`` for a tuple or a scalar), ``dtype`` its XLA element type.
      nbytes: its size in bytes.
      primitive: the JAX primitive that produced it (last part of the HLO ``op_name``).
      op_name: the full JAX op name, e.g. ``jit(step)/transpose(jvp())/div``.
      source: ``file:line`` of the user's code that made it, or ``""`` when unknown.
      kind: ``"argument"``, ``"output"`` or ``"temp"``.
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
    """The largest buffers live at the memory peak, and the totals of :func:`report`."""

    name: str
    totals: MemoryReport
    peak_bytes: int
    buffers: tuple[Buffer, ...]

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
            f"({format_bytes(self.peak_bytes)} live; {self.totals})\n" + _table(rows, head)
        )


@dataclasses.dataclass(frozen=True)
class Growth:
    """A buffer (identified by primitive, source and rank) and its bytes at each size."""

    primitive: str
    source: str
    shapes: tuple[tuple[int, ...], ...]
    nbytes: tuple[int, ...]
    exponent: float


@dataclasses.dataclass(frozen=True)
class ScalingReport:
    """Temp memory at several sizes, its fitted exponent, and the buffers that grow."""

    name: str
    sizes: tuple[int, ...]
    temp_bytes: tuple[int, ...]
    exponent: float
    growing: tuple[Growth, ...]

    def __str__(self) -> str:
        lines = [
            f"temp memory against {self.name}: "
            + ", ".join(
                f"{self.name}={s}: {format_bytes(t)}"
                for s, t in zip(self.sizes, self.temp_bytes, strict=True)
            )
            + f"; fitted exponent {self.exponent:.2f}"
        ]
        if not self.growing:
            lines.append(f"no buffer live at the peak grows with {self.name}.")
        else:
            rows = [
                (
                    f"{g.exponent:.2f}",
                    " -> ".join(format_bytes(b) for b in g.nbytes),
                    str(list(g.shapes[-1])),
                    g.primitive,
                    g.source or "?",
                )
                for g in self.growing
            ]
            lines.append(
                _table(rows, (f"exponent in {self.name}", "bytes", "shape", "primitive", "source"))
            )
        return "\n".join(lines)


def _table(rows, header):
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(
        [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
        + [fmt.format(*map(str, r)) for r in rows]
    )


def _parse_shape(text):
    if text.startswith("("):
        return (), "tuple"
    m = _SHAPE.match(text)
    if not m:
        return (), text.split("{")[0]
    dims = tuple(int(d) for d in m.group("dims").split(",") if d)
    return dims, m.group("dtype")


def _frames(hlo: str):
    """``stack_frame_id -> "file:line"`` from the module's FileNames/FileLocations/StackFrames."""
    sections: dict[str, dict[int, str]] = {}
    current = None
    for line in hlo.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = sections.setdefault(line, {})
            continue
        if current is not None:
            m = re.match(r"^(\d+) (.*)$", line)
            if not m:
                current = None
                continue
            current[int(m.group(1))] = m.group(2)
    files = {k: v.strip('"') for k, v in sections.get("FileNames", {}).items()}
    locs = {}
    for k, v in sections.get("FileLocations", {}).items():
        f = re.search(r"file_name_id=(\d+)", v)
        ln = re.search(r"\bline=(\d+)", v)
        if f and ln:
            locs[k] = f"{files.get(int(f.group(1)), '?')}:{ln.group(1)}"
    out = {}
    for k, v in sections.get("StackFrames", {}).items():
        m = re.search(r"file_location_id=(\d+)", v)
        if m:
            out[k] = locs.get(int(m.group(1)), "")
    return out


def _instructions(hlo: str):
    """``name -> (shape, dtype, op_name, stack_frame_id, is_parameter)`` for every instruction."""
    out = {}
    for line in hlo.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        shape, dtype = _parse_shape(m.group("shape"))
        rest = m.group("rest")
        op = re.search(r'op_name="([^"]*)"', rest)
        frame = re.search(r"stack_frame_id=(\d+)", rest)
        out[m.group("name")] = (
            shape,
            dtype,
            op.group(1) if op else "",
            int(frame.group(1)) if frame else None,
            rest.startswith("parameter("),
        )
    return out


def _entry_outputs(hlo: str) -> set[str]:
    """Instructions whose buffers are the program's outputs (the entry ROOT and its operands)."""
    entry = hlo[hlo.find("\nENTRY ") :]
    m = re.search(r"ROOT %([\w.\-]+) = \S+ (\w+)\(([^)]*)\)", entry)
    if not m:
        return set()
    names = {m.group(1)}
    if m.group(2) == "tuple":
        names |= set(re.findall(r"%([\w.\-]+)", m.group(3)))
    return names


def _peak(live: str):
    """``[(name, bytes)]`` of the buffers listed under "Live ranges at N (peak)"."""
    out, inside = [], False
    for line in live.splitlines():
        if "(peak)" in line:
            inside = True
            continue
        if inside:
            m = _LIVE.match(line)
            if not m:
                if line.strip():
                    break
                continue
            out.append((m.group("name"), int(m.group("bytes"))))
    return out


def _compile_with_dump(fn, args, kwargs, name):
    target = functools.partial(fn, **kwargs) if kwargs else fn
    with tempfile.TemporaryDirectory(prefix="foldax-audit-") as d:
        try:
            lowered = jax.jit(target).lower(*args)
            compiled = lowered.compile(compiler_options={"xla_dump_to": d})
        except Exception as e:
            raise RuntimeError(
                f"foldax.memory.audit({name}): the function failed to compile: "
                f"{type(e).__name__}: {e}"
            ) from e
        lives = sorted(glob.glob(os.path.join(d, "*after_optimizations-live-range.txt")))
        hlos = [p.replace("-live-range.txt", ".txt") for p in lives]
        if not lives or not os.path.exists(hlos[-1]):
            raise RuntimeError(
                f"foldax.memory.audit({name}): the {jax.default_backend()} backend wrote no "
                f"buffer live ranges; memory audits need the CPU or GPU backend."
            )
        with open(lives[-1]) as f:
            live = f.read()
        with open(hlos[-1]) as f:
            hlo = f.read()
    return compiled, live, hlo


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
    compiled, live, hlo = _compile_with_dump(fn, args, kwargs, name)
    totals = report_from_compiled(compiled, name)
    frames = _frames(hlo)
    instrs = _instructions(hlo)
    outputs = _entry_outputs(hlo)
    peak = _peak(live)
    buffers = []
    for inst, nbytes in peak:
        shape, dtype, op_name, frame, is_param = instrs.get(inst, ((), "?", "", None, False))
        kind = "argument" if is_param else "output" if inst in outputs else "temp"
        buffers.append(
            Buffer(
                instruction=inst,
                shape=shape,
                dtype=dtype,
                nbytes=nbytes,
                primitive=op_name.rsplit("/", 1)[-1] if op_name else "",
                op_name=op_name,
                source=frames.get(frame, "") if frame is not None else "",
                kind=kind,
            )
        )
    buffers.sort(key=lambda b: -b.nbytes)
    return AuditReport(
        name=name,
        totals=totals,
        peak_bytes=sum(b for _, b in peak),
        buffers=tuple(buffers[:top]),
    )


def _fit(sizes, values) -> float:
    """Least-squares slope of log(values) against log(sizes), over the sizes where the value is
    not 0: 0 when it is 0 everywhere, ``inf`` when it is 0 at every size but the largest."""
    v = np.asarray(values, np.float64)
    pos = v > 0
    if not pos.any():
        return 0.0
    if pos.sum() < 2:
        return math.inf if pos[-1] else 0.0
    x = np.log(np.asarray(sizes, np.float64)[pos])
    return float(np.polyfit(x, np.log(v[pos]), 1)[0])


def scaling(
    make: Callable[[int], tuple[Callable, Sequence[Any]]],
    sizes: Sequence[int],
    *,
    name: str = "N",
    top: int = 50,
    threshold: float = 0.1,
    min_fraction: float = 0.01,
) -> ScalingReport:
    """How temp memory, and each buffer live at the peak, grows with a size.

    ``make(size)`` returns ``(fn, args)``; each is compiled (not run) and audited. The exponent of
    temp memory in the size is fitted on a log-log scale, and every buffer at the peak that is
    found at all sizes (matched by primitive, source line and rank), grows with exponent above
    ``threshold`` and holds at least ``min_fraction`` of the temp memory at the largest size is
    listed, largest exponent first.

    Example:
      >>> import jax, jax.numpy as jnp, foldax
      >>> make = lambda n: (lambda x: jnp.sort(jnp.outer(x, x), 0).sum(),
      ...                   (jax.ShapeDtypeStruct((n,), jnp.float32),))
      >>> s = foldax.memory.scaling(make, [64, 128, 256])
      >>> round(s.exponent), s.growing[0].shapes[-1]
      (2, (256, 256))
    """
    sizes = tuple(int(s) for s in sizes)
    if len(sizes) < 2:
        raise ValueError(f"foldax.memory.scaling: give at least two sizes, got {sizes}.")
    audits = []
    for s in sizes:
        fn, args = make(s)
        audits.append(audit(fn, *args, top=top))
    temps = tuple(a.totals.temp_bytes for a in audits)
    keyed = []
    for a in audits:
        d: dict[tuple, Buffer] = {}
        for b in a.buffers:
            if b.kind != "temp":
                continue
            key = (b.primitive, b.source, len(b.shape))
            if key not in d or d[key].nbytes < b.nbytes:
                d[key] = b
        keyed.append(d)
    growing = []
    for key in set.intersection(*(set(d) for d in keyed)):
        bs = [d[key] for d in keyed]
        nb = tuple(b.nbytes for b in bs)
        e = _fit(sizes, nb)
        if e > threshold and nb[-1] >= min_fraction * temps[-1]:
            growing.append(Growth(key[0], key[1], tuple(b.shape for b in bs), nb, e))
    growing.sort(key=lambda g: (-round(g.exponent, 1), -g.nbytes[-1]))
    return ScalingReport(
        name=name,
        sizes=sizes,
        temp_bytes=temps,
        exponent=_fit(sizes, temps),
        growing=tuple(growing),
    )


__all__ = ["AuditReport", "Buffer", "Growth", "ScalingReport", "audit", "scaling"]
