# ruff: noqa: B023
"""On a TPU: the Pallas contracting fold against the XLA fold (values) and against what a TPU
user calls instead (time, temp). One process; writes ``$OUT/tpu.json`` and prints a table.

    PYTHONPATH=$PYTHONPATH:$PWD/src python dev/tpu/run.py [quick] [SECTION ...]

SECTIONs: checks, attention, lengths, segments, lce, gauss, chamfer, knn (all by default),
sweep (blocks; ``SWEEP=gauss,lce`` limits its workloads, ``SWEEP_VMEM_MIB`` the VMEM budget).
"""

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

import foldax
from foldax import _engine

QUICK = "quick" in sys.argv
OUT = os.environ.get("OUT", "/tmp")
results = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "rows": []}
try:
    from importlib import metadata

    results["libtpu"] = next(
        f"{d.metadata['Name']} {d.version}"
        for d in metadata.distributions()
        if d.metadata["Name"].lower().startswith("libtpu")
    )
except StopIteration:
    results["libtpu"] = "unknown"


def temp_bytes(f, *args):
    try:
        m = jax.jit(f).lower(*args).compile().memory_analysis()
        return int(m.temp_size_in_bytes)
    except Exception:
        return -1


def timed(f, *args, reps=7):
    """Median of ``reps`` calls after the first (of 2 where the first took over 3 s)."""
    g = jax.jit(f)
    t0 = time.perf_counter()
    jax.block_until_ready(g(*args))
    first = time.perf_counter() - t0
    if first > 3:
        jax.block_until_ready(g(*args))  # (the first call compiled)
        t0 = time.perf_counter()
        jax.block_until_ready(g(*args))
        reps = 2 if time.perf_counter() - t0 > 0.3 else reps
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(g(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)), first


def row(name, ways, args):
    """Time each way in turns (median of 7 after warm-up), its temp; print one line."""
    out = {"name": name}
    for way, f in ways.items():
        try:
            med, first = timed(f, *args)
            out[way] = {"ms": med * 1e3, "first_s": first, "temp_mib": temp_bytes(f, *args) / 2**20}
        except Exception as e:
            out[way] = {"error": f"{type(e).__name__}: {str(e)[:1500]}"}
    results["rows"].append(out)
    line = " | ".join(
        f"{w}: {v['ms']:.2f} ms (1st {v['first_s']:.1f} s, temp {v['temp_mib']:.1f} MiB)"
        if "ms" in v
        else f"{w}: {v['error'][:300]}"
        for w, v in out.items()
        if w != "name"
    )
    print(f"{name}: {line}", flush=True)
    save()


def save():
    with open(os.path.join(OUT, "tpu.json"), "w") as fh:
        json.dump(results, fh, indent=1)


def with_impl(impl, f):
    def g(*a):
        with _engine.implementation(impl):
            return f(*a)

    return g


def check(name, f, args, tol):
    """The kernel's values against the XLA fold's, at highest matmul precision: the largest
    error relative to the largest magnitude of the XLA fold's (at least 1)."""
    try:
        with jax.default_matmul_precision("highest"):
            a = jax.jit(with_impl(None, f))(*args)
            b = jax.jit(with_impl("xla", f))(*args)
        pairs = list(zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
        f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
        errs = [float(jnp.max(jnp.abs(f32(x) - f32(y)))) for x, y in pairs]
        scales = [max(1.0, float(jnp.max(jnp.abs(f32(y))))) for _, y in pairs]
        finite = all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(a))
        ok = finite and all(e <= tol * s for e, s in zip(errs, scales, strict=True))
        results.setdefault("checks", []).append(
            {"name": name, "errs": errs, "scales": scales, "ok": ok}
        )
        print(f"check {name}: {'ok' if ok else 'BAD'} {errs} of {scales}", flush=True)
    except Exception:
        msg = traceback.format_exc()[-3000:]
        results.setdefault("checks", []).append({"name": name, "error": msg})
        print(f"check {name}: ERROR {msg}", flush=True)
    save()


r = np.random.default_rng(0)


def normal(shape, dtype=jnp.float32, scale=1.0):
    return jnp.asarray(r.standard_normal(shape) * scale, dtype)


