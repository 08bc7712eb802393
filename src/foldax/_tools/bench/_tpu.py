"""BENCHMARKS.md's section for a run on a TPU (``bench/tpu.json``, written by
``dev/tpu/run.py`` on the TPU): every way of each workload, with its time relative to the way a
TPU user calls instead."""

from __future__ import annotations

TPU_FILE = "tpu.json"
#: the way each workload is compared with, first found
PEERS = ("splash", "plain", "lax.map", "jax.nn", "jax.ops", "global-max segment_sum", "broadcast")


def _ratio(row, way):
    peer = next((p for p in PEERS if "ms" in row.get(p, {})), None)
    if peer is None or "ms" not in row[way]:
        return ""
    return f"{row[way]['ms'] / row[peer]['ms']:.2f} of {peer}"


def _cell(way):
    if "ms" not in way:
        return "| error | | |"
    return f"| {way['ms']:.2f} ms | {way['first_s']:.1f} s | {way['temp_mib']:.1f} MiB |"


def _ways(row):
    """A row's ways and their figures (its other entries, errors against a reference or
    checks of the results, are not ways)."""
    return [(w, f) for w, f in row.items() if isinstance(f, dict) and ("ms" in f or "error" in f)]


def _table(rows) -> list[str]:
    lines = [
        "| workload | way | median time | first call | temp | time relative to |",
        "|---|---|---:|---:|---:|---|",
    ]
    for row in rows:
        for way, fig in _ways(row):
            lines.append(f"| {row['name']} | {way} {_cell(fig)} {_ratio(row, way)} |")
    return lines


def _made_by(run) -> str:
    return (
        f"`{run['command']}` on {run['date']} ({run['device']}, jax {run['jax']}, "
        f"{run['libtpu']}), every way in one process, median of 7 jitted calls after a warm-up; "
        "temp is XLA's `temp_size_in_bytes`."
    )


def tpu_section(tpu: dict) -> list[str]:
    """The markdown lines of the TPU run ``tpu`` (its ``rows``, ``device``, ``jax``,
    ``libtpu``, ``command``, ``date``), and of the runs in its ``more`` (each alike)."""
    lines = [
        f"## On one TPU ({tpu['device']})",
        "",
        _made_by(tpu) + " `foldax` takes its Pallas kernels there, "
        '`foldax_xla` the XLA fold (`implementation="xla"`). What each way is, and what the '
        "figures mean: the page *On a TPU* of the docs (`docs/tpu.md`).",
        "",
        *_table(tpu["rows"]),
    ]
    for run in tpu.get("more", ()):
        lines += ["", _made_by(run), "", *_table(run["rows"])]
    return [*lines, ""]
