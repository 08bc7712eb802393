"""Sharded reductions: ``mesh_cases.py`` runs in subprocesses with 8 host CPU devices (the flag
must be set before JAX starts). Each group below is its own subprocess, so ``pytest -n 2``
spreads them over the workers: two groups of about equal time (each subprocess pays JAX's start
and the compiles its cases share once). Checks that need no mesh run here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import foldax

HERE = Path(__file__).parent
GROUPS = {
    "segment_jit_ssm_and_replicated": "test_segment_on_mesh or test_segment_nan or "
    "test_segment_vmap or empty or replicated or cauchy or seed_workload",
    "segment_shard_map_and_pairwise": "test_segment_axis_name or pairwise",
}


@pytest.mark.slow
@pytest.mark.parametrize("group", list(GROUPS))
def test_on_8_host_devices(group):
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    env["JAX_PLATFORMS"] = "cpu"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist"]
    cmd += [str(HERE / "mesh_cases.py"), "-k", GROUPS[group]]
    proc = subprocess.run(
        cmd, env=env, cwd=HERE.parent, capture_output=True, text=True, timeout=500
    )
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"8-device checks ({group}) failed:\n{tail}"
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1], tail


def test_groups_cover_every_mesh_case():
    """Every test in mesh_cases.py is selected by exactly one group."""
    import ast

    tree = ast.parse((HERE / "mesh_cases.py").read_text())
    names = [
        f.name for f in tree.body if isinstance(f, ast.FunctionDef) and f.name.startswith("test_")
    ]

    def selected(name, expr):
        return any(all(term in name for term in alt.split(" and ")) for alt in expr.split(" or "))

    for name in names:
        hits = [g for g, expr in GROUPS.items() if selected(name, expr)]
        assert len(hits) == 1, f"{name} is selected by {hits}"


def test_axis_name_outside_shard_map_is_an_error():
    with pytest.raises(ValueError, match=r"foldax\.segment_logsumexp: axis_name='rows' is not"):
        foldax.segment_logsumexp(jnp.ones(4), sizes=[4], axis_name="rows")
    with pytest.raises(TypeError, match=r"foldax\.pairwise_reduce: axis_name must be a mesh axis"):
        foldax.pairwise_reduce(lambda a, b: a * b, jnp.ones(3), jnp.ones(3), axis_name=3)
    with pytest.raises(ValueError, match=r"foldax\.cauchy: axis_name='n' is not a mesh axis"):
        foldax.cauchy(
            jnp.ones(3, jnp.complex64),
            jnp.ones(2, jnp.complex64),
            jnp.ones(3, jnp.complex64),
            axis_name="n",
        )


def test_one_device_mesh_is_the_plain_path():
    """A mesh of one device (what every machine has) changes nothing."""
    mesh = jax.make_mesh((1,), ("d",))
    x = jax.device_put(np.arange(6, dtype=np.float32), jax.NamedSharding(mesh, jax.P("d")))
    out = jax.jit(lambda x: foldax.segment_sum(x, sizes=[2, 4]))(x)
    np.testing.assert_array_equal(out, [1.0, 14.0])