def checks():
    x, y = normal((1000, 16)), normal((1300, 16))
    v = normal((1300, 8))
    soft = lambda a, b: (jnp.dot(a, b[0]), b[1])  # noqa: E731
    check(
        "softmax",
        lambda x, y, v: foldax.pairwise_reduce(soft, x, (y, v), reduction="softmax"),
        (x, y, v),
        1e-5,
    )
    dot = lambda a, b: jnp.dot(a, b)  # noqa: E731
    check(
        "logsumexp",
        lambda x, y: foldax.pairwise_reduce(dot, x, y, reduction="logsumexp"),
        (x, y),
        1e-4,
    )
    x3, y3 = normal((1000, 3)), normal((1300, 3))
    gauss = lambda a, b: jnp.exp(-jnp.sum((a - b[0]) ** 2)) * b[1]  # noqa: E731
    check(
        "gauss_sum",
        lambda x, y, v: foldax.pairwise_reduce(gauss, x, (y, v), reduction="sum"),
        (x3, y3, v),
        1e-4,
    )
    sq = lambda a, b: jnp.sum((a - b) ** 2)  # noqa: E731
    for red in ("min", "max", "argmin", "argmax", "min_argmin", "max_argmax"):
        check(
            red,
            lambda x, y, red=red: foldax.pairwise_reduce(sq, x, y, reduction=red),
            (x3, y3),
            1e-5,
        )
    q = normal((2, 1000, 4, 128), jnp.bfloat16)
    for causal in (False, True):
        check(
            f"attention causal={causal}",
            lambda q, c=causal: foldax.dot_product_attention(q, q, q, is_causal=c),
            (q,),
            2e-2,
        )
    ids = jnp.asarray(np.sort(r.integers(0, 5, (2, 1000))), jnp.int32)
    for name, kw in (
        ("window", dict(local_window_size=(200, 30))),
        ("segment_ids", dict(segment_ids=ids)),
    ):
        check(
            f"attention {name}",
            lambda q, kw=kw: foldax.dot_product_attention(q, q, q, **kw),
            (q,),
            2e-2,
        )
    lens = jnp.asarray([1000, 613], jnp.int32)
    check(
        "attention lengths",
        lambda q: foldax.dot_product_attention(
            q, q, q, query_seq_lengths=lens, key_value_seq_lengths=lens
        ),
        (q,),
        2e-2,
    )
    h, w = normal((1000, 256), jnp.bfloat16), normal((3000, 256), jnp.bfloat16, 0.06)
    lab = jnp.asarray(r.integers(0, 3000, 1000), jnp.int32)
    check("lce", lambda h, w, lab: foldax.linear_cross_entropy(h, w, lab), (h, w, lab), 1e-2)
    sqsum = lambda f: lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2)  # noqa: E731
    grads = {
        "softmax": (
            lambda x, y, v: foldax.pairwise_reduce(soft, x, (y, v), reduction="softmax"),
            (x, y, v),
        ),
        "logsumexp": (
            lambda x, y: foldax.pairwise_reduce(dot, x, y, reduction="logsumexp"),
            (x, y),
        ),
        "gauss_sum": (
            lambda x, y, v: foldax.pairwise_reduce(gauss, x, (y, v), reduction="sum"),
            (x3, y3, v),
        ),
        "min": (lambda x, y: foldax.pairwise_reduce(sq, x, y, reduction="min"), (x3, y3)),
        "max": (lambda x, y: foldax.pairwise_reduce(sq, x, y, reduction="max"), (x3, y3)),
        "min ties": (  # three rows of y nearest the first of x, two the second
            lambda x, y: foldax.pairwise_reduce(sq, x, y, reduction="min"),
            (
                x3.at[0].set(y3[3] + 0.01).at[1].set(y3[7] + 0.01),
                y3.at[500].set(y3[3]).at[900].set(y3[3]).at[1200].set(y3[7]),
            ),
        ),
        "attention causal": (lambda q: foldax.dot_product_attention(q, q, q, is_causal=True), (q,)),
        "attention window": (
            lambda q: foldax.dot_product_attention(q, q, q, local_window_size=(200, 30)),
            (q,),
        ),
        "attention lengths": (
            lambda q: foldax.dot_product_attention(q, q, q, key_value_seq_lengths=lens),
            (q,),
        ),
        "attention segment_ids": (
            lambda q: foldax.dot_product_attention(q, q, q, segment_ids=ids, is_causal=True),
            (q,),
        ),
    }
    for name, (f, args) in grads.items():
        tol = 2e-2 if args[0].dtype == jnp.bfloat16 else 1e-3  # relative
        g = jax.grad(sqsum(f), tuple(range(len(args))))
        check(f"grad {name}", g, args, tol)
        jv = lambda *a, f=f: jax.jvp(sqsum(f), a, a)[1]  # noqa: E731
        check(f"jvp {name}", jv, args, tol)
    check(
        "grad lce",
        jax.grad(lambda h, w, lab: foldax.linear_cross_entropy(h, w, lab), (0, 1)),
        (h, w, lab),
        1e-2,
    )
    check(
        "attention grad",
        jax.grad(lambda q: jnp.sum(foldax.dot_product_attention(q, q, q).astype(jnp.float32))),
        (q,),
        0.5,
    )


