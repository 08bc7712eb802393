"""The documentation: the site builds warnings-as-errors with every public name, the line numbers
it quotes are current, and user-facing text speaks of the problems, not of our history."""

from __future__ import annotations

import re
import subprocess
import sys
import xml.etree.ElementTree as ET
import zlib
from pathlib import Path

import jax
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


@pytest.mark.slow
def test_site_builds_warnings_as_errors(built_site):
    for page in ("index", "getting-started", "ragged-logsumexp", "s4-cauchy", "design"):
        assert (built_site / f"{page}.html").exists(), page
    for page in ("distributed", "memory-audit", "benchmarks", "api", "cli"):
        assert (built_site / f"{page}.html").exists(), page


@pytest.mark.slow
def test_api_reference_covers_every_public_name(built_site):
    documented = inventory_names(built_site / "objects.inv")
    missing = [n for n in public_names() if n not in documented]
    assert not missing, f"add these to docs/api.md: {missing}"


@pytest.mark.slow
def test_api_reference_renders_math(built_site):
    html = (built_site / "api.html").read_text()
    assert r"\mathrm{out}_s" in html and r"\\mathrm" not in html  # the TeX, as its annotation
    assert 'class="math' in html and '<math xmlns="http://www.w3.org/1998/Math/MathML"' in html


#: Pages that have math (others may too).
MATH_PAGES = ("api", "ragged-logsumexp", "s4-cauchy")


@pytest.mark.slow
def test_math_is_mathml_and_nothing_is_fetched(built_site):
    """Every page reads offline: no script or stylesheet from the network (MathJax's CDN was
    one), and every formula is MathML that the browser renders, with no TeX left over."""
    pages = sorted(built_site.glob("*.html"))
    assert len(pages) >= 10
    for page in pages:
        html = page.read_text()
        for tag, url in re.findall(r"<(script|link)\b[^>]*?\b(?:src|href)=\"([^\"]*)\"", html):
            remote = url.startswith(("http:", "https:", "//")) or "cdn." in url
            assert not remote and "jsdelivr" not in url, f"{page.name}: <{tag}> {url}"
            assert "mathjax" not in url.lower(), f"{page.name}: <{tag}> {url}"
        wrappers = len(re.findall(r'class="math notranslate"', html))
        formulas = re.findall(r"<math [^>]*>(.*?)</math>", html, re.S)
        assert len(formulas) == wrappers, page.name  # none fell back to showing its TeX
        for body in formulas:
            shown = re.sub(r"<annotation [^>]*>.*?</annotation>", "", body, flags=re.S)
            assert "\\" not in shown and "<semantics><mrow>" in body, (page.name, body[:200])
        assert wrappers > 0 or page.stem not in MATH_PAGES, page.name


def offline_math():
    sys.path.insert(0, str(DOCS / "_ext"))
    try:
        import offline_math
    finally:
        sys.path.remove(str(DOCS / "_ext"))
    return offline_math


def mathml(tex: str, *, display: bool) -> ET.Element:
    """``to_mathml``'s output parsed, checked to carry its TeX as the annotation."""
    root = ET.fromstring(offline_math().to_mathml(tex, display=display))
    ns = "{http://www.w3.org/1998/Math/MathML}"
    assert root.tag == f"{ns}math" and root.get("display") == ("block" if display else "inline")
    (semantics,) = root
    shown, annotation = semantics
    assert annotation.get("encoding") == "application/x-tex" and annotation.text == tex
    for element in root.iter():
        element.tag = element.tag.removeprefix(ns)
    return shown


def tags(element: ET.Element) -> list[str]:
    return [e.tag for e in element.iter()]


def test_tex_to_mathml_as_tex_sets_it():
    shown = mathml(r"\mathrm{out}_s = \max_{i \in s} v_i", display=True)
    assert "munder" in tags(shown) and "msub" in tags(shown)  # max's limits under it, v_i
    inline = mathml(r"\max_{i \in s} v_i", display=False)
    assert "munder" not in tags(inline)  # inside a line of text, a subscript
    (big,) = (e for e in mathml(r"\bigoplus_{j<N} x_j", display=True).iter() if e.text == "⨁")
    assert big.tag == "mo"  # an operator, which the browser enlarges
    spaced = mathml(r"\log L + \log(x)", display=False)
    row = [e.tag for e in spaced[0]]
    assert row[:3] == ["mi", "mspace", "mi"], row  # log, a thin space, L
    assert row[4:6] == ["mi", "mo"], row  # log( with no space
    (fence,) = (e for e in mathml(r"\Big(x\Big)^2", display=True).iter() if e.tag == "msup")
    assert fence[0].tag == "mrow" and fence[0][0].get("minsize")  # sized where it is a row


