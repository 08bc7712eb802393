"""linear_cross_entropy's gradient: temp (foldax.memory.report) and time, bfloat16 and float32.

python dev/lce-order/measure.py [--time] [--sizes T,V ...]
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import foldax
from foldax.memory import report


def plain(h, w, labels):
    z = jnp.einsum("td,vd->tv", h, w, preferred_element_type=jnp.float32)
    label_z = jnp.take_along_axis(z, labels[:, None], axis=-1)[:, 0]
    return jnp.mean(jax.nn.logsumexp(z, axis=-1) - label_z)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--time", action="store_true")
    p.add_argument("--sizes", nargs="*", default=["8192,32768", "8192,131072"])
    p.add_argument("--dtypes", nargs="*", default=["bfloat16", "float32"])
    p.add_argument("--d", type=int, default=512)
    a = p.parse_args()
    print("jax", jax.__version__)
    for size in a.sizes:
        t, v = map(int, size.split(","))
        for dt in a.dtypes:
            dtype = jnp.dtype(dt)
            sds = (
                jax.ShapeDtypeStruct((t, a.d), dtype),
                jax.ShapeDtypeStruct((v, a.d), dtype),
                jax.ShapeDtypeStruct((t,), jnp.int32),
            )
            row = [f"T={t} V={v} {dt}"]
            for name, f in (("plain", plain), ("foldax", foldax.linear_cross_entropy)):
                fwd = report(f, *sds).temp_bytes
                grad = report(jax.value_and_grad(f, (0, 1)), *sds).temp_bytes
                row.append(f"{name} {fwd / 1e6:.1f}/{grad / 1e6:.1f} MB")
            print("  ".join(row), flush=True)
            if a.time:
                k = jax.random.split(jax.random.key(0), 3)
                h = jax.random.normal(k[0], (t, a.d), dtype)
                w = (jax.random.normal(k[1], (v, a.d)) / np.sqrt(a.d)).astype(dtype)
                lab = jax.random.randint(k[2], (t,), 0, v)
                fs = {
                    n: jax.jit(jax.value_and_grad(f, (0, 1)))
                    for n, f in (("plain", plain), ("foldax", foldax.linear_cross_entropy))
                }
                for f in fs.values():
                    jax.block_until_ready(f(h, w, lab))
                ts = {n: [] for n in fs}
                for _ in range(3):
                    for n, f in fs.items():
                        t0 = time.perf_counter()
                        jax.block_until_ready(f(h, w, lab))
                        ts[n].append(time.perf_counter() - t0)
                print(
                    "   grad time "
                    + "  ".join(f"{n} {statistics.median(x):.2f}s" for n, x in ts.items()),
                    flush=True,
                )


if __name__ == "__main__":
    main()