def segments_rows():
    """Packed sequences (documents of unequal lengths in one row, ``segment_ids``) beside
    splash given the same ids; inputs in splash's layout, as :func:`attention_rows`."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    h, d = 16, 128
    for t in (4096,) if QUICK else (4096, 16384):
        q, k, v = (normal((h, t, d), jnp.bfloat16) for _ in range(3))
        cuts = np.sort(r.choice(np.arange(1, t), 5, replace=False))
        ids = jnp.asarray(np.searchsorted(cuts, np.arange(t), side="right"), jnp.int32)
        for causal in (False, True):
            sp = splash(t, causal, h)
            seg = sk.SegmentIds(q=ids, kv=ids)
            ours = lambda q, k, v, c=causal: foldax.dot_product_attention(  # noqa: E731
                q[None].transpose(0, 2, 1, 3), k[None].transpose(0, 2, 1, 3),
                v[None].transpose(0, 2, 1, 3), is_causal=c, segment_ids=ids[None],
            )  # fmt: skip
            ways = {
                "foldax": ours,
                "foldax_xla": with_impl("xla", ours),
                "splash": lambda q, k, v, sp=sp, seg=seg: sp(q, k, v, segment_ids=seg),
            }
            row(f"attention T={t} causal={causal} 6 documents fwd", ways, (q, k, v))
            loss = lambda f: jax.grad(  # noqa: E731
                lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)), (0, 1, 2)
            )
            grads = {w: loss(f) for w, f in ways.items()}
            row(f"attention T={t} causal={causal} 6 documents grad", grads, (q, k, v))


def splash(t, causal, h):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    one = sm.CausalMask((t, t)) if causal else sm.FullMask((t, t))
    b = min(512, t)
    sizes = sk.BlockSizes(
        block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
        block_kv_dkv_compute=b, use_fused_bwd_kernel=True,
    )  # fmt: skip
    kernel = sk.make_splash_mha_single_device(sm.MultiHeadMask([one] * h), block_sizes=sizes)
    return lambda q, k, v, **kw: kernel(q * (1.0 / np.sqrt(q.shape[-1])), k, v, **kw)  # (H, T, D)


def attention_rows():
    h, d = 16, 128
    for t in (4096,) if QUICK else (4096, 16384):
        q, k, v = (normal((h, t, d), jnp.bfloat16) for _ in range(3))
        for causal in (False, True):
            sp = splash(t, causal, h)
            ours = lambda q, k, v, c=causal: foldax.dot_product_attention(  # noqa: E731
                q[None].transpose(0, 2, 1, 3), k[None].transpose(0, 2, 1, 3),
                v[None].transpose(0, 2, 1, 3), is_causal=c,
            )  # fmt: skip
            nn = lambda q, k, v, c=causal: jax.nn.dot_product_attention(  # noqa: E731
                q[None].transpose(0, 2, 1, 3), k[None].transpose(0, 2, 1, 3),
                v[None].transpose(0, 2, 1, 3), is_causal=c, implementation="xla",
            )  # fmt: skip
            ways = {"foldax": ours, "foldax_xla": with_impl("xla", ours), "splash": sp}
            if t <= 4096:
                ways["jax.nn"] = nn
            row(f"attention T={t} causal={causal} fwd", ways, (q, k, v))
            loss = lambda f: jax.grad(  # noqa: E731
                lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)), (0, 1, 2)
            )
            row(
                f"attention T={t} causal={causal} grad",
                {w: loss(f) for w, f in ways.items()},
                (q, k, v),
            )


def lengths_rows():
    """Padded batches: each sequence's keys up to its length (no splash peer: it takes none)."""
    b, h, t, d = 4, 16, 4096, 128
    q, k, v = (normal((b, t, h, d), jnp.bfloat16) for _ in range(3))
    lens = jnp.asarray([4096, 3000, 1024, 2500], jnp.int32)
    ours = lambda q, k, v: foldax.dot_product_attention(q, k, v, key_value_seq_lengths=lens)  # noqa: E731
    nn = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
        q, k, v, key_value_seq_lengths=lens, implementation="xla"
    )
    ways = {"foldax": ours, "foldax_xla": with_impl("xla", ours), "jax.nn": nn}
    row(f"attention B={b} T={t} kv lengths fwd", ways, (q, k, v))
    loss = lambda f: jax.grad(  # noqa: E731
        lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32)), (0, 1, 2)
    )
    row(f"attention B={b} T={t} kv lengths grad", {w: loss(f) for w, f in ways.items()}, (q, k, v))


