"""Run a Python block of the README as a user would paste it into a script.

    .venv/bin/python dev/timings/snippet.py "Three reductions over 20,000"

runs the first fenced ``python`` block after the first line of README.md that contains the
marker, with the imports the README assumes (``jax``, ``jax.numpy as jnp``, ``foldax``), and waits
for every array it made. ``measure.py`` times it.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRELUDE = "import jax\nimport jax.numpy as jnp\nimport foldax\n"


def block_after(text: str, marker: str) -> str:
    """The first fenced python block after the line containing ``marker``."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if marker in line), None)
    if start is None:
        raise SystemExit(f"no line of README.md contains {marker!r}")
    body: list[str] | None = None
    for line in lines[start + 1 :]:
        if body is None and line.strip() == "```python":
            body = []
        elif body is not None and line.strip() == "```":
            return "\n".join(body) + "\n"
        elif body is not None:
            body.append(line)
    raise SystemExit(f"no ```python block after {marker!r} in README.md")


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        raise SystemExit("usage: snippet.py MARKER")
    code = PRELUDE + block_after((ROOT / "README.md").read_text(), argv[0])
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    import jax

    made = jax.tree.leaves([v for k, v in scope.items() if not k.startswith("__")])
    jax.block_until_ready([x for x in made if isinstance(x, jax.Array)])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
