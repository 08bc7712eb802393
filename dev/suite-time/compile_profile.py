"""Where the test suite's time goes: every XLA backend compile, with the test that caused it.

A pytest plugin and its summary. Run the suite with it (the persistent compilation cache off,
so that every compile is seen), then summarise::

    FOLDAX_TEST_COMPILE_CACHE=0 PYTHONPATH=dev/suite-time \
        .venv/bin/python -m pytest -n 2 -q -p compile_profile
    python dev/suite-time/compile_profile.py            # reads /tmp/foldax-compiles.*.json

Each process writes ``/tmp/foldax-compiles.<pid>.json`` (``COMPILE_PROFILE_OUT`` changes the
prefix): one row per compile, ``[test node id, module name, seconds, lines of StableHLO, whether
the program has a while loop]``.
"""

from __future__ import annotations

import collections
import glob
import json
import os
import sys
import time

PREFIX = os.environ.get("COMPILE_PROFILE_OUT", "/tmp/foldax-compiles")
_rows: list = []
_test = ["(collection)"]


def _install():
    import jax._src.compiler as compiler  # the one function every backend compile goes through

    original = compiler.backend_compile_and_load

    def timed(backend, module, *args, **kwargs):
        start = time.perf_counter()
        out = original(backend, module, *args, **kwargs)
        seconds = time.perf_counter() - start
        text = str(module)
        name = str(module.operation.attributes["sym_name"]).strip('"')
        _rows.append((_test[0], name, seconds, text.count("\n"), "stablehlo.while" in text))
        return out

    compiler.backend_compile_and_load = timed


def pytest_configure(config):
    _install()


def pytest_runtest_setup(item):
    _test[0] = item.nodeid


def pytest_unconfigure(config):
    with open(f"{PREFIX}.{os.getpid()}.json", "w") as f:
        json.dump(_rows, f)


def summary(prefix=PREFIX, top=25):
    rows = []
    for path in glob.glob(f"{prefix}.*.json"):
        with open(path) as f:
            rows += json.load(f)
    total = sum(r[2] for r in rows)
    loops = [r for r in rows if r[4]]
    print(f"{len(rows)} compiles, {total:.0f} s; with a loop: {len(loops)}, "
          f"{sum(r[2] for r in loops):.0f} s")  # fmt: skip
    per_test, count = collections.Counter(), collections.Counter()
    for test, _, seconds, _, _ in rows:
        per_test[test] += seconds
        count[test] += 1
    print(f"\n{'seconds':>8} {'compiles':>8}  test")
    for test, seconds in per_test.most_common(top):
        print(f"{seconds:8.1f} {count[test]:8d}  {test}")


if __name__ == "__main__":
    summary(*sys.argv[1:2])
