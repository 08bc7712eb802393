"""XLA's dump of a compiled program, and what an audit reads from it.

:func:`_compile_with_dump` compiles a function with ``xla_dump_to`` switched on and returns the
text of its live ranges, optimized HLO and buffer assignment; the rest parses that text: the HLO
instructions (:class:`_Instr`), the ``stack_frame_id -> (file:line, ...)`` call chains (and the
user's line in each: foldax's own frames are skipped), the buffers live at the peak, where each
is placed and its kind, and how many steps foldax's folds take. The program is lowered as
:func:`foldax.memory.report` lowers it (:func:`foldax._memory.lower`: any callable).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import tempfile

import jax

from .. import _jax
from .._memory import lower

_SHAPE = re.compile(r"^(?P<dtype>[a-z]+[0-9]*)\[(?P<dims>[0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+) = (?P<rest>.*)$")
_COMPUTATION = re.compile(r"^(?P<entry>ENTRY\s+)?%(?P<name>[\w.\-]+) \(.*\{\s*$")
_LIVE = re.compile(r"^\s*(?P<name>[\w.\-]+)\{(?P<index>[0-9,]*)\}: (?P<bytes>\d+) bytes")
#: An ``op_name`` component that is a scope (``jit(f)``, ``transpose(jvp())``), not a primitive.
_SCOPE = re.compile(r"[^()]*\(.*\)")
#: The foldax package (this sub-package's parent): frames in it are foldax's own code (its
#: folds' loops), never shown: a buffer made there is put on the user's line that called foldax.
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
#: foldax's tools (the command line, the workloads' models) are code of foldax's users.
_TOOLS = os.path.join(_PACKAGE, "_tools") + os.sep
#: foldax's measuring code: the frames around it are the audit's caller, not the program's.
_MEASURING = (os.path.join(_PACKAGE, "_audit") + os.sep, os.path.join(_PACKAGE, "_memory.py:"))
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')


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
    parameter: int | None = None  # a parameter's number


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


def _frames(hlo: str) -> dict[int, tuple[str, ...]]:
    """``stack_frame_id -> ("file:line", ...)``, innermost first, from the module's FileNames,
    FileLocations and StackFrames (which prints each frame's parent's id plus one: 0 is none)."""
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
    steps = {}
    for k, v in sections.get("StackFrames", {}).items():
        loc = re.search(r"file_location_id=(\d+)", v)
        parent = re.search(r"parent_frame_id=(\d+)", v)
        if loc:
            steps[k] = (locs.get(int(loc.group(1)), ""), int(parent.group(1)) - 1 if parent else 0)
    out = {}
    for k in steps:
        chain, frame = [], k
        while frame in steps and len(chain) < 1000:
            loc, frame = steps[frame]
            chain.append(loc)
        out[k] = tuple(chain)
    return out


def _is_engine(location: str) -> bool:
    """Whether a ``file:line`` is in foldax's own code (not its tools)."""
    return location.startswith(_PACKAGE) and not location.startswith(_TOOLS)


def _relative(location: str) -> str:
    """A ``file:line`` with its path relative to the working directory, when it is inside it."""
    path, _, line = location.rpartition(":")
    if os.path.isabs(path):
        try:
            rel = os.path.relpath(path)
        except ValueError:  # another drive
            rel = path
        if not rel.startswith(os.pardir):
            path = rel
    return f"{path}:{line}"


def _user_line(chain) -> str:
    """The innermost ``file:line`` of a frame chain that is the user's (not foldax's engine:
    what foldax made is put on the line that called it), relative to the working directory;
    ``""`` when there is none before the audit's own call."""
    for location in chain:
        if not location or location.startswith(_MEASURING):
            return ""
        if not _is_engine(location):
            return _relative(location)
    return ""


