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
import operator
import os
import re
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ._memory import MemoryReport, _name, format_bytes, report_from_compiled

_SHAPE = re.compile(r"^(?P<dtype>[a-z]+[0-9]*)\[(?P<dims>[0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+) = (?P<rest>.*)$")
_COMPUTATION = re.compile(r"^(?P<entry>ENTRY\s+)?%(?P<name>[\w.\-]+) \(.*\{\s*$")
_LIVE = re.compile(r"^\s*(?P<name>[\w.\-]+)\{(?P<index>[0-9,]*)\}: (?P<bytes>\d+) bytes")
#: An ``op_name`` component that is a scope (``jit(f)``, ``transpose(jvp())``), not a primitive.
_SCOPE = re.compile(r"[^()]*\(.*\)")
#: The foldax package: frames in it are foldax's own code (its folds' loops).
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


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
    """Temp memory at several sizes, its fitted exponent, and the buffers that grow.

    ``fold_steps``: :attr:`AuditReport.fold_steps` at each size. ``note``: ``""``, or what the
    sizes cannot tell: when temp memory grows but foldax's folds ran in one step at all sizes but
    at most one, a step held the whole problem (a fold's memory grows with the problem until a
    step is full), so the fit says nothing of whether memory stays flat at larger sizes.
    """

    name: str
    sizes: tuple[int, ...]
    temp_bytes: tuple[int, ...]
    exponent: float
    growing: tuple[Growth, ...]
    fold_steps: tuple[int | None, ...] = ()
    note: str = ""

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
        if self.note:
            lines.append(f"note: {self.note}")
        return "\n".join(lines)


