"""Packed-sequence causal attention: several documents in one row, each attending only within
itself, as language models are trained, with ``foldax.dot_product_attention``.

A batch of ``B`` rows of ``L`` tokens, each row packing documents of random lengths (their
``segment_ids`` sorted), goes through one attention layer with grouped-query heads (8 query
heads sharing 2 key / value heads, head size 64). foldax takes the ids themselves and skips
every block of pairs across documents, forward and backward. The usual way is
``jax.nn.dot_product_attention`` with the equivalent ``(B, 1, L, L)`` boolean mask, which
computes and stores every pair. The script checks that both agree, then prints each one's
XLA temp memory and time (in turns, median of repeats), forward and for the gradient of a loss
with respect to the layer's weights.

    python examples/packed_attention.py          # B = 2, L = 4,096, 16 documents a row
    python examples/packed_attention.py --smoke  # B = 2, L = 256, about 20 s

Measured on a shared 2-core CPU machine (``python examples/packed_attention.py``, B = 2,
L = 4,096, the layer's forward and the gradient of its loss with respect to its weights):

    forward   foldax 63.5 MB temp,  0.71 s   jax.nn 3.2 GB temp,  5.9 s
    gradient  foldax 149 MB temp,   3.4 s    jax.nn 4.4 GB temp, 11.0 s
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import foldax
from foldax.memory import format_bytes, report

HEADS, KV_HEADS, HEAD = 8, 2, 64


def packing(rng, batch, length, docs):
    """``(batch, length)`` sorted document ids: ``docs`` documents of random lengths a row."""
    rows = []
    for _ in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, length), docs - 1, replace=False))
        rows.append(np.searchsorted(cuts, np.arange(length), side="right"))
    return jnp.asarray(np.stack(rows), jnp.int32)


def init(rng, width):
    scale = 1.0 / np.sqrt(width)
    shapes = {
        "q": (width, HEADS * HEAD),
        "k": (width, KV_HEADS * HEAD),
        "v": (width, KV_HEADS * HEAD),
        "o": (HEADS * HEAD, width),
    }
    return {n: jnp.asarray(scale * rng.standard_normal(s), jnp.float32) for n, s in shapes.items()}


def layer(params, x, ids, attention):
    """One attention layer over ``x (B, L, width)``; ``attention(q, k, v, ids)`` does the rest."""
    b, n, _ = x.shape
    q = (x @ params["q"]).reshape(b, n, HEADS, HEAD)
    k = (x @ params["k"]).reshape(b, n, KV_HEADS, HEAD)
    v = (x @ params["v"]).reshape(b, n, KV_HEADS, HEAD)
    return attention(q, k, v, ids).reshape(b, n, HEADS * HEAD) @ params["o"]


def with_foldax(q, k, v, ids):
    return foldax.dot_product_attention(q, k, v, is_causal=True, segment_ids=ids)


def with_jax_nn(q, k, v, ids):
    same = ids[:, None, :, None] == ids[:, None, None, :]  # (B, 1, L, L)
    return jax.nn.dot_product_attention(q, k, v, mask=same, is_causal=True)


def loss(params, x, ids, attention):
    return jnp.mean(layer(params, x, ids, attention) ** 2)


def timed_in_turns(fns, args, repeats):
    """Median seconds of each of ``fns(*args)``, one call of each per round, after a warm-up."""
    for f in fns.values():
        jax.block_until_ready(f(*args))
    times = {n: [] for n in fns}
    for _ in range(repeats):
        for n, f in fns.items():
            t = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[n].append(time.perf_counter() - t)
    return {n: float(np.median(t)) for n, t in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="small sizes, about 20 s")
    parser.add_argument("--length", type=int, default=None, help="tokens a row (default 4096)")
    args = parser.parse_args()
    length = args.length or (256 if args.smoke else 4096)
    batch, docs, width, repeats = 2, 16, 128, 2 if args.smoke else 3
    rng = np.random.default_rng(0)
    params, ids = init(rng, width), packing(rng, batch, length, docs)
    x = jnp.asarray(rng.standard_normal((batch, length, width)), jnp.float32)
    ways = {
        "foldax.dot_product_attention(segment_ids=)": with_foldax,
        "jax.nn (L x L mask)": with_jax_nn,
    }
    fwd = {n: jax.jit(lambda p, x, i, a=a: layer(p, x, i, a)) for n, a in ways.items()}
    grad = {n: jax.jit(jax.grad(lambda p, x, i, a=a: loss(p, x, i, a))) for n, a in ways.items()}

    outs = [np.asarray(f(params, x, ids)) for f in fwd.values()]
    grads = [jax.tree.leaves(g(params, x, ids)) for g in grad.values()]
    err = np.max(np.abs(outs[0] - outs[1])) / np.max(np.abs(outs[1]))
    gerr = max(
        float(np.max(np.abs(a - b)) / np.max(np.abs(b))) for a, b in zip(*grads, strict=True)
    )
    print(
        f"B = {batch}, L = {length:,}, {docs} documents a row, {HEADS} query / {KV_HEADS} key-value heads"
    )
    print(f"max relative difference: output {err:.1e}, weights' gradient {gerr:.1e}")
    if not (err < 1e-4 and gerr < 1e-3):
        raise SystemExit("agreement check: FAILED")
    print("agreement check: passed")

    for label, fns in (("forward", fwd), ("gradient", grad)):
        secs = timed_in_turns(fns, (params, x, ids), repeats)
        print(f"\n{label} (XLA temp memory, median time):")
        for n, f in fns.items():
            temp = report(f, params, x, ids).temp_bytes
            print(f"  {n:45s} {format_bytes(temp):>10s}  {secs[n] * 1e3:9.1f} ms")


if __name__ == "__main__":
    main()
