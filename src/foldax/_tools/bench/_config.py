"""What a ``foldax bench`` run is and where it runs: the workload names, the README markers
and plot folder, the sizes of a full and a quick run (and of the test suite's tiny run), the
peers compared against (and whether each is installed), and the machine's description."""

from __future__ import annotations

import dataclasses
import os
import platform

import jax
import numpy as np

WORKLOADS = (
    "seed",
    "likelihood",
    "precomputed",
    "graph",
    "s4",
    "gaussian",
    "nearest",
    "attention",
    "packed",
    "overhead",
    "sharded",
    "keops_users",
    "lm_loss",
)
README_START = "<!-- bench-results:start -->"
README_END = "<!-- bench-results:end -->"
PLOT_DIR = "bench"


def _lm_cases(tokens: tuple, vocabularies: tuple) -> tuple:
    """The lm_loss workload's ``(T, V, dtype)`` cases: every T with every V in float32, then
    the smallest pair in bfloat16."""
    grid = tuple((t, v, "float32") for t in tokens for v in vocabularies)
    return (*grid, (tokens[0], vocabularies[0], "bfloat16"))


@dataclasses.dataclass(frozen=True)
class Config:
    """Sizes of one run (``FULL``, ``QUICK`` or the test suite's ``TINY``)."""

    repeats: int
    seed_cases: tuple  # (repeat, shrink, with the slicing loop)
    precomputed_n: int
    s4_ns: tuple
    s4_h: int
    s4_l: int
    gauss_n: int
    att_n: int
    sharded: tuple  # (repeat, shrink)
    overhead_pairs: int = 4000  # M = N of the pairwise call whose overhead is measured
    graph: tuple = (1_000_000, 100_000)  # (edges, nodes)
    packed: tuple = (8192, 16384)  # sequence lengths of packed attention
    overhead_shrink: int = 1  # divides the seed sizes of the overhead workload's compile rows
    likelihood_shrink: int = 1  # divides the seed sizes of the likelihood workload
    kmin_ks: tuple = (5, 16, 32, 64, 128)  # the k of the nearest workload's k-min rows
    seed_segments: int | None = None  # the seed workload's first segments only (None: all 123)
    keops_n: int = 20_000  # keops_users: M = N of the 3-D rows (kernel matrix, k-NN, floor)
    keops_rs: tuple = (1, 8, 32)  # keops_users: the R of the kernel matrix times V (N, R)
    keops_digits: tuple = (60_000, 1_000)  # keops_users: (rows, queries) of the 784-D k-NN
    keops_chamfer: tuple = (8, 20_000, 30_000)  # keops_users: (pairs, points of x, of y)
    keops_floor: int = 4096  # keops_users: side of the square of values of the floor's rates
    # lm_loss: the (tokens T, vocabulary V, dtype) of each case, the hidden size D, and the
    # rounds timed (fewer than ``repeats``: a round of the largest case takes a minute on 2 cores)
    lm_cases: tuple = _lm_cases((4096, 8192), (32768, 131072))
    lm_d: int = 512
    lm_repeats: int = 3
    # the N of the calls whose overhead is measured (pairwise: min(N, overhead_pairs))
    overhead_sizes: tuple = (1_000, 100_000)


