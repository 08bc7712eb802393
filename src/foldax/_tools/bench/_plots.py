"""The plots of ``foldax bench``, drawn from the results (a run's, or any saved
``results.json``): temp memory against N and foldax's time relative to each other way.

What each plot shows is worked out first (:func:`memory_series`, :func:`ratio_bars`: plain
data, testable without matplotlib), then drawn. A zero on a log axis cannot be drawn: zero-byte
points are left out and named in a note under the plot. A floor (a lower bound measured in the
same run, not a competitor) is drawn as a floor: a marker, never a "foldax is slower" bar."""

from __future__ import annotations

import os

from . import _noise

#: The memory plot's panels: (workload, key of N, title)
MEMORY_PANELS = (
    ("seed", "n", "ragged logsumexp under vmap (rows N)"),
    ("s4", "n", "S4 Cauchy (poles N)"),
)
#: The workloads of the time-ratio plot, and foldax's names in them
RATIO_WORKLOADS = ("seed", "precomputed", "s4", "gaussian", "nearest", "attention")
FOLDAX = ("foldax", "foldax.cauchy")
#: The kinds of bar of the time-ratio plot: colour and legend
KINDS = {
    "faster": ("tab:green", "foldax faster"),
    "slower": ("tab:red", "foldax slower"),
    "noise": ("tab:gray", "within noise (the two ways' runs overlap)"),
    "floor": ("k", "foldax over a floor (a lower bound, not a competitor)"),
}


BUSY = "measured on a busy machine (load average above the cores)"


def is_floor(impl: str) -> bool:
    """Whether a row is a floor (``floor: jnp.exp(x).sum()``, ``floor``, ``GEMM floor``)."""
    return impl.startswith("floor") or impl.endswith("floor")


def memory_series(results: dict, workload: str, xkey: str = "n"):
    """``({label: [(N, bytes), ...]}, [not drawn, ...])``: each way and pass's temp bytes
    against N, without the zero (and missing) values a log axis cannot show, and a note
    naming each zero left out."""
    rows = results["workloads"].get(workload, [])
    series, dropped = {}, []
    for impl in dict.fromkeys(r["impl"] for r in rows):
        for p in ("forward", "gradient"):
            mine = [r for r in rows if r["impl"] == impl and r["pass"] == p and xkey in r]
            pts = sorted((r[xkey], r["temp_bytes"]) for r in mine if r["temp_bytes"])
            zeros = sorted(r[xkey] for r in mine if r["temp_bytes"] == 0)
            if pts:
                series[f"{impl} ({p})"] = pts
            if zeros:
                dropped.append(f"{impl} ({p}) at N = {', '.join(f'{n:,}' for n in zeros)}")
    return series, dropped


def ratio_bars(results: dict) -> list[dict]:
    """One entry per other way of each case and pass of ``RATIO_WORKLOADS``: ``label``,
    ``ratio`` (foldax's median time over the other's), ``low`` and ``high`` (the ratio's range
    over the runs' spreads, or None), ``kind`` (a key of ``KINDS``) and ``busy`` (measured on a
    busy machine: the bar is hatched)."""
    bars = []
    for wl in RATIO_WORKLOADS:
        rows = results["workloads"].get(wl, [])
        for r in rows:
            if r["impl"] in FOLDAX or not r["seconds"]:
                continue
            f = next(
                (
                    x
                    for x in rows
                    if x["case"] == r["case"] and x["pass"] == r["pass"] and x["impl"] in FOLDAX
                ),
                None,
            )
            if f is None:
                continue
            ratio = f["seconds"] / r["seconds"]
            if is_floor(r["impl"]):
                kind = "floor"
            elif _noise.overlaps(f, r):
                kind = "noise"
            else:
                kind = "faster" if ratio <= 1 else "slower"
            spread = "seconds_min" in f and "seconds_min" in r and r["seconds_min"] > 0
            name = {"seed": "ragged logsumexp"}.get(wl, wl)
            busy = "busy machine" in _noise.marks(f, r)
            bars.append(
                {
                    "label": f"{name} {r['case']}, {r['pass']}: {r['impl']}"
                    + (" (busy machine)" if busy else ""),
                    "busy": busy,
                    "ratio": ratio,
                    "low": f["seconds_min"] / r["seconds_max"] if spread else None,
                    "high": f["seconds_max"] / r["seconds_min"] if spread else None,
                    "kind": kind,
                }
            )
    return bars


def plots(results: dict, out_dir: str) -> list[str]:
    """Temp memory against N (log-log) and time ratios against each other way; the file
    names written into ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return [_memory_plot(plt, results, out_dir), _ratio_plot(plt, results, out_dir)]


def _memory_plot(plt, results: dict, out_dir: str) -> str:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (wl, xkey, title) in zip(axes, MEMORY_PANELS, strict=True):
        series, dropped = memory_series(results, wl, xkey)
        for label, pts in series.items():
            style = "s--" if label.endswith("(gradient)") else "o-"
            ax.loglog(*zip(*pts, strict=True), style, label=label)
        ax.set(title=title, xlabel="N", ylabel="XLA temp bytes")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
        if dropped:
            note = "Not drawn: 0 bytes (no temp buffer; a log axis has no 0): " + "; ".join(dropped)
            ax.text(0, -0.16, note, transform=ax.transAxes, fontsize=6, va="top", wrap=True)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "memory_vs_n.png"), dpi=110, bbox_inches="tight")
    plt.close(fig)
    return "memory_vs_n.png"


def _ratio_plot(plt, results: dict, out_dir: str) -> str:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    bars = ratio_bars(results)
    fig, ax = plt.subplots(figsize=(11, 0.25 * len(bars) + 1.6))
    ys = range(len(bars))
    for y, b in zip(ys, bars, strict=True):
        colour = KINDS[b["kind"]][0]
        if b["kind"] == "floor":  # a marker at the ratio: no bar from 1 to it
            ax.plot([b["ratio"]], [y], "D", color=colour, ms=4)
        else:
            ax.barh([y], [b["ratio"]], color=colour, hatch="///" if b["busy"] else None)
        if b["low"] is not None:
            xerr = [[b["ratio"] - b["low"]], [b["high"] - b["ratio"]]]
            ax.errorbar([b["ratio"]], [y], xerr=xerr, fmt="none", ecolor="k", lw=0.6, capsize=2)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(list(ys), [b["label"] for b in bars], fontsize=6)
    ax.set_xscale("log")
    whiskers = any(b["low"] is not None for b in bars)
    ax.set_xlabel(
        "foldax time relative to the other way's (< 1: foldax is faster)"
        + ("; whiskers: its range over the runs" if whiskers else "")
    )
    kinds = dict.fromkeys(b["kind"] for b in bars)
    handles = [
        Line2D([], [], marker="D", ls="", color=KINDS[k][0], label=KINDS[k][1])
        if k == "floor"
        else Patch(color=KINDS[k][0], label=KINDS[k][1])
        for k in KINDS
        if k in kinds
    ]
    if any(b["busy"] for b in bars):
        handles.append(Patch(facecolor="w", edgecolor="k", hatch="///", label=BUSY))
    if handles:
        ax.legend(handles=handles, fontsize=6, loc="lower right")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "time_ratios.png"), dpi=110, bbox_inches="tight")
    plt.close(fig)
    return "time_ratios.png"
