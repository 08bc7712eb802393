# ruff: noqa: B023, E731
"""On a TPU: the families that are not matrix products (segment reductions, the seed's ragged
log-sum-exp, S4's Cauchy kernel, an elementwise pairwise kernel) against the op a TPU user calls
instead. One process, every way in turns; writes ``$OUT/families.json`` and prints a table.

    PYTHONPATH=$PYTHONPATH:$PWD/src python dev/tpu/families.py [quick] [SECTION ...]

SECTIONs: segments, seed, cauchy, laplace (all by default), cauchy_sweep (budgets; env
``CAUCHY_BUDGETS``). ``FAMILIES_SEGMENTS`` / ``FAMILIES_ORDERS`` limit the segment rows.
"""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import run

import foldax
from foldax._tools import workloads as wl

QUICK = run.QUICK
results = run.results


def save():
    with open(os.path.join(run.OUT, "families.json"), "w") as fh:
        json.dump(results, fh, indent=1)


_row = run.row


def row(*args):
    """The runner's row, saved at once (a later step may not finish)."""
    _row(*args)
    save()


run.row = row


def err(a, b) -> float:
    """Largest difference relative to the largest magnitude (NaN if either is not finite),
    computed on the device (the arrays are GiBs)."""
    a, b = (jax.tree.leaves(t)[0] for t in (a, b))
    finite = bool(jnp.all(jnp.isfinite(a)) & jnp.all(jnp.isfinite(b)))
    if not finite:
        return float("nan")
    return float(jnp.max(jnp.abs(a - b)) / jnp.maximum(1.0, jnp.max(jnp.abs(b))))


def plain_lse(x, ids, n, **kw):
    m = jax.lax.stop_gradient(jax.ops.segment_max(x, ids, n, **kw))
    return m + jnp.log(jax.ops.segment_sum(jnp.exp(x - m[ids]), ids, n, **kw))


def plain_softmax(x, ids, n, **kw):
    m = jax.lax.stop_gradient(jax.ops.segment_max(x, ids, n, **kw))
    e = jnp.exp(x - m[ids])
    return e / jax.ops.segment_sum(e, ids, n, **kw)[ids]


def plain_mean(x, ids, n, **kw):
    s = jax.ops.segment_sum(x, ids, n, **kw)
    c = jax.ops.segment_sum(jnp.ones(x.shape[:1], x.dtype), ids, n, **kw)
    return s / jnp.maximum(c, 1)[:, None]


PEERS = {
    "segment_sum": jax.ops.segment_sum,
    "segment_max": jax.ops.segment_max,
    "segment_min": jax.ops.segment_min,
    "segment_mean": plain_mean,
    "segment_logsumexp": plain_lse,
    "segment_softmax": plain_softmax,
}


