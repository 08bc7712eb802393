"""Rendering ``results.json`` (and nothing else) as text: the tables of ``BENCHMARKS.md``,
the README's results block with its headline rows, and the terminal tables of a run."""

from __future__ import annotations

from ..._memory import format_bytes
from ..._table import table
from . import _noise
from ._config import (
    BASELINE,
    PLOT_DIR,
    README_END,
    README_START,
    WORKLOADS,
    format_time,
    machine_line,
)
from ._texts import NOISE_NOTE, NOTES, QUICK_NOTE, TITLES
from ._tpu import tpu_section
from ._versions import versions_section


def _fmt_err(e):
    return "n/a" if e is None else f"{e:.1e}"


def noise_summary(results: dict) -> list[str]:
    """The lines a run prints last: how many ratios are within noise and how many rows were
    measured on a busy machine, and, for a quick run, that its sizes are not a full run's."""
    noisy = busy = total = 0
    for name, rows in results["workloads"].items():
        for r in rows:
            b = _base(rows, r, r.get("baseline", BASELINE[name]))
            total += 1
            busy += bool(r.get("busy"))
            noisy += b is not None and _noise.overlaps(r, b)
    load = results.get("load") or {}
    when = ""
    if load.get("start") is not None and load.get("end") is not None:
        when = f": {load['start']:.2f} at the start, {load['end']:.2f} at the end"
    lines = [
        f"noise: {noisy} of {total} rows are within noise of their baseline (the ranges of "
        f"their runs overlap); {busy} were measured on a busy machine (1-minute load average "
        f"above the {load.get('cores', '?')} cores{when})"
    ]
    if results.get("quick"):
        lines.append(QUICK_NOTE.replace("`", ""))
    return lines


def _base(rows, r, baseline):
    for b in rows:
        if b["case"] == r["case"] and b["pass"] == r["pass"] and b["impl"] == baseline:
            return b
    return None


def _ratio_cell(r, b):
    """A table's ratio cell: ``r``'s time over its baseline ``b``'s, with the noise marks."""
    if b is None or not b["seconds"]:
        return "n/a" + _noise.mark_text(r)
    return f"{r['seconds'] / b['seconds']:.2f}" + _noise.mark_text(r, b)


def _time_cell(r):
    """A table's median time, with the fastest and slowest run where the row records them."""
    return format_time(r["seconds"]) + _noise.spread_text(r)


def _fmt_num(x, fmt):
    return "n/a" if x is None else format(x, fmt)


#: The lm_loss workload's columns beside the usual ones: (header, cell of a row)
LM_COLUMNS = (
    ("grad max rel err", lambda r: _fmt_err(r["grad_rel_err"])),
    ("GEMM floor / time", lambda r: _fmt_num(r["floor_fraction"], ".2f")),
    ("compile", lambda r: format_time(r["compile_seconds"])),
)


def workload_table(results: dict, name: str) -> list[str]:
    rows = results["workloads"][name]
    base_name = BASELINE[name]
    extra = name == "sharded"
    lm = name == "lm_loss"
    head = (
        f"| case | implementation | pass | XLA temp | median time | time relative to {base_name} |"
    )
    head += " arguments / device | all-gather |" if extra else " max rel err vs float64 |"
    sep = "|---|---|---|---:|---:|---:|" + ("---:|---|" if extra else "---:|")
    if lm:
        head += "".join(f" {h} |" for h, _ in LM_COLUMNS)
        sep += "---:|" * len(LM_COLUMNS)
    lines = [head, sep]
    for r in rows:
        b = _base(rows, r, r.get("baseline", base_name))
        ratio = _ratio_cell(r, b)
        temp = "n/a" if r["temp_bytes"] is None else format_bytes(r["temp_bytes"])
        tail = (
            f" {format_bytes(r['argument_bytes'])} | {'yes' if r['all_gather'] else 'no'} |"
            if extra
            else f" {_fmt_err(r['rel_err'])} |"
        )
        if lm:
            tail += "".join(f" {cell(r)} |" for _, cell in LM_COLUMNS)
        lines.append(
            f"| {r['case']} | {r['impl']} | {r['pass']} | {temp} | {_time_cell(r)} | {ratio} |"
            + tail
        )
    return lines


