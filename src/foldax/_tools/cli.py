"""Command line: ``foldax demo``, ``foldax audit``, ``foldax bench`` (also ``python -m foldax``)."""

from __future__ import annotations

import argparse
import re
import sys

from .._audit import check_sizes
from ..memory import format_bytes
from .demo import DEMO_TIMES, WORKLOADS, demo


class UsageError(Exception):
    """A mistake in the command line: printed as one line naming the fix, exit status 2."""


MAKE_CONTRACT = (
    "the target must be a function make(size) -> (fn, args): fn is what to compile, args its "
    "arguments (arrays or jax.ShapeDtypeStruct), e.g. examples/audit_s4.py:naive"
)


#: ``foldax audit``'s default sizes: large enough that a foldax fold takes several steps at each
#: of them (on CPU a step holds at most 2^18 rows of a segment reduction per batch element, and a
#: pairwise one's tiles stop growing well below 2^18 rows; see foldax._engine._budget), so that
#: the fit shows whether memory stays flat rather than how a single step grows. Only compiled.
DEFAULT_SIZES = "262144,524288,1048576"


def _parse_sizes(text: str, name: str = "--sizes") -> list[int]:
    """``--sizes``: comma-separated whole numbers, checked as :func:`foldax.memory.scaling`
    checks its ``sizes`` (at least two, distinct, positive), sorted."""
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise UsageError(
            f"{name} must be comma-separated whole numbers, e.g. --sizes {DEFAULT_SIZES}; "
            f"got {text!r}"
        ) from None
    try:
        return list(
            check_sizes(sizes, name=name, example=f"--sizes {DEFAULT_SIZES}", got=repr(text))
        )
    except (TypeError, ValueError) as e:
        raise UsageError(str(e)) from None


def _import_file(path: str):
    """The Python file at ``path``, imported as a module, or a UsageError naming the fix."""
    import importlib.util
    import os

    if not os.path.isfile(path):
        raise UsageError(f"no such file {path!r} (give path/to/file.py:function)")
    spec = importlib.util.spec_from_file_location("_foldax_audit_target", path)
    if spec is None or spec.loader is None:
        raise UsageError(f"{path!r} is not a Python file (give path/to/file.py:function)")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the user's file: report it in one line
        raise UsageError(f"importing {path} failed: {type(e).__name__}: {e}") from None
    return module


def _size_functions(module) -> list[str]:
    """The public functions a file defines that take one argument (a size), else its public
    callables: what to offer when the target names none of them."""
    import inspect

    mine = [
        n
        for n, v in vars(module).items()
        if inspect.isfunction(v) and v.__module__ == module.__name__ and not n.startswith("_")
    ]

    def takes_a_size(name):
        try:
            inspect.signature(getattr(module, name)).bind(0)
        except (TypeError, ValueError):
            return False
        return True

    return sorted(filter(takes_a_size, mine)) or sorted(
        n for n, v in vars(module).items() if callable(v) and not n.startswith("_")
    )


def _load_target(target: str):
    """``path/to/file.py:function`` -> (the function, its module), or a UsageError naming the
    fix (with the file's functions where the function is missing or wrong)."""
    path, colon, func = target.rpartition(":")
    if not colon:
        path, func = target, ""
    if not path:
        raise UsageError(f"expected path/to/file.py:function, got {target!r}")
    module = _import_file(path)
    names = _size_functions(module)
    if not func:
        raise UsageError(
            f"expected path/to/file.py:function, got {target!r}: name the function"
            + (f", one of: {', '.join(names[:8])} (e.g. {path}:{names[0]})" if names else "")
        )
    make = getattr(module, func, None)
    if make is None:
        raise UsageError(
            f"{path} has no function {func!r}"
            + (f" (it has: {', '.join(names[:8])})" if names else "")
        )
    if not callable(make):
        raise UsageError(f"{path}:{func} is not a function; {MAKE_CONTRACT}")
    return make, module


