"""The README as users read it: its Python blocks run when pasted, one after the other, and what
pyproject.toml points to in it exists."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", text, re.M | re.S)


#: Checks run right after the README block that contains the key: the shapes its comments give.
CHECKS = {
    "foldax.segment_logmeanexp(": "assert values.shape == (10, 3) and grads.shape == (10, 5)",
    "memory_budget(": "assert grads.shape == (1000, 5)",
    'reduction="kmin"': "assert k.shape == i.shape == (20000,) and vals.shape == (20000, 5)",
    "dot_product_attention(": "assert out.shape == (2, 512, 8, 64) and lse.shape == (2, 512, 8)",
    "make_mesh(": "assert out.shape == (3, 5)",
}


@pytest.mark.slow
def test_readme_python_blocks_run_when_pasted(tmp_path):
    """Every ```python block of the README, pasted in order into one script (each may use what
    the blocks before it made), runs, and its results have the shapes its comments give."""
    blocks = python_blocks(README.read_text())
    assert len(blocks) >= 5
    script = []
    for block in blocks:
        script.append(block)
        script += [check for key, check in CHECKS.items() if key in block]
    assert len(script) == len(blocks) + len(CHECKS), "a check's block is gone from the README"
    path = tmp_path / "readme.py"
    path.write_text("\n".join([*script, 'print("README blocks ran")']))
    proc = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=600, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "README blocks ran" in proc.stdout


def test_pyproject_points_to_readme_sections_that_exist():
    headings = set(re.findall(r"^#+ (.+)$", README.read_text(), re.M))
    pointers = re.findall(r"README: ([\w ]+)", (ROOT / "pyproject.toml").read_text())
    assert pointers, "pyproject.toml no longer points into the README: drop this test"
    for name in pointers:
        assert name.strip() in headings, f"pyproject.toml points to README: {name}, not a heading"
