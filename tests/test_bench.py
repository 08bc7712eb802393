"""``foldax bench``: one quick run end to end, and the repository's figures against their JSON.

The runs here are ``foldax bench --quick`` with ``FOLDAX_BENCH_TINY=1``: every case of a quick
run, through the same code, at the tiny sizes of ``bench.TINY`` (compiling, not measuring, is
what takes the time of a test run).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

from foldax._tools import bench as _bench
from foldax._tools.bench import _lm_loss as _bench_lm_loss

ROOT = Path(__file__).parent.parent
#: The runs compile every workload and time nothing that is checked: LLVM's optimisation level 0
#: compiles them about a third faster. (Not the rest of the suite: at level 0 XLA:CPU may round
#: one expression differently in two fusions of a program, which changes numbers that tests check.)
TINY_ENV = {
    **os.environ,
    _bench.TINY_ENV: "1",
    "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip(),
}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """``foldax bench --quick`` (tiny sizes) in a fresh folder holding a README with the
    results markers."""
    out = tmp_path_factory.mktemp("bench")
    readme = f"# mine\n\nbefore\n\n{_bench.README_START}\nold\n{_bench.README_END}\n\nafter\n"
    (out / "README.md").write_text(readme)
    cmd = [sys.executable, "-m", "foldax", "bench", "--quick", "--out", str(out)]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, check=False, env=TINY_ENV
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc


@pytest.mark.slow
def test_quick_run_measures_every_workload(quick_run):
    out, proc = quick_run
    results = json.loads((out / _bench.PLOT_DIR / "results.json").read_text())
    assert set(results["workloads"]) == set(_bench.WORKLOADS)
    assert results["quick"] and results["command"] == "foldax bench --quick"
    assert results["config"] == json.loads(json.dumps(dataclasses.asdict(_bench.TINY)))
    for name, rows in results["workloads"].items():
        assert rows, name
        for r in rows:
            assert r["seconds"] > 0 and math.isfinite(r["seconds"]), r
            # (an optional peer's error is what it is: measured and reported, not ours to bound)
            peer = r["impl"] in _bench_lm_loss.PEER_OF
            assert r["rel_err"] is None or peer or r["rel_err"] < 1e-3, r
    impls = {r["impl"] for r in results["workloads"]["seed"]}
    assert {"global-max segment_sum", "pad-and-scan", "foldax"} <= impls  # (loop: full runs)
    sharded = results["workloads"]["sharded"]
    assert {r["devices"] for r in sharded} == {1, 8}
    assert not any(r["all_gather"] for r in sharded)
    # the progress bar and the tables
    assert "] " in proc.stderr and f"/{_bench._steps(_bench.TINY, _bench.WORKLOADS)}" in proc.stderr
    assert _bench._steps(_bench.TINY, _bench.WORKLOADS) == _bench._steps(
        _bench.QUICK, _bench.WORKLOADS
    )
    assert "implementation" in proc.stdout


@pytest.mark.slow
def test_quick_run_reports_missing_peers_as_skipped(quick_run):
    out, proc = quick_run
    results = json.loads((out / _bench.PLOT_DIR / "results.json").read_text())
    missing = {p for p in _bench.PEERS if not _bench.available(p)}
    assert {s["peer"] for s in results["skipped"]} == missing
    for s in results["skipped"]:
        assert f"skipped: {s['peer']} (not installed; pip install -e '{s['extra']}')" in proc.stderr
        assert s["extra"] in (out / "BENCHMARKS.md").read_text()
    impls = {r["impl"] for rows in results["workloads"].values() for r in rows}
    assert ("pykeops (CPU)" in impls) == ("pykeops" not in missing)
    assert ("torch.segment_reduce max + sum" in impls) == ("torch.segment_reduce" not in missing)
    plots = sorted(p.name for p in (out / _bench.PLOT_DIR).glob("*.png"))
    assert plots == ([] if "plots (matplotlib)" in missing else sorted(results["plots"]))


@pytest.mark.slow
def test_quick_run_renders_markdown_and_readme_from_its_json(quick_run):
    out, _ = quick_run
    results = json.loads((out / _bench.PLOT_DIR / "results.json").read_text())
    assert (out / "BENCHMARKS.md").read_text() == _bench.render_markdown(results)
    readme = (out / "README.md").read_text()
    assert readme.startswith("# mine\n\nbefore\n\n") and readme.endswith("\n\nafter\n")
    assert _bench.readme_block_of(readme) == _bench.render_readme_block(results)


def test_repository_figures_match_their_json():
    """README's Results block and BENCHMARKS.md are what the committed results.json renders."""
    path = ROOT / _bench.PLOT_DIR / "results.json"
    results = json.loads(path.read_text())
    assert not results["quick"], "the committed results must come from a full run"
    versions = json.loads((ROOT / _bench.PLOT_DIR / _bench.VERSIONS_FILE).read_text())
    tpu = json.loads((ROOT / _bench.PLOT_DIR / _bench.TPU_FILE).read_text())
    want = _bench.render_markdown(results, versions, tpu)
    assert (ROOT / "BENCHMARKS.md").read_text() == want
    block = _bench.readme_block_of((ROOT / "README.md").read_text())
    assert block == _bench.render_readme_block(results)
    for plot in results["plots"]:
        assert (ROOT / _bench.PLOT_DIR / plot).exists(), plot