def segment_rows():
    """E messages to V nodes, F features, ids unsorted and sorted; forward and gradient."""
    e, v, feat = (400_000, 40_000, 128) if QUICK else (4_000_000, 400_000, 128)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((e, feat)), jnp.float32)
    names = os.environ.get("FAMILIES_SEGMENTS", ",".join(PEERS)).split(",")
    orders = os.environ.get("FAMILIES_ORDERS", "unsorted,sorted").split(",")
    for order in orders:
        raw = rng.integers(0, v, e)
        ids = jnp.asarray(np.sort(raw) if order == "sorted" else raw, jnp.int32)
        kw = {"indices_are_sorted": True} if order == "sorted" else {}
        for name in names:
            ours = lambda x, i: getattr(foldax, name)(x, i, v, **kw)
            peer = lambda x, i: PEERS[name](x, i, v, **kw)
            w = jnp.asarray(rng.standard_normal((v, feat) if "softmax" not in name else (e, feat)))
            w = w.astype(jnp.float32)
            # the weights are an argument: closed over, they are a constant of the program,
            # and XLA:TPU takes 15-145 s to compile a gradient over a constant of 0.2-2 GB
            wsum = lambda out, w: jnp.sum(out * w[: out.shape[0]])
            g = lambda f: lambda x, i, w: jax.grad(lambda x: wsum(f(x, i), w))(x)
            run.row(
                f"{name} {order} E={e} V={v} F={feat} fwd",
                {"foldax": ours, "jax.ops": peer},
                (x, ids),
            )
            run.row(f"{name} {order} grad", {"foldax": g(ours), "jax.ops": g(peer)}, (x, ids, w))
            part = (x[: e // 10], ids[: e // 10], w)  # (both gradients at once at full size
            # and jax.ops' temp fill the chip's memory)
            diff = err(jax.jit(g(ours))(*part), jax.jit(g(peer))(*part))
            results["rows"][-1]["grad_err"] = diff
            print(f"  gradient's relative difference: {diff:.2e}", flush=True)
            save()


def seed_rows():
    """The seed's ragged log-sum-exp, vmapped over B = 10 thetas, and its gradient; and the
    gradient vmapped over B = 1,000 at a tenth of the rows (temp)."""
    p = wl.seed_problem(shrink=10 if QUICK else 1)
    ways = {k: wl.forward_and_grad(f(p.sizes)) for k, f in wl.WAYS.items() if k != "slicing loop"}
    run.row(f"seed N={p.n} B=10 fwd", {k: f for k, (f, _) in ways.items()}, (p.thetas, p.x))
    run.row(f"seed N={p.n} B=10 grad", {k: g for k, (_, g) in ways.items()}, (p.thetas, p.x))
    save()
    q = wl.seed_problem(shrink=10, batch=1000)
    ways = {
        k: wl.forward_and_grad(f(q.sizes))[1] for k, f in wl.WAYS.items() if k != "slicing loop"
    }
    ways.pop("pad-and-scan")  # its residuals at B = 1,000: tens of GiB
    run.row(f"seed N={q.n} B=1000 grad", ways, (q.thetas, q.x))
    save()


def cauchy_rows():
    cases = [(64, 4096, True), (512, 16_384, False)]
    for n, length, fwd in cases[:1] if QUICK else cases:
        p = wl.s4_problem(n, h=256, length=length)
        ways = {"foldax": wl.s4_foldax, "broadcast": wl.s4_naive}
        if fwd:
            run.row(f"cauchy H=256 L={length} N={n} fwd", ways, (p.v, p.z, p.w))
        grads = {k: wl.s4_grad(f) for k, f in ways.items()}
        run.row(f"cauchy H=256 L={length} N={n} grad", grads, (p.v, p.z, p.w))
        results["rows"][-1]["grad_err"] = err(
            jax.jit(grads["foldax"])(p.v, p.z, p.w), jax.jit(grads["broadcast"])(p.v, p.z, p.w)
        )
        save()


def cauchy_sweep():
    """Cauchy's time and temp under memory budgets from 16 MiB (the default) up, and with the
    whole ``(L, N)`` of a channel as one tile: which step a TPU wants (``CAUCHY_BUDGETS`` in
    MiB, comma-separated)."""
    budgets = [int(b) for b in os.environ.get("CAUCHY_BUDGETS", "16,64,256,1024").split(",")]
    for n, length in ((64, 4096), (512, 16_384)):
        p = wl.s4_problem(n, h=256, length=length)
        ways = {}
        for mib in budgets:

            def ours(v, z, w, mib=mib):
                with foldax.memory_budget(mib * 2**20):
                    return wl.s4_grad(wl.s4_foldax)(v, z, w)

            ways[f"budget {mib} MiB"] = ours
        whole = lambda v, z, w: wl.s4_grad(
            lambda v, z, w: foldax.cauchy(v, z, w, block_size=(length, n))
        )(v, z, w)
        ways["one tile"] = whole
        ways["broadcast"] = wl.s4_grad(wl.s4_naive)
        run.row(f"cauchy sweep H=256 L={length} N={n} grad", ways, (p.v, p.z, p.w))


def laplace_rows():
    n = 98_304
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((n, 3)) * 0.3, jnp.float32)
    b = jnp.asarray(rng.standard_normal((n, 1)), jnp.float32)
    lap = lambda a, c: jnp.exp(-jnp.sum(jnp.abs(a - c[0]))) * c[1]
    ours = lambda x, b: foldax.pairwise_reduce(lap, x, (x, b), reduction="sum")

    def lmap(x, b, block=1024):
        def one(xb):
            return jnp.exp(-jnp.abs(xb[:, None] - x[None]).sum(-1)) @ b

        return jax.lax.map(one, x.reshape(-1, block, 3)).reshape(n, -1)

    run.row(f"laplace kernel sum N={n}", {"foldax": ours, "lax.map": lmap}, (x, b))
    results["rows"][-1]["err"] = err(jax.jit(ours)(x, b), jax.jit(lmap)(x, b))
    save()


SECTIONS = {
    "segments": segment_rows,
    "seed": seed_rows,
    "cauchy": cauchy_rows,
    "laplace": laplace_rows,
    "cauchy_sweep": cauchy_sweep,
}

if __name__ == "__main__":
    run.main(SECTIONS, save, [name for name in SECTIONS if name != "cauchy_sweep"])
