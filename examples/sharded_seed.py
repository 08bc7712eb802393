"""The ragged logsumexp with its rows split over a device mesh, and S4's kernel split over channels.

On a CPU, this script simulates 8 devices (the flag must be set before JAX starts; it is set
below unless ``XLA_FLAGS`` already sets a device count):

    python examples/sharded_seed.py          # N = 1,159,351 rows, about 6 s on 2 CPU cores
    python examples/sharded_seed.py --smoke  # 1/100 of the rows, about 9 s

On a multi-host cluster, call ``jax.distributed.initialize()`` first and build the sharded
arrays from each process's rows (``jax.make_array_from_process_local_data``); the rest is the
same program.
"""

import os
import sys

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import jax
import jax.numpy as jnp
import numpy as np

import foldax
from foldax import workloads as w


def ragged_logsumexp(mesh, shrink):
    """Per-segment logmeanexp of a model over rows split across devices, vmapped over theta."""
    rows = jax.sharding.NamedSharding(mesh, jax.P("rows"))
    devices = mesh.size
    problem = w.seed_problem(repeat=1, shrink=shrink)
    sizes, n = problem.sizes, problem.n
    # N must split evenly: pad it, and give the padding rows the id S, which is dropped (the ids
    # stay sorted, so foldax still takes its tiled path).
    n_pad = n + (-n) % devices
    ids = np.full(n_pad, len(sizes), np.int32)
    ids[:n] = np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)
    x = jax.device_put(jnp.pad(problem.x, ((0, n_pad - n), (0, 0))), rows)
    log_n = np.log(np.asarray(sizes, np.float32))

    def per_theta(theta, x):
        lse = foldax.segment_logsumexp(x, ids, len(sizes), fn=lambda r: w.model(theta, r))
        return lse - log_n

    loss = jax.jit(jax.vmap(jax.value_and_grad(lambda t, x: per_theta(t, x).sum()), (0, None)))
    value, grad = loss(problem.thetas, x)  # every device folds its N/8 rows; one all-reduce
    print(
        f"ragged logsumexp: {devices} devices, N = {n:,}; values {value.shape}, gradients {grad.shape}"
    )
    compiled = loss.lower(problem.thetas, x).compile()
    print("  per device:", foldax.memory.report_from_compiled(compiled))
    print("  all-gather in the program:", "all-gather" in compiled.as_text())


def s4_channels(mesh, length):
    """S4's Cauchy kernel with the H channels split over the devices (no communication)."""
    h, n_poles = 8 * mesh.size, 64
    v = jax.random.normal(jax.random.key(0), (h, n_poles), jnp.complex64)
    poles = -0.5 + 1j * jnp.arange(n_poles, dtype=jnp.float32)
    w_ = jnp.broadcast_to(poles, (h, n_poles)).astype(jnp.complex64)
    z = jnp.exp(2j * jnp.pi * jnp.arange(length) / length).astype(jnp.complex64)
    channels = jax.sharding.NamedSharding(mesh, jax.P("rows", None))
    v, w_ = jax.device_put(v, channels), jax.device_put(w_, channels)
    k = jax.jit(lambda v, z, w_: foldax.cauchy(v, z, w_, conjugate=True))(v, z, w_)
    print(f"S4 Cauchy kernel: {k.shape} split as {k.sharding.spec}")


def main(argv):
    smoke = "--smoke" in argv
    mesh = jax.make_mesh((jax.device_count(),), ("rows",))  # the sharding is part of the type
    ragged_logsumexp(mesh, shrink=100 if smoke else 1)
    s4_channels(mesh, length=64 if smoke else 1024)


if __name__ == "__main__":
    main(sys.argv[1:])
