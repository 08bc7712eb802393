"""Rendering ``results.json`` (and nothing else) as text: the tables of ``BENCHMARKS.md``,
the README's results block with its headline rows, and the terminal tables of a run."""

from __future__ import annotations

from ..._memory import format_bytes
from ..._table import table
from ._config import (
    BASELINE,
    PLOT_DIR,
    README_END,
    README_START,
    WORKLOADS,
    format_time,
    machine_line,
)
from ._versions import versions_section

TITLES = {
    "seed": "The ragged logsumexp under vmap: per-segment logsumexp(f(theta, x)) - log(size), "
    "vmapped over 10 theta",
    "likelihood": "The same likelihood with a pair of row arrays: per-segment "
    "logsumexp(f(theta, x) - log_prior) - log(size), vmapped over 10 theta",
    "precomputed": "Precomputed data: segment logsumexp of float32 values",
    "graph": "A graph network's messages, float32: E edges reduced to V receiver nodes",
    "s4": "S4's Cauchy kernel, complex64 (forward k = cauchy(v, z, w); gradient of sum |k|^2)",
    "gaussian": "Gaussian kernel, D = 3, float32",
    "nearest": "Nearest neighbours: squared distance, D = 3, float32 (min, argmin, k-min)",
    "attention": "Exact attention, float32 (pairwise_reduce softmax vs jax.nn.dot_product_attention)",
    "packed": "Packed-sequence causal attention, float32: 16 documents in one sequence, one head",
    "overhead": "What a call costs beside its work: eager call, jitted call and compile time",
    "sharded": "The ragged logsumexp on 8 host CPU devices (rows split over a mesh), per-device "
    "memory",
    "keops_users": "What KeOps' users write, float32 on CPU: kernel matrix times V, k-NN, "
    "Chamfer with its gradient, and the machine's floor",
}


NOTES = {
    "seed": "Ways: `slicing loop` (materialize f, one dynamic slice + logsumexp per segment; "
    "left out at N x 10, where its 1230 slices take minutes to compile), `global-max "
    "segment_sum` (the usual stable way: one global max, then `jax.ops.segment_sum` of exp), "
    "`pad-and-scan` (pad every segment to the largest, `lax.scan` over segments with a masked "
    "logsumexp), `foldax` "
    "(`segment_logsumexp(x, sizes=..., fn=model)`). Gradient: of the per-segment sum with "
    "respect to theta.",
    "likelihood": "The rows come as two arrays, the features `x` (N, 5) and a per-row "
    "`log_prior` (N,), passed to foldax as one pytree: `segment_logsumexp((x, log_prior), "
    "sizes=..., fn=lambda rows: model(theta, rows[0]) - rows[1])`. Same model, sizes and "
    "ways as above, each way's calls timed in turns; the baseline is the pad-and-scan a "
    "user writes when the padded copy fits. Gradient: of the per-segment sum with respect "
    "to theta.",
    "precomputed": "The floor is `jnp.exp(x).sum()`: one pass over the data, no segments. "
    "torch runs on the same CPU with its default threads.",
    "graph": "Plain data (messages already computed) reduced by receiver: `unsorted ids` as "
    "edges come, `sorted ids` with `indices_are_sorted=True` on both sides, `sizes` for foldax "
    "against the same sorted ids with the hint for the peer. The peer is the program a user "
    "writes with `jax.ops` (for the softmax, jraph's `segment_softmax`: max, gather, exp, sum, "
    "gather, divide; for the log-softmax, `x - max` less the gathered log of that sum). "
    "Gradient: of the sum of the result times fixed random weights.",
    "gaussian": "`sum_j exp(-|x_i - y_j|^2)` and `logsumexp_j(-|x_i - y_j|^2)`. XLA fuses the dense "
    "sum into its reduction (0 B temp) but not the logsumexp; pykeops' memory is not XLA's.",
    "nearest": "`min_j |x_i - y_j|^2`, its `argmin` and the k nearest for k = 5 to 128 "
    "(`reduction=\"kmin\"`, pykeops' `Kmin_argKmin`), each reduction's two ways timed in "
    "turns. The error column of argmin and k-min is "
    "the fraction of indices that differ from NumPy's on float64 distances (near-ties may "
    "round either way in float32). foldax spreads each step's large fusions over XLA:CPU's "
    "threads, pykeops runs one loop per thread: on a shared 2-core virtual machine, where "
    "waking a thread sometimes costs far more than usual, foldax's times can double from one "
    "run to the next while pykeops' stay put; on one core (`taskset -c 0`) both are steady.",
    "packed": "`foldax.dot_product_attention(q, k, v, is_causal=True, segment_ids=ids)` (each "
    "token attends to the earlier tokens of its own document; blocks across documents are "
    "skipped, listed from each block's range of ids) against `jax.nn.dot_product_attention` "
    "with the same mask as an `(L, L)` boolean array built from the ids in the jitted function, "
    "and against foldax with the causal mask alone (what the documents save). Gradient: of "
    "the sum of the output, with respect to q, k and v.",
    "overhead": "Each case names the op a user would call without foldax (`without foldax`). "
    "`eager call`: the function called directly, as in a notebook or a Python loop (foldax runs "
    "a cached executable: the same shapes, static arguments and `fn` / `kernel` structure "
    "compile once). `jitted call`: `jax.jit` of the function, after its first call (dispatch "
    "and run). `compile`: trace, lower and compile a new `jax.jit` of it. Small calls are "
    "mostly overhead; the 100,000-row calls also show the work.",
    "keops_users": "Inputs standard normal (the 784-D k-NN: uniform pixels in [0, 1)), fixed "
    "seeds; foldax jitted, pykeops' `LazyTensor`s, each case's two ways timed in turns. Kernel "
    "matrix times V: `pairwise_reduce(lambda a, b: jnp.exp(-jnp.sum((a - b[0]) ** 2)) * b[1], "
    "x, (y, V))` against `K @ V` with `K = (-((x_i - y_j) ** 2).sum(-1)).exp()`; error: the "
    "largest error relative to the largest magnitude of its column (entries of a kernel matrix "
    'times random-signed vectors can be near 0). k-NN: `reduction="kmin", k=10` of '
    "`jnp.sum((a - b) ** 2)` against `Kmin_argKmin(10, 1)`; error: the fraction of indices that "
    'differ from `np.argsort(d, kind="stable")[:, :10]` on float64 distances. Chamfer: '
    "`mean(min_j |x_i - y_j|^2) + mean(min_i |x_i - y_j|^2)` per pair, foldax's "
    "`jax.jit(jax.vmap(jax.value_and_grad(chamfer, (0, 1))))` against pykeops' batched "
    "LazyTensors `(B, N, 1, 3)`, `(B, 1, M, 3)` with torch's autograd: KeOps does not "
    "differentiate a min reduction, so its users take `argmin` and gather the distances in "
    "torch; error: the loss of the first pair against float64. Floor: the rates of `exp` and "
    "of float32 multiply-adds (those of a matrix product: the vector units' peak) measured in the "
    "same run, timed in turns with foldax's Gaussian sum; the ratio of those rows is relative "
    "to the floor (foldax's time / the floor's).",
    "sharded": "One process with `XLA_FLAGS=--xla_force_host_platform_device_count=8`: the same "
    "program on one device and with the rows split over 8 (N padded to a multiple of 8, padding "
    "rows dropped by id). The 8 simulated devices share this machine's cores: the time ratio "
    "shows 8 device programs keeping the cores busy, not more hardware.",
}


