"""The package's layout: the tools apart from the library, public names in examples and docs."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "foldax"
#: the modules that are the tools' surface (the command line, the public workloads)
TOOL_SURFACE = {"__main__.py", "workloads.py"}


@pytest.mark.slow
def test_the_library_never_imports_the_tools():
    code = (
        "import sys, foldax, foldax.memory, jax.numpy as jnp\n"
        "foldax.segment_sum(jnp.ones(3), sizes=[1, 2])\n"
        "print(sorted(m for m in sys.modules if m.startswith('foldax._tools')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC)
        if rel.parts[0] == "_tools" or str(rel) in TOOL_SURFACE:
            continue
        imports = re.search(r"(from|import)\s+[\w.]*_tools\b|foldax\._tools", path.read_text())
        assert not imports, f"{rel} imports the tools: {imports.group(0)!r}"


def test_examples_and_docs_use_public_names():
    private = re.compile(r"from foldax(\.\w+)* import _[a-z]|import foldax\._[a-z]|foldax\._[a-z]")
    files = [*ROOT.glob("examples/*.py"), *ROOT.glob("docs/*.md"), *ROOT.glob("docs/*.py")]
    files.append(ROOT / "README.md")
    for path in files:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if "src/foldax/" in line:  # a quoted source location, not an import
                continue
            assert not private.search(line), f"{path.name}:{n}: {line.strip()}"


@pytest.mark.slow
def test_lint_and_format_are_clean():
    """``ruff check`` and ``ruff format --check`` over the sources, tests, docs and examples."""
    ruff = Path(sys.executable).with_name("ruff")
    if not ruff.exists():
        pytest.skip("ruff is not installed (pip install -e '.[test]')")
    paths = ["src", "tests", "docs", "examples"]
    for args in (["check", "-q"], ["format", "--check", "-q"]):
        proc = subprocess.run([str(ruff), *args, *paths], cwd=ROOT, capture_output=True, text=True)
        assert proc.returncode == 0, f"ruff {' '.join(args)}:\n{proc.stdout}{proc.stderr}"


def test_modules_and_functions_stay_small():
    """One concept per module: at most 600 lines; at most 80 lines of code per function."""
    for path in SRC.rglob("*.py"):
        text = path.read_text()
        assert len(text.splitlines()) <= 600, f"{path.relative_to(SRC)}: over 600 lines"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                body = node.body
                doc = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                first = body[1] if doc and len(body) > 1 else body[0]
                size = node.end_lineno - first.lineno + 1
                assert size <= 80, f"{path.relative_to(SRC)}:{node.lineno} {node.name}: {size}"


def test_the_package_is_typed():
    assert (SRC / "py.typed").exists()
