"""``foldax demo``: a workload three ways, with XLA's temp memory, the time and the error."""

from __future__ import annotations

import time

from .._table import table as text_table
from ..memory import format_bytes

#: Measured on 2 CPU cores, on a quiet machine and on one shared with other jobs (see the
#: README); printed next to the commands.
DEMO_TIMES = {"ragged": "40 to 75 s", "s4": "80 s to 3.5 min"}
WORKLOADS = ("ragged", "s4", "all")

#: What each way of the ragged workload computes, printed before it is measured.
RAGGED_WAYS = {
    "slicing loop": "f of every row, then a Python loop: one dynamic slice and logsumexp per "
    "segment",
    "global-max segment_sum": "f of every row, one max over all rows, then "
    "jax.ops.segment_sum of exp(f - max): JAX's usual stable way (a segment ~90 below the max "
    "underflows)",
    "foldax": "foldax.segment_logsumexp(x, sizes=..., fn=f): f streamed over chunks of rows, "
    "each segment shifted by its own max",
}
#: What each way of S4's Cauchy kernel computes.
S4_WAYS = {
    "naive broadcast": "v[:, None, :] / (z[None, :, None] - w[:, None, :]) summed over N: the "
    "(H, L, N) array",
    "nested vmap": "the sum over N for one node, vmapped over the L nodes and the H channels",
    "foldax.cauchy": "foldax.cauchy(v, z, w): the sum over N streamed, no (H, L, N) array",
}
#: The poles of ``foldax demo s4``.
S4_NS = (64, 256, 512)


def _ratio_note(short: str, name: str) -> str:
    return f"time / {short}: median time relative to the {name} way's (< 1: faster)"


class _Steps:
    """Progress lines ``  [i/n] what ... 12.3 s``: each step's number as it starts, its
    time when it ends (at the next step, or at :meth:`end`)."""

    def __init__(self, total: int):
        self.total, self.i, self.t0 = total, 0, None

    def __call__(self, what: str) -> None:
        self.end()
        self.i += 1
        print(f"  [{self.i}/{self.total}] {what} ...", end="", flush=True)
        self.t0 = time.perf_counter()

    def end(self) -> None:
        if self.t0 is not None:
            print(f" {time.perf_counter() - self.t0:.1f} s", flush=True)
            self.t0 = None


def _legend(ways: dict[str, str]) -> None:
    print("The three ways:")
    width = max(map(len, ways))
    for name, what in ways.items():
        print(f"  {name:<{width}}  {what}")


def _less(base: int, ours: int) -> str:
    """``"93x less temp memory (1.0 MB against 92.7 MB)"``: ``ours`` bytes against ``base``."""
    if ours == base:
        return f"the same temp memory ({format_bytes(ours)})"
    if ours == 0:
        return f"no temp memory (against {format_bytes(base)})"
    if ours < base:
        ratio = f"{base / ours:,.{0 if base >= 10 * ours else 1}f}x less"
    else:
        ratio = f"{ours / base:,.1f}x more"
    return f"{ratio} temp memory ({format_bytes(ours)} against {format_bytes(base)})"


def demo(args) -> int:
    """Run the chosen workloads (default: the ragged logsumexp under vmap)."""
    t0 = time.perf_counter()
    if args.workload in ("all", "ragged"):
        demo_ragged(args)
    if args.workload in ("all", "s4"):
        if args.workload == "all":
            print()
        demo_s4(args)
    print(f"(done in {time.perf_counter() - t0:.0f} s; temp memory is XLA's compiled estimate)")
    if args.workload == "ragged":
        print(
            "Next: `foldax demo s4` measures S4's Cauchy kernel the same way "
            f"({DEMO_TIMES['s4']} on 2 CPU cores)."
        )
    return 0


def _steps_note(repeats: int, reference: str) -> str:
    return (
        f"Each step: {reference}, or one way and pass compiled, timed (median of {repeats} "
        f"run{'s' if repeats != 1 else ''}) and checked against it."
    )


def demo_s4(args) -> None:
    """S4's Cauchy kernel three ways over N: memory, time and error against complex128."""
    from . import workloads as w

    print(
        f"S4 Cauchy kernel: H = {w.S4_H} channels, L = {w.S4_L} nodes, N poles, complex64; "
        f"forward k = cauchy(v, z, w) and gradient of sum |k|^2 w.r.t. (v, z, w).",
        flush=True,
    )
    _legend(S4_WAYS)
    print(_steps_note(args.repeats, "a complex128 reference"), flush=True)
    steps = _Steps(len(S4_NS) * (1 + 2 * len(w.S4_WAYS)))
    rows = w.measure_s4(ns=S4_NS, repeats=args.repeats, progress=steps)
    steps.end()
    base = {(r["n"], r["pass_"]): r for r in rows if r["way"] == "naive broadcast"}
    table = [
        (
            r["n"],
            r["way"],
            r["pass_"],
            format_bytes(r["temp_bytes"]),
            f"{r['seconds'] * 1e3:.1f} ms",
            f"{r['seconds'] / base[r['n'], r['pass_']]['seconds']:.2f}",
            f"{r['rel_err']:.1e}",
        )
        for r in rows
    ]
    print()
    print(
        text_table(
            table,
            ("N", "way", "pass", "XLA temp", "median time", "time / naive", "max rel err"),
            right=range(1, 7),
        )
    )
    print(_ratio_note("naive", "naive broadcast"))
    print()
    fx = {(r["n"], r["pass_"]): r for r in rows if r["way"] == "foldax.cauchy"}
    for p in ("forward", "gradient"):
        each = [
            f"N = {n}: {_less(base[n, p]['temp_bytes'], fx[n, p]['temp_bytes'])}"
            for n in sorted({r["n"] for r in rows})
        ]
        print(f"foldax.cauchy {p}, against the naive broadcast: {'; '.join(each)}.")


def demo_ragged(args) -> None:
    """The ragged logsumexp under vmap three ways: memory, time and error against float64."""
    from . import workloads as w

    problem = w.seed_problem(batch=args.batch, segments=args.segments)
    print(
        f"The ragged logsumexp under vmap: N = {problem.n:,} rows x {w.FEATURES} features in "
        f"{len(problem.sizes)} segments of unequal sizes, per-segment "
        f"logsumexp(f(theta, x)) - log(size), vmapped over {args.batch} theta, float32.",
        flush=True,
    )
    _legend(RAGGED_WAYS)
    print(_steps_note(args.repeats, "the float64 NumPy reference"), flush=True)
    steps = _Steps(1 + 2 * len(w.DEMO_WAYS))
    steps("the float64 NumPy reference")
    ref = w.reference(problem)
    rows = w.measure_seed(problem, repeats=args.repeats, ref=ref, progress=steps)
    steps.end()
    base = {r.pass_: r for r in rows if r.way == "global-max segment_sum"}
    table = [
        (
            r.way,
            r.pass_,
            format_bytes(r.temp_bytes),
            f"{r.seconds * 1e3:.1f} ms",
            f"{r.seconds / base[r.pass_].seconds:.2f}",
            f"{r.rel_err:.1e}",
        )
        for r in rows
    ]
    print()
    print(
        text_table(
            table,
            ("way", "pass", "XLA temp", "median time", "time / global-max", "max rel err"),
            right=range(1, 6),
        )
    )
    print(_ratio_note("global-max", "global-max segment_sum"))
    fx = {r.pass_: r for r in rows if r.way == "foldax"}
    print()
    for p in ("forward", "gradient"):
        print(
            f"foldax {p}, against the global-max segment_sum way: "
            f"{_less(base[p].temp_bytes, fx[p].temp_bytes)}."
        )
