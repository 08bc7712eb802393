"""The wrong answers users reported, each checked against a float64 dense reference (NaN is a
failure), several calls each: forward mode of softmax folds, min / max ties, 64-bit labels,
warnings from a mask's formula, D = 0, NumPy scalar options. Prints one line per case.

    python dev/wrong-answers/check.py      # with the jax of this environment
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np

import foldax

jax.config.update("jax_enable_x64", True)
rng = np.random.default_rng(0)


def err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return np.inf if not np.all(np.isfinite(got)) else float(np.max(np.abs(got - want)))


def report(name, errs, bound):
    ok = all(e <= bound for e in errs)
    print(f"{'ok ' if ok else 'BAD'} {name}: max error {max(errs):.2e} over {len(errs)} calls")


def softmax_jvp(m, n):
    q, k, v = rng.normal(size=(m, 3)), rng.normal(size=(n, 3)), rng.normal(size=(n, 2))
    ours = lambda q, k: foldax.pairwise_reduce(  # noqa: E731
        lambda a, b: (jnp.dot(a, b[0]), b[1]), q, (k, v), reduction="softmax"
    )
    dense = lambda q, k: jax.nn.softmax(q @ k.T, axis=1) @ v  # noqa: E731
    dq, dk = rng.normal(size=q.shape), rng.normal(size=k.shape)
    want = jax.jvp(dense, (q, k), (dq, dk))[1]
    f = jax.jit(lambda *a: jax.jvp(ours, a[:2], a[2:])[1])
    report(f"softmax jvp {m} x {n}", [err(f(q, k, dq, dk), want) for _ in range(5)], 1e-10)
    x = rng.normal(size=(90, 3))
    want = jax.jacfwd(dense)(x, k)
    report(
        "softmax jacfwd 90 x 3 vs 130", [err(jax.jacfwd(ours)(x, k), want) for _ in range(3)], 1e-10
    )


def _sqdist(a, b):
    return jnp.sum((a - b) ** 2)


def _tie_pair(red):
    """``(ours, dense)``: sum of sin of the min / max of squared distances."""

    def ours(x, y):
        return jnp.sum(
            jnp.sin(foldax.pairwise_reduce(_sqdist, x, y, reduction=red, block_size=(16, 24)))
        )

    def dense(x, y):
        d = jax.vmap(lambda a: jax.vmap(lambda b: _sqdist(a, b))(y))(x)
        return jnp.sum(jnp.sin(getattr(jnp, red)(d, 1)))

    return ours, dense


def ties():
    x, y0 = rng.normal(size=(70, 3)), rng.normal(size=(30, 3))
    y = np.concatenate([y0] * 3)
    for red in ("min", "max"):
        ours, dense = _tie_pair(red)
        g, gw = jax.grad(ours, (0, 1)), jax.grad(dense, (0, 1))(x, y)
        errs = [max(err(a, b) for a, b in zip(g(x, y), gw, strict=True)) for _ in range(3)]
        t = jax.jvp(ours, (x, y), (x, y))[1]
        errs.append(err(t, jax.jvp(dense, (x, y), (x, y))[1]))
        report(f"{red} of three tied rows: grad and jvp", errs, 1e-9)


def labels():
    h, w = rng.normal(size=(3, 4)), rng.normal(size=(10, 4))
    lab = jnp.asarray([2**32 + 1, 3, 2], jnp.int64)
    out = foldax.linear_cross_entropy(h, w, lab, reduction="none")
    print(f"{'ok ' if np.isnan(out[0]) and np.isfinite(out[1]) else 'BAD'} label 2**32 + 1: {out}")
    lab = jnp.asarray([3, 3, 2], jnp.int64)
    out = foldax.linear_cross_entropy(h, w, lab, ignore_index=2**32 + 3, reduction="none")
    print(
        f"{'ok ' if np.all(out != 0) else 'BAD'} ignore_index 2**32 + 3 ignores no label 3: {out}"
    )
    u = jnp.asarray([2**32 - 100, 1, 2], jnp.uint32)
    out = foldax.linear_cross_entropy(h, w, u, reduction="none")
    print(f"{'ok ' if np.isnan(out[0]) else 'BAD'} uint32 label 2**32 - 100: {out}")


def others():
    x, y = rng.normal(size=(600, 4)), rng.normal(size=(600, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            foldax.pairwise_reduce(
                jnp.dot, x, y, reduction="logsumexp", mask=lambda t, s: t // s == 2
            )
            print("ok  mask t // s == 2: no warning")
        except Exception as e:
            print(f"BAD mask t // s == 2: {type(e).__name__}: {e}")
    h, w, lab = np.zeros((3, 0)), np.zeros((10, 0)), jnp.asarray([1, 2, 3])
    out = foldax.linear_cross_entropy(h, w, lab, reduction="none")
    report("linear_cross_entropy D = 0 is log V", [err(out, np.full(3, np.log(10)))], 1e-12)
    q = rng.normal(size=(1, 8, 2, 4)).astype(np.float32)
    for kw in (
        {"logits_soft_cap": np.float32(30.0)},
        {"dropout_rate": np.float32(0.0)},
        {"logits_soft_cap": np.asarray(30.0)},
    ):
        foldax.dot_product_attention(q, q, q, **kw)
        print(f"ok  dot_product_attention({kw}) accepted")


if __name__ == "__main__":
    print(f"jax {jax.__version__}")
    softmax_jvp(2048, 64)
    softmax_jvp(4096, 130)
    ties()
    labels()
    others()
