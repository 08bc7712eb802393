"""The headline workloads on the oldest and the newest JAX foldax accepts, side by side.

Two ``foldax bench`` runs of the same workloads, one on each JAX, one after the other on one
machine, are kept together in ``bench/jax-versions.json`` (:func:`compare`): each run's rows and
machine, and a measured cause for every time ratio that moved by more than
:data:`MOVED` between them. ``BENCHMARKS.md`` renders the pair as its last section
(:func:`versions_section`); a moved ratio without a cause is an error, not a blank cell.
"""

from __future__ import annotations

from ..._memory import format_bytes
from ._config import BASELINE, format_time, machine_line

#: The file, beside ``results.json``, holding the pair of runs.
VERSIONS_FILE = "jax-versions.json"
#: A time ratio (foldax / baseline) that changes by more than this between the runs has moved.
MOVED = 0.10


def _key(row) -> str:
    return f"{row['workload']} | {row['case']} | {row['pass']}"


def _pairs(run: dict):
    """``(key, foldax row, baseline row)`` for every foldax row with its baseline in ``run``."""
    for workload, rows in run["workloads"].items():
        base = {(r["case"], r["pass"]): r for r in rows if r["impl"] == BASELINE[workload]}
        for r in rows:
            peer = base.get((r["case"], r["pass"]))
            if r["impl"] == "foldax" and peer is not None and peer["seconds"]:
                yield _key(r), r, peer


def _ratio(row, peer) -> float:
    return row["seconds"] / peer["seconds"]


def moved(old: dict, new: dict) -> list[str]:
    """The rows (``"workload | case | pass"``) whose time ratio moved by more than MOVED."""
    new_rows = {k: (r, p) for k, r, p in _pairs(new)}
    return [
        k
        for k, r, p in _pairs(old)
        if k in new_rows and abs(_ratio(*new_rows[k]) / _ratio(r, p) - 1) > MOVED
    ]


def compare(old: dict, new: dict, causes: dict[str, str]) -> dict:
    """The content of ``jax-versions.json`` for two runs' ``results.json``; ``causes`` maps
    each moved row (:func:`moved`) to why it moved."""
    rows = moved(old, new)
    missing = [k for k in rows if not causes.get(k)]
    if missing:
        raise ValueError(f"a measured cause is needed for each moved ratio: {missing}")
    keep = ("command", "date", "machine", "repeats", "workloads")
    return {
        "old": {k: old[k] for k in keep},
        "new": {k: new[k] for k in keep},
        "causes": {k: causes[k] for k in rows},
    }


def _temp(row, peer) -> str:
    return f"{format_bytes(row['temp_bytes'])} / {format_bytes(peer['temp_bytes'])}"


def versions_section(versions: dict) -> list[str]:
    """The markdown lines of BENCHMARKS.md's section for a ``jax-versions.json``."""
    old, new, causes = versions["old"], versions["new"], versions["causes"]
    jax_old, jax_new = old["machine"]["jax"], new["machine"]["jax"]
    lines = [
        "## The headline workloads on the oldest and the newest JAX",
        "",
        f"Two runs one after the other on one machine: `{old['command']}` on {old['date']} "
        f"({machine_line(old['machine'])}) and `{new['command']}` on {new['date']} "
        f"({machine_line(new['machine'])}). Ratios are foldax's median time over the "
        f"baseline's in the same run (the tables above name each workload's baseline); a "
        f"ratio that moved by more than {MOVED:.0%} between the two JAX versions is in bold, "
        f"with its measured cause. Temp is foldax's / the baseline's.",
        "",
        f"| workload | case | pass | foldax, jax {jax_old} | foldax, jax {jax_new} "
        f"| ratio, jax {jax_old} | ratio, jax {jax_new} | temp, jax {jax_old} "
        f"| temp, jax {jax_new} | why the ratio moved |",
        "|---|---|---|---:|---:|---:|---:|---|---|---|",
    ]
    new_rows = {k: (r, p) for k, r, p in _pairs(new)}
    for key, r_old, p_old in _pairs(old):
        if key not in new_rows:
            continue
        r_new, p_new = new_rows[key]
        a, b = f"{_ratio(r_old, p_old):.2f}", f"{_ratio(r_new, p_new):.2f}"
        cause = causes.get(key, "")
        if cause:
            a, b = f"**{a}**", f"**{b}**"
        lines.append(
            f"| {key} | {format_time(r_old['seconds'])} | {format_time(r_new['seconds'])} "
            f"| {a} | {b} | {_temp(r_old, p_old)} | {_temp(r_new, p_new)} | {cause} |"
        )
    return [*lines, ""]
