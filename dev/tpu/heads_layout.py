# ruff: noqa: E731
"""On a TPU: can an attention kernel read and write the user's ``(T, H, D)`` layout in place,
every head of a block of positions per grid step, at the speed of the heads-major layout?

A ``(T, H, D)`` array whose ``H`` is a multiple of the sublane tiling (16 for bfloat16) and
``D == 128`` has the same bytes as ``(T * H, D)``: a block of ``bt * H`` rows is ``bt``
positions of every head, and head ``h`` is every ``H``-th row from ``h`` (a strided load).
Stand-alone flash-attention forwards (no mask, online softmax in VMEM scratch), timed in turns:

* ``heads_major``: ``(H, T, D)`` arrays, grid ``(H, T / bt, S / bs)`` (what foldax's kernels
  read today);
* ``moved``: ``(T, H, D)`` arrays moved to ``(H, T, D)`` and back by XLA around the same kernel
  (what a user in that layout pays today: the moves' temp);
* ``strided``: ``(T * H, D)`` views, grid ``(T / bt, S / bs)``, each head's rows by a strided
  load, the output by strided stores;
* ``reshaped``: the same blocks, each loaded whole, reshaped ``(bt, H, D)`` and indexed;
* ``batched``: the same blocks as one product batched over the heads (``einsum``).

    PYTHONPATH=$PYTHONPATH:$PWD/src python dev/tpu/heads_layout.py [T ...]

Writes ``$OUT/heads_layout.json``: per way the median of 7 calls after a warm-up, the first
call, XLA's temp bytes and the largest error against ``heads_major``."""

from __future__ import annotations

import functools
import json
import os
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

OUT = os.environ.get("OUT", "/tmp")
H, D, BT, BS = 16, 128, 512, 512
F32 = jnp.float32


def _online(q, k, v, m_ref, l_ref, acc_ref, at):
    """One tile's online-softmax update of the states at ``at`` (a scratch index)."""
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=F32)
    m_prev, l_prev = m_ref[at], l_ref[at]  # (bt, 128), lanes alike
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    p = jnp.exp(s - m_new[:, :1])
    alpha = jnp.exp(m_prev - m_new)
    l_ref[at] = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
    m_ref[at] = m_new
    pv = jnp.dot(p.astype(v.dtype), v, preferred_element_type=F32)
    acc_ref[at] = acc_ref[at] * alpha[:, :1] + pv


def _init(m_ref, l_ref, acc_ref):
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, F32)
    l_ref[...] = jnp.zeros(l_ref.shape, F32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, F32)