def lce_rows():
    """The LM loss against the plain loss, and against Tokamax's kernels where Tokamax imports
    (``LCE_DTYPES=bfloat16,float32``; Tokamax is given ``w`` in its own ``(D, V)`` layout)."""
    t, d = 8192, 2048
    dtypes = os.environ.get("LCE_DTYPES", "bfloat16").split(",")
    for dtype, v in [(dt, v) for dt in dtypes for v in ((65_536,) if QUICK else (65_536, 131_072))]:
        h = normal((t, d), jnp.dtype(dtype))
        w = normal((v, d), jnp.dtype(dtype), 1 / np.sqrt(d))
        lab = jnp.asarray(r.integers(0, v, t), jnp.int32)

        def plain(h, w, lab):
            z = jnp.einsum("td,vd->tv", h, w, preferred_element_type=jnp.float32)
            return jnp.mean(
                jax.nn.logsumexp(z, -1) - jnp.take_along_axis(z, lab[:, None], -1)[:, 0]
            )

        ours = lambda h, w, lab: foldax.linear_cross_entropy(h, w, lab)  # noqa: E731
        ways = {"foldax": ours, "foldax_xla": with_impl("xla", ours), "plain": plain}
        ways.update(_tokamax_ways())
        name = f"lce T={t} D={d} V={v}" + ("" if dtype == "bfloat16" else f" {dtype}")
        row(f"{name} fwd", ways, (h, w, lab))
        vg = {k: jax.value_and_grad(f, (0, 1)) for k, f in ways.items()}
        row(f"{name} value_and_grad", vg, (h, w, lab))


def _tokamax_ways():
    """Tokamax's loss by its implementations, where it imports: ``w`` is read as ``(D, V)``."""
    try:
        import tokamax
    except Exception as e:  # not installed, or not for this JAX
        print(f"tokamax: not measured ({type(e).__name__}: {str(e)[:200]})", flush=True)
        return {}

    def way(impl):
        def loss(h, w, lab):
            return tokamax.linear_softmax_cross_entropy_loss(
                h, lab, w.T, reduction="mean", implementation=impl
            )

        return loss

    return {f"tokamax {impl}": way(impl) for impl in ("mosaic_tpu", "chunked_xla")}


def kernel_sum_rows():
    for n in (98_304,) if QUICK else (98_304, 1_048_576):
        x = normal((n, 3), scale=0.3)
        b = normal((n, 1))
        gauss = lambda a, c: jnp.exp(-jnp.sum((a - c[0]) ** 2)) * c[1]  # noqa: E731
        ours = lambda x, b: foldax.pairwise_reduce(gauss, x, (x, b), reduction="sum")  # noqa: E731

        def lmap(x, b, block=1024, precision=None):
            def one(xb):
                dot = functools.partial(jnp.dot, precision=precision)
                d = jnp.sum(xb**2, 1)[:, None] + jnp.sum(x**2, 1)[None] - 2 * dot(xb, x.T)
                return dot(jnp.exp(-d), b)

            return jax.lax.map(one, x.reshape(-1, block, 3)).reshape(n, -1)

        highest = functools.partial(lmap, precision=jax.lax.Precision.HIGHEST)
        ways = {"foldax": ours, "lax.map": lmap}
        if n < 500_000:  # ~12 s a call at 1M
            ways["lax.map highest"] = highest
        if n < 500_000:  # the XLA fold takes ~11 s a call at 1M
            ways["foldax_xla"] = with_impl("xla", ours)
        row(f"gauss kernel sum N={n}", ways, (x, b))
        rows = np.asarray(r.choice(n, 256, replace=False))  # errors against float64
        xs, bs = np.asarray(x, np.float64), np.asarray(b, np.float64)
        want, size = [], []
        for part in np.split(rows, 16):  # (16, N, 3) float64 at a time
            k = np.exp(-((xs[part, None] - xs[None]) ** 2).sum(-1))
            want.append(k @ bs)
            size.append(k @ np.abs(bs))
        want, size = np.concatenate(want), np.concatenate(size)
        errs = {}
        for way, f in ways.items():
            if way != "foldax_xla":
                got = np.asarray(jax.jit(f)(x, b), np.float64)[rows]
                errs[way] = float(np.max(np.abs(got - want) / size))
        results["rows"][-1]["errors"] = errs
        print(f"  relative errors (of sum |k b|) against float64: {errs}", flush=True)
        save()


