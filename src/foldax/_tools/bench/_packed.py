"""The ``packed`` workload of ``foldax bench``: packed-sequence causal attention (16 documents
in one sequence of L tokens, as language models are trained; one head, D = 64, float32),
``foldax.dot_product_attention`` with ``segment_ids`` against ``jax.nn.dot_product_attention``
with the equivalent ``(L, L)`` mask and against foldax with the causal mask alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..._memory import report
from ._config import Config
from ._measure import _row
from ._progress import Progress

PEER = "jax.nn.dot_product_attention"
DOCUMENTS = 16


def documents(length, count=DOCUMENTS, seed=0):
    """``(length,)`` sorted document ids: ``count`` documents of random lengths."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.choice(np.arange(1, length), count - 1, replace=False))
    return np.searchsorted(cuts, np.arange(length), side="right").astype(np.int32)


def _programs():
    import foldax

    def packed(q, k, v, ids):
        return foldax.dot_product_attention(q, k, v, is_causal=True, segment_ids=ids)

    def causal(q, k, v, ids):
        return foldax.dot_product_attention(q, k, v, is_causal=True)

    def peer(q, k, v, ids):
        same = ids[0][:, None] == ids[0][None, :]
        return jax.nn.dot_product_attention(q, k, v, mask=same[None, None], is_causal=True)

    return {PEER: peer, "foldax": packed, "foldax causal only": causal}


def _reference(q, k, v, ids):
    """float64 packed causal attention, one query block at a time (no (L, L) float64 array)."""
    q, k, v = (np.asarray(a, np.float64)[0, :, 0] for a in (q, k, v))
    ids = np.asarray(ids)[0]
    out = np.empty_like(q)
    for s in range(0, len(q), 1024):
        rows = np.arange(s, min(s + 1024, len(q)))
        logits = q[rows] @ k.T / np.sqrt(q.shape[1])
        keep = (ids[rows, None] == ids[None, :]) & (np.arange(len(k))[None, :] <= rows[:, None])
        logits = np.where(keep, logits, -np.inf)
        p = np.exp(logits - logits.max(1, keepdims=True))
        out[rows] = (p / p.sum(1, keepdims=True)) @ v
    return out


def bench_packed(cfg: Config, prog: Progress) -> list[dict]:
    """Forward and gradient of each program at every length of ``cfg.packed``, timed in turns."""
    from .. import workloads as w

    rows = []
    for length in cfg.packed:
        rng = np.random.default_rng(5)
        q, k, v = (
            jnp.asarray(rng.standard_normal((1, length, 1, 64), dtype=np.float32)) for _ in "qkv"
        )
        ids = jnp.asarray(documents(length))[None]
        args = (q, k, v, ids)
        ref = _reference(*args)
        progs = _programs()
        grads = {
            n: jax.grad(lambda q, k, v, ids, f=f: f(q, k, v, ids).sum(), (0, 1, 2))
            for n, f in progs.items()
        }
        case = f"L = {length:,}, {DOCUMENTS} documents, D = 64"
        for pass_, fns in (("forward", progs), ("gradient", grads)):
            prog.step(f"packed L = {length:,}: {pass_}")
            jitted = {n: jax.jit(f) for n, f in fns.items()}
            times = w.median_times(
                {n: (lambda f=f, a=args: f(*a)) for n, f in jitted.items()}, repeats=cfg.repeats
            )
            for n, f in fns.items():
                err = None
                if pass_ == "forward" and n != "foldax causal only":
                    got = np.asarray(jitted[n](*args))[0, :, 0]
                    err = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
                temp = report(f, *args).temp_bytes
                rows.append(_row("packed", case, n, pass_, temp, times[n], err, length=length))
    return rows
