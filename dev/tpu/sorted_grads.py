# ruff: noqa: B023, E731
"""On a TPU: segment reductions with sorted ids (``indices_are_sorted=True``), their gradients
(of ``sum(out * w)``), foldax against the ``jax.ops`` program a user writes, each compiled on
its own and timed (median of 5 calls after one), printing as it goes. The peers come last:
with sorted ids their gradients take minutes to compile.

    PYTHONPATH=$PYTHONPATH:$PWD/src python dev/tpu/sorted_grads.py [E]
"""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import foldax

sys.path.insert(0, os.path.dirname(__file__))
from sorted_compile import timed


def jraph_softmax(x, ids, n, **kw):
    m = jax.lax.stop_gradient(jax.ops.segment_max(x, ids, n, **kw))
    e = jnp.exp(x - m[ids])
    return e / jax.ops.segment_sum(e, ids, n, **kw)[ids]


def jraph_lse(x, ids, n, **kw):
    m = jax.lax.stop_gradient(jax.ops.segment_max(x, ids, n, **kw))
    return m + jnp.log(jax.ops.segment_sum(jnp.exp(x - m[ids]), ids, n, **kw))


NAMES = {
    "segment_sum": jax.ops.segment_sum,
    "segment_max": jax.ops.segment_max,
    "segment_logsumexp": jraph_lse,
    "segment_softmax": jraph_softmax,
}


def main(e: int):
    v = e // 10
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((e, 128)), jnp.float32)
    ids = jnp.asarray(np.sort(rng.integers(0, v, e)), jnp.int32)
    out = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "E": e, "rows": {}}
    names = os.environ.get("SORTED_NAMES", ",".join(NAMES)).split(",")
    ways = [(n, "foldax") for n in names] + [(n, "jax.ops") for n in names]
    for name, who in ways:
        f = getattr(foldax, name) if who == "foldax" else NAMES[name]
        w = jnp.asarray(rng.standard_normal((e if "softmax" in name else v, 128)), jnp.float32)
        # ids and the cotangent's weights are arguments: closed over, they are constants of
        # the program, and XLA:TPU takes seconds to minutes over a constant of 0.2-2 GB
        fwd = lambda x, ids, w: f(x, ids, v, indices_are_sorted=True)
        loss = lambda x, ids, w: jnp.sum(fwd(x, ids, w) * w)
        for what, h in (("fwd", fwd), ("grad", jax.grad(loss))):
            if what not in os.environ.get("SORTED_WHAT", "fwd,grad"):
                continue
            r = timed(h, x, ids, w)
            out["rows"][f"{name} {what} {who}"] = r
            print(
                f"{name} {what} {who}: compile {r['compile_s']:.1f} s, {r['ms']:.2f} ms", flush=True
            )
            with open(os.path.join(os.environ.get("OUT", "/tmp"), "sorted_grads.json"), "w") as fh:
                json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4_000_000)
