"""The entry points of ``foldax bench``: ``run`` measures every workload, then ``write`` saves
``results.json``, the plots, ``BENCHMARKS.md`` and the README's results block; ``render``
rewrites the text from an existing ``results.json`` without running anything."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable

from ._config import (
    FULL,
    MATPLOTLIB,
    PEERS,
    PLOT_DIR,
    QUICK,
    README_END,
    README_START,
    TINY,
    TINY_ENV,
    WORKLOADS,
    Config,
    available,
    machine,
)
from ._graph import bench_graph, graph_cases
from ._keops import bench_keops_users
from ._lm_loss import bench_lm_loss
from ._measure import (
    LIKELIHOOD_WAYS,
    bench_attention,
    bench_gaussian,
    bench_likelihood,
    bench_nearest,
    bench_precomputed,
    bench_s4,
    bench_seed,
    bench_sharded,
)
from ._noise import load_average, results_load
from ._overhead import bench_overhead, overhead_steps
from ._packed import bench_packed
from ._plots import plots
from ._progress import Progress
from ._render import TITLES, noise_summary, render_markdown, render_readme_block, terminal_table
from ._tpu import TPU_FILE
from ._versions import VERSIONS_FILE


def _steps(cfg: Config, only) -> int:
    from .. import workloads as w

    count = {
        "seed": sum(2 * (len(w.WAYS) - (0 if loop else 1)) for _, _, loop in cfg.seed_cases),
        "likelihood": 2 * len(LIKELIHOOD_WAYS),
        "precomputed": 4,
        "graph": len(graph_cases(cfg)),
        "s4": len(cfg.s4_ns) * len(w.S4_WAYS) * 2,
        "gaussian": 6,
        "nearest": 2 * (2 + len(cfg.kmin_ks)),
        "attention": 6,
        "packed": 2 * len(cfg.packed),
        # each call at each size (eager, jitted, compile), then the compile-only cases
        "overhead": overhead_steps(cfg),
        "sharded": 1,
        # kernel matrix times V per R, k-NN in 3-D and 784-D, Chamfer: foldax and pykeops
        # (or its skip line) each; the floor: exp, multiply-add, foldax
        "keops_users": 2 * (len(cfg.keops_rs) + 2 + 1) + 3,
        # per case: the floor, then plain, foldax, tokamax and jax-cce (or their skip lines)
        # forward, and the four again value-and-grad
        "lm_loss": len(cfg.lm_cases) * (1 + 4 + 4),
    }
    return sum(count[k] for k in only)


BENCHES: dict[str, Callable[[Config, Progress], list[dict]]] = {
    "seed": bench_seed,
    "likelihood": bench_likelihood,
    "graph": bench_graph,
    "precomputed": bench_precomputed,
    "s4": bench_s4,
    "gaussian": bench_gaussian,
    "nearest": bench_nearest,
    "attention": bench_attention,
    "packed": bench_packed,
    "overhead": bench_overhead,
    "sharded": bench_sharded,
    "keops_users": bench_keops_users,
    "lm_loss": bench_lm_loss,
}


def run(
    quick: bool = False,
    only=None,
    out: str = ".",
    command: str | None = None,
    merge: bool = False,
) -> dict:
    """Run the benchmarks, write ``results.json``, plots, ``BENCHMARKS.md`` (and the README's
    results block if ``out/README.md`` has the markers). With ``merge``, the workloads run
    replace theirs in the existing ``out/bench/results.json`` and the others are kept (each
    workload's figures still come from one run). Returns the results."""
    cfg = FULL if not quick else TINY if os.environ.get(TINY_ENV) == "1" else QUICK
    names = list(WORKLOADS) if not only else list(only)
    for n in names:
        if n not in BENCHES:
            raise SystemExit(
                f"foldax bench: unknown workload {n!r}; choose from {', '.join(WORKLOADS)}"
            )
    command = command or "foldax bench" + (" --quick" if quick else "") + "".join(
        f" --only {n}" for n in (only or [])
    ) + (" --merge" if merge else "")
    previous = _previous(out, quick) if merge else None
    skipped = [{"peer": p, "extra": PEERS[p][1]} for p in PEERS if not available(p)]
    for s in skipped:
        later = "; foldax bench --render draws them later" if s["peer"] == MATPLOTLIB else ""
        print(
            f"skipped: {s['peer']} (not installed; pip install -e '{s['extra']}'){later}",
            file=sys.stderr,
        )
    prog = Progress(_steps(cfg, names))
    load = load_average()
    results = {
        "command": command,
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "quick": quick,
        "repeats": cfg.repeats,
        "config": dataclasses.asdict(cfg),
        "skipped": skipped,
        "workloads": {},
        "plots": [],
    }
    for name in names:
        results["workloads"][name] = BENCHES[name](cfg, prog)
        print(f"\n{TITLES[name]}\n{terminal_table(results, name)}\n", flush=True)
    results["load"] = results_load(load, os.cpu_count())
    print("\n".join(noise_summary(results)), flush=True)
    if previous is not None:
        results = _merged(previous, results, names)
    write(results, out)
    return results


def _previous(out: str, quick: bool) -> dict:
    """The results a ``merge`` run adds to (checked before anything is measured)."""
    path = os.path.join(out, PLOT_DIR, "results.json")
    if not os.path.isfile(path):
        raise SystemExit(f"foldax bench: --merge adds to {path}, which does not exist; run "
                         f"foldax bench --out {out} first")  # fmt: skip
    with open(path) as f:
        previous = json.load(f)
    if previous["quick"] != quick:
        kind = "quick" if previous["quick"] else "full"
        raise SystemExit(f"foldax bench: {path} holds a {kind} run; merge a run of the same "
                         f"sizes ({'with' if previous['quick'] else 'without'} --quick)")  # fmt: skip
    return previous


def _merged(previous: dict, results: dict, names) -> dict:
    """``previous`` with the workloads ``names`` of ``results`` in place of its own, and a
    record of the run that measured them."""
    merged = dict(previous)
    merged["workloads"] = {**previous["workloads"], **results["workloads"]}
    # each earlier run keeps the workloads this one does not replace (none left: dropped)
    runs = [
        {**r, "workloads": [w for w in r["workloads"] if w not in names]}
        for r in previous.get("merged", [])
        if not set(r["workloads"]) <= set(names)
    ]
    runs.append(
        {
            "command": results["command"],
            "date": results["date"],
            "workloads": names,
            "machine": results["machine"],
            "load": results["load"],
        }
    )
    merged["merged"] = runs
    merged["skipped"] = results["skipped"]
    return merged


def _draw(results: dict, plot_dir: str, say: bool = True) -> bool:
    """Draw the plots of ``results`` into ``plot_dir`` where matplotlib imports, and record
    them in ``results`` (no longer listing matplotlib as skipped); whether they were drawn.
    ``say``: where it does not import, say how to draw them."""
    if not available(MATPLOTLIB):
        if not say:  # a run has said so among its skipped peers
            return False
        extra = PEERS[MATPLOTLIB][1]
        print(f"plots: not drawn (matplotlib is not installed; pip install -e '{extra}' or "
              "pip install matplotlib, then foldax bench --render draws them from the saved "
              "results)", file=sys.stderr)  # fmt: skip
        return False
    results["plots"] = plots(results, plot_dir)
    results["skipped"] = [s for s in results.get("skipped", []) if s["peer"] != MATPLOTLIB]
    return True


def write(results: dict, out: str) -> None:
    plot_dir = os.path.join(out, PLOT_DIR)
    os.makedirs(plot_dir, exist_ok=True)
    _draw(results, plot_dir, say=False)
    with open(os.path.join(plot_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    _write_text(results, out)
    print(
        f"wrote {plot_dir}/results.json, {out}/BENCHMARKS.md"
        + (f", plots {results['plots']}" if results["plots"] else "")
    )


def _kept(out: str, name: str) -> dict | None:
    """A JSON kept beside ``results.json`` (``None`` where there is none)."""
    path = os.path.join(out, PLOT_DIR, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def _write_text(results: dict, out: str) -> None:
    # the headline workloads on two JAX versions, and a run on a TPU, are kept beside
    pair, tpu = _kept(out, VERSIONS_FILE), _kept(out, TPU_FILE)
    with open(os.path.join(out, "BENCHMARKS.md"), "w") as f:
        f.write(render_markdown(results, pair, tpu))
    readme = os.path.join(out, "README.md")
    if os.path.exists(readme):
        with open(readme) as f:
            text = f.read()
        if README_START in text and README_END in text:
            head, rest = text.split(README_START, 1)
            tail = rest.split(README_END, 1)[1]
            with open(readme, "w") as f:
                f.write(head + render_readme_block(results) + tail)


def render(out: str) -> list[str]:
    """Rewrite ``BENCHMARKS.md`` and the README block from ``out/bench/results.json`` (no runs),
    and draw the plots from it where matplotlib imports, whether or not it did when the results
    were measured (``results.json`` then records them). Returns the plots the text shows."""
    path = os.path.join(out, PLOT_DIR, "results.json")
    with open(path) as f:
        results = json.load(f)
    before = (results.get("plots", []), results.get("skipped", []))
    if _draw(results, os.path.dirname(path)):
        print(f"drew {', '.join(os.path.join(out, PLOT_DIR, p) for p in results['plots'])}")
        if (results["plots"], results["skipped"]) != before:
            with open(path, "w") as f:
                json.dump(results, f, indent=1)
    else:  # the plots drawn before, where they are still there
        results["plots"] = [
            p for p in results.get("plots", []) if os.path.isfile(os.path.join(out, PLOT_DIR, p))
        ]
    _write_text(results, out)
    return results["plots"]
