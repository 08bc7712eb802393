"""The plots of ``foldax bench``, drawn from the results: temp memory against N and time
ratios against each peer."""

from __future__ import annotations

import os


def plots(results: dict, out_dir: str) -> list[str]:
    """Temp memory against N (log-log) and time ratios against each peer; file names written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (wl, xkey, title) in zip(
        axes,
        (("seed", "n", "ragged logsumexp under vmap (rows N)"), ("s4", "n", "S4 Cauchy (poles N)")),
        strict=True,
    ):
        rows = results["workloads"].get(wl, [])
        for impl in dict.fromkeys(r["impl"] for r in rows):
            for p, style in (("forward", "o-"), ("gradient", "s--")):
                pts = sorted(
                    (r[xkey], r["temp_bytes"]) for r in rows if r["impl"] == impl and r["pass"] == p
                )
                if len(pts) > 1:
                    ax.loglog(*zip(*pts, strict=True), style, label=f"{impl} ({p})")
        ax.set(title=title, xlabel="N", ylabel="XLA temp bytes")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "memory_vs_n.png"), dpi=110, bbox_inches="tight")
    plt.close(fig)
    written.append("memory_vs_n.png")

    labels, ratios = [], []
    for wl in ("seed", "precomputed", "s4", "gaussian", "nearest", "attention"):
        rows = results["workloads"].get(wl, [])
        for r in rows:
            if r["impl"] in ("foldax", "foldax.cauchy") or r["seconds"] is None:
                continue
            f = next(
                (
                    x
                    for x in rows
                    if x["case"] == r["case"]
                    and x["pass"] == r["pass"]
                    and x["impl"] in ("foldax", "foldax.cauchy")
                ),
                None,
            )
            if f:
                name = {"seed": "ragged logsumexp"}.get(wl, wl)
                labels.append(f"{name} {r['case']}, {r['pass']}: {r['impl']}")
                ratios.append(f["seconds"] / r["seconds"])
    fig, ax = plt.subplots(figsize=(11, 0.25 * len(labels) + 1.2))
    ax.barh(
        range(len(labels)), ratios, color=["tab:green" if q <= 1 else "tab:red" for q in ratios]
    )
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(range(len(labels)), labels, fontsize=6)
    ax.set_xscale("log")
    ax.set_xlabel("foldax time relative to the peer's (< 1: foldax is faster)")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "time_ratios.png"), dpi=110, bbox_inches="tight")
    plt.close(fig)
    written.append("time_ratios.png")
    return written
