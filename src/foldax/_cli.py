"""Command line: ``foldax demo``, ``foldax audit``, ``foldax bench`` (also ``python -m foldax``)."""

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
    """Run the chosen workloads (default: the segment seed workload)."""
    t0 = time.perf_counter()
    if args.workload in ("all", "seed"):
        demo_seed(args)
    if args.workload in ("all", "s4"):
        if args.workload == "all":
            print()
        demo_s4(args)
    print(f"(done in {time.perf_counter() - t0:.0f} s; temp memory is XLA's compiled estimate)")
    if args.workload == "seed":
        print("Next: `foldax demo s4` measures S4's Cauchy kernel the same way (about 1.5 min).")
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


def audit_cmd(args) -> int:
    """``foldax audit path.py:function``: the function takes a size and returns ``(fn, args)``."""
    import importlib.util
    import os

    from . import memory

    path, _, func = args.target.rpartition(":")
    if not path or not func:
        print(
            f"foldax audit: expected path/to/file.py:function, got {args.target!r}", file=sys.stderr
        )
        return 2
    if not os.path.exists(path):
        print(f"foldax audit: no such file {path!r}", file=sys.stderr)
        return 2
    spec = importlib.util.spec_from_file_location("_foldax_audit_target", path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    spec.loader.exec_module(module)
    make = getattr(module, func, None)
    if make is None:
        print(f"foldax audit: {path} has no function {func!r}", file=sys.stderr)
        return 2
    sizes = [int(s) for s in args.sizes.split(",")]
    fn, fargs = make(sizes[-1])
    print(memory.audit(fn, *fargs, top=args.top))
    print()
    rep = memory.scaling(make, sizes, name=args.name)
    print(rep)
    _device_peak(fn, fargs)
    if args.plot:
        _plot(rep, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _device_peak(fn, fargs) -> None:
    """On a GPU, run once and report the device's measured peak beside XLA's estimate."""
    import jax

    dev = jax.devices()[0]
    if dev.platform != "gpu":
        return
    concrete = [
        jax.numpy.zeros(a.shape, a.dtype) if isinstance(a, jax.ShapeDtypeStruct) else a
        for a in fargs
    ]
    jax.block_until_ready(jax.jit(fn)(*concrete))
    stats = dev.memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        print(f"device {dev}: measured peak {format_bytes(stats['peak_bytes_in_use'])}")


def _plot(rep, out) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            "foldax audit --plot needs matplotlib: pip install 'foldax[plot]'"
        ) from None
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.loglog(rep.sizes, rep.temp_bytes, "o-k", label=f"temp total (exponent {rep.exponent:.2f})")
    for g in rep.growing[:8]:
        ax.loglog(rep.sizes, g.nbytes, "o--", label=f"{g.primitive} {g.source} ({g.exponent:.2f})")
    ax.set_xlabel(rep.name)
    ax.set_ylabel("bytes")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="foldax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="run a seed workload three ways and compare")
    p.add_argument(
        "workload",
        nargs="?",
        default="seed",
        choices=("seed", "s4", "all"),
        help="seed (default, under a minute): segment logsumexp of seed 000; s4 (~1.5 min): "
        "S4's Cauchy kernel of seed 002; all: both",
    )
    p.add_argument("--batch", type=int, default=10, help="number of theta vmapped over")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats (median reported)")
    p.set_defaults(func=demo)
    a = sub.add_parser(
        "audit", help="which buffers make a program's memory grow, and which line made them"
    )
    a.add_argument("target", help="path/to/file.py:function, function(size) -> (fn, args)")
    a.add_argument("--sizes", default="64,256,512", help="comma-separated sizes")
    a.add_argument("--name", default="N", help="name of the size, for printing")
    a.add_argument("--top", type=int, default=10, help="buffers listed at the peak")
    a.add_argument("--plot", help="write memory against size to this PNG (needs matplotlib)")
    a.set_defaults(func=audit_cmd)
    b = sub.add_parser(
        "bench", help="every headline number, side by side with the installed peers, plots"
    )
    b.add_argument("--quick", action="store_true", help="small sizes, under 2 minutes on 2 cores")
    b.add_argument(
        "--only",
        action="append",
        metavar="NAME",
        help="run only this workload (repeatable): seed, precomputed, s4, gaussian, attention, sharded",
    )
    b.add_argument(
        "--out",
        default=".",
        help="folder for BENCHMARKS.md and bench/ (results.json, plots); a README.md there with "
        "the results markers gets its Results block rewritten",
    )
    b.add_argument(
        "--render",
        action="store_true",
        help="measure nothing: rewrite BENCHMARKS.md and the README block from OUT/bench/results.json",
    )
    b.set_defaults(func=bench_cmd)
    args = parser.parse_args(argv)
    return args.func(args)


def bench_cmd(args) -> int:
    from . import _bench

    if args.render:
        _bench.render(args.out)
    else:
        _bench.run(quick=args.quick, only=args.only, out=args.out)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
