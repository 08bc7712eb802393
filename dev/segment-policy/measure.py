"""The measurements behind foldax's CPU policy for segment reductions of plain data
(``src/foldax/_segment/_policy.py``): XLA's scatter by per-row ids against the tile walk over
contiguous segments, forward and gradient, next to the ``jax.ops`` program (jraph's for the
softmax; for the log-sum-exp and the mean, what a user writes with ``jax.ops``), timed in turns in one process (median of 7, after a warm-up), jitted, float32.

    .venv/bin/python dev/segment-policy/measure.py                 # N = 1,000,000 rows
    .venv/bin/python dev/segment-policy/measure.py --rows 200000 --reductions sum

Prints one markdown row per case: times in ms, and each way's time over the peer's. The
table in docs/design.md ("Which program plain data runs") is this script's output.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

import foldax
from foldax._segment import _policy
from foldax._tools import workloads as w
from foldax._tools.bench._graph import _jraph_softmax as jraph_softmax


def _logsumexp(x, ids, s):
    """A segment log-sum-exp as a user writes it with ``jax.ops`` (each segment's max)."""
    m = jax.lax.stop_gradient(jax.ops.segment_max(x, ids, s, indices_are_sorted=True))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.exp(x - m[ids])
    return m + jnp.log(jax.ops.segment_sum(e, ids, s, indices_are_sorted=True))


def _mean(x, ids, s):
    """A segment mean as a user writes it with ``jax.ops``."""
    tot = jax.ops.segment_sum(x, ids, s, indices_are_sorted=True)
    count = jax.ops.segment_sum(jnp.ones_like(ids, x.dtype), ids, s, indices_are_sorted=True)
    return tot / jnp.maximum(count, 1.0).reshape(-1, *[1] * (x.ndim - 1))


def _peer(reduction):
    if reduction == "softmax":  # jraph's program, as the bench's graph workload times it
        return lambda x, ids, s: jraph_softmax(x, ids, s, True)
    if reduction in ("logsumexp", "mean"):
        return {"logsumexp": _logsumexp, "mean": _mean}[reduction]
    f = getattr(jax.ops, f"segment_{reduction}")
    return lambda x, ids, s: f(x, ids, s, indices_are_sorted=True)


def _forced(reduction, sizes, walk):
    """foldax on static ``sizes``, with the policy forced to walk or to scatter."""
    f = getattr(foldax, f"segment_{reduction}")

    def run(x, ids, s):
        saved = _policy.walks_contiguous
        _policy.walks_contiguous = lambda *a: walk
        try:
            return f(x, sizes=sizes)
        finally:
            _policy.walks_contiguous = saved

    return run


def measure(n, reduction, feat, per_segment, rng, repeats=7):
    s = max(1, n // per_segment)
    ids_np = np.sort(rng.integers(0, s, n)).astype(np.int32)
    sizes = np.bincount(ids_np, minlength=s)
    ids, x = jnp.asarray(ids_np), jnp.asarray(rng.standard_normal((n, feat)), jnp.float32)
    ways = {
        "peer": _peer(reduction),
        "walk": _forced(reduction, sizes, True),
        "scatter": _forced(reduction, sizes, False),
    }
    out = {}
    for pass_ in ("forward", "gradient"):
        if pass_ == "forward":
            fns = {k: jax.jit(functools.partial(f, s=s)) for k, f in ways.items()}
        else:
            fns = {
                k: jax.jit(jax.grad(lambda x, i, f=f: jnp.sum(jnp.sin(f(x, i, s)))))
                for k, f in ways.items()
            }
        calls = {k: functools.partial(f, x, ids) for k, f in fns.items()}
        out[pass_] = w.median_times(calls, repeats=repeats)
    return s, out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--reductions", nargs="+", default=["sum", "max", "softmax"])
    p.add_argument("--features", nargs="+", type=int, default=[1, 4, 16, 64])
    p.add_argument("--per-segment", nargs="+", type=int, default=[10, 300, 100_000])
    args = p.parse_args()
    rng = np.random.default_rng(0)
    print("| reduction | F | rows / segment | pass | peer ms | walk | scatter | policy |")
    print("|---|---|---|---|---|---|---|---|")
    for red in args.reductions:
        for feat in args.features:
            for per in args.per_segment:
                s, out = measure(args.rows, red, feat, per, rng)
                walks = _policy.walks_contiguous(args.rows, s, (feat,), red == "softmax")
                policy = "walk" if walks else "scatter"
                for pass_, t in out.items():
                    peer = t["peer"]
                    print(
                        f"| {red} | {feat} | {per:,} | {pass_} | {peer * 1e3:.1f} | "
                        f"{t['walk'] / peer:.2f}x | {t['scatter'] / peer:.2f}x | {policy} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