def _table(rows, header):
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(
        [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
        + [fmt.format(*map(str, r)) for r in rows]
    )


@dataclasses.dataclass(frozen=True)
class _Instr:
    """One HLO instruction, as much of it as an audit needs."""

    shape: str  # the HLO shape, e.g. "f32[4,4]{1,0}" or "(s32[], f32[4]{0})"
    opcode: str
    operands: tuple[str, ...]
    op_name: str
    frame: int | None  # stack_frame_id
    computation: str
    root: bool
    trip_count: int | None  # a while loop's known trip count
    loop_computations: tuple[str, ...]  # a while loop's condition and body


def _split_shape(text):
    """``'<shape> <rest>'`` split after the shape (a tuple's shape has spaces in it)."""
    if not text.startswith("("):
        shape, _, rest = text.partition(" ")
        return shape, rest
    depth = 0
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
            return text[: i + 1], text[i + 1 :].lstrip()
    return text, ""


def _tuple_elements(text):
    """The element shapes of a tuple shape ``(a, (b, c), d)``."""
    inner = re.sub(r"/\*.*?\*/", "", text[1:-1])
    out, depth, start = [], 0, 0
    for i, ch in enumerate(inner):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(inner[start:i].strip())
            start = i + 1
    if inner.strip():
        out.append(inner[start:].strip())
    return out


def _parse_shape(text, index=()):
    """``(dims, dtype)`` of an HLO shape, or of its element at the tuple ``index``."""
    for i in index:
        elements = _tuple_elements(text) if text.startswith("(") else []
        if i >= len(elements):
            break
        text = elements[i]
    if text.startswith("("):
        return (), "tuple"
    m = _SHAPE.match(text)
    if not m:
        return (), text.split("{")[0]
    dims = tuple(int(d) for d in m.group("dims").split(",") if d)
    return dims, m.group("dtype")


def _call(rest):
    """``(opcode, operand names, attributes)`` of an instruction's right-hand side."""
    m = re.match(r"([\w\-]+)\(", rest)
    if not m:
        return "", (), rest
    depth, end = 0, len(rest)
    for i in range(m.end() - 1, len(rest)):
        depth += (rest[i] == "(") - (rest[i] == ")")
        if depth == 0:
            end = i
            break
    operands = tuple(re.findall(r"%([\w.\-]+)", rest[m.end() : end]))
    return m.group(1), operands, rest[end + 1 :]


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
    """``({name: _Instr}, entry computation's name)`` for every instruction of the module."""
    out, computation, entry = {}, "", ""
    for line in hlo.splitlines():
        c = _COMPUTATION.match(line)
        if c:
            computation = c.group("name")
            entry = computation if c.group("entry") else entry
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        shape, rest = _split_shape(m.group("rest"))
        opcode, operands, attrs = _call(rest)
        op = re.search(r'op_name="([^"]*)"', attrs)
        frame = re.search(r"stack_frame_id=(\d+)", attrs)
        trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', attrs)
        loops = re.findall(r"\b(?:condition|body)=%([\w.\-]+)", attrs) if opcode == "while" else []
        out[m.group("name")] = _Instr(
            shape=shape,
            opcode=opcode,
            operands=operands,
            op_name=op.group(1) if op else "",
            frame=int(frame.group(1)) if frame else None,
            computation=computation,
            root=line.lstrip().startswith("ROOT "),
            trip_count=int(trips.group(1)) if trips else None,
            loop_computations=tuple(loops),
        )
    return out, entry


def _entry_outputs(instrs, entry) -> set[str]:
    """Instructions whose buffers are the program's outputs (the entry's ROOT, and the elements
    of a ROOT tuple)."""
    roots = [n for n, i in instrs.items() if i.root and i.computation == entry]
    out = set()
    while roots:
        name = roots.pop()
        out.add(name)
        if instrs[name].opcode == "tuple":
            roots += [o for o in instrs[name].operands if o in instrs and o not in out]
    return out


def _peak(live: str):
    """``[(name, tuple index, bytes)]`` of the buffers listed under "Live ranges at N (peak)"."""
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
            index = tuple(int(i) for i in m.group("index").split(",") if i)
            out.append((m.group("name"), index, int(m.group("bytes"))))
    return out


def _primitive(op_name: str) -> str:
    """The JAX primitive named by an ``op_name`` (its last part), ``""`` where the last part is a
    scope (``jit(f)``): what the program's top level holds without any primitive making it."""
    last = op_name.split(";")[0].rsplit("/", 1)[-1]
    return "" if _SCOPE.fullmatch(last) else last


def _line(inst, frames) -> str:
    """The ``file:line`` that made an instruction, for one a JAX primitive made. One no
    primitive made (a constant the function closes over, lowered at the function's top level)
    carries the location of the call that traced the function, not a line that made it."""
    if inst is None or inst.frame is None or not _primitive(inst.op_name):
        return ""
    return frames.get(inst.frame, "")


def _is_constant(name, instrs, depth=0) -> bool:
    """Whether an instruction holds a constant: an HLO ``constant`` or ``iota``, or made (with
    no primitive of the function's) from constants only, e.g. the broadcast of a splat that
    XLA keeps as a buffer."""
    inst = instrs.get(name)
    if inst is None or depth > 32:
        return False
    if inst.opcode in ("constant", "iota"):
        return True
    if inst.opcode == "parameter" or not inst.operands or _primitive(inst.op_name):
        return False
    return all(_is_constant(o, instrs, depth + 1) for o in inst.operands)


def _used_at(name, instrs, consumers, frames) -> str:
    """The ``file:line`` of the first instruction that uses ``name``, looking through XLA's
    copies, tuples and fusions that have no line of their own."""
    frontier, seen = [name], {name}
    for _ in range(4):
        later = []
        for n in frontier:
            for c in consumers.get(n, ()):
                line = _line(instrs[c], frames)
                if line:
                    return line
                if c not in seen:
                    seen.add(c)
                    later.append(c)
        frontier = later
    return ""


def _fold_steps(instrs, frames) -> int | None:
    """How many steps the longest foldax fold of a compiled program takes, from XLA's known trip
    counts; ``None`` when it has no fold, or when XLA does not know a count.

    A fold is a ``lax.scan`` (a ``while`` in HLO) whose body holds foldax's code; a loop that
    runs once is compiled away, but its body keeps the loop in its ``op_name``
    (``.../while/body/...``). A dense plan's inner scan (directly inside the outer one)
    multiplies the count; loops inside jitted functions of the body (a ``searchsorted``) do
    not count."""
    loops: dict[str, bool] = {}  # loop (op_name up to its "while") -> foldax code in its body
    trips: dict[str, list] = {}
    for inst in instrs.values():
        ours = inst.frame is not None and frames.get(inst.frame, "").startswith(_PACKAGE)
        for name in inst.op_name.split(";"):
            parts = name.split("/")
            for i in range(len(parts) - 1):
                if parts[i] == "while" and parts[i + 1] in ("body", "cond"):
                    key = "/".join(parts[: i + 1])
                    loops[key] = loops.get(key, False) or ours
        if inst.opcode == "while":
            trips.setdefault(inst.op_name.split(";")[0], []).append(inst.trip_count)
    ours = [k for k, v in loops.items() if v]
    folds = [k for k in ours if not any(k.startswith(o + "/") for o in ours if o != k)]
    if not folds:
        return None

    def count(key):
        known = trips.get(key, [1])  # no loop left: it ran once
        return None if None in known else max(known)

    steps = 1
    for fold in folds:
        inner = [
            q
            for q in loops
            if q.startswith(fold + "/body/")
            and all(c == "closed_call" for c in q[len(fold) + 6 :].split("/")[:-1])
        ]
        counts = [count(fold), *(count(q) for q in inner)]
        if None in counts:
            return None
        steps = max(steps, counts[0] * max(counts[1:], default=1))
    return steps


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
        assignment = lives[-1].replace("-live-range.txt", "-buffer-assignment.txt")
        allocations = ""
        if os.path.exists(assignment):
            with open(assignment) as f:
                allocations = f.read()
    return compiled, live, hlo, allocations


def _allocation_kinds(text: str) -> dict[tuple[str, tuple[int, ...]], str]:
    """``(instruction, tuple index) -> kind`` from XLA's buffer assignment: ``"argument"`` (an
    entry parameter's allocation), ``"output"`` (maybe live out: a loop's state can share the
    output's buffer), ``"constant"`` or ``"temp"``."""
    out, kind = {}, "temp"
    for line in text.splitlines():
        a = re.match(r"^allocation \d+: size \d+(?P<flags>.*):\s*$", line)
        if a:
            flags = a.group("flags")
            kind = (
                "argument"
                if re.search(r", parameter \d+", flags)
                else "output"
                if "maybe-live-out" in flags
                else "constant"
                if ", constant" in flags
                else "temp"
            )
            continue
        v = re.match(r"^\s*value: <\d+ (?P<name>[\w.\-]+)(?:\{(?P<index>[0-9,]*)\})?[ >]", line)
        if v:
            index = tuple(int(i) for i in (v.group("index") or "").split(",") if i)
            out[v.group("name"), index] = kind
    return out


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

    ``sizes``: at least two distinct positive whole numbers, in any order (they are sorted). A
    foldax fold's memory grows with the problem until one step of it is full (steps are sized
    from the memory budget: see :func:`foldax.memory_budget`), and stays flat beyond; take sizes
    where the folds take several steps. When they ran in one step at all sizes but at most one,
    the report's ``note`` says so.

    Raises:
      TypeError: when ``sizes`` is not a sequence of whole numbers.
      ValueError: when there are fewer than two sizes, or one is not positive or is repeated.

    Example:
      >>> import jax, jax.numpy as jnp, foldax
      >>> make = lambda n: (lambda x: jnp.sort(jnp.outer(x, x), 0).sum(),
      ...                   (jax.ShapeDtypeStruct((n,), jnp.float32),))
      >>> s = foldax.memory.scaling(make, [64, 128, 256])
      >>> round(s.exponent), s.growing[0].shapes[-1]
      (2, (256, 256))
    """
    sizes = check_sizes(sizes)
    report, _ = _scaling(make, sizes, name, top, threshold, min_fraction)
    return report


def _scaling(make, sizes, name, top, threshold, min_fraction):
    """:func:`scaling` of checked ``sizes``, and the audit at each size."""
    audits = _audits(make, sizes, top)
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
    exponent = _fit(sizes, temps)
    steps = tuple(a.fold_steps for a in audits)
    report = ScalingReport(
        name=name,
        sizes=sizes,
        temp_bytes=temps,
        exponent=exponent,
        growing=tuple(growing),
        fold_steps=steps,
        note=_step_note(name, sizes, steps) if exponent > threshold else "",
    )
    return report, audits


def _audits(make, sizes, top):
    out = []
    for s in sizes:
        fn, args = make(s)
        out.append(audit(fn, *args, top=top))
    return out


def _step_note(name, sizes, steps) -> str:
    """Say so when the sizes are too small to tell whether foldax keeps memory flat: every fold
    held the whole problem in one step at all sizes but at most one."""
    if not steps or None in steps or sum(s > 1 for s in steps) >= 2:
        return ""
    one = ", ".join(str(n) for n, s in zip(sizes, steps, strict=True) if s == 1)
    return (
        f"at {name}={one} foldax's folds ran in one step (steps per size: "
        f"{', '.join(map(str, steps))}): a step held the whole problem, and a fold's memory "
        f"grows with the problem until a step is full. These sizes are too small to tell "
        f"whether temp memory stays flat; audit larger sizes, where the folds take several steps."
    )


#: Sizes in the error messages' examples.
EXAMPLE_SIZES = (2**18, 2**19, 2**20)


def check_sizes(
    sizes: Any,
    *,
    name: str = "foldax.memory.scaling: sizes",
    example: str = f"sizes={list(EXAMPLE_SIZES)}",
    got: str | None = None,
) -> tuple[int, ...]:
    """The sizes of a scaling fit, sorted: at least two distinct positive whole numbers (ints or
    NumPy integers). ``name`` and ``example`` word the errors (the command line passes its
    ``--sizes``), ``got`` shows what was given.

    Raises:
      TypeError: when ``sizes`` is not a sequence of whole numbers.
      ValueError: when there are fewer than two sizes, or one is not positive or is repeated.
    """
    if isinstance(sizes, str | bytes) or not hasattr(sizes, "__iter__"):
        raise TypeError(
            f"{name} must be a sequence of whole numbers, e.g. {example}; got {sizes!r}"
        )
    values = list(sizes)
    got = repr(values) if got is None else got
    out = []
    for v in values:
        try:
            if isinstance(v, bool | np.bool_):
                raise TypeError
            out.append(operator.index(v))
        except TypeError:
            raise TypeError(
                f"{name} must be whole numbers (int), e.g. {example}; got {v!r} in {got}"
            ) from None
    if len(out) < 2:
        raise ValueError(
            f"{name} needs at least two sizes to fit how memory grows, e.g. {example}; got {got}"
        )
    bad = [v for v in out if v <= 0]
    if bad:
        raise ValueError(
            f"{name} must be distinct positive numbers: {bad[0]} is not positive; e.g. "
            f"{example}; got {got}"
        )
    repeated = sorted({v for v in out if out.count(v) > 1})
    if repeated:
        raise ValueError(
            f"{name} must be distinct positive numbers: {repeated[0]} is repeated; give each "
            f"size once, at least two distinct sizes, e.g. {example}; got {got}"
        )
    return tuple(sorted(out))


__all__ = ["AuditReport", "Buffer", "Growth", "ScalingReport", "audit", "scaling"]