def chamfer_rows():
    """The Chamfer distance of 4 pairs of 3-D clouds and its gradient, vmapped over the pairs."""
    sq = lambda a, b: jnp.sum((a - b) ** 2)  # noqa: E731

    def chamfer(x, y):
        near_x = foldax.pairwise_reduce(sq, x, y, reduction="min")
        near_y = foldax.pairwise_reduce(sq, y, x, reduction="min")
        return jnp.mean(near_x) + jnp.mean(near_y)

    sizes = (16_384,) if QUICK else (16_384, 98_304)
    light = os.environ.get("CHAMFER_SIZES")  # (only these sizes, only the gradient as chosen)
    for n in tuple(map(int, light.split(","))) if light else sizes:
        xs, ys = normal((4, n, 3)), normal((4, n, 3))
        ours = jax.vmap(jax.value_and_grad(chamfer, (0, 1)))
        if light:
            row(f"chamfer+grad 4 pairs N={n}", {"foldax": ours}, (xs, ys))
            continue
        ways = {"foldax": ours, "foldax_pallas": with_impl("pallas", ours)}
        if n < 50_000:  # (the XLA fold's gradient: ~3 s a call at 98k)
            ways["foldax_xla"] = with_impl("xla", ours)
        row(f"chamfer+grad 4 pairs N={n}", ways, (xs, ys))
        if "foldax_xla" in ways:  # the kernels' values and gradients against the XLA fold's
            want = jax.tree.leaves(jax.jit(ways["foldax_xla"])(xs, ys))
            for way in ("foldax", "foldax_pallas"):
                try:
                    got = jax.tree.leaves(jax.jit(ways[way])(xs, ys))
                    errs = [float(jnp.max(jnp.abs(u - w))) for u, w in zip(got, want, strict=True)]
                except Exception as e:
                    errs = f"{type(e).__name__}: {str(e)[:300]}"
                results["rows"][-1][f"{way}_errs_vs_xla"] = errs
                print(f"  {way}: largest differences from the XLA fold: {errs}", flush=True)
            save()
        ways = {"foldax": jax.vmap(chamfer), "foldax_xla": with_impl("xla", jax.vmap(chamfer))}
        row(f"chamfer 4 pairs N={n}", ways, (xs, ys))


def knn_rows():
    """k nearest neighbours (k = 10) of 10,240 queries among 60,000 rows of 784 features: the
    k-min fold (its kernel asked for, and as chosen) against a ``lax.map`` of a GEMM distance
    block and ``lax.top_k``; the indices compared."""
    m, n, d, k = (2048, 12_000, 784, 10) if QUICK else (10_240, 60_000, 784, 10)
    if os.environ.get("KNN_SIZES"):  # (a smoke run: M,N,D)
        m, n, d = map(int, os.environ["KNN_SIZES"].split(","))
    if os.environ.get("KNN_BLOCKS"):  # the kernel's blocks: ROWS,COLS
        from foldax._kernels.tpu import _contracting as kc

        kc.DEFAULT_BLOCKS = kc.BlockSizes(*map(int, os.environ["KNN_BLOCKS"].split(",")))
    q, data = normal((m, d)), normal((n, d))
    sq = lambda a, b: jnp.sum((a - b) ** 2)  # noqa: E731
    ours = lambda q, x: foldax.pairwise_reduce(sq, q, x, reduction="kmin", k=k)  # noqa: E731

    def lmap(q, x, block=1024):
        def one(qb):
            dist = jnp.sum(qb**2, 1)[:, None] + jnp.sum(x**2, 1)[None] - 2 * qb @ x.T
            neg, idx = jax.lax.top_k(-dist, k)
            return -neg, idx

        return jax.lax.map(one, q.reshape(-1, block, d))

    ways = {"lax.map": lmap, "foldax_pallas": with_impl("pallas", ours), "foldax": ours}
    for way, f in ways.items():  # (compile and one call, printed as they finish)
        t0 = time.perf_counter()
        g = jax.jit(f).lower(q, data).compile()
        t1 = time.perf_counter()
        jax.block_until_ready(g(q, data))
        print(
            f"  {way}: compile {t1 - t0:.1f} s, a call {time.perf_counter() - t1:.2f} s", flush=True
        )
    row(f"knn k={k} {m}x{n} D={d}", ways, (q, data))
    got = jax.jit(ways["foldax_pallas"])(q, data)[1]
    want = jax.jit(ours)(q, data)[1]
    peer = jax.jit(lmap)(q, data)[1].reshape(m, k)
    results["rows"][-1]["same_indices_as_xla_fold"] = bool(jnp.all(got == want))
    results["rows"][-1]["same_indices_as_lax_map"] = float(jnp.mean(got == peer))
    print(f"  indices: kernel == XLA fold {bool(jnp.all(got == want))}", flush=True)
    save()


