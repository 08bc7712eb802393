"""Measure how long the commands that the documentation quotes take; rewrite docs/timings.json.

Run from anywhere, with the checkout's virtual environment, one heavy job on the machine at a time:

    .venv/bin/python dev/timings/measure.py                          # every entry (half an hour on 2 CPU cores)
    .venv/bin/python dev/timings/measure.py --only examples/flax_s4.py   # one entry (repeatable)
    .venv/bin/python dev/timings/measure.py --skip "foldax demo s4"      # all but these (repeatable)
    .venv/bin/python dev/timings/measure.py --runs 3 --only KEY       # the fastest of 3 runs
    .venv/bin/python dev/timings/measure.py --busy --only KEY         # its time on a busy machine
    .venv/bin/python dev/timings/measure.py --list                   # keys, commands, the texts

docs/timings.json holds one entry per timed thing, keyed by a name: ``command`` (run from the
repository root; a leading ``python``, ``foldax`` or ``sphinx-build`` is the one next to the
Python running this script, and ``{tmp}`` is a fresh temporary folder), ``refs`` (the strings by
which the text names it; ``of`` and ``flag`` make it a variant of another entry, named by that
entry's ref followed by the flag, e.g. ``--smoke``), and what a measurement writes: ``seconds``
(wall time of one run, start-up included), ``cpu_seconds`` (its user and system time: far
less than the cores times ``seconds`` means it waited for other jobs), ``date`` and ``machine``
(cores, CPU, the load average before the run, versions), and ``runs`` when the time is the
fastest of several (``--runs``: on a machine shared with other jobs, the fastest run is the one
that waited least). ``busy`` holds the same fields for a run on a machine shared with other jobs
(``--busy``); an entry that has it is quoted as a range, quiet to busy (``dev/timings/rule.py``).
An entry with
``"manual": true`` is measured only when named with ``--only``. Each entry is written back as soon
as it is measured; a command that fails leaves its entry as it was and makes the exit status 1.

To time something new: add its entry (command and refs) by hand, run ``--only KEY``, then write
the text's quote as ``tests/test_timings.py`` says (the rule is ``dev/timings/rule.py``).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import resource
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rule import format_range, format_time

ROOT = Path(__file__).resolve().parents[2]
TIMINGS = ROOT / "docs" / "timings.json"
BIN = Path(sys.executable).parent
LOGS = Path(tempfile.gettempdir()) / "foldax-timings"


def load() -> dict:
    return json.loads(TIMINGS.read_text())


#: The order an entry's fields are written in.
ORDER = ("command", "refs", "of", "flag", "manual", "seconds", "cpu_seconds", "runs", "date")


def save(data: dict) -> None:
    rank = {f: i for i, f in enumerate(ORDER)}
    for key, e in data["entries"].items():
        data["entries"][key] = dict(sorted(e.items(), key=lambda kv: rank.get(kv[0], len(rank))))
    TIMINGS.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    try:
        jax = importlib.metadata.version("jax")
    except importlib.metadata.PackageNotFoundError:
        jax = "not installed"
    return {
        "cpus": os.cpu_count(),
        "cpu": cpu_name(),
        "load_1min_before": round(os.getloadavg()[0], 2),
        "software": f"jax {jax}, Python {platform.python_version()}",
    }


def argv_of(command: str, tmp: str) -> list[str]:
    """The command as run: ``{tmp}`` filled in, its program taken from this environment."""
    argv = [a.replace("{tmp}", tmp) for a in shlex.split(command)]
    local = BIN / argv[0]
    if argv[0] == "python":
        argv[0] = sys.executable
    elif local.exists():
        argv[0] = str(local)
    return argv


def cpu_seconds() -> float:
    """User and system time of the waited-for children so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def measure(key: str, entry: dict) -> tuple[float, float] | None:
    """One run of the entry's command from the repository root: its wall and CPU seconds (None
    if it failed)."""
    tmp = tempfile.mkdtemp(prefix="foldax-timing-")
    LOGS.mkdir(exist_ok=True)
    log = LOGS / (key.replace("/", "_").replace(" ", "_") + ".log")
    try:
        argv = argv_of(entry["command"], tmp)
        with log.open("w") as out:
            c0, t0 = cpu_seconds(), time.perf_counter()
            proc = subprocess.run(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, check=False)
            seconds, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if proc.returncode != 0:
        tail = log.read_text()[-2000:]
        print(f"  FAILED (exit {proc.returncode}), output in {log}:\n{tail}", flush=True)
        return None
    return seconds, cpu


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", action="append", metavar="KEY", help="measure this entry")
    p.add_argument("--skip", action="append", default=[], metavar="KEY", help="leave it out")
    p.add_argument("--runs", type=int, default=1, help="run each N times, keep the fastest")
    p.add_argument(
        "--busy",
        action="store_true",
        help="record the runs as the entry's time on a busy machine (its range's upper end)",
    )
    p.add_argument("--list", action="store_true", help="print the entries, measure nothing")
    args = p.parse_args(argv)
    data = load()
    entries = data["entries"]
    for key in [*(args.only or []), *args.skip]:
        if key not in entries:
            p.error(f"no entry {key!r} in docs/timings.json (keys: {', '.join(entries)})")
    if args.list:
        for key, e in entries.items():
            said = format_time(e["seconds"]) if "seconds" in e else "not measured"
            if "busy" in e and "seconds" in e:
                said = format_range(e["seconds"], e["busy"]["seconds"])
            print(f"{key}: {e['command']}  [{said}]  refs {e['refs']}")
        return 0
    if args.only:
        keys = [k for k in entries if k in args.only]
    else:
        keys = [k for k in entries if not entries[k].get("manual")]
    keys = [k for k in keys if k not in args.skip]
    failed = []
    for i, key in enumerate(keys, 1):
        print(f"[{i}/{len(keys)}] {key}: {entries[key]['command']}", flush=True)
        where = machine()
        took = [measure(key, entries[key]) for _ in range(args.runs)]
        if None in took:
            failed.append(key)
            continue
        seconds, cpu = min(took)
        data = load()  # written back entry by entry: keep edits made meanwhile
        entry = data["entries"][key]
        if args.busy:
            entry = entry.setdefault("busy", {})
        entry.pop("runs", None)
        if args.runs > 1:
            entry["runs"] = args.runs
        entry.update(
            seconds=round(seconds, 1),
            cpu_seconds=round(cpu, 1),
            date=datetime.date.today().isoformat(),
            machine=where,
        )
        save(data)
        print(f"  {seconds:.1f} s ({cpu:.1f} s CPU): {format_time(seconds)}", flush=True)
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
