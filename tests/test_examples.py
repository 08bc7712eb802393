"""Examples run as users run them (``--smoke``: small sizes, seconds)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.mark.parametrize(
    ("script", "needs", "expect"),
    [
        ("seed_vmap_memory.py", None, ("B = 1000", "memory_budget")),
        ("flax_s4.py", "flax", ("foldax.cauchy (defaults)",)),
    ],
)
def test_example_smoke_run(script, needs, expect):
    if needs is not None and importlib.util.find_spec(needs) is None:
        pytest.skip(f"{needs} is not installed (pip install -e '.[examples]')")
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--smoke"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert all(e in proc.stdout for e in expect), proc.stdout
