"""Command line: ``foldax demo`` (also ``python -m foldax demo``)."""

from __future__ import annotations

import argparse
import sys
import time

from .memory import format_bytes


def _table(rows, header):
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows, strict=True)]
    line = "  ".join(f"{{:>{w}}}" if i else f"{{:<{w}}}" for i, w in enumerate(widths))
    out = [line.format(*header), line.format(*("-" * w for w in widths))]
    out += [line.format(*map(str, r)) for r in rows]
    return "\n".join(out)


def demo(args) -> int:
    """Run the chosen workloads (default: both seeds)."""
    t0 = time.perf_counter()
    if args.workload in ("all", "seed"):
        demo_seed(args)
    if args.workload in ("all", "s4"):
        if args.workload == "all":
            print()
        demo_s4(args)
    print(f"(done in {time.perf_counter() - t0:.0f} s; temp memory is XLA's compiled estimate)")
    return 0


def demo_s4(args) -> None:
    """S4's Cauchy kernel three ways over N: memory, time and error against complex128."""
    from . import _workloads as w

    print(
        f"S4 Cauchy kernel: H = {w.S4_H} channels, L = {w.S4_L} nodes, N poles, complex64; "
        f"forward k = cauchy(v, z, w) and gradient of sum |k|^2 w.r.t. (v, z, w).",
        flush=True,
    )

    def progress(msg):
        print(f"  measuring {msg} ...", flush=True)

    rows = w.measure_s4(repeats=args.repeats, progress=progress)
    base = {(r["n"], r["pass_"]): r for r in rows if r["way"] == "naive broadcast"}
    table = [
        (
            r["n"],
            r["way"],
            r["pass_"],
            format_bytes(r["temp_bytes"]),
            f"{r['seconds'] * 1e3:.1f} ms",
            f"{base[r['n'], r['pass_']]['seconds'] / r['seconds']:.2f}x",
            f"{r['rel_err']:.1e}",
        )
        for r in rows
    ]
    print()
    print(
        _table(
            table,
            ("N", "way", "pass", "XLA temp", "median time", "speed-up vs naive", "max rel err"),
        )
    )


def demo_seed(args) -> None:
    """The seed workload three ways: memory, time and error against a float64 reference."""
    from . import _workloads as w

    problem = w.seed_problem(batch=args.batch)
    print(
        f"Seed workload: N = {problem.n:,} rows x {w.FEATURES} features in {len(problem.sizes)} "
        f"segments, per-segment logsumexp(f(theta, x)) - log(size), vmapped over "
        f"{args.batch} theta, float32.",
        flush=True,
    )
    print("Computing the float64 NumPy reference ...", flush=True)
    ref = w.reference(problem)

    def progress(msg):
        print(f"  measuring {msg} ...", flush=True)

    rows = w.measure_seed(problem, repeats=args.repeats, ref=ref, progress=progress)
    base = {r.pass_: r for r in rows if r.way == "global-max segment_sum"}
    table = [
        (
            r.way,
            r.pass_,
            format_bytes(r.temp_bytes),
            f"{r.seconds * 1e3:.1f} ms",
            f"{base[r.pass_].seconds / r.seconds:.2f}x",
            f"{r.rel_err:.1e}",
        )
        for r in rows
    ]
    print()
    print(
        _table(
            table,
            ("way", "pass", "XLA temp", "median time", "speed-up vs global-max", "max rel err"),
        )
    )
    fx = {r.pass_: r for r in rows if r.way == "foldax"}
    print()
    for p in ("forward", "gradient"):
        print(
            f"foldax {p}: {base[p].temp_bytes / fx[p].temp_bytes:,.0f}x less temp memory than "
            f"the global-max segment_sum version."
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="foldax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="run the seed workload three ways and compare")
    p.add_argument(
        "workload",
        nargs="?",
        default="all",
        choices=("all", "seed", "s4"),
        help="seed: segment logsumexp (seed 000); s4: S4's Cauchy kernel (seed 002)",
    )
    p.add_argument("--batch", type=int, default=10, help="number of theta vmapped over")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats (median reported)")
    p.set_defaults(func=demo)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
