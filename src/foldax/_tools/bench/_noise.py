"""How far a ``foldax bench`` figure can be trusted: each row records the spread of its timed
runs (the fastest and slowest beside the median) and the machine's load average when it was
measured; a ratio whose two ways' spreads overlap is within noise, and a row measured while the
load average exceeded the cores was measured on a busy machine.

Results saved without these fields (by an older ``foldax bench``) carry no marks: every
function here treats a missing field as "not recorded", never as "quiet"."""

from __future__ import annotations

import os

from ._config import format_time


def load_average() -> float | None:
    """The 1-minute load average (runnable threads, the bench's own included), if the system
    reports one."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):  # not on every platform
        return None


def conditions(seconds) -> dict:
    """The fields a row records beside its median ``seconds``: the spread of its runs where
    ``seconds`` carries one (a ``workloads.Timing``), the load average and whether it exceeded
    the cores (``busy``)."""
    out = dict(seconds.spread()) if hasattr(seconds, "spread") else {}
    load = load_average()
    if load is not None:
        out["load"] = load
        out["busy"] = load > (os.cpu_count() or 1)
    return out


def results_load(start: float | None, cores: int | None) -> dict:
    """The run's load record: the 1-minute load average at its start and at its end."""
    return {"start": start, "end": load_average(), "cores": cores}


def overlaps(a: dict, b: dict) -> bool:
    """Whether the spreads of two rows' runs overlap (False where either has none)."""
    if a is b or "seconds_min" not in a or "seconds_min" not in b:
        return False
    return a["seconds_min"] <= b["seconds_max"] and b["seconds_min"] <= a["seconds_max"]


def marks(a: dict, b: dict | None = None) -> list[str]:
    """The reasons to doubt ``a``'s time (or its ratio to ``b``'s): ``within noise`` where the
    two spreads overlap, ``busy machine`` where either was measured at a load above the cores."""
    out = []
    if b is not None and overlaps(a, b):
        out.append("within noise")
    if a.get("busy") or (b is not None and b.get("busy")):
        out.append("busy machine")
    return out


def mark_text(a: dict, b: dict | None = None) -> str:
    """``marks`` as a cell's suffix: ``" (within noise; busy machine)"``, or ``""``."""
    m = marks(a, b)
    return f" ({'; '.join(m)})" if m else ""


def spread_text(r: dict) -> str:
    """``" (min – max)"`` of a row's runs, or ``""`` where it records none."""
    if "seconds_min" not in r or r["seconds_min"] is None:
        return ""
    return f" ({format_time(r['seconds_min'])} – {format_time(r['seconds_max'])})"


def recorded(results: dict) -> bool:
    """Whether ``results`` records spreads or load (a run of this version of the bench)."""
    return "load" in results or any(
        "seconds_min" in r or "load" in r for rows in results["workloads"].values() for r in rows
    )


def legend(results: dict) -> list[str]:
    """BENCHMARKS.md's sentences on the noise of ``results`` (none for results that record
    none)."""
    if not recorded(results):
        return []
    load = results.get("load") or {}
    where = ""
    if load.get("start") is not None and load.get("end") is not None:
        where = (
            f" The 1-minute load average was {load['start']:.2f} when the run started and "
            f"{load['end']:.2f} when it ended, on {load['cores']} cores."
        )
    return [
        "Beside each median, in brackets, the fastest and the slowest of its runs. A ratio marked "
        "*within noise* compares two ways whose ranges overlap: the difference between them is "
        "smaller than the run-to-run spread, so it is not measured. A row marked *busy machine* "
        "was measured while the load average exceeded the cores (the bench's own threads count "
        "for at most the cores): another program took a share of the CPU, and its times may be "
        f"slow by that share.{where}",
        "",
    ]
