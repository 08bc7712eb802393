"""Test configuration: strict dtype promotion everywhere and a seeded RNG per test.

Every test that draws random data takes the ``rng`` fixture: a NumPy Generator seeded from the
test's node id (so each test has its own, reproducible stream) xor ``FOLDAX_TEST_SEED`` (set it to
explore other seeds). The seed is printed, so it appears in the captured output of a failure.
"""

from __future__ import annotations

import os
import sys
import zlib
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))

# mesh_cases.py needs 8 host devices: test_shard.py runs it in subprocesses that have them.
collect_ignore = [] if "device_count=8" in os.environ.get("XLA_FLAGS", "") else ["mesh_cases.py"]
# multiprocess_case.py is one process of a jax.distributed run: test_multiprocess.py starts it.
collect_ignore.append("multiprocess_case.py")

# Implicit promotions (e.g. float32 + float64 arrays) would hide dtype bugs in the library, and
# implicit rank promotion (a (3,) array broadcast against (N, 3)) shape bugs: users who forbid it
# must be able to call every function.
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture(autouse=True)
def _strict_dtype_promotion():
    with jax.numpy_dtype_promotion("strict"):
        yield


@pytest.fixture
def seed(request) -> int:
    base = int(os.environ.get("FOLDAX_TEST_SEED", "0"))
    s = zlib.crc32(request.node.nodeid.encode()) ^ base
    print(f"rng seed: {s} (node id {request.node.nodeid!r}, FOLDAX_TEST_SEED={base})")
    request.node.user_properties.append(("rng_seed", s))
    return s


@pytest.fixture
def rng(seed) -> np.random.Generator:
    return np.random.default_rng(seed)