def heads_major(q, k, v):
    """(H, T, D) -> (H, T, D)."""
    h, t, d = q.shape

    def kernel(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref):
        j = pl.program_id(2)

        @pl.when(j == 0)
        def _():
            _init(m_ref, l_ref, acc_ref)

        _online(q_ref[...], k_ref[...], v_ref[...], m_ref, l_ref, acc_ref, slice(None))

        @pl.when(j == pl.num_programs(2) - 1)
        def _():
            o_ref[...] = (acc_ref[...] / l_ref[...][:, :1]).astype(o_ref.dtype)

    return pl.pallas_call(
        kernel,
        grid=(h, t // BT, k.shape[1] // BS),
        in_specs=[
            pl.BlockSpec((None, BT, d), lambda hh, i, j: (hh, i, 0)),
            pl.BlockSpec((None, BS, d), lambda hh, i, j: (hh, j, 0)),
            pl.BlockSpec((None, BS, d), lambda hh, i, j: (hh, j, 0)),
        ],
        out_specs=pl.BlockSpec((None, BT, d), lambda hh, i, j: (hh, i, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        scratch_shapes=[pltpu.VMEM((BT, 128), F32)] * 2 + [pltpu.VMEM((BT, d), F32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=INTERPRET,
    )(q, k, v)


def moved(q, k, v):
    """(T, H, D) -> (T, H, D) through the heads-major kernel (XLA moves the heads)."""
    to = lambda a: jnp.swapaxes(a, 0, 1)
    return to(heads_major(to(q), to(k), to(v)))


def _every_head(kernel, q, k, v):
    """``kernel`` over ``(T * H, D)`` views of ``(T, H, D)`` arrays: blocks of ``BT`` (``BS``)
    positions of every head, per-head states ``(H, BT, ...)`` in scratch."""
    t, h, d = q.shape
    flat = lambda a: a.reshape(a.shape[0] * h, d)
    out = pl.pallas_call(
        kernel,
        grid=(t // BT, k.shape[0] // BS),
        in_specs=[
            pl.BlockSpec((BT * h, d), lambda i, j: (i, 0)),
            pl.BlockSpec((BS * h, d), lambda i, j: (j, 0)),
            pl.BlockSpec((BS * h, d), lambda i, j: (j, 0)),
        ],
        out_specs=pl.BlockSpec((BT * h, d), lambda i, j: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((t * h, d), q.dtype),
        scratch_shapes=[pltpu.VMEM((h, BT, 128), F32)] * 2 + [pltpu.VMEM((h, BT, d), F32)],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"), vmem_limit_bytes=100 * 2**20
        ),
        interpret=INTERPRET,
    )(flat(q), flat(k), flat(v))
    return out.reshape(t, h, d)


def in_place(q, k, v, *, strided):
    """(T, H, D) -> (T, H, D), every head of ``BT`` positions per step, read in place."""
    h, d = q.shape[1:]

    def head(ref, hh, rows):
        if strided:
            return ref[pl.ds(hh, rows, stride=h), :]
        return ref[...].reshape(rows, h, d)[:, hh, :]

    def kernel(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref):
        j = pl.program_id(1)

        @pl.when(j == 0)
        def _():
            _init(m_ref, l_ref, acc_ref)

        for hh in range(h):
            qh, kh, vh = head(q_ref, hh, BT), head(k_ref, hh, BS), head(v_ref, hh, BS)
            _online(qh, kh, vh, m_ref, l_ref, acc_ref, hh)

        @pl.when(j == pl.num_programs(1) - 1)
        def _():
            outs = [(acc_ref[hh] / l_ref[hh][:, :1]).astype(o_ref.dtype) for hh in range(h)]
            if strided:
                for hh, out in enumerate(outs):
                    o_ref[pl.ds(hh, BT, stride=h), :] = out
            else:
                o_ref[...] = jnp.stack(outs, axis=1).reshape(BT * h, d)

    return _every_head(kernel, q, k, v)


def batched(q, k, v):
    """(T, H, D) -> (T, H, D), every head of ``BT`` positions per step, as one batched product
    (``einsum`` over the heads: what a fold whose pairs are per-head logits would trace)."""
    h, d = q.shape[1:]

    def kernel(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref):
        j = pl.program_id(1)

        @pl.when(j == 0)
        def _():
            _init(m_ref, l_ref, acc_ref)

        qb = q_ref[...].reshape(BT, h, d)
        kb, vb = k_ref[...].reshape(BS, h, d), v_ref[...].reshape(BS, h, d)
        s = jnp.einsum("thd,shd->hts", qb, kb, preferred_element_type=F32)
        m_prev, l_prev = m_ref[...], l_ref[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=2, keepdims=True))
        p = jnp.exp(s - m_new[..., :1])
        alpha = jnp.exp(m_prev - m_new)
        l_ref[...] = alpha * l_prev + jnp.sum(p, axis=2, keepdims=True)
        m_ref[...] = m_new
        pv = jnp.einsum("hts,shd->htd", p.astype(vb.dtype), vb, preferred_element_type=F32)
        acc_ref[...] = acc_ref[...] * alpha[..., :1] + pv

        @pl.when(j == pl.num_programs(1) - 1)
        def _():
            out = (acc_ref[...] / l_ref[...][..., :1]).astype(o_ref.dtype)  # (H, BT, D)
            o_ref[...] = jnp.swapaxes(out, 0, 1).reshape(BT * h, d)

    return _every_head(kernel, q, k, v)


U32 = jnp.uint32
HIGH = 0xFFFF0000  # a 32-bit word's upper half


def _unpack(words):
    """``(rows, D)`` uint32 words of two bfloat16 each -> ``(low, high)`` bfloat16 arrays
    (exact: a bfloat16 is a float32's upper half)."""
    low = jax.lax.bitcast_convert_type(words << 16, F32)
    high = jax.lax.bitcast_convert_type(words & U32(HIGH), F32)
    return low.astype(jnp.bfloat16), high.astype(jnp.bfloat16)


def _pack(low, high):
    """Two float32 arrays, each rounded to bfloat16, as uint32 words ``(high << 16) | low``."""
    bits = lambda a: jax.lax.bitcast_convert_type(a.astype(jnp.bfloat16).astype(F32), U32)
    return (bits(low) >> 16) | (bits(high) & U32(HIGH))


def _pair_step(qw, kw, vw, ow, m_ref, l_ref, acc_ref):
    """One grid step of two heads from uint32 word refs (rows ``position * H / 2 + pair``):
    their online softmax, and at the last block of keys their outputs packed into ``ow``."""
    j, p = pl.program_id(1), pl.program_id(2)
    half = qw.shape[0] // BT
    words = lambda ref, rows: ref[pl.ds(p, rows, stride=half), :]
    qs, ks, vs = _unpack(words(qw, BT)), _unpack(words(kw, BS)), _unpack(words(vw, BS))
    for e in range(2):
        _online(qs[e], ks[e], vs[e], m_ref, l_ref, acc_ref, 2 * p + e)

    @pl.when(j == pl.num_programs(1) - 1)
    def _():
        outs = [acc_ref[2 * p + e] / l_ref[2 * p + e][:, :1] for e in range(2)]
        ow[pl.ds(p, BT, stride=half), :] = _pack(*outs)


def _pairs_call(kernel, args, h, per, dtype, scratch):
    """``kernel`` on the grid ``(T / bt, S / bs, H / 2)`` over ``(positions * per, D)`` arrays
    (``per`` rows a position), each head's states ``(H, BT, ...)`` then ``scratch``."""
    (t, d), s = (args[0].shape[0] // per, args[0].shape[1]), args[1].shape[0] // per
    return pl.pallas_call(
        kernel,
        grid=(t // BT, s // BS, h // 2),
        in_specs=[
            pl.BlockSpec((BT * per, d), lambda i, j, p: (i, 0)),
            pl.BlockSpec((BS * per, d), lambda i, j, p: (j, 0)),
            pl.BlockSpec((BS * per, d), lambda i, j, p: (j, 0)),
        ],
        out_specs=pl.BlockSpec((BT * per, d), lambda i, j, p: (i, 0)),
        out_shape=jax.ShapeDtypeStruct((t * per, d), dtype),
        scratch_shapes=[pltpu.VMEM((h, BT, 128), F32)] * 2
        + [pltpu.VMEM((h, BT, d), F32), *scratch],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary"),
            vmem_limit_bytes=100 * 2**20,
        ),
        interpret=INTERPRET,
    )(*args)


def pairs(q, k, v):
    """(T, H, D) -> (T, H, D) in place, two heads per grid step. The ``(T * H, D)`` bfloat16
    blocks are read as uint32 words (Pallas' bitcast packs rows ``2r`` and ``2r + 1`` into
    word row ``r``, the even row in the low half), so the words of heads ``2p`` and ``2p + 1``
    are every ``H / 2``-th word row from ``p``: a strided load of 32-bit values, which Mosaic
    lowers from a uint32 ref (from a bitcast bfloat16 ref it crashes, and a 16-bit strided
    load it refuses): each block is copied as words into uint32 scratch when it arrives. The
    grid ``(T / bt, S / bs, H / 2)`` walks the head pairs innermost: the blocks of every head
    stay in VMEM while it does, so each is loaded once, and the body is two heads' code (the
    per-head loop's 16 took 32 s to compile)."""
    t, h, d = q.shape
    half = h // 2

    def kernel(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, qw, kw, vw, ow):
        j, p = pl.program_id(1), pl.program_id(2)

        @pl.when((j == 0) & (p == 0))
        def _():
            _init(m_ref, l_ref, acc_ref)
            qw[...] = pltpu.bitcast(q_ref[...], U32)

        @pl.when(p == 0)
        def _():
            kw[...] = pltpu.bitcast(k_ref[...], U32)
            vw[...] = pltpu.bitcast(v_ref[...], U32)

        _pair_step(qw, kw, vw, ow, m_ref, l_ref, acc_ref)

        @pl.when((j == pl.num_programs(1) - 1) & (p == half - 1))
        def _():
            o_ref[...] = pltpu.bitcast(ow[...], o_ref.dtype)

    flat = lambda a: a.reshape(a.shape[0] * h, d)
    words = lambda rows: pltpu.VMEM((rows * half, d), U32)
    scratch = [words(BT), words(BS), words(BS), words(BT)]
    out = _pairs_call(kernel, (flat(q), flat(k), flat(v)), h, h, q.dtype, scratch)
    return out.reshape(t, h, d)


def _to_words(a):
    """``(T, H, D)`` bfloat16 -> ``(T * H / 2, D)`` uint32, rows paired as Pallas' bitcast
    pairs them (by XLA: a copy unless its layouts make it a view)."""
    r = a.shape[0] * a.shape[1]
    return jax.lax.bitcast_convert_type(a.reshape(r // 2, 2, a.shape[2]).swapaxes(1, 2), U32)


def _from_words(w, shape):
    return jax.lax.bitcast_convert_type(w, jnp.bfloat16).swapaxes(1, 2).reshape(shape)


def pairs_words(q, k, v):
    """:func:`pairs` with the blocks made words by XLA before the kernel (no copies in it)."""
    h = q.shape[1]
    half = h // 2

    def kernel(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref):
        j, p = pl.program_id(1), pl.program_id(2)

        @pl.when((j == 0) & (p == 0))
        def _():
            _init(m_ref, l_ref, acc_ref)

        _pair_step(q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref)

    out = _pairs_call(kernel, (_to_words(q), _to_words(k), _to_words(v)), h, half, U32, [])
    return _from_words(out, q.shape)


WAYS = {
    "heads_major": (heads_major, "HTD"),
    "moved": (moved, "THD"),
    "strided": (functools.partial(in_place, strided=True), "THD"),
    "reshaped": (functools.partial(in_place, strided=False), "THD"),
    "batched": (batched, "THD"),
    "pairs": (pairs, "THD"),
    "pairs_words": (pairs_words, "THD"),
}
if os.environ.get("HEADS_WAYS"):  # e.g. heads_major,moved,pairs (the others compile for long)
    WAYS = {w: WAYS[w] for w in os.environ["HEADS_WAYS"].split(",")}


def _temp(fn, args):
    try:
        mem = jax.jit(fn).lower(*args).compile().memory_analysis()
        return None if mem is None else mem.temp_size_in_bytes / 2**20
    except Exception:
        return None


INTERPRET = os.environ.get("HEADS_INTERPRET") == "1"


def main():
    lengths = [int(a) for a in sys.argv[1:]] or [4096, 16384]
    rows = []
    print(jax.devices()[0].device_kind, jax.__version__, flush=True)
    for t in lengths:
        key = jax.random.split(jax.random.key(0), 3)
        thd = [jax.random.normal(kk, (t, H, D), jnp.bfloat16) for kk in key]
        htd = [jnp.swapaxes(a, 0, 1) for a in thd]
        ref = None
        fns = {}
        for name, (fn, layout) in WAYS.items():
            args = thd if layout == "THD" else htd
            row = dict(name=name, t=t)
            try:
                f = jax.jit(fn)
                t0 = time.perf_counter()
                out = jax.block_until_ready(f(*args))
                row["first_s"] = time.perf_counter() - t0
                out = np.asarray(out.astype(F32))
                out = out if layout == "THD" else np.swapaxes(out, 0, 1)
                ref = out if ref is None else ref
                row["err"] = float(np.max(np.abs(out - ref)))
                row["temp_mib"] = _temp(fn, args)
                fns[name] = (f, args)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
                row["trace"] = traceback.format_exc()[-3000:]
            rows.append(row)
        times = {n: [] for n in fns}
        for _ in range(7):  # in turns
            for n, (f, args) in fns.items():
                t0 = time.perf_counter()
                jax.block_until_ready(f(*args))
                times[n].append(time.perf_counter() - t0)
        for row in rows:
            if row["t"] == t and row["name"] in times:
                row["ms"] = 1e3 * float(np.median(times[row["name"]]))
        for row in rows[-len(WAYS) :]:
            print({k: v for k, v in row.items() if k != "trace"}, flush=True)
        with open(os.path.join(OUT, "heads_layout.json"), "w") as fh:
            json.dump(
                dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows),
                fh,
                indent=1,
            )


if __name__ == "__main__":
    main()
