"""An S4 layer written the way Flax users write it (``nn.vmap`` over channels, each calling
``foldax.cauchy`` on ``(N,)`` arrays): at default settings its training step needs about the
memory of the same step with the Cauchy sum replaced by an O(L + N) stand-in."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("flax")

EXAMPLES = Path(__file__).parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))

import flax_s4  # noqa: E402

import foldax  # noqa: E402
from foldax.memory import report  # noqa: E402

pytestmark = pytest.mark.slow

H, L = 128, 1024


def _temp(cauchy, n):
    params, (xs, ys), step = flax_s4.make_step(cauchy, H, n, L)
    return report(step, params, xs, ys).temp_bytes


@pytest.mark.parametrize("n", [64, 256])
def test_training_step_memory_near_the_stand_in(n):
    got, floor = _temp(foldax.cauchy, n), _temp(flax_s4.cauchy_stand_in, n)
    naive = _temp(flax_s4.cauchy_naive, n)
    assert got <= 1.15 * floor, (got, floor)
    assert got * 10 < naive, (got, naive)