def _target_sizes(module, path: str) -> list[int] | None:
    """The target file's ``AUDIT_SIZES`` (its default ``--sizes``), checked; None if unset."""
    sizes = getattr(module, "AUDIT_SIZES", None)
    if sizes is None:
        return None
    try:
        text = sizes if isinstance(sizes, str) else ",".join(map(str, sizes))
    except TypeError:
        text = repr(sizes)
    return _parse_sizes(text, name=f"AUDIT_SIZES in {path}")


def _checked_make(make, target):
    """Wrap ``make`` so that a wrong signature or return value is a UsageError."""
    import inspect

    try:
        inspect.signature(make).bind(0)
    except TypeError:
        raise UsageError(f"{target} cannot be called with one size; {MAKE_CONTRACT}") from None
    except ValueError:  # no signature (a builtin): try it
        pass

    def checked(size):
        try:
            out = make(size)
        except Exception as e:
            raise UsageError(f"{target}({size}) raised {_one_line(e)}") from None
        if not (isinstance(out, tuple | list) and len(out) == 2 and callable(out[0])):
            raise UsageError(
                f"{target}({size}) returned {type(out).__name__}, not (fn, args); {MAKE_CONTRACT}"
            )
        fn, fargs = out
        return fn, tuple(fargs) if isinstance(fargs, tuple | list) else (fargs,)

    return checked


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def audit_cmd(args) -> int:
    """``foldax audit path.py:function``: the function takes a size and returns ``(fn, args)``."""
    import dataclasses
    import os

    from .. import _audit

    given = getattr(args, "sizes", None)
    sizes = _parse_sizes(given) if given is not None else None
    if args.top < 1:
        raise UsageError(f"--top must be a positive number of buffers, got {args.top}")
    if args.plot and os.path.dirname(args.plot) and not os.path.isdir(os.path.dirname(args.plot)):
        raise UsageError(f"--plot {args.plot}: no such folder {os.path.dirname(args.plot)!r}")
    make_at, module = _load_target(args.target)
    if sizes is None:
        path = args.target.rpartition(":")[0]
        sizes = _target_sizes(module, path) or _parse_sizes(DEFAULT_SIZES)
    checked = _checked_make(make_at, args.target)
    last = {}

    def make(size):
        last["fn"], last["args"] = out = checked(size)
        return out

    try:
        rep, audits = _audit._scaling(
            make, sizes, name=args.name, top=max(50, args.top), threshold=0.1, min_fraction=0.01
        )
    except UsageError:
        raise
    except Exception as e:
        raise UsageError(
            f"compiling fn(*args) from {args.target}(size) failed: {_one_line(e)}"
        ) from None
    audit = dataclasses.replace(audits[-1], buffers=audits[-1].buffers[: args.top])
    print(audit)
    print()
    print(rep)
    _device_peak(last["fn"], last["args"], audit.totals.peak_bytes)
    if args.plot:
        _plot(rep, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _device_peak(fn, fargs, estimate) -> None:
    """On a GPU, run once and report the device's measured peak beside XLA's estimate (not when
    the estimate exceeds the device's memory)."""
    import jax

    dev = jax.devices()[0]
    if dev.platform != "gpu":
        return
    limit = (dev.memory_stats() or {}).get("bytes_limit")
    if limit is not None and estimate > limit:
        print(
            f"device {dev}: not run (XLA's estimate {format_bytes(estimate)} exceeds its "
            f"{format_bytes(limit)})"
        )
        return
    try:
        from .._memory import jit_any

        concrete = jax.tree.map(
            lambda a: (
                jax.numpy.zeros(a.shape, a.dtype) if isinstance(a, jax.ShapeDtypeStruct) else a
            ),
            tuple(fargs),
        )
        jitted, dyn_args, dyn_kwargs = jit_any(fn, concrete, {}, "fn")  # any callable, as audited
        jax.block_until_ready(jitted(*dyn_args, **dyn_kwargs))
    except Exception as e:
        print(f"device {dev}: running fn(*args) failed, no measured peak: {_one_line(e)}")
        return
    stats = dev.memory_stats() or {}
    if "peak_bytes_in_use" in stats:
        print(f"device {dev}: measured peak {format_bytes(stats['peak_bytes_in_use'])}")


def _plot(rep, out) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError(
            "--plot needs matplotlib: pip install -e '.[plot]' (or pip install matplotlib)"
        ) from None
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.loglog(rep.sizes, rep.temp_bytes, "o-k", label=f"temp total (exponent {rep.exponent:.2f})")
    for g in rep.growing[:8]:
        ax.loglog(rep.sizes, g.nbytes, "o--", label=f"{g.primitive} {g.source} ({g.exponent:.2f})")
    ax.set_xlabel(rep.name)
    ax.set_ylabel("bytes")
    ax.legend(fontsize=7)
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=120)
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot write --plot {out}: {_one_line(e)}") from None


