# ruff: noqa: E731
"""On a TPU: a segment log-sum-exp's forward and gradient against float64 on the host, foldax
and the ``jax.ops`` program, and the pieces of foldax's gradient (the forward's ``(m, rel)``,
``exp(-rel)`` against ``1 / sum``), to find where an error comes from.

    PYTHONPATH=$PYTHONPATH:$PWD/src python dev/tpu/lse_accuracy.py [E,V,F]
"""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from lse_variants import inputs  # (this script's folder is on sys.path)

import foldax

OUT = os.environ.get("OUT", "/tmp")
E, V, F = map(int, (sys.argv[1] if len(sys.argv) > 1 else "400000,40000,128").split(","))


def main():
    x_np, ids_np, w_np = inputs(E, V, F)
    x, ids, w = jnp.asarray(x_np), jnp.asarray(ids_np), jnp.asarray(w_np)
    x64 = x_np.astype(np.float64)
    m = np.full((V, F), -np.inf)
    np.maximum.at(m, ids_np, x64)
    s = np.zeros((V, F))
    np.add.at(s, ids_np, np.exp(x64 - m[ids_np]))
    lse = m + np.log(s)
    grad64 = w_np[ids_np].astype(np.float64) * np.exp(x64 - lse[ids_np])

    def plain(x, i):
        mm = jax.lax.stop_gradient(jax.ops.segment_max(x, i, V, indices_are_sorted=True))
        return mm + jnp.log(jax.ops.segment_sum(jnp.exp(x - mm[i]), i, V, indices_are_sorted=True))

    ours = lambda x, i: foldax.segment_logsumexp(x, i, V, indices_are_sorted=True)
    unsorted = lambda x, i: foldax.segment_logsumexp(x, i, V)
    res = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "E,V,F": [E, V, F]}
    for name, f in (("jax.ops", plain), ("foldax", ours), ("foldax unsorted", unsorted)):
        fwd = np.asarray(jax.jit(f)(x, ids), np.float64)
        g = jax.jit(jax.grad(lambda x, i, f=f: jnp.sum(f(x, i) * w)))(x, ids)
        res[name] = {
            "fwd_err": float(np.nanmax(np.abs(fwd - lse)[s > 0])),
            "grad_err": float(np.max(np.abs(np.asarray(g, np.float64) - grad64))),
        }
        print(name, res[name], flush=True)
    # pieces, on the device: exp(-log(s)) against 1 / s; exp(x - m) against float64
    s32 = jnp.asarray(np.where(s > 0, s, 1.0), jnp.float32)
    inv = np.asarray(jax.jit(lambda s: jnp.exp(-jnp.log(s)))(s32), np.float64)
    div = np.asarray(jax.jit(lambda s: 1.0 / s)(s32), np.float64)
    ref = 1.0 / np.where(s > 0, s, 1.0).astype(np.float32).astype(np.float64)
    res["exp(-log s) rel err"] = float(np.max(np.abs(inv - ref) / ref))
    res["1/s rel err"] = float(np.max(np.abs(div - ref) / ref))
    e = np.asarray(jax.jit(lambda x, mm: jnp.exp(x - mm[ids]))(x, jnp.asarray(m, jnp.float32)))
    r = np.exp(x64 - m.astype(np.float32).astype(np.float64)[ids_np])
    res["exp rel err"] = float(np.max(np.abs(e - r) / r))
    lg = np.asarray(jax.jit(jnp.log)(s32), np.float64)
    res["log abs err"] = float(np.max(np.abs(lg - np.log(np.asarray(s32, np.float64)))))
    print({k: v for k, v in res.items() if "err" in k and isinstance(v, float)}, flush=True)
    with open(os.path.join(OUT, "lse_accuracy.json"), "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
