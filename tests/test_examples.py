"""Examples run as users run them."""

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).parent.parent / "examples"


def test_seed_vmap_memory_example():
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "seed_vmap_memory.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "B = 1000" in proc.stdout and "memory_budget" in proc.stdout