def _unescape(text: str) -> str:
    """An HLO string attribute's text as it was written (``params[\\'a\\']`` -> ``params['a']``)."""
    return re.sub(r"\\(.)", r"\1", text)


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
        op = _OP_NAME.search(attrs)
        frame = re.search(r"stack_frame_id=(\d+)", attrs)
        trips = re.search(r'"known_trip_count":\{"n":"(\d+)"', attrs)
        loops = re.findall(r"\b(?:condition|body)=%([\w.\-]+)", attrs) if opcode == "while" else []
        number = re.match(r"parameter\((\d+)\)", rest) if opcode == "parameter" else None
        out[m.group("name")] = _Instr(
            shape=shape,
            opcode=opcode,
            operands=operands,
            op_name=_unescape(op.group(1)) if op else "",
            frame=int(frame.group(1)) if frame else None,
            computation=computation,
            root=line.lstrip().startswith("ROOT "),
            trip_count=int(trips.group(1)) if trips else None,
            loop_computations=tuple(loops),
            parameter=int(number.group(1)) if number else None,
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
    """The user's ``file:line`` that made an instruction, for one a JAX primitive made. One no
    primitive made (a constant the function closes over, lowered at the function's top level)
    carries the location of the call that traced the function, not a line that made it."""
    if inst is None or inst.frame is None or not _primitive(inst.op_name):
        return ""
    return _user_line(frames.get(inst.frame, ()))


def _is_constant(name, instrs, depth=0) -> bool:
    """Whether an instruction holds a constant: an HLO ``constant`` or ``iota``, a fusion of
    constants only (no operands), or made (with no primitive of the function's) from constants
    only, e.g. the broadcast of a splat that XLA keeps as a buffer."""
    inst = instrs.get(name)
    if inst is None or depth > 32:
        return False
    if inst.opcode in ("constant", "iota"):
        return True
    if inst.opcode == "parameter" or _primitive(inst.op_name):
        return False
    if not inst.operands:
        return inst.opcode == "fusion"
    return all(_is_constant(o, instrs, depth + 1) for o in inst.operands)


def _nearest_line(name, instrs, neighbours, frames) -> str:
    """The user's ``file:line`` of the nearest instruction to ``name`` along ``neighbours``
    (``{name: [names]}``: its consumers, or its operands), looking through XLA's copies, tuples
    and fusions that have no line of their own."""
    frontier, seen = [name], {name}
    for _ in range(4):
        later = []
        for n in frontier:
            for c in neighbours.get(n, ()):
                line = _line(instrs.get(c), frames)
                if line:
                    return line
                if c not in seen:
                    seen.add(c)
                    later.append(c)
        frontier = later
    return ""


def _used_at(name, instrs, consumers, frames) -> str:
    """The ``file:line`` of the first instruction that uses ``name``."""
    return _nearest_line(name, instrs, consumers, frames)


def _xla_source(name, instrs, consumers, frames) -> str:
    """The source of a buffer XLA made itself (no primitive of the function made it: a stage of
    a split reduction, a copy): the user's line that uses it, or failing that that made its
    operands."""
    used = _nearest_line(name, instrs, consumers, frames)
    if used:
        return f"made by XLA (used at {used})"
    operands = {n: i.operands for n, i in instrs.items()}
    made = _nearest_line(name, instrs, operands, frames)
    return f"made by XLA (from {made})" if made else "made by XLA"


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
        chain = frames.get(inst.frame, ()) if inst.frame is not None else ()
        ours = bool(chain) and _is_engine(chain[0])
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
    """``(compiled, live ranges, optimized HLO, buffer assignment, hoisted constants)`` of
    ``fn(*args, **kwargs)``, lowered as :func:`foldax.memory.report` lowers it (any callable,
    array leaves traced); the last: :func:`hoisted_constants`."""
    with tempfile.TemporaryDirectory(prefix="foldax-audit-") as d:
        try:
            lowered = lower(fn, args, kwargs, name)
            constants = hoisted_constants(lowered.as_text())
            with _jax.compiled_here():  # not loaded from a persistent cache: dumped
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
    return compiled, live, hlo, allocations, constants


def hoisted_constants(module: str) -> frozenset[int]:
    """The numbers of the program's parameters that are arrays its function closes over (jax
    >= 0.12.1 passes them as leading arguments marked ``jax.const``, where older versions
    compiled them in as constants)."""
    main = re.search(r"func\.func public @main\((?P<args>.*?)\)\s*->", module, re.DOTALL)
    if main is None:
        return frozenset()
    parts = re.split(r"%arg(\d+):", main.group("args"))[1:]
    return frozenset(
        int(k)
        for k, rest in zip(parts[::2], parts[1::2], strict=True)
        if "jax.const = true" in rest
    )


def _allocations(text: str) -> dict[tuple[str, tuple[int, ...]], tuple[str, int, int]]:
    """``(instruction, tuple index) -> (kind, allocation, offset)`` from XLA's buffer
    assignment. The kind is ``"argument"`` (an entry parameter's allocation), ``"output"``
    (maybe live out: a loop's state can share the output's buffer), ``"constant"`` or
    ``"temp"``; two buffers at the same allocation and offset share their memory."""
    out, kind, number = {}, "temp", -1
    for line in text.splitlines():
        a = re.match(r"^allocation (?P<n>\d+): size \d+(?P<flags>.*):\s*$", line)
        if a:
            flags, number = a.group("flags"), int(a.group("n"))
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
            at = re.search(r"\boffset=(\d+)", line)
            offset = int(at.group(1)) if at else 0
            out[v.group("name"), index] = (kind, number, offset)
    return out