def _fmt_err(e):
    return "n/a" if e is None else f"{e:.1e}"


def _base(rows, r, baseline):
    for b in rows:
        if b["case"] == r["case"] and b["pass"] == r["pass"] and b["impl"] == baseline:
            return b
    return None


def workload_table(results: dict, name: str) -> list[str]:
    rows = results["workloads"][name]
    base_name = BASELINE[name]
    extra = name == "sharded"
    head = (
        f"| case | implementation | pass | XLA temp | median time | time relative to {base_name} |"
    )
    head += " arguments / device | all-gather |" if extra else " max rel err vs float64 |"
    sep = "|---|---|---|---:|---:|---:|" + ("---:|---|" if extra else "---:|")
    lines = [head, sep]
    for r in rows:
        b = _base(rows, r, r.get("baseline", base_name))
        ratio = "n/a" if b is None or not b["seconds"] else f"{r['seconds'] / b['seconds']:.2f}"
        temp = "n/a" if r["temp_bytes"] is None else format_bytes(r["temp_bytes"])
        tail = (
            f" {format_bytes(r['argument_bytes'])} | {'yes' if r['all_gather'] else 'no'} |"
            if extra
            else f" {_fmt_err(r['rel_err'])} |"
        )
        lines.append(
            f"| {r['case']} | {r['impl']} | {r['pass']} | {temp} | {format_time(r['seconds'])} | {ratio} |"
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
    """``a``'s time relative to ``b``'s, formatted."""
    return f"{a['seconds'] / b['seconds']:.2f}x"


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
                    f"{r['seconds'] / peer['seconds']:.2f}x ({secs})",
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


def render_markdown(results: dict, versions: dict | None = None) -> str:
    """BENCHMARKS.md: every workload of ``results``, then, given a ``jax-versions.json``
    (:mod:`._versions`), the headline workloads on the oldest and the newest JAX."""
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
    return "\n".join(lines)


def render_readme_block(results: dict) -> str:
    lines = [
        README_START,
        f"Measured by `{results['command']}` on {results['date']} "
        f"({machine_line(results['machine'])}){_merged_note(results)}; "
        "every figure, with errors against float64, in [BENCHMARKS.md](BENCHMARKS.md).",
        "",
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
        f"time rel. to {base_name}",
        "rel err",
    )
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
                "n/a" if b is None else f"{r['seconds'] / b['seconds']:.2f}",
                _fmt_err(r["rel_err"]),
            )
        )
    return table(cells, header)


def readme_block_of(text: str) -> str | None:
    if README_START not in text or README_END not in text:
        return None
    return README_START + text.split(README_START, 1)[1].split(README_END, 1)[0] + README_END
