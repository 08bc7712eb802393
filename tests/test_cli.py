"""The console entry points: `foldax demo`, `foldax audit`, `foldax bench`, `python -m foldax`."""

import re
import subprocess
import sys

import pytest

from foldax._tools import cli as _cli


def test_help_lists_demo(capsys):
    with pytest.raises(SystemExit) as e:
        _cli.main(["--help"])
    assert e.value.code == 0
    assert "demo" in capsys.readouterr().out


def test_unknown_command_is_an_error(capsys):
    with pytest.raises(SystemExit) as e:
        _cli.main(["nonsense"])
    assert e.value.code == 2


@pytest.mark.slow
def test_demo_runs_end_to_end():
    """`python -m foldax demo` prints the three ways, forward and gradient, with small errors
    (vmapped over 2 theta, not the default 10, and the first 16 of the 123 segments: the same
    code, a fraction of the compiling and the work)."""
    argv = ["ragged", "--repeats", "1", "--batch", "2", "--segments", "16"]
    out = subprocess.run(
        [sys.executable, "-m", "foldax", "demo", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    for way in ("slicing loop", "global-max segment_sum", "foldax"):
        assert out.count(way) >= 2, out
    rows = [
        line.split() for line in out.splitlines() if line.startswith("foldax ") and " ms " in line
    ]
    assert len(rows) == 2, out
    for row in rows:
        assert float(row[-1]) < 1e-4, out  # max relative error against float64
    assert "foldax gradient, against the global-max segment_sum way: " in out
    assert "less temp memory" in out
    assert " in 16 segments of unequal sizes" in out
    assert "time / global-max" in out and "(< 1: faster)" in out
    # what each way is, then one numbered line per step with the seconds it took
    assert "slicing loop            f of every row, then a Python loop" in out, out
    steps = re.findall(r"^  \[(\d+)/7\] (.+) \.\.\. \d+\.\d s$", out, re.M)
    assert [int(i) for i, _ in steps] == list(range(1, 8)), out
    assert steps[0][1] == "the float64 NumPy reference" and steps[-1][1] == "foldax gradient"


def test_demo_says_what_each_way_is():
    from foldax._tools import demo
    from foldax._tools import workloads as w

    assert tuple(demo.RAGGED_WAYS) == w.DEMO_WAYS
    assert tuple(demo.S4_WAYS) == tuple(w.S4_WAYS)


def test_demo_s4_counts_its_steps_and_sums_up_the_memory(monkeypatch, capsys):
    """`foldax demo s4` numbers its steps, times each, and ends with how many times less temp
    memory foldax.cauchy needs at each N (the measurement itself replaced by fixed figures)."""
    import argparse

    from foldax._tools import demo
    from foldax._tools import workloads as w

    temps = {"naive broadcast": 1000, "nested vmap": 1000, "foldax.cauchy": 10}

    def fake_measure(ns, repeats, progress):
        rows = []
        for n in ns:
            progress(f"N={n}: complex128 reference")
            for way in w.S4_WAYS:
                for p in ("forward", "gradient"):
                    progress(f"N={n}: {way} {p}")
                    temp = temps[way] * n * (2 if p == "gradient" else 1)
                    rows.append(
                        dict(n=n, way=way, pass_=p, temp_bytes=temp, seconds=0.01, rel_err=1e-7)
                    )
        return rows

    monkeypatch.setattr(w, "measure_s4", fake_measure)
    monkeypatch.setattr(demo, "S4_NS", (64, 512))
    demo.demo_s4(argparse.Namespace(repeats=2))
    out = capsys.readouterr().out
    assert "median of 2 runs" in out and "naive broadcast  v[:, None, :]" in out, out
    steps = re.findall(r"^  \[(\d+)/14\] .+ \.\.\. \d+\.\d s$", out, re.M)
    assert len(steps) == 14, out
    assert (
        "foldax.cauchy gradient, against the naive broadcast: N = 64: 100x less temp memory "
        "(1.3 KB against 128.0 KB); N = 512: 100x less temp memory (10.2 KB against 1.0 MB)."
    ) in out, out


def test_less_memory_text():
    from foldax._tools.demo import _less

    assert _less(92_700_000, 993_800) == "93x less temp memory (993.8 KB against 92.7 MB)"
    assert _less(2_800_000, 1_800_000).startswith("1.6x less temp memory")
    assert _less(1000, 2000).startswith("2.0x more temp memory")
    assert _less(0, 0) == "the same temp memory (0 B)"
    assert _less(1000, 0) == "no temp memory (against 1.0 KB)"


@pytest.mark.slow
def test_s4_workload_small():
    """The demo's S4 measurement on a small configuration: every way agrees with complex128."""
    from foldax._tools import workloads as w

    rows = w.measure_s4(ns=(4, 8), h=3, length=16, repeats=1, time_it=False)
    assert {r["way"] for r in rows} == set(w.S4_WAYS)
    assert len(rows) == 2 * len(w.S4_WAYS) * 2
    for r in rows:
        assert r["rel_err"] < 1e-5, r
        assert r["temp_bytes"] >= 0


@pytest.mark.parametrize("command", ["demo", "audit", "bench"])
def test_help_shows_the_defaults(command, capsys):
    with pytest.raises(SystemExit) as e:
        _cli.main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "(default: " in out
    for word in ("seed 00", "(report)"):
        assert word not in out


def test_demo_workload_names(capsys):
    assert _cli._workload("ragged") == "ragged" and _cli._workload("seed") == "ragged"
    with pytest.raises(SystemExit) as e:
        _cli.main(["demo", "nope"])
    assert e.value.code == 2
    assert "choose ragged, s4 or all" in capsys.readouterr().err


MAKE_TARGETS = """
import jax.numpy as jnp

def plain(a, b, c):
    return a

def not_a_pair(n):
    return 3

def raises(n):
    raise ValueError("boom")

def bad_program(n):
    return (lambda x: jnp.dot(x, jnp.ones(3)), (jnp.ones(n),))

def good(n):
    return (lambda x: jnp.exp(x).sum(), (jnp.ones(n),))
"""


@pytest.fixture
def targets(tmp_path):
    path = tmp_path / "targets.py"
    path.write_text(MAKE_TARGETS)
    (tmp_path / "broken.py").write_text("x = (\n")
    (tmp_path / "sized.py").write_text(MAKE_TARGETS + "\nAUDIT_SIZES = (8, 16)\n")
    (tmp_path / "bad_sizes.py").write_text(MAKE_TARGETS + "\nAUDIT_SIZES = [8]\n")
    return tmp_path


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["T/targets.py:good", "--sizes", "64"], "--sizes needs at least two sizes"),
        (["T/targets.py:good", "--sizes", "64,a"], "--sizes must be comma-separated whole numbers"),
        (["T/targets.py:good", "--sizes", "0,8"], "--sizes must be distinct positive numbers"),
        (
            ["T/targets.py:plain"],
            "cannot be called with one size; the target must be a function make(size) -> (fn, args)",
        ),
        (["T/targets.py:not_a_pair"], "returned int, not (fn, args)"),
        (["T/targets.py:raises"], "raised ValueError: boom"),
        (["T/targets.py:bad_program", "--sizes", "4,8"], "compiling fn(*args) from"),
        (["T/targets.py:nothere"], "has no function 'nothere' (it has: bad_program, good"),
        (["T/missing.py:f"], "no such file"),
        (["T/targets.py"], "expected path/to/file.py:function"),
        (["T/targets.py"], "name the function, one of: bad_program, good, not_a_pair, raises"),
        (["T/targets.py:"], "name the function, one of: bad_program, good"),
        (["T/bad_sizes.py:good"], "AUDIT_SIZES in T/bad_sizes.py needs at least two sizes"),
        (["T/broken.py:f"], "importing T/broken.py failed: SyntaxError"),
    ],
)
def test_audit_user_errors_are_one_line(targets, argv, message, capsys):
    argv = [a.replace("T/", f"{targets}/") for a in argv]
    assert _cli.main(["audit", *argv]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith("foldax audit: ") and message.replace("T/", f"{targets}/") in err, err


def test_audit_runs_a_good_target(targets, capsys):
    assert _cli.main(["audit", f"{targets}/targets.py:good", "--sizes", "8,16"]) == 0
    assert "fitted exponent" in capsys.readouterr().out


def test_audit_takes_the_targets_own_sizes(targets, capsys):
    """A file's AUDIT_SIZES are its default --sizes (examples/audit_s4.py sets sizes its naive
    step can hold); --sizes still wins."""
    assert _cli.main(["audit", f"{targets}/sized.py:good"]) == 0
    assert "against N: N=8: " in capsys.readouterr().out
    assert _cli.main(["audit", f"{targets}/sized.py:good", "--sizes", "4,32"]) == 0
    assert "against N: N=4: " in capsys.readouterr().out


@pytest.mark.slow
def test_audit_of_the_s4_example_fits_its_default_sizes(capsys):
    """`foldax audit examples/audit_s4.py:naive`, as the help suggests, with no --sizes: the
    naive step at N = 64 to 512 (1.1 GB buffers), not at a million poles (terabytes)."""
    assert _cli.main(["audit", "examples/audit_s4.py:naive", "--top", "1"]) == 0
    out = capsys.readouterr().out
    # gigabytes at N = 512 (3.3 GB of temp on jax 0.10.2, 2.2 GB on 0.12.1), never terabytes
    assert "against N: N=64: " in out and re.search(r"N=512: [\d.]+ GB", out), out
    assert " TB" not in out, out


@pytest.mark.slow
def test_audit_error_from_the_console_has_no_traceback():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "foldax",
            "audit",
            "examples/audit_s4.py:with_foldax",
            "--sizes",
            "64",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr, proc.stderr


def test_bench_writes_only_where_told(tmp_path, monkeypatch, capsys):
    """The default --out is a new folder, never the checkout's BENCHMARKS.md and README."""
    from foldax._tools import bench as _bench

    calls = []
    monkeypatch.setattr(_bench, "run", lambda **kw: calls.append(kw))
    monkeypatch.chdir(tmp_path)
    assert _cli.main(["bench", "--quick"]) == 0
    assert calls == [{"quick": True, "only": None, "out": _cli.BENCH_OUT, "merge": False}]
    assert (tmp_path / _cli.BENCH_OUT).is_dir() and _cli.BENCH_OUT not in (".", "")
    assert _cli.main(["bench", "--merge"]) == 2
    assert "--merge needs --only NAME" in capsys.readouterr().err
    assert _cli.main(["bench", "--render", "--out", str(tmp_path / "none")]) == 2
    assert "does not exist: run foldax bench --out" in capsys.readouterr().err
    (tmp_path / "file").write_text("")
    assert _cli.main(["bench", "--out", str(tmp_path / "file")]) == 2


@pytest.mark.slow
def test_audit_default_sizes_show_the_segment_fold_flat(capsys):
    """The default --sizes are large enough for the segment workload's folds to take several
    steps: temp memory is flat (at 64, 256, 512 it grew with exponent 1.6, all in one step)."""
    import re

    assert _cli.main(["audit", "examples/audit_segment.py:with_foldax", "--top", "3"]) == 0
    out = capsys.readouterr().out
    sizes = [int(s) for s in _cli.DEFAULT_SIZES.split(",")]
    assert f"N={sizes[0]}:" in out and f"N={sizes[-1]}:" in out, out
    exponent = float(re.search(r"fitted exponent (-?[0-9.]+)", out).group(1))
    assert abs(exponent) < 0.05, out
    assert "no buffer live at the peak grows with N." in out and "note:" not in out, out


@pytest.mark.slow
def test_audit_at_one_step_sizes_says_they_are_too_small(capsys):
    argv = ["audit", "examples/audit_segment.py:with_foldax", "--sizes", "64,256,512", "--top", "1"]
    assert _cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "note: at N=64, 256, 512 foldax's folds ran in one step" in out, out
    assert "too small to tell whether temp memory stays flat" in out, out


def test_audit_compiles_each_size_once(targets, monkeypatch, capsys):
    from foldax import _audit

    calls = []
    real = _audit.audit
    monkeypatch.setattr(_audit, "audit", lambda fn, *a, **k: calls.append(1) or real(fn, *a, **k))
    assert _cli.main(["audit", f"{targets}/targets.py:good", "--sizes", "8,16,32"]) == 0
    assert len(calls) == 3
    assert "f32[32]" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["T/targets.py:good", "--sizes", "64,64"], "--sizes must be distinct positive numbers"),
        (["T/targets.py:good", "--sizes", "64,64"], "64 is repeated; give each size once"),
        (["T/targets.py:good", "--sizes=-8,8"], "-8 is not positive"),
        (["T/targets.py:good", "--sizes", ""], "--sizes needs at least two sizes"),
        (["T/targets.py:good", "--sizes", "8,1.5"], "--sizes must be comma-separated whole"),
        (["T/targets.py:good", "--top", "0"], "--top must be a positive number of buffers"),
        (["T/targets.py:good", "--top", "x"], "argument --top: invalid int value: 'x'"),
        (["T/targets.py:good", "--plot", "T/no/such/dir/x.png"], "--plot T/no/such/dir/x.png"),
        (["T/targets.py:good", "--bogus"], "unrecognized arguments: --bogus"),
        ([], "the following arguments are required: target"),
    ],
)
def test_audit_bad_options_are_one_line(targets, argv, message, capsys):
    argv = [a.replace("T/", f"{targets}/") for a in argv]
    try:
        rc = _cli.main(["audit", *argv])
    except SystemExit as e:  # argparse's own checks
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    # (an unknown option is the top-level parser's: "foldax: unrecognized arguments")
    assert err.startswith(("foldax audit: ", "foldax: ")), err
    assert message.replace("T/", f"{targets}/") in err, err