def _pick(results, workload, impl, pass_, case=None):
    for r in results["workloads"].get(workload, []):
        if r["impl"] == impl and r["pass"] == pass_ and (case is None or r["case"] == case):
            return r
    return None


def _vs_bytes(a, b):
    """``a``'s temp bytes vs ``b``'s, formatted."""
    return f"{format_bytes(a['temp_bytes'])} vs {format_bytes(b['temp_bytes'])}"


def _ratio(a, b):
    """``a``'s time relative to ``b``'s, formatted, with the noise marks (``_noise.marks``)."""
    return f"{a['seconds'] / b['seconds']:.2f}x" + _noise.mark_text(a, b)


def headlines(results: dict) -> list[tuple[str, str, str]]:
    """``(claim, memory, time)`` rows for the README, each from the JSON."""
    return [
        *_seed_headlines(results),
        *_likelihood_headlines(results),
        *_precomputed_headlines(results),
        *_graph_headlines(results),
        *_s4_headlines(results),
        *_kernel_headlines(results),
        *_attention_headlines(results),
        *_packed_headlines(results),
        *_overhead_headlines(results),
        *_sharded_headlines(results),
        *_keops_headlines(results),
        *_lm_loss_headlines(results),
    ]


def _seed_headlines(results: dict) -> list[tuple[str, str, str]]:
    """The ragged logsumexp under vmap, per case and pass: foldax vs global-max segment_sum."""
    out = []
    seed_cases = sorted(
        {r["case"] for r in results["workloads"].get("seed", [])},
        key=lambda c: int(c.split("=")[1].replace(",", "")),
    )
    for case in seed_cases:
        for p in ("forward", "gradient"):
            b = _pick(results, "seed", "global-max segment_sum", p, case)
            f = _pick(results, "seed", "foldax", p, case)
            if b and f:
                out.append(
                    (
                        f"ragged logsumexp under vmap, {case}, {p}: foldax vs global-max segment_sum",
                        f"{_vs_bytes(f, b)} ({b['temp_bytes'] / f['temp_bytes']:.0f}x less)",
                        _ratio(f, b),
                    )
                )
    return out


def _likelihood_headlines(results: dict) -> list[tuple[str, str, str]]:
    """The likelihood with a pair of row arrays, per pass: foldax vs pad-and-scan."""
    out = []
    for p in ("forward", "gradient"):
        b = _pick(results, "likelihood", "pad-and-scan", p)
        f = _pick(results, "likelihood", "foldax", p)
        if b and f:
            claim = f"ragged likelihood, x and log_prior as two row arrays ({f['case']}), {p}"
            out.append((f"{claim}: foldax vs pad-and-scan", _vs_bytes(f, b), _ratio(f, b)))
    return out


def _precomputed_headlines(results: dict) -> list[tuple[str, str, str]]:
    """Segment logsumexp of precomputed values: each way's time relative to the floor's."""
    out = []
    pre = results["workloads"].get("precomputed", [])
    if pre:
        fl = _pick(results, "precomputed", "floor: jnp.exp(x).sum()", "forward")
        for impl in (
            "foldax",
            "jax.ops segment_max + segment_sum",
            "torch.segment_reduce max + sum",
        ):
            r = _pick(results, "precomputed", impl, "forward")
            if r:
                out.append(
                    (
                        f"precomputed segment logsumexp ({r['case']}): {impl} vs the `jnp.exp(x).sum()` floor",
                        "",
                        f"{_ratio(r, fl)} (of the floor)",
                    )
                )
    return out


def _per_case_headlines(results: dict, workload: str, claim) -> list[tuple[str, str, str]]:
    """foldax against the workload's baseline in every case and pass; ``claim(row)`` names it."""
    out = []
    for f in results["workloads"].get(workload, []):
        b = _pick(results, workload, BASELINE[workload], f["pass"], f["case"])
        if f["impl"] == "foldax" and b:
            out.append((f"{claim(f)}: foldax vs {b['impl']}", _vs_bytes(f, b), _ratio(f, b)))
    return out


