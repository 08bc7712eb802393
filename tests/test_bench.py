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
import subprocess
import sys
from pathlib import Path

import pytest

from foldax._tools import bench as _bench

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
            assert r["rel_err"] is None or r["rel_err"] < 1e-3, r
    impls = {r["impl"] for r in results["workloads"]["seed"]}
    assert {"global-max segment_sum", "pad-and-scan", "slicing loop", "foldax"} <= impls
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
    assert (ROOT / "BENCHMARKS.md").read_text() == _bench.render_markdown(results, versions)
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