BENCH_OUT = "foldax-bench"


def _workload(name: str) -> str:
    name = {"seed": "ragged"}.get(name, name)  # the old name still works
    if name not in WORKLOADS:
        raise argparse.ArgumentTypeError(f"choose ragged, s4 or all (got {name!r})")
    return name


#: A reST role, ``:func:`foldax.memory.scaling``` or ``:class:`~foldax.memory.Buffer```.
_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`(~?)([^`<]*?)\s*(?:<[^>]*>)?`")


def _plain(text: str) -> str:
    """Help text as a terminal shows it: a reST role becomes the name it points to (the last
    part of a ``~`` one), a ``literal`` its text; docstrings reused as help stay readable."""
    text = _ROLE.sub(lambda m: m.group(2).rsplit(".", 1)[-1] if m.group(1) else m.group(2), text)
    return text.replace("``", "")


def version_text() -> str:
    """``foldax --version``: foldax's, jax's and jaxlib's versions, then the backend JAX runs on
    (or why it could not start one: the versions still help to report it)."""
    import importlib.metadata
    import os
    import platform

    import jax

    import foldax

    try:
        devices = jax.devices()
        first, n = devices[0], len(devices)
        backend = f"backend {first.platform}: {n} device{'s' if n > 1 else ''}"
        if first.device_kind != first.platform:
            backend += f" ({first.device_kind})"
    except Exception as e:  # a broken accelerator install
        chosen = os.environ.get("JAX_PLATFORMS")
        backend = f"no backend could start{f' (JAX_PLATFORMS={chosen!r})' if chosen else ''}: "
        backend += _one_line(e)
    return (
        f"foldax {foldax.__version__}\n"
        f"jax {jax.__version__}, jaxlib {importlib.metadata.version('jaxlib')}, "
        f"Python {platform.python_version()}; {backend}"
    )


class _Version(argparse.Action):
    """``--version``: computed when asked (it starts JAX's backend), printed, then exit."""

    def __init__(self, option_strings, dest, **kwargs):
        kwargs.update(nargs=0, default=argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit(0)


class _Parser(argparse.ArgumentParser):
    """argparse, with a mistake in the command line printed as one line (exit status 2) and
    help texts without reST markup."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")

    def format_help(self):
        return _plain(super().format_help())


def _add_bench(sub, fmt) -> None:
    """``foldax bench`` and its options."""
    b = sub.add_parser(
        "bench",
        help="every headline number, side by side with the installed peers, plots",
        description="Run every benchmark with the installed peers; write results.json, plots, "
        "BENCHMARKS.md and a README results block into --out.",
        formatter_class=fmt,
    )
    b.add_argument("--quick", action="store_true", help="small sizes, about 3.5 minutes on 2 cores")
    b.add_argument(
        "--only",
        action="append",
        metavar="NAME",
        help="run only this workload (repeatable): seed, likelihood, precomputed, graph, s4, "
        "gaussian, nearest, attention, packed, overhead, sharded, keops_users, lm_loss",
    )
    b.add_argument(
        "--out",
        default=BENCH_OUT,
        help="folder (created if missing) for BENCHMARKS.md and bench/ (results.json, plots); a "
        "README.md there with the results markers gets its Results block rewritten",
    )
    b.add_argument(
        "--merge",
        action="store_true",
        help="with --only: put the workloads run into OUT/bench/results.json in place of "
        "theirs, keeping every other workload's figures",
    )
    b.add_argument(
        "--render",
        action="store_true",
        help="measure nothing: rewrite BENCHMARKS.md and the README block from "
        "OUT/bench/results.json, and draw its plots where matplotlib is installed",
    )
    b.set_defaults(func=bench_cmd)


def main(argv=None) -> int:
    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = _Parser(prog="foldax", description=_plain(__doc__), formatter_class=fmt)
    parser.add_argument(
        "--version",
        action=_Version,
        help="print the versions of foldax, jax and jaxlib and the backend JAX runs on, and exit",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "demo",
        help="run a workload three ways: memory, time, error against float64",
        description="Run a workload three ways and print XLA's temp memory, the median time "
        "relative to the usual way (< 1: faster) and the error against a float64 reference.",
        formatter_class=fmt,
    )
    p.add_argument(
        "workload",
        nargs="?",
        default="ragged",
        type=_workload,
        metavar="{ragged,s4,all}",
        help=f"ragged ({DEMO_TIMES['ragged']} on 2 CPU cores, the longer on a busy machine): the "
        "ragged logsumexp under vmap, a per-segment logsumexp over 1.16 M rows in 123 unequal "
        f"segments; s4 ({DEMO_TIMES['s4']}): S4's Cauchy kernel; all: both, one after the other",
    )
    p.add_argument("--batch", type=int, default=10, help="number of theta vmapped over")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats (median reported)")
    # The test suite's run: the ragged workload's first segments only (a slicing loop compiles
    # one slice per segment). Not listed in --help.
    p.add_argument("--segments", type=int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=demo)
    a = sub.add_parser(
        "audit",
        help="which buffers make a program's memory grow, and which line made them",
        description="Compile a program at several sizes (nothing runs) and list the buffers live "
        "at its memory peak, the line of code that made each, and how each grows with the size. "
        + MAKE_CONTRACT[0].upper()
        + MAKE_CONTRACT[1:]
        + ".",
        formatter_class=fmt,
    )
    a.add_argument("target", help="path/to/file.py:function, with function(size) -> (fn, args)")
    a.add_argument(
        "--sizes",
        default=argparse.SUPPRESS,
        help="at least two distinct comma-separated sizes (fn is compiled at each, not run); "
        "default: the target file's AUDIT_SIZES where it sets them (examples/audit_s4.py: "
        f"64,256,512), else {DEFAULT_SIZES}, large enough for foldax's folds to take several "
        "steps",
    )
    a.add_argument("--name", default="N", help="name of the size, for printing")
    a.add_argument("--top", type=int, default=10, help="buffers listed at the peak")
    a.add_argument("--plot", help="write memory against size to this PNG (needs matplotlib)")
    a.set_defaults(func=audit_cmd)
    _add_bench(sub, fmt)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except UsageError as e:
        print(f"foldax {args.command}: {e}", file=sys.stderr)
        return 2


def bench_cmd(args) -> int:
    import os

    from . import bench as _bench

    for name in args.only or ():
        if name not in _bench.WORKLOADS:
            raise UsageError(
                f"unknown workload {name!r}; choose from {', '.join(_bench.WORKLOADS)}"
            )
    if args.render:
        results = os.path.join(args.out, _bench.PLOT_DIR, "results.json")
        if not os.path.isfile(results):
            raise UsageError(
                f"--render reads {results}, which does not exist: run foldax bench --out "
                f"{args.out} first, or point --out at a folder holding bench/results.json"
            )
        _bench.render(args.out)
        print(f"wrote {os.path.join(args.out, 'BENCHMARKS.md')} from {results}")
    else:
        if os.path.exists(args.out) and not os.path.isdir(args.out):
            raise UsageError(f"--out {args.out!r} is a file; give a folder")
        os.makedirs(args.out, exist_ok=True)
        if args.merge and not args.only:
            raise UsageError("--merge needs --only NAME: the workloads to measure again")
        _bench.run(quick=args.quick, only=args.only, out=args.out, merge=args.merge)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