def _graph_headlines(results: dict) -> list[tuple[str, str, str]]:
    """A graph network's message reductions, per case and pass: foldax vs the jax.ops way."""
    return _per_case_headlines(
        results,
        "graph",
        lambda f: f"graph, {f['edges']:,} edges -> {f['nodes']:,} nodes, {f['case']}, {f['pass']}",
    )


def _packed_headlines(results: dict) -> list[tuple[str, str, str]]:
    """Packed causal attention, per length and pass: foldax vs jax.nn with the same mask."""
    return _per_case_headlines(
        results, "packed", lambda f: f"packed causal attention, {f['case']}, {f['pass']}"
    )


def _s4_headlines(results: dict) -> list[tuple[str, str, str]]:
    """S4's Cauchy kernel at the largest N, per pass: foldax vs naive broadcast."""
    out = []
    s4 = results["workloads"].get("s4", [])
    if s4:
        top = max(r["n"] for r in s4)
        for p in ("forward", "gradient"):
            b = _pick(results, "s4", "naive broadcast", p, f"N = {top}")
            f = _pick(results, "s4", "foldax.cauchy", p, f"N = {top}")
            out.append(
                (
                    f"S4 Cauchy, H = {f['h']}, L = {f['length']}, N = {top}, {p}: foldax vs naive broadcast",
                    _vs_bytes(f, b),
                    _ratio(f, b),
                )
            )
    return out


def _kmin_reductions(results: dict) -> list[str]:
    """The nearest workload's k-min reductions ("kmin, k = 5", ...), by k."""
    reds = {r.get("reduction", "") for r in results["workloads"].get("nearest", [])}
    return sorted((r for r in reds if r.startswith("kmin")), key=lambda r: int(r.split("=")[1]))


def _kernel_headlines(results: dict) -> list[tuple[str, str, str]]:
    """The Gaussian kernel and nearest-neighbour reductions: foldax vs each other way."""
    out = []
    for wl, red in (
        ("gaussian", "sum"),
        ("gaussian", "logsumexp"),
        ("nearest", "min"),
        ("nearest", "argmin"),
        *(("nearest", r) for r in _kmin_reductions(results)),
    ):
        rows = [r for r in results["workloads"].get(wl, []) if r.get("reduction") == red]
        f = next((r for r in rows if r["impl"] == "foldax"), None)
        for r in rows:
            if f and r["impl"] != "foldax":
                mem = "" if r["temp_bytes"] is None else _vs_bytes(f, r)
                if r["temp_bytes"] == 0:
                    mem += " (XLA fuses this dense sum: no N x M buffer either)"
                out.append(
                    (
                        f"{'Gaussian kernel' if wl == 'gaussian' else 'nearest'} {r['case']}: foldax vs {r['impl']}",
                        mem,
                        _ratio(f, r),
                    )
                )
    return out


def _attention_headlines(results: dict) -> list[tuple[str, str, str]]:
    """Exact attention: foldax vs jax.nn.dot_product_attention per pass, then each masked
    foldax forward vs the unmasked one."""
    out = []
    for p in ("forward", "gradient"):
        b = _pick(results, "attention", "jax.nn.dot_product_attention", p)
        f = _pick(results, "attention", "foldax", p)
        if b and f:
            out.append(
                (
                    f"attention {f['case']}, {p}: foldax vs jax.nn.dot_product_attention",
                    _vs_bytes(f, b),
                    _ratio(f, b),
                )
            )
    plain = _pick(results, "attention", "foldax", "forward")
    for r in results["workloads"].get("attention", []):
        if plain and r["impl"] == "foldax" and r["pass"] == "forward" and r is not plain:
            out.append(
                (
                    f"attention {r['case']}, forward: foldax masked vs foldax unmasked",
                    _vs_bytes(r, plain),
                    _ratio(r, plain),
                )
            )
    return out