def test_device_peak_is_not_run_where_it_cannot_fit(monkeypatch, capsys):
    import jax

    class FakeGPU:
        platform = "gpu"

        def memory_stats(self):
            return {"bytes_limit": 1000}

        def __str__(self):
            return "gpu:0"

    monkeypatch.setattr(jax, "devices", lambda: [FakeGPU()])
    ran = []
    _cli._device_peak(lambda x: ran.append(x), (jax.ShapeDtypeStruct((8,), "float32"),), 10**6)
    assert not ran
    out = capsys.readouterr().out.strip()
    assert out == "device gpu:0: not run (XLA's estimate 1.0 MB exceeds its 1.0 KB)", out


def _pyproject_version() -> str:
    import tomllib
    from pathlib import Path

    with open(Path(__file__).parent.parent / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["version"]


def test_version_is_the_one_in_pyproject():
    import foldax

    assert foldax.__version__ == _pyproject_version()


@pytest.mark.slow
def test_version_flag_prints_versions_and_backend():
    """`foldax --version` from the console: foldax's version, then jax's, jaxlib's and the
    backend on a second line, exit status 0."""
    import importlib.metadata

    import jax

    proc = subprocess.run(
        [sys.executable, "-m", "foldax", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    first, second = proc.stdout.strip().splitlines()
    assert first == f"foldax {_pyproject_version()}"
    assert second.startswith(
        f"jax {jax.__version__}, jaxlib {importlib.metadata.version('jaxlib')}, Python "
    ), second
    n = jax.device_count()
    assert f"; backend {jax.default_backend()}: {n} device{'s' if n > 1 else ''}" in second


def test_version_says_why_no_backend_started(monkeypatch):
    import jax

    def broken():
        raise RuntimeError("Unable to initialize backend 'cuda': no CUDA device\nmore detail")

    monkeypatch.setattr(jax, "devices", broken)
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    first, second = _cli.version_text().splitlines()
    assert first == f"foldax {_pyproject_version()}"
    assert second.endswith(
        "; no backend could start (JAX_PLATFORMS='cuda'): RuntimeError: Unable to initialize "
        "backend 'cuda': no CUDA device"
    ), second


def test_plain_turns_markup_into_text():
    text = (
        "see :func:`foldax.memory.scaling`, :class:`~foldax.memory.Buffer`, "
        ":py:meth:`the method <foldax.memory.AuditReport.top>` and ``foldax demo``"
    )
    assert _cli._plain(text) == ("see foldax.memory.scaling, Buffer, the method and foldax demo")
    assert _cli._plain("examples/audit_s4.py:naive, `x`") == "examples/audit_s4.py:naive, `x`"


@pytest.mark.parametrize("command", [[], ["demo"], ["audit"], ["bench"]])
def test_help_has_no_markup(command, capsys):
    """What a terminal shows: no reST literals (``x``) and no roles (:func:`x`)."""
    import re

    with pytest.raises(SystemExit) as e:
        _cli.main([*command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out and not re.search(r":[a-z]+:`", out), out
    if not command:
        assert "--version" in out and "foldax demo, foldax audit, foldax bench" in out, out


def test_bench_help_names_every_workload(capsys):
    from foldax._tools import bench as _bench

    with pytest.raises(SystemExit):
        _cli.main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    listed = out.split("run only this workload (repeatable): ", 1)[1].split(" (default", 1)[0]
    assert [w.strip() for w in listed.split(",")] == list(_bench.WORKLOADS), listed
