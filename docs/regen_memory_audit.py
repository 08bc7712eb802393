"""Regenerate the console outputs quoted in ``docs/memory-audit.md`` (compile-only, ~15 s).

    python docs/regen_memory_audit.py          # rewrite the outputs in place
    python docs/regen_memory_audit.py --check  # exit 1 if a quoted file:line is stale

Every console block that starts with ``$ foldax audit ...`` gets the output of that command,
run from the repository root. Lines inside foldax's own engine are shown without their line
number (they move from release to release); lines of the examples and of the workload's model
keep theirs, and ``tests/test_docs.py`` checks that they are current.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "memory-audit.md"
BLOCK = re.compile(r"(```console\n\$ (foldax audit [^\n]*)\n)(.*?)(```)", re.S)
#: foldax files whose line numbers are quoted (the model of the ragged workload)
KEEP_LINES = ("src/foldax/_tools/workloads.py",)
REF = re.compile(r"[\w./-]+\.py:\d+")


def run_audit(command: str) -> str:
    """The stdout of ``foldax audit ...`` run from the repository root, paths made relative."""
    argv = [sys.executable, "-m", "foldax", *shlex.split(command)[1:]]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"{command} exited with {proc.returncode}:\n{proc.stderr[-2000:]}")
    prefix = str(ROOT) + os.sep

    def rel(m):
        path, line = m.group(1), m.group(2)
        shown = f"{path}:{line}" if path.startswith(("examples/", *KEEP_LINES)) else path
        return shown + " " * (len(m.group(0)) - len(shown))  # keep the columns aligned

    text = proc.stdout.replace(prefix, "")
    return re.sub(r"((?:examples|src)/[\w./-]+\.py):(\d+)", rel, text)


def regenerate(text: str) -> str:
    return BLOCK.sub(
        lambda m: m.group(1) + run_audit(m.group(2)).rstrip() + "\n" + m.group(4), text
    )


def refs(text: str) -> set[str]:
    return set(REF.findall(text))


def main(argv) -> int:
    old = DOC.read_text()
    new = regenerate(old)
    if "--check" in argv:
        stale = refs(old) - refs(new)
        if stale:
            print(f"stale in {DOC.name}: {sorted(stale)}; run python docs/regen_memory_audit.py")
            return 1
        return 0
    DOC.write_text(new)
    print(f"rewrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