def _sharded_headlines(results: dict) -> list[tuple[str, str, str]]:
    """The ragged logsumexp on several host devices vs one, per pass (per-device memory)."""
    out = []
    for p in ("forward", "gradient"):
        one = _pick(results, "sharded", "1 device(s)", p)
        eight = next(
            (
                r
                for r in results["workloads"].get("sharded", [])
                if r["pass"] == p and r["devices"] > 1
            ),
            None,
        )
        if one and eight:
            out.append(
                (
                    f"ragged logsumexp {one['case']} on {eight['devices']} host devices, {p} (per device)",
                    f"arguments {format_bytes(eight['argument_bytes'])} vs {format_bytes(one['argument_bytes'])}, temp {_vs_bytes(eight, one)}",
                    _ratio(eight, one),
                )
            )
    return out


def _keops_headlines(results: dict) -> list[tuple[str, str, str]]:
    """What KeOps' users write: foldax vs pykeops per case, then foldax vs the machine's floor
    for the Gaussian kernel sum."""
    out = []
    rows = results["workloads"].get("keops_users", [])
    for f in rows:
        b = _base(rows, f, f.get("baseline", BASELINE["keops_users"]))
        if f["impl"] == "foldax" and b and b["seconds"]:
            what = f["case"].split(";")[0]
            ratio = _ratio(f, b) + (" (of the floor)" if b["impl"] == "floor" else "")
            out.append((f"{what}, {f['pass']}: foldax vs {b['impl']}", "", ratio))
    return out


def _lm_loss_headlines(results: dict) -> list[tuple[str, str, str]]:
    """A language model's loss, per case and pass: foldax vs each other way (not the floor),
    with foldax's share of the GEMM floor."""
    out = []
    rows = results["workloads"].get("lm_loss", [])
    for f in rows:
        if f["impl"] != "foldax":
            continue
        for r in rows:
            same = r["case"] == f["case"] and r["pass"] == f["pass"]
            if same and r["impl"] not in ("foldax", "GEMM floor") and r["seconds"]:
                what = f["case"].split(";")[0]
                out.append(
                    (
                        f"LM loss (linear cross-entropy) {what}, {f['pass']}: foldax vs {r['impl']}",
                        _vs_bytes(f, r),
                        f"{_ratio(f, r)} (GEMM floor / foldax's time: {f['floor_fraction']:.2f})",
                    )
                )
    return out


def _overhead_headlines(results: dict) -> list[tuple[str, str, str]]:
    """The overhead rows a user meets first: eager and jitted calls of ``segment_sum``, an eager
    pairwise call, and the compile times of the nearest-neighbour and ragged programs."""
    rows = results["workloads"].get("overhead", [])
    out = []
    for r in rows:
        first = (r["case"].startswith("segment_sum") and r["pass"] != "compile") or (
            r["case"].startswith("pairwise") and r["pass"] == "eager call"
        )
        compile_only = r["case"].startswith(("nearest", "ragged")) and r["pass"] == "compile"
        if r["impl"] != "foldax" or not (first or compile_only):
            continue
        peer = _base(rows, r, BASELINE["overhead"])
        if peer and peer["seconds"]:
            secs = format_time(r["seconds"]) + " vs " + format_time(peer["seconds"])
            out.append(
                (
                    f"{r['pass']}: {r['case']}",
                    "",
                    f"{r['seconds'] / peer['seconds']:.2f}x ({secs})" + _noise.mark_text(r, peer),
                )
            )
    return out


def _merged_note(results: dict) -> str:
    """Which workloads a later run measured (``foldax bench --only ... --merge``), if any, and
    on which machine where it is not the first run's."""

    def where(r):
        m = r.get("machine")
        return f" ({machine_line(m)})" if m and m != results["machine"] else ""

    return "".join(
        f"; {', '.join(r['workloads'])} by `{r['command']}` on {r['date']}{where(r)}"
        for r in results.get("merged", [])
    )


