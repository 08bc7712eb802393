"""Every time the text quotes ("about 20 s", "about 4.5 min") is the measured one.

docs/timings.json holds one entry per timed thing (a command, its measured wall time, the date,
the machine, and the strings by which the text names it); ``dev/timings/measure.py`` measures it
and ``dev/timings/rule.py`` says how a time is written. Here, in README.md, docs/*.md, the
examples (docstrings and ``--help``) and the command line's help, every quote must name exactly
one entry and be that entry's time as the rule writes it. Pure text: nothing is run.

A quote names the entry whose reference string comes last before it in the same line (a table
row), markdown paragraph or, in a Python file, line; an example's own file names the example
before each of its lines. An entry with ``of`` and ``flag`` (``examples/X.py --smoke``) is named
by its parent's reference followed, before the quote, by the flag. An entry measured on a quiet
and on a busy machine (``busy``) is quoted as the range between them ("30 to 75 s").
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMINGS = ROOT / "docs" / "timings.json"
MEASURE = ".venv/bin/python dev/timings/measure.py"


def _load_rule():
    spec = importlib.util.spec_from_file_location("timings_rule", ROOT / "dev/timings/rule.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rule = _load_rule()

#: Times in the text that are figures of a measured quantity, not how long a command takes.
NOT_RUN_TIMES = {"docs/design.md": ("about 0.1 s more to compile a loop",)}
#: The fields of an entry (measure.py's docstring says what each is).
FIELDS = {
    "command",
    "refs",
    "seconds",
    "cpu_seconds",
    "runs",
    "date",
    "machine",
    "of",
    "flag",
    "manual",
    "busy",
}
#: "about 20 s on 2 CPU cores": the cores named right after a quote.
CORES = re.compile(r" on (\d+) (?:CPU )?cores")


def entries() -> dict:
    return json.loads(TIMINGS.read_text())["entries"]


def text_files() -> list[Path]:
    files = [
        ROOT / "README.md",
        *sorted(ROOT.glob("docs/*.md")),
        *sorted(ROOT.glob("examples/*.py")),
    ]
    return files + sorted((ROOT / "src/foldax/_tools").glob("*.py"))


def units(rel: str, text: str) -> list[tuple[int, str]]:
    """(first line number, text) of each stretch a quote is read in: a markdown paragraph (fences
    and blank lines end one) or table row, a line of Python (an example's prefixed by its name)."""
    lines = text.splitlines()
    if not rel.endswith(".md"):
        own = f"{rel} " if rel.startswith("examples/") else ""
        return [(n, own + line) for n, line in enumerate(lines, 1)]
    out: list[tuple[int, str]] = []
    para: list[str] = []
    start = 0
    for n, line in enumerate([*lines, ""], 1):
        brk = not line.strip() or line.lstrip().startswith(("```", "|"))
        if brk and para:
            out.append((start, "\n".join(para)))
            para = []
        if line.lstrip().startswith("|"):
            out.append((n, line))
        elif not brk:
            start = start if para else n
            para.append(line)
    return out


def attribute(unit: str, pos: int, table: dict) -> tuple[list[str], int]:
    """The entries whose reference comes last before ``pos`` (one, unless ambiguous), with the
    offset where it ends; then the variant whose flag follows it, if one does."""
    best: dict[str, tuple[int, int]] = {}
    for key, e in table.items():
        for ref in e["refs"]:
            at = unit.rfind(ref, 0, pos)  # the last occurrence that ends before the quote
            if at >= 0:
                best[key] = max(best.get(key, (-1, 0)), (at + len(ref), len(ref)))
    if not best:
        return [], -1
    top = max(best.values())
    keys = [k for k, v in best.items() if v == top]
    if len(keys) == 1:
        after = unit[top[0] : pos]
        flagged = [(after.rfind(e["flag"]), k) for k, e in table.items() if e.get("of") == keys[0]]
        flagged = [f for f in flagged if f[0] >= 0]
        if flagged:
            keys = [max(flagged)[1]]
    return keys, top[0]


def said(e: dict) -> str:
    """How the text writes an entry's time: one time, or the range from quiet to busy."""
    if "busy" in e:
        return rule.format_range(e["seconds"], e["busy"]["seconds"])
    return rule.format_time(e["seconds"])


def quotes_in(unit: str) -> list[re.Match]:
    """The time quotes of a stretch of text, in order: ranges, single times ("about 20 s",
    not the ones inside a range) and times in words."""
    ranges = list(rule.RANGE.finditer(unit))
    inside = lambda m: any(r.start() <= m.start() < r.end() for r in ranges)  # noqa: E731
    singles = [m for m in rule.QUOTE.finditer(unit) if not inside(m)]
    return sorted([*ranges, *singles, *rule.VAGUE.finditer(unit)], key=lambda m: m.start())


def check_text(rel: str, text: str, table: dict) -> tuple[list[str], set[str]]:
    """The problems with the time quotes of one file, and the entries they name."""
    problems, named = [], set()
    exempt = NOT_RUN_TIMES.get(rel, ())
    for first, unit in units(rel, text):
        for m in quotes_in(unit):
            if any(0 <= m.start() - unit.find(x) < len(x) for x in exempt if x in unit):
                continue
            where = f"{rel}:{first + unit.count(chr(10), 0, m.start())}: {m.group(0)!r}"
            keys, _ = attribute(unit, m.start(), table)
            if len(keys) != 1:
                why = f"names {keys}" if keys else "names no entry of docs/timings.json"
                problems.append(
                    f"{where} {why}: name the command the way one entry's refs do, or add an "
                    f"entry to docs/timings.json (command, refs) and run {MEASURE} --only KEY"
                )
                continue
            key = keys[0]
            named.add(key)
            e = table[key]
            if "seconds" not in e:
                problems.append(f"{where}: {key!r} is not measured yet: {MEASURE} --only '{key}'")
                continue
            want = said(e)
            if m.re is rule.VAGUE or rule.canonical(m.group(0)) != rule.canonical(want):
                busy = f" and {e['busy']['seconds']} s on a busy machine" if "busy" in e else ""
                problems.append(
                    f"{where} should read {want!r}: {key!r} took {e['seconds']} s{busy} on "
                    f"{e['date']} (the rule: dev/timings/rule.py; remeasure: {MEASURE} "
                    f"--only '{key}'{' [--busy]' if busy else ''})"
                )
            cores = CORES.match(unit, m.end())
            if cores and int(cores.group(1)) != e["machine"]["cpus"]:
                problems.append(
                    f"{where} says {cores.group(1)} cores; {key!r} was measured on "
                    f"{e['machine']['cpus']}"
                )
    return problems, named


def check_all(table: dict) -> tuple[list[str], set[str]]:
    problems, named = [], set()
    for path in text_files():
        p, n = check_text(path.relative_to(ROOT).as_posix(), path.read_text(), table)
        problems += p
        named |= n
    return problems, named


def test_timings_json_is_well_formed():
    data = json.loads(TIMINGS.read_text())
    assert set(data) == {"about", "entries"}
    table = data["entries"]
    assert table, "docs/timings.json has no entries"
    owner: dict[str, str] = {}
    for key, e in table.items():
        assert isinstance(e.get("command"), str) and e["command"].strip(), key
        assert {"command", "refs"} <= set(e) <= FIELDS, f"{key}: fields {sorted(e)}"
        for arg in shlex.split(e["command"]):
            if arg.endswith(".py"):
                assert (ROOT / arg).exists(), f"{key}: {arg} does not exist"
        assert e["refs"] and all(isinstance(r, str) and r.strip() for r in e["refs"]), key
        for ref in e["refs"]:
            assert ref not in owner, f"{ref!r} is a ref of both {owner[ref]!r} and {key!r}"
            owner[ref] = key
        assert ("of" in e) == ("flag" in e), f"{key}: 'of' and 'flag' go together"
        if "of" in e:
            assert e["of"] in table and "of" not in table[e["of"]], f"{key}: of {e['of']!r}"
        if "seconds" in e:  # measured: then with its date and machine
            assert isinstance(e["seconds"], int | float) and e["seconds"] > 0, key
            assert re.fullmatch(r"\d{4}-\d\d-\d\d", e.get("date", "")), f"{key}: date"
            assert isinstance(e.get("machine", {}).get("cpus"), int), f"{key}: machine cpus"
        if "busy" in e:  # the same command on a busy machine: slower than the quiet time
            busy = e["busy"]
            assert "seconds" in e and busy["seconds"] >= e["seconds"], key
            assert re.fullmatch(r"\d{4}-\d\d-\d\d", busy.get("date", "")), f"{key}: busy date"
            assert isinstance(busy.get("machine", {}).get("cpus"), int), f"{key}: busy cpus"


def test_every_quote_is_the_measured_time():
    problems, _ = check_all(entries())
    assert not problems, "time quotes that disagree with docs/timings.json:\n" + "\n".join(problems)


def test_every_entry_is_quoted():
    table = entries()
    _, named = check_all(table)
    unquoted = sorted(set(table) - named)
    assert not unquoted, f"entries of docs/timings.json that no text quotes: {unquoted}"


def test_not_run_times_are_still_there():
    for rel, texts in NOT_RUN_TIMES.items():
        for text in texts:
            assert text in (ROOT / rel).read_text(), f"{rel} no longer says {text!r}: drop it"


@pytest.mark.parametrize(
    ("seconds", "said"),
    [
        *[(0.4, "about 1 s"), (6.1, "about 6 s"), (9.6, "about 10 s"), (21.4, "about 20 s")],
        *[(23, "about 25 s"), (87.4, "about 85 s"), (88, "about 1.5 min"), (119, "about 2 min")],
        *[(136, "about 2.5 min"), (272, "about 4.5 min"), (300, "about 5 min")],
    ],
)
def test_the_rule(seconds, said):
    assert rule.format_time(seconds) == said
    assert rule.canonical(said.replace("min", "minutes").replace(" s", " seconds")) == said


@pytest.mark.parametrize(
    ("quiet", "busy", "said"),
    [(31.6, 72.5, "30 to 75 s"), (64, 219, "65 s to 3.5 min"), (100, 200, "1.5 to 3.5 min")],
)
def test_the_rule_for_ranges(quiet, busy, said):
    assert rule.format_range(quiet, busy) == said
    assert rule.format_range(quiet, quiet) == rule.format_time(quiet)  # alike: one time
    spelled = said.replace("min", "minutes").replace(" s", " seconds")
    assert rule.canonical(spelled) == rule.canonical(said) == said
    assert [m.group(0) for m in quotes_in(f"takes {spelled} here")] == [spelled]


def test_the_checker_rejects_what_it_should():
    """Altered copies of real lines fail, and the unaltered ones pass."""
    table = entries()
    docs_build = rule.format_time(table["docs build"]["seconds"])
    readme = (ROOT / "README.md").read_text()
    line = next(x for x in readme.splitlines() if "Three reductions over 20,000" in x)
    quote = rule.QUOTE.search(line).group(0)
    wrong = rule.format_time(3 * table["README pairwise snippet"]["seconds"] + 60)
    problems, _ = check_text("README.md", readme.replace(line, line.replace(quote, wrong)), table)
    assert len(problems) == 1 and "should read" in problems[0], problems

    def check(text, rel="docs/x.md"):
        return check_text(rel, text, table)[0]

    assert not check(f"Build this site ({docs_build}): `sphinx-build`.")
    assert "names no entry" in check(f"This takes {docs_build}.")[0]
    assert "should read" in check("Build this site (a few seconds).")[0]
    assert "says 8 cores" in check(f"Build this site ({docs_build} on 8 CPU cores).")[0]
    full = rule.format_time(table["examples/flax_s4.py"]["seconds"])
    smoke = rule.format_time(table["examples/flax_s4.py --smoke"]["seconds"])
    assert full != smoke
    assert not check(f"`python examples/flax_s4.py` ({full}; `--smoke`, {smoke})")
    assert len(check(f"`python examples/flax_s4.py` ({smoke}; `--smoke`, {full})")) == 2
    own = f'    parser.add_argument("--smoke", help="small sizes, {smoke}")'
    assert not check(own, rel="examples/flax_s4.py")  # an example's own help names its smoke run
    assert check(own.replace("--smoke", "--full"), rel="examples/flax_s4.py")
    demo, demo_s4 = (said(table[k]) for k in ("foldax demo", "foldax demo s4"))
    assert demo != demo_s4
    assert not check(f"`foldax demo` then `foldax demo s4` ({demo_s4})")  # the nearest one
    assert check(f"`foldax demo s4` then `foldax demo` ({demo_s4})")
    quiet = rule.format_time(table["foldax demo"]["seconds"])  # a busy entry's quiet end alone
    assert "should read" in check(f"`foldax demo` ({quiet})")[0]
    assert "should read" in check(f"`sphinx-build` (7 to {docs_build[6:]})")[0]  # no range
    assert not check(f"| `examples/flax_s4.py` | a few steps | {full} |")
    assert "names no entry" in check(f"`examples/flax_s4.py` trains:\n| x | {full} |")[0]
