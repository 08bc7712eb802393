"""Trace+lower and XLA compile time of linear_cross_entropy against the plain loss.

python dev/lce-order/compile_time.py [T V dtype]
"""

import statistics
import sys
import time

import jax
import jax.numpy as jnp

import foldax


def plain(h, w, labels):
    z = jnp.einsum("td,vd->tv", h, w, preferred_element_type=jnp.float32)
    label_z = jnp.take_along_axis(z, labels[:, None], axis=-1)[:, 0]
    return jnp.mean(jax.nn.logsumexp(z, axis=-1) - label_z)


t, v = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (4096, 32768)
dtype = jnp.dtype(sys.argv[3] if len(sys.argv) > 3 else "float32")
sds = (
    jax.ShapeDtypeStruct((t, 512), dtype),
    jax.ShapeDtypeStruct((v, 512), dtype),
    jax.ShapeDtypeStruct((t,), jnp.int32),
)
res = {}
for rep in range(4):
    for name, f in (("plain", plain), ("foldax", foldax.linear_cross_entropy)):
        for kind, g in (("fwd", f), ("grad", jax.value_and_grad(f, (0, 1)))):
            fn = jax.jit(lambda *a, g=g: g(*a))
            t0 = time.perf_counter()
            low = fn.lower(*sds)
            t1 = time.perf_counter()
            low.compile()
            t2 = time.perf_counter()
            if rep:
                res.setdefault((name, kind), []).append((t1 - t0, t2 - t1))
for (name, kind), xs in res.items():
    lo = statistics.median(x[0] for x in xs)
    co = statistics.median(x[1] for x in xs)
    print(
        f"{name:7s} {kind:5s} lower {lo * 1e3:6.0f} ms  compile {co * 1e3:6.0f} ms  total {(lo + co) * 1e3:6.0f} ms"
    )

if len(sys.argv) > 4:  # and the peers (jax >= 0.11)
    from foldax._tools.bench import _lm_loss as lm

    sd = (sds[0], jax.ShapeDtypeStruct((512, v), dtype), sds[2])
    for name, f, args in (("tokamax", lm._tokamax, sd), ("jax-cce", lm._cce, sds)):
        for kind, g in (("fwd", f), ("grad", jax.value_and_grad(f, (0, 1)))):
            xs = []
            for _ in range(3):
                fn = jax.jit(lambda *a, g=g: g(*a))
                t0 = time.perf_counter()
                fn.lower(*args).compile()
                xs.append(time.perf_counter() - t0)
            print(f"{name:7s} {kind:5s} total {statistics.median(xs) * 1e3:6.0f} ms")
