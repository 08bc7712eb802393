"""The documentation: the site builds warnings-as-errors with every public name, the line numbers
it quotes are current, and user-facing text speaks of the problems, not of our history."""

from __future__ import annotations

import re
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

import foldax
import foldax.memory

ROOT = Path(__file__).parent.parent
DOCS = ROOT / "docs"


def public_names() -> list[str]:
    names = [f"foldax.{n}" for n in dir(foldax) if not n.startswith("_") and n != "memory"]
    names += [f"foldax.memory.{n}" for n in foldax.memory.__all__]
    return sorted(names)


def inventory_names(path: Path) -> set[str]:
    """Object names in a Sphinx ``objects.inv`` (format 2: four header lines, then zlib)."""
    raw = path.read_bytes()
    body = zlib.decompress(raw.split(b"\n", 4)[4]).decode()
    return {line.split(" ", 1)[0] for line in body.splitlines()}


@pytest.fixture(scope="module")
def built_site(tmp_path_factory):
    out = tmp_path_factory.mktemp("html")
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html"]
    proc = subprocess.run(
        [*cmd, str(DOCS), str(out)], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def test_site_builds_warnings_as_errors(built_site):
    for page in ("index", "getting-started", "ragged-logsumexp", "s4-cauchy", "design"):
        assert (built_site / f"{page}.html").exists(), page
    for page in ("distributed", "memory-audit", "benchmarks", "api", "cli"):
        assert (built_site / f"{page}.html").exists(), page


def test_api_reference_covers_every_public_name(built_site):
    documented = inventory_names(built_site / "objects.inv")
    missing = [n for n in public_names() if n not in documented]
    assert not missing, f"add these to docs/api.md: {missing}"


def test_api_reference_renders_math(built_site):
    html = (built_site / "api.html").read_text()
    assert r"\mathrm{out}_s" in html and r"\\mathrm" not in html
    assert 'class="math' in html


def test_quoted_audit_lines_are_current():
    """Every ``file.py:NNN`` in docs/*.md is what the command it is quoted from prints now."""
    sys.path.insert(0, str(DOCS))
    try:
        import regen_memory_audit as regen
    finally:
        sys.path.remove(str(DOCS))
    old = regen.DOC.read_text()
    stale = regen.refs(old) - regen.refs(regen.regenerate(old))
    assert not stale, f"stale line numbers {sorted(stale)}: run python docs/regen_memory_audit.py"
    for doc in DOCS.glob("*.md"):
        if doc != regen.DOC:
            assert not regen.refs(doc.read_text()), f"{doc.name} quotes a line number"


#: Words from how foldax came about, which mean nothing to a user.
HISTORY = [
    r"seed 00\d",
    r"report's code",
    r"\(report\)",
    r"in the report",
    r"seed report",
    r"maintainers'",
    r"seed user",
    r"discussion #",
    r"issue #?\d",
    r"#\d{4,}",
]


def user_facing_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *DOCS.rglob("*.md")]
    files += [*(ROOT / "src" / "foldax").rglob("*.py"), *(ROOT / "examples").glob("*.py")]
    return [f for f in files if "_build" not in f.parts]


@pytest.mark.parametrize("path", user_facing_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_words_from_our_history(path):
    text = path.read_text()
    found = [m.group(0) for pat in HISTORY for m in re.finditer(pat, text, re.I)]
    assert not found, f"{path.relative_to(ROOT)}: {found}"