@pytest.mark.slow
def test_merge_replaces_only_the_workloads_run(quick_run, tmp_path):
    """``--only NAME --merge`` measures NAME again into an existing results.json, keeps every
    other workload's figures, and the text says which run measured what. NAME is the cheapest
    workload, ``precomputed``: the merge is the same for every workload."""
    out, _ = quick_run
    before = json.loads((out / _bench.PLOT_DIR / "results.json").read_text())
    merged_dir = tmp_path / "merged"
    (merged_dir / _bench.PLOT_DIR).mkdir(parents=True)
    (merged_dir / _bench.PLOT_DIR / "results.json").write_text(json.dumps(before))
    cmd = [sys.executable, "-m", "foldax", "bench", "--quick", "--only", "precomputed", "--merge"]
    proc = subprocess.run(
        [*cmd, "--out", str(merged_dir)], capture_output=True, text=True, timeout=600, env=TINY_ENV
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = json.loads((merged_dir / _bench.PLOT_DIR / "results.json").read_text())
    assert set(after["workloads"]) == set(before["workloads"])
    for name in set(before["workloads"]) - {"precomputed"}:
        assert after["workloads"][name] == before["workloads"][name], name
    assert after["workloads"]["precomputed"] != before["workloads"]["precomputed"]
    assert after["merged"][-1]["workloads"] == ["precomputed"]
    text = (merged_dir / "BENCHMARKS.md").read_text()
    assert "precomputed by `foldax bench --quick --only precomputed --merge`" in text
    full = subprocess.run(
        [sys.executable, "-m", "foldax", "bench", "--only", "precomputed", "--merge", "--out",
         str(merged_dir)], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert full.returncode != 0 and "holds a quick run" in full.stderr


@pytest.mark.slow
def test_unknown_workload_is_a_clear_error():
    proc = subprocess.run(
        [sys.executable, "-m", "foldax", "bench", "--only", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode != 0
    assert "foldax bench: unknown workload 'nope'; choose from seed" in proc.stderr


def test_jax_versions_need_a_cause_for_each_moved_ratio():
    """A ratio that moved by more than 10% between the two JAX versions is rendered in bold
    with its cause, and cannot be kept without one."""
    versions = json.loads((ROOT / _bench.PLOT_DIR / _bench.VERSIONS_FILE).read_text())
    old, new = versions["old"], versions["new"]
    assert old["machine"]["jax"] != new["machine"]["jax"]
    moved = _bench.moved(old, new)
    assert sorted(moved) == sorted(versions["causes"])
    with pytest.raises(ValueError, match="a measured cause is needed"):
        _bench.compare(old, new, {})
    text = "\n".join(_bench.render_markdown({**_empty_results(old)}, versions).splitlines())
    for key in moved:
        line = next(x for x in text.splitlines() if x.startswith(f"| {key} |"))
        assert line.count("**") == 4 and line.endswith(f"| {versions['causes'][key]} |")


def _empty_results(run):
    return {**run, "skipped": [], "plots": [], "workloads": {}}


# --- the progress bar, the noise of the figures, and the plots ------------------------------

#: A progress bar's line: ``[#####...] done/total  seconds s  what``
STEP = re.compile(r"^\[[#.]{24}\]\s+(\d+)/(\d+)\s")


@pytest.mark.slow
def test_progress_reaches_its_total_at_the_last_step(quick_run):
    """The bar announces as many steps as the workloads take: none past the total, none short."""
    _, proc = quick_run
    steps = [tuple(map(int, m.groups())) for m in map(STEP.match, proc.stderr.splitlines()) if m]
    total = _bench._steps(_bench.TINY, _bench.WORKLOADS)
    assert {t for _, t in steps} == {total}
    assert [d for d, _ in steps] == list(range(1, total + 1))


def test_overhead_steps_count_its_calls():
    """``_steps`` counts the overhead workload's calls at each of its sizes."""
    from foldax._tools.bench import _overhead

    for n in _bench.TINY.overhead_sizes:
        assert len(_overhead._overhead_calls(n, _bench.TINY)) == _overhead._CALLS_PER_SIZE
    assert len(_overhead._compile_cases(_bench.TINY)) == len(_overhead._COMPILE_ONLY)


@pytest.mark.slow
def test_quick_run_records_the_spread_and_the_load(quick_run):
    out, proc = quick_run
    results = json.loads((out / _bench.PLOT_DIR / "results.json").read_text())
    timed = 0
    for rows in results["workloads"].values():
        for r in rows:
            assert "load" in r and r["busy"] == (r["load"] > os.cpu_count()), r
            if "seconds_min" in r:
                timed += 1
                assert r["seconds_min"] <= r["seconds"] <= r["seconds_max"], r
                assert r["rounds"] >= 1, r
    assert timed > 0.9 * sum(map(len, results["workloads"].values()))  # all but derived floors
    assert set(results["load"]) == {"start", "end", "cores"}
    assert "noise: " in proc.stdout and "within noise of their baseline" in proc.stdout
    assert "smaller sizes than a full run's" in proc.stdout
    assert _bench.QUICK_NOTE in (out / "BENCHMARKS.md").read_text()
    assert _bench.QUICK.repeats >= 5


def test_timing_is_the_median_and_carries_its_spread():
    from foldax._tools import workloads as w

    t = w.Timing([0.3, 0.1, 0.2])
    assert t == 0.2 and (t.low, t.high, t.rounds) == (0.1, 0.3, 3)
    assert json.loads(json.dumps({"s": t})) == {"s": 0.2}
    back = pickle.loads(pickle.dumps(t))
    assert back == 0.2 and (back.low, back.high) == (0.1, 0.3)
    assert t.spread() == {"seconds_min": 0.1, "seconds_max": 0.3, "rounds": 3}
    times = w.median_times({"a": lambda: 1, "b": lambda: 2}, repeats=4, warmup=0)
    for s in times.values():
        assert isinstance(s, float) and s.rounds == 4 and s.low <= s <= s.high
    assert w.median_time(lambda: 1, repeats=3).rounds == 3


def _row(impl, seconds, low=None, high=None, busy=None, case="c", pass_="forward"):
    r = {"workload": "graph", "case": case, "impl": impl, "pass": pass_, "temp_bytes": 1000,
         "seconds": seconds, "rel_err": None, "edges": 10, "nodes": 2}  # fmt: skip
    if low is not None:
        r.update(seconds_min=low, seconds_max=high, rounds=5)
    if busy is not None:
        r.update(load=3.0 if busy else 0.5, busy=busy)
    return r


def _results(rows, **kw):
    return {"command": "foldax bench", "date": "2026-01-01", "quick": False, "repeats": 5,
            "machine": {"cpu": "x", "cores": 2, "backend": "cpu", "device": "cpu", "jax": "0",
                        "numpy": "0", "python": "3"},
            "skipped": [], "plots": [], "workloads": {"graph": rows}, **kw}  # fmt: skip


def test_ratios_within_noise_or_on_a_busy_machine_are_marked():
    peer = "jax.ops (jraph's way)"
    overlapping = _results([_row("foldax", 1.0, 0.8, 1.3, False), _row(peer, 1.1, 1.0, 1.2, False)])
    apart = _results([_row("foldax", 1.0, 0.9, 1.05, False), _row(peer, 2.0, 1.9, 2.1, False)])
    busy = _results([_row("foldax", 1.0, 0.9, 1.05, True), _row(peer, 2.0, 1.9, 2.1, False)])
    table = "\n".join(_bench.workload_table(overlapping, "graph"))
    assert "| 0.91 (within noise) |" in table and "1000.0 ms (800.0 ms – 1300.0 ms)" in table
    assert "within noise" not in "\n".join(_bench.workload_table(apart, "graph"))
    assert "| 0.50 (busy machine) |" in "\n".join(_bench.workload_table(busy, "graph"))
    (_, _, ratio), *_ = _bench.headlines(overlapping)
    assert ratio == "0.91x (within noise)"
    assert "within noise" in _bench.terminal_table(overlapping, "graph")
    assert _bench.NOISE_NOTE in _bench.render_readme_block(overlapping)
    assert "*within noise*" in _bench.render_markdown(overlapping)


def test_results_without_spread_or_load_render_as_before():
    """Results saved by an older bench (no spread, no load) carry no marks and no notes."""
    old = _results([_row("foldax", 1.0), _row("jax.ops (jraph's way)", 2.0)])
    assert _bench.workload_table(old, "graph")[2].endswith("| 1000.0 ms | 0.50 | n/a |")
    assert _bench.headlines(old)[0][2] == "0.50x"
    assert _bench.NOISE_NOTE not in _bench.render_readme_block(old)
    assert "*within noise*" not in _bench.render_markdown(old)


def test_plots_leave_zeros_off_the_log_axis_and_draw_floors_as_floors():
    from foldax._tools.bench import _plots

    seed = [
        {"impl": "foldax", "pass": "forward", "n": n, "temp_bytes": b, "seconds": 1.0}
        for n, b in ((100, 0), (1000, 0), (10_000, 4096))
    ]
    series, dropped = _plots.memory_series({"workloads": {"seed": seed}}, "seed")
    assert series == {"foldax (forward)": [(10_000, 4096)]}
    assert dropped == ["foldax (forward) at N = 100, 1,000"]
    results = json.loads((ROOT / _bench.PLOT_DIR / "results.json").read_text())
    bars = _plots.ratio_bars(results)
    floors = [b for b in bars if b["kind"] == "floor"]
    assert floors and all("floor" in b["label"] for b in floors)
    assert not any("floor" in b["label"] for b in bars if b["kind"] != "floor")
    noisy = _results([_row("foldax", 1.0, 0.8, 1.3), _row("dense XLA", 1.1, 1.0, 1.2)])
    noisy["workloads"] = {"gaussian": noisy["workloads"]["graph"]}
    (bar,) = _plots.ratio_bars(noisy)
    assert bar["kind"] == "noise" and bar["low"] == 0.8 / 1.2 and bar["high"] == 1.3 / 1.0


def _saved(tmp_path, plots):
    """A folder holding the repository's results.json as a run without matplotlib saved it."""
    results = json.loads((ROOT / _bench.PLOT_DIR / "results.json").read_text())
    results["plots"] = plots
    results["skipped"] = [{"peer": "plots (matplotlib)", "extra": ".[plot]"}]
    (tmp_path / _bench.PLOT_DIR).mkdir()
    (tmp_path / _bench.PLOT_DIR / "results.json").write_text(json.dumps(results))
    return results


def test_render_draws_the_plots_of_results_measured_without_matplotlib(tmp_path):
    pytest.importorskip("matplotlib")
    _saved(tmp_path, [])
    drawn = _bench.render(str(tmp_path))
    assert drawn == ["memory_vs_n.png", "time_ratios.png"]
    for p in drawn:
        assert (tmp_path / _bench.PLOT_DIR / p).stat().st_size > 10_000
    saved = json.loads((tmp_path / _bench.PLOT_DIR / "results.json").read_text())
    assert saved["plots"] == drawn and saved["skipped"] == []
    assert (
        f"![time_ratios.png]({_bench.PLOT_DIR}/time_ratios.png)"
        in (tmp_path / "BENCHMARKS.md").read_text()
    )


def test_render_without_matplotlib_says_how_to_draw_the_plots(tmp_path, monkeypatch, capsys):
    from foldax._tools.bench import _run

    monkeypatch.setattr(_run, "available", lambda peer: peer != _bench.MATPLOTLIB)
    _saved(tmp_path, ["time_ratios.png"])  # recorded, but not in the folder: not linked
    assert _bench.render(str(tmp_path)) == []
    assert "pip install -e '.[plot]'" in capsys.readouterr().err
    assert "time_ratios.png" not in (tmp_path / "BENCHMARKS.md").read_text()


def test_each_merged_run_lists_only_the_workloads_it_still_holds():
    """A run's record names only the workloads no later merge replaced; a run none of whose
    workloads is left is dropped, so BENCHMARKS.md never credits a run with figures it no
    longer holds."""
    from foldax._tools.bench._run import _merged

    def run(names, day):
        command = f"foldax bench --only {' --only '.join(names)} --merge"
        workloads = {name: [] for name in names}
        return {"command": command, "date": day, "machine": {}, "load": {}, "skipped": [],
                "workloads": workloads}  # fmt: skip

    results = {**run(["a", "b", "c"], "d0"), "merged": []}
    results = _merged(results, run(["a", "b"], "d1"), ["a", "b"])
    results = _merged(results, run(["b"], "d2"), ["b"])
    assert [(r["date"], r["workloads"]) for r in results["merged"]] == [
        ("d1", ["a"]),
        ("d2", ["b"]),
    ]
    results = _merged(results, run(["a"], "d3"), ["a"])
    assert [(r["date"], r["workloads"]) for r in results["merged"]] == [
        ("d2", ["b"]),
        ("d3", ["a"]),
    ]
