"""One of two processes of a multi-controller run (started by ``test_multiprocess.py``).

Each process owns one CPU device; together they hold one row-sharded global array. The
process checks, against float64 NumPy references computed from the full data (which every
process can rebuild from the seed): a segment log-sum-exp of a fitted ``fn`` (a model with
parameters), its gradient with respect to the parameters, and a pairwise reduction whose rows
of ``y`` are split across the processes.
Usage: ``python multiprocess_case.py PROCESS_ID NUM_PROCESSES PORT``.
"""

from __future__ import annotations

import itertools
import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.config.update("jax_numpy_dtype_promotion", "strict")
pid, nproc, port = (int(a) for a in sys.argv[1:4])
jax.distributed.initialize(f"localhost:{port}", num_processes=nproc, process_id=pid)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import foldax  # noqa: E402

N, F = 4096, 3
SIZES = [1000, 0, 1, 2000, 1095]
rng = np.random.default_rng(0)
X = rng.standard_normal((N, F)).astype(np.float32)
THETA = np.asarray([0.3, -0.7, 1.1], np.float32)
Q = rng.standard_normal((16, F)).astype(np.float32)

mesh = jax.make_mesh((nproc,), ("p",), axis_types=(jax.sharding.AxisType.Explicit,))
rows = NamedSharding(mesh, P("p"))
x = jax.make_array_from_callback((N, F), rows, lambda idx: X[idx])
assert len(x.addressable_shards) == 1 and x.addressable_shards[0].data.shape == (N // nproc, F)


def loss(theta, x):
    lse = foldax.segment_logsumexp(x, sizes=SIZES, fn=lambda r: jnp.sin(r @ theta) * 3.0)
    return jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0)), lse


def pair(q, x):
    return foldax.pairwise_reduce(lambda a, b: -jnp.sum((a - b) ** 2), q, x, reduction="logsumexp")


(val, lse), grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(jnp.asarray(THETA), x)
out = jax.jit(pair)(jnp.asarray(Q), x)

# float64 references from the full data
v = np.sin(X.astype(np.float64) @ THETA.astype(np.float64)) * 3.0
dv = np.cos(X.astype(np.float64) @ THETA.astype(np.float64))[:, None] * 3.0 * X  # d v / d theta
bounds = np.concatenate([[0], np.cumsum(SIZES)])
want_lse, want_grad = [], np.zeros(F)
for lo, hi in itertools.pairwise(bounds):
    if hi == lo:
        want_lse.append(-np.inf)
        continue
    m = v[lo:hi].max()
    p = np.exp(v[lo:hi] - m)
    want_lse.append(m + np.log(p.sum()))
    want_grad += (p / p.sum()) @ dv[lo:hi]
d = -((Q.astype(np.float64)[:, None] - X.astype(np.float64)[None]) ** 2).sum(-1)
want_pair = d.max(1) + np.log(np.exp(d - d.max(1, keepdims=True)).sum(1))


def close(got, want, tol, what):
    got = np.asarray(jax.device_get(got), np.float64)
    inf = np.isinf(want)
    assert np.array_equal(got[inf], want[inf]), f"process {pid}: {what} infinities differ"
    err = np.max(np.abs(got[~inf] - want[~inf]) / np.maximum(1.0, np.abs(want[~inf])))
    assert err <= tol, f"process {pid}: {what} off by {err:.2e}"


close(lse, np.asarray(want_lse), 1e-5, "segment_logsumexp")
close(grad, want_grad, 1e-4, "its gradient")
close(out, want_pair, 1e-5, "pairwise logsumexp")
print(f"process {pid}: ok")
jax.distributed.shutdown()