@pytest.mark.parametrize(
    ("tex", "why"),
    [
        (r"\frac{1}{n} \foo{x}", r"the command \foo is not known to latex2mathml"),
        (r"\frac{1}{", "latex2mathml raised"),
        (r"\begin{aligned} a &= b \end{aligned}", "the converter wrote malformed MathML"),
    ],
)
def test_tex_that_cannot_be_rendered_is_an_error(tex, why):
    with pytest.raises(ValueError, match="cannot render the math") as e:
        offline_math().to_mathml(tex, display=True)
    assert why in str(e.value) and repr(tex) in str(e.value), str(e.value)


def build_tiny_site(tmp_path: Path, index: str) -> tuple[subprocess.CompletedProcess, Path]:
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    (src / "conf.py").write_text(
        f"import sys\nsys.path.insert(0, {str(DOCS / '_ext')!r})\nextensions = ['offline_math']\n"
    )
    (src / "index.rst").write_text(index)
    cmd = [sys.executable, "-m", "sphinx", "-W", "-q", "-b", "html", str(src), str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False), out


def test_a_strict_build_renders_every_kind_of_formula(tmp_path):
    index = (
        "Title\n=====\n\nInline :math:`x_i^2` math.\n\n"
        ".. math:: a = b\n   :label: first\n\n"
        ".. math::\n\n   a = 1\n\n   b = 2\n\n"
        ".. math::\n\n   a &= 1 \\\\\n   b &= 2\n"
    )
    proc, out = build_tiny_site(tmp_path, index)
    assert proc.returncode == 0, proc.stderr
    html = (out / "index.html").read_text()
    assert html.count('<math xmlns="http://www.w3.org/1998/Math/MathML"') == 5
    assert html.count('display="inline"') == 1 and '<span class="eqno">(1)' in html
    assert "<mtable" in html  # lines broken by a double backslash are aligned in a table


def test_a_strict_build_fails_on_math_it_cannot_render(tmp_path):
    proc, _ = build_tiny_site(tmp_path, "Title\n=====\n\n.. math:: \\foo{x}\n")
    assert proc.returncode != 0
    assert "index.rst:" in proc.stderr and r"the command \foo is not known" in proc.stderr


@pytest.mark.slow
def test_quoted_audit_lines_are_current():
    """Every ``file.py:NNN`` in docs/*.md is what the command it is quoted from prints now."""
    sys.path.insert(0, str(DOCS))
    try:
        import regen_memory_audit as regen
    finally:
        sys.path.remove(str(DOCS))
    old = regen.DOC.read_text()
    new = regen.regenerate(old)
    stale = regen.refs(old) - regen.refs(new)
    assert not stale, f"stale line numbers {sorted(stale)}: run python docs/regen_memory_audit.py"
    for doc in DOCS.glob("*.md"):
        if doc != regen.DOC:
            assert not regen.refs(doc.read_text()), f"{doc.name} quotes a line number"
    if (jax.__version__, jax.default_backend()) == ("0.10.2", "cpu"):  # where they were made
        assert new == old, "stale figures in memory-audit.md: run python docs/regen_memory_audit.py"
        # the prose's figures: the foldax S4 step's temp total against its temp live at the peak,
        # and the naive step's largest buffers
        block = new[new.index("audit_s4.py:with_foldax") :]
        total = re.search(r"XLA's totals: temp ([\d.]+ [KMG]?B)", block).group(1)
        peak = re.search(r"live at the peak: [\d.]+ [KMG]?B \(temp ([\d.]+ [KMG]?B)", block).group(
            1
        )
        assert f"{total} against {peak}" in old, (total, peak)
        naive = new[new.index("audit_s4.py:naive") :]
        largest = re.search(r"^([\d.]+ [KMG]?B) +temp +c64\[256,1024,512\]", naive, re.M).group(1)
        assert f"The three {largest} buffers of shape `(256, 1024, 512)`" in old, largest


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
