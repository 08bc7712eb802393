"""The foldax rows of two ``foldax bench`` runs side by side, with their peers: a markdown table
of times, time ratios (foldax / the workload's baseline) and temp memory, ratios that moved by
more than 10% marked ``**``.

    python dev/jax-versions/side_by_side.py OLD/bench/results.json NEW/bench/results.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

BASE = {"seed": "global-max segment_sum", "graph": "jax.ops (jraph's way)"}


def rows(path):
    out = {}
    for workload, found in json.loads(Path(path).read_text())["workloads"].items():
        for r in found:
            out[(workload, r["case"], r["impl"], r["pass"])] = r
    return out


def size(b):
    return "0 B" if b == 0 else f"{b / 1e6:.1f} MB" if b >= 1e6 else f"{b / 1e3:.1f} KB"


def time(s):
    return f"{s * 1e3:.1f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} µs"


def main(old_path, new_path):
    old, new = rows(old_path), rows(new_path)
    print(
        "| workload | case | pass | foldax, old | foldax, new | peer, old | peer, new "
        "| ratio, old | ratio, new | temp foldax / peer, old | temp foldax / peer, new |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---|---|")
    for key, f_old in old.items():
        workload, case, impl, pass_ = key
        peer = (workload, case, BASE.get(workload), pass_)
        if impl != "foldax" or key not in new or peer not in old or peer not in new:
            continue
        f_new, p_old, p_new = new[key], old[peer], new[peer]
        r_old = f_old["seconds"] / p_old["seconds"]
        r_new = f_new["seconds"] / p_new["seconds"]
        moved = " **" if abs(r_new / r_old - 1) > 0.10 else ""
        print(
            f"| {workload} | {case} | {pass_} | {time(f_old['seconds'])} "
            f"| {time(f_new['seconds'])} | {time(p_old['seconds'])} | {time(p_new['seconds'])} "
            f"| {r_old:.2f} | {r_new:.2f}{moved} "
            f"| {size(f_old['temp_bytes'])} / {size(p_old['temp_bytes'])} "
            f"| {size(f_new['temp_bytes'])} / {size(p_new['temp_bytes'])} |"
        )


if __name__ == "__main__":
    main(*sys.argv[1:3])
