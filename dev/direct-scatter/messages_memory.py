"""Temp memory of segment_sum / max as a drop-in for jax.ops on messages computed in the same
jit (a graph attention layer: h[senders] * att, 200 k edges x 8 heads x 16 features, 20 k
nodes), forward and gradient with respect to h and att; the graph passed as data.

    python dev/direct-scatter/messages_memory.py
"""

import jax
import jax.numpy as jnp
import numpy as np

import foldax

E, V, H, F = 200_000, 20_000, 8, 16
OPS = {
    "foldax.segment_sum": foldax.segment_sum,
    "jax.ops.segment_sum": jax.ops.segment_sum,
    "foldax.segment_max": foldax.segment_max,
    "jax.ops.segment_max": jax.ops.segment_max,
}


def main():
    rng = np.random.default_rng(0)
    snd = jnp.asarray(rng.integers(0, V, E), jnp.int32)
    rcv = jnp.asarray(rng.integers(0, V, E), jnp.int32)
    h = jax.ShapeDtypeStruct((V, H, F), jnp.float32)
    att = jax.ShapeDtypeStruct((E, H), jnp.float32)
    w = jax.ShapeDtypeStruct((V, H, F), jnp.float32)
    for ids, sort in ((rcv, False), (jnp.sort(rcv), True)):
        for name, op in OPS.items():

            def fwd(h, att, snd, ids, w, op=op, sort=sort):
                return op(h[snd] * att[..., None], ids, V, indices_are_sorted=sort)

            def grad(h, att, snd, ids, w, fwd=fwd):
                def loss(h, att):
                    out = fwd(h, att, snd, ids, w)
                    return jnp.sum(jnp.where(jnp.isfinite(out), out, 0) * w)

                return jax.grad(loss, (0, 1))(h, att)

            args = (h, att, snd, ids, w)
            a, b = (foldax.memory.report(f, *args).temp_bytes / 1e6 for f in (fwd, grad))
            print(f"sorted={sort!s:5} {name:20s} forward {a:7.1f} MB  gradient {b:7.1f} MB")


if __name__ == "__main__":
    main()
