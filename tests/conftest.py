"""Test configuration: strict dtype promotion everywhere and a seeded RNG per test.

Every test that draws random data takes the ``rng`` fixture: a NumPy Generator seeded from the
test's node id (so each test has its own, reproducible stream) xor ``FOLDAX_TEST_SEED`` (set it to
explore other seeds). The seed is printed, so it appears in the captured output of a failure.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
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


#: A compilation cache shared by the run's processes (pytest-xdist's workers and the subprocesses
#: that run the 8-device cases, the examples and the bench): many tests build the same programs
#: (the dense references, the same fold at the same shapes), and the suite is compile-bound. An
#: executable is reused only for an identical program, so no test checks anything less; the
#: folder is removed when the run ends. FOLDAX_TEST_COMPILE_CACHE=0 turns it off.
_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"
_made: list[str] = []


def pytest_configure(config):
    if os.environ.get("FOLDAX_TEST_COMPILE_CACHE", "1") == "0":
        return
    if _CACHE_ENV not in os.environ:  # the run's first process: workers inherit the folder
        os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="foldax-tests-jax-cache-")
        _made.append(os.environ[_CACHE_ENV])
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    for path in _made:  # made by this process (not a worker's or a subprocess's inherited one)
        shutil.rmtree(path, ignore_errors=True)


#: Tests that run a subprocess for most of a minute or more. They are scheduled first, so that
#: pytest-xdist's workers do not wait on one of them at the end (the bench's tests share one
#: module-scoped run: kept together, they land on one worker).
HEAVY = (
    "test_shard.py::test_on_8_host_devices",
    "test_bench.py::",
    "test_examples.py::test_example_smoke_run",
)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: not any(h in item.nodeid for h in HEAVY))  # stable


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
