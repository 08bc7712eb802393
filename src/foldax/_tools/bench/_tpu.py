"""BENCHMARKS.md's section for a run on a TPU (``bench/tpu.json``, written by
``dev/tpu/run.py`` on the TPU): every way of each workload, with its time relative to the way a
TPU user calls instead."""

from __future__ import annotations

TPU_FILE = "tpu.json"
#: the way each workload is compared with, first found
PEERS = ("splash", "plain", "lax.map", "jax.nn")


def _ratio(row, way):
    peer = next((p for p in PEERS if "ms" in row.get(p, {})), None)
    if peer is None or "ms" not in row[way]:
        return ""
    return f"{row[way]['ms'] / row[peer]['ms']:.2f} of {peer}"


def _cell(way):
    if "ms" not in way:
        return "| error | | |"
    return f"| {way['ms']:.2f} ms | {way['first_s']:.1f} s | {way['temp_mib']:.1f} MiB |"


def tpu_section(tpu: dict) -> list[str]:
    """The markdown lines of the TPU run ``tpu`` (its ``rows``, ``device``, ``jax``,
    ``libtpu``, ``command``, ``date``)."""
    lines = [
        f"## On one TPU ({tpu['device']})",
        "",
        f"`{tpu['command']}` on {tpu['date']} ({tpu['device']}, jax {tpu['jax']}, "
        f"{tpu['libtpu']}), every way in one process, median of 7 jitted calls after a warm-up; "
        "temp is XLA's `temp_size_in_bytes`. `foldax` takes its Pallas kernels there, "
        '`foldax_xla` the XLA fold (`implementation="xla"`). What each way is, and what the '
        "figures mean: the page *On a TPU* of the docs (`docs/tpu.md`).",
        "",
        "| workload | way | median time | first call | temp | time relative to |",
        "|---|---|---:|---:|---:|---|",
    ]
    for row in tpu["rows"]:
        for way, fig in row.items():
            if way != "name":
                lines.append(f"| {row['name']} | {way} {_cell(fig)} {_ratio(row, way)} |")
    return [*lines, ""]
