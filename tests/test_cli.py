"""The console entry points: `foldax demo` and `python -m foldax`."""

import subprocess
import sys

import pytest

from foldax import _cli


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
    """`python -m foldax demo` prints the three ways, forward and gradient, with small errors."""
    out = subprocess.run(
        [sys.executable, "-m", "foldax", "demo", "seed", "--repeats", "1"],
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
    assert "less temp memory" in out


def test_s4_workload_small():
    """The demo's S4 measurement on a small configuration: every way agrees with complex128."""
    from foldax import _workloads as w

    rows = w.measure_s4(ns=(4, 8), h=3, length=16, repeats=1, time_it=False)
    assert {r["way"] for r in rows} == set(w.S4_WAYS)
    assert len(rows) == 2 * len(w.S4_WAYS) * 2
    for r in rows:
        assert r["rel_err"] < 1e-5, r
        assert r["temp_bytes"] >= 0
