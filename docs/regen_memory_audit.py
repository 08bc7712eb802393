"""Regenerate the console outputs quoted in ``docs/memory-audit.md`` (compile-only, ~15 s).

    python docs/regen_memory_audit.py          # rewrite the outputs in place
    python docs/regen_memory_audit.py --check  # exit 1 if a quoted file:line is stale

Every console block that starts with ``$ foldax audit ...`` gets the output of that command,
run from the repository root, as it prints it (paths relative to the root; the audit shows no
line of foldax's engine, only the lines of the examples and of the workload's model, which
``tests/test_docs.py`` checks are current).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "memory-audit.md"
BLOCK = re.compile(r"(```console\n\$ (foldax audit [^\n]*)\n)(.*?)(```)", re.S)
REF = re.compile(r"[\w./-]+\.py:\d+")


def run_audit(command: str) -> str:
    """The stdout of ``foldax audit ...`` run from the repository root."""
    argv = [sys.executable, "-m", "foldax", *shlex.split(command)[1:]]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"{command} exited with {proc.returncode}:\n{proc.stderr[-2000:]}")
    return "\n".join(line.rstrip() for line in proc.stdout.splitlines())


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