FULL = Config(
    7, ((1, 1, True), (10, 1, False)), 50_000_000, (64, 256, 512), 256, 1024, 20_000, 4096, (10, 1)
)
#: A quick run: the cases at smaller sizes than a full run's (its figures compare with each
#: other, not with a full run's), each time a median of 5 runs (fewer say little on a machine
#: that is doing anything else); under 2 minutes on 2 cores, where most of a step is compiling:
#: the seed at its own size alone, without its slicing loop (which compiles a slice per
#: segment: 20 of 150 s), calls' overhead at one size, fewer k-min, LM-loss and packed cases.
QUICK = Config(
    5,
    ((1, 1, False),),
    2_000_000,
    (32, 128),
    32,
    256,
    2_000,
    512,
    (1, 10),
    2000,
    (100_000, 10_000),
    (512,),
    10,
    likelihood_shrink=10,
    kmin_ks=(5, 16),
    keops_n=2000,
    keops_rs=(1, 32),
    keops_digits=(3000, 100),
    keops_chamfer=(4, 2000, 3000),
    keops_floor=1024,
    lm_cases=_lm_cases((512,), (4096, 16384)),
    lm_repeats=3,
    overhead_sizes=(1_000,),
)
#: The test suite's run: every case of a quick run (the same cases, so the same steps), at the
#: smallest sizes that still exercise each. Not a command-line option: ``--quick`` runs it when
#: the environment sets ``FOLDAX_BENCH_TINY=1`` (tests/test_bench.py does); ``results.json``
#: records the sizes under ``config``.
TINY = dataclasses.replace(
    QUICK,
    repeats=1,
    seed_cases=((1, 100, False),),
    precomputed_n=20_000,
    s4_ns=(8, 16),
    s4_h=4,
    s4_l=32,
    gauss_n=200,
    att_n=64,
    sharded=(1, 1000),
    overhead_pairs=200,
    graph=(2_000, 200),
    packed=(64,),
    overhead_shrink=1000,
    likelihood_shrink=1000,
    seed_segments=16,
    keops_n=200,
    keops_digits=(500, 50),
    keops_chamfer=(2, 100, 150),
    keops_floor=64,
    # V a multiple of 2048, Tokamax's vocabulary block (see lm_loss's note)
    lm_cases=_lm_cases((64,), (2048, 4096)),
    lm_d=32,
    lm_repeats=1,
)
TINY_ENV = "FOLDAX_BENCH_TINY"


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    dev = jax.devices()[0]
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "backend": jax.default_backend(),
        "device": getattr(dev, "device_kind", str(dev)),
        "jax": jax.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def machine_line(m: dict) -> str:
    return (
        f"{m['cpu']}, {m['cores']} cores visible, jax {m['jax']} ({m['backend']}: {m['device']}), "
        f"numpy {m['numpy']}, Python {m['python']}"
    )


#: The entry of ``PEERS`` that draws the plots.
MATPLOTLIB = "plots (matplotlib)"
#: peer -> (module to import, the extra that brings it)
PEERS = {
    "torch.segment_reduce": ("torch", ".[torch]"),
    "pykeops": ("pykeops", ".[keops]"),
    MATPLOTLIB: ("matplotlib", ".[plot]"),
}


#: Peers that a workload adds only where they are installed, never reported as skipped (no
#: extra of foldax brings them: each needs jax >= 0.11, so Python >= 3.12): peer -> module
OPTIONAL_PEERS = {
    "tokamax": "tokamax",
    "jax-cce": "jax_cce",
}


def available(peer: str) -> bool:
    import importlib.util

    module = PEERS[peer][0] if peer in PEERS else OPTIONAL_PEERS[peer]
    return importlib.util.find_spec(module) is not None


#: The baseline each workload's ratios are taken against ("time / baseline").
BASELINE = {
    "seed": "global-max segment_sum",
    "likelihood": "pad-and-scan",
    "precomputed": "floor: jnp.exp(x).sum()",
    "graph": "jax.ops (jraph's way)",
    "s4": "naive broadcast",
    "gaussian": "dense XLA",
    "nearest": "pykeops (CPU)",
    "attention": "jax.nn.dot_product_attention",
    "packed": "jax.nn.dot_product_attention",
    "overhead": "without foldax",
    "sharded": "1 device(s)",
    "keops_users": "pykeops (CPU)",
    "lm_loss": "plain (T x V logits)",
}


def format_time(s):
    """Seconds as µs, ms or s."""
    if s is None:
        return "n/a"
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    return f"{s * 1e3:.1f} ms" if s < 10 else f"{s:.1f} s"