def render_markdown(results: dict, versions: dict | None = None, tpu: dict | None = None) -> str:
    """BENCHMARKS.md: every workload of ``results``, then, given a ``jax-versions.json``
    (:mod:`._versions`), the headline workloads on the oldest and the newest JAX, and given a
    ``tpu.json`` (:mod:`._tpu`), the run on a TPU."""
    lines = [
        "# Benchmarks",
        "",
        f"Produced by `{results['command']}` on {results['date']}, from `{PLOT_DIR}/results.json`"
        f"{_merged_note(results)}.",
        f"Machine: {machine_line(results['machine'])}.",
        "",
        "Memory is XLA's compiled temp-buffer figure (`foldax.memory.report`; deterministic). Times "
        f"are medians of {results['repeats']} runs after a warm-up, each workload's in one run; "
        "every ratio compares numbers from the same run. Time ratios are time relative to the baseline "
        "named in each table (this way's median time / the baseline's): below 1 means faster than "
        "the baseline. Errors are max relative errors against float64 (complex128 for S4).",
        "",
        *_noise.legend(results),
        *([QUICK_NOTE, ""] if results.get("quick") else []),
    ]
    if results["skipped"]:
        lines += ["Skipped peers (not installed; the extra brings them):", ""]
        lines += [f"* {s['peer']}: `pip install -e '{s['extra']}'`" for s in results["skipped"]]
        lines.append("")
    for name in WORKLOADS:
        if name not in results["workloads"]:
            continue
        note = [NOTES[name], ""] if name in NOTES else []
        lines += [f"## {TITLES[name]}", "", *note, *workload_table(results, name), ""]
    if results.get("plots"):
        lines += ["## Plots", ""] + [f"![{p}]({PLOT_DIR}/{p})" for p in results["plots"]] + [""]
    if versions is not None:
        lines += versions_section(versions)
    if tpu is not None:
        lines += ["", *tpu_section(tpu)] if lines[-1] else tpu_section(tpu)
    return "\n".join(lines)


def render_readme_block(results: dict) -> str:
    lines = [
        README_START,
        f"Measured by `{results['command']}` on {results['date']} "
        f"({machine_line(results['machine'])}){_merged_note(results)}; "
        "every figure, with errors against float64, in [BENCHMARKS.md](BENCHMARKS.md).",
        "",
        *([QUICK_NOTE, ""] if results.get("quick") else []),
        *([NOISE_NOTE, ""] if _noise.recorded(results) else []),
        "| foldax vs | XLA temp memory | time relative to the other (< 1: foldax is faster) |",
        "|---|---|---|",
        *(f"| {c} | {m} | {t} |" for c, m, t in headlines(results)),
        "",
    ]
    if "time_ratios.png" in results.get("plots", []):
        lines += [f"![time ratios]({PLOT_DIR}/time_ratios.png)", ""]
    lines.append(README_END)
    return "\n".join(lines)


def terminal_table(results: dict, name: str) -> str:
    rows = results["workloads"][name]
    base_name = BASELINE[name]
    header = (
        "case",
        "implementation",
        "pass",
        "XLA temp",
        "median time",
        "fastest - slowest",
        f"time rel. to {base_name}",
        "rel err",
    )
    lm = name == "lm_loss"
    if lm:
        header += tuple(h for h, _ in LM_COLUMNS)
    cells = []
    for r in rows:
        b = _base(rows, r, r.get("baseline", base_name))
        cells.append(
            (
                r["case"],
                r["impl"],
                r["pass"],
                "n/a" if r["temp_bytes"] is None else format_bytes(r["temp_bytes"]),
                format_time(r["seconds"]),
                _noise.spread_text(r).strip(" ()") or "n/a",
                _ratio_cell(r, b),
                _fmt_err(r["rel_err"]),
                *((cell(r) for _, cell in LM_COLUMNS) if lm else ()),
            )
        )
    return table(cells, header)


def readme_block_of(text: str) -> str | None:
    if README_START not in text or README_END not in text:
        return None
    return README_START + text.split(README_START, 1)[1].split(README_END, 1)[0] + README_END
