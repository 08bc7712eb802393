"""Every example runs as users run it, with ``--smoke`` (small sizes, seconds)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "examples"

#: script -> (module it needs beyond foldax, text its output must contain)
EXPECT = {
    "audit_s4.py": (None, ("fitted exponent",)),
    "audit_segment.py": (None, ("fitted exponent",)),
    "equinox_gp.py": ("equinox", ("agreement check: passed", "models (filter_vmap)")),
    "flax_s4.py": ("flax", ("foldax.cauchy (defaults)",)),
    "lm_loss.py": ("flax", ("agreement check: passed", "training step, XLA temp memory")),
    "graph_attention.py": (None, ("agreement check: passed", "gradient (XLA temp memory")),
    "packed_attention.py": (None, ("agreement check: passed", "jax.nn (L x L mask)")),
    "numpyro_events.py": ("numpyro", ("posterior mean", "foldax.segment_logmeanexp", "padded")),
    "s4_layer.py": (None, ("kernel max abs difference",)),
    "seed_vmap_memory.py": (None, ("B = 1000", "memory_budget")),
    "sharded_seed.py": (None, ("devices, N =", "all-gather in the program: False")),
    "sinkhorn.py": (None, ("agreement check: passed", "one Sinkhorn iteration")),
}


def test_every_example_is_listed():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(EXPECT)


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(EXPECT))
def test_example_smoke_run(script):
    needs, expect = EXPECT[script]
    if needs is not None and importlib.util.find_spec(needs) is None:
        pytest.fail(f"{needs} is not installed: pip install -e '.[examples]' (or '.[test]')")
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--smoke"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert all(e in proc.stdout for e in expect), proc.stdout