def sweep():
    """The kernel's block sizes, on attention, the LM loss and a Gaussian kernel sum."""
    from foldax._kernels.tpu import _contracting as kc

    h, t, d = 16, 4096, 128
    q, k, v = (normal((1, t, h, d), jnp.bfloat16) for _ in range(3))
    hh = normal((8192, 2048), jnp.bfloat16)
    w = normal((65_536, 2048), jnp.bfloat16, 1 / np.sqrt(2048))
    lab = jnp.asarray(r.integers(0, 65_536, 8192), jnp.int32)
    x = normal((98_304, 3), scale=0.3)
    b = normal((98_304, 1))
    gauss = lambda a, c: jnp.exp(-jnp.sum((a - c[0]) ** 2)) * c[1]  # noqa: E731
    only = os.environ.get("SWEEP", "attn,attn_causal,lce,gauss").split(",")
    kc._VMEM_BUDGET = int(os.environ.get("SWEEP_VMEM_MIB", "48")) * 2**20
    sizes = ((512, 512), (1024, 512), (512, 1024), (1024, 1024), (256, 512), (2048, 512))
    for rows, cols in (*sizes, (1024, 2048), (2048, 1024), (512, 2048)):
        kc.DEFAULT_BLOCKS = kc.BlockSizes(rows, cols)
        ways = {
            "attn": (lambda q, k, v: foldax.dot_product_attention(q, k, v), (q, k, v)),
            "attn_causal": (
                lambda q, k, v: foldax.dot_product_attention(q, k, v, is_causal=True),
                (q, k, v),
            ),
            "lce": (lambda h, w, lab: foldax.linear_cross_entropy(h, w, lab), (hh, w, lab)),
            "gauss": (
                lambda x, b: foldax.pairwise_reduce(gauss, x, (x, b), reduction="sum"),
                (x, b),
            ),
        }
        for name, (f, args) in ways.items():
            if name in only:
                row(f"sweep {rows}x{cols} {name}", {"foldax": f}, args)
    kc.DEFAULT_BLOCKS, kc._VMEM_BUDGET = kc.BlockSizes(), 48 * 2**20


SECTIONS = {
    "checks": checks,
    "attention": attention_rows,
    "lengths": lengths_rows,
    "segments": segments_rows,
    "lce": lce_rows,
    "gauss": kernel_sum_rows,
    "chamfer": chamfer_rows,
    "knn": knn_rows,
    "sweep": sweep,
}


def main(sections, save, default):
    """Run the sections named on the command line (else ``default``), each on its own: one
    that fails is recorded and the others' rows are kept; then the kernels' refusals."""
    from foldax._kernels import tpu as kernels

    print(results["device"], jax.__version__, results["libtpu"], flush=True)
    for name in [name for name in sections if name in sys.argv] or default:
        try:
            sections[name]()
        except Exception as e:
            print(f"{name}: {type(e).__name__}: {str(e)[:2000]}", flush=True)
            results.setdefault("failures", []).append(f"{name}: {e}"[:3000])
            save()
    results["refusals"] = [str(e)[:600] for e in kernels.refusals()]
    save()


if __name__ == "__main__":
    main(SECTIONS, save, [name for name in SECTIONS if name != "sweep"])
