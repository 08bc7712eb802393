import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from foldax import workloads as w

problem = w.seed_problem()
args = (problem.thetas, problem.x)
S = len(problem.sizes)
N = problem.n
ids = jnp.asarray(np.repeat(np.arange(S), problem.sizes).astype(np.int32))
C = 16384


def per_theta(theta, x):
    steps = -(-N // C)

    def body(c, i):
        m, s = c
        st = jnp.minimum(i * C, N - C)
        xs = lax.dynamic_slice_in_dim(x, st, C)
        sg = lax.dynamic_slice_in_dim(ids, st, C)
        own = st + jnp.arange(C) >= i * C
        v = jnp.where(own, w.model(theta, xs), -jnp.inf)
        mm = jnp.maximum(m, jnp.full(S, -jnp.inf).at[sg].max(v))
        s = s * jnp.exp(m - mm) + jnp.zeros(S).at[sg].add(jnp.exp(v - mm[sg]))
        return (mm, s), None

    (m, s), _ = lax.scan(body, (jnp.full(S, -jnp.inf), jnp.zeros(S)), jnp.arange(steps))
    return m + jnp.log(s)


fwd = jax.vmap(per_theta, (0, None))
grad = jax.vmap(jax.grad(lambda t, x: per_theta(t, x).sum()), (0, None))
for name, f in (("fwd", fwd), ("grad", grad)):
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        jax.jit(lambda *a, f=f: f(*a)).lower(*args).compile()
        ts.append(time.perf_counter() - t0)
    print(name, np.median(ts))
