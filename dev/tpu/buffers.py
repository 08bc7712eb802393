"""On a TPU: XLA's buffer assignment for the Chamfer gradient (4 pairs of 98,304 3-D points),
its largest allocations with their padded sizes, from ``--xla_dump_to``.

    XLA_FLAGS=--xla_dump_to=$OUT/dump PYTHONPATH=$PYTHONPATH:$PWD/src python dev/tpu/buffers.py
"""

import glob
import os
import re

import jax
import jax.numpy as jnp

import foldax

n = int(os.environ.get("CHAMFER_N", "98304"))
sq = lambda a, b: jnp.sum((a - b) ** 2)  # noqa: E731


def chamfer(x, y):
    near = lambda a, b: foldax.pairwise_reduce(sq, a, b, reduction="min")  # noqa: E731
    return jnp.mean(near(x, y)) + jnp.mean(near(y, x))


x = jax.ShapeDtypeStruct((4, n, 3), jnp.float32)
c = jax.jit(jax.vmap(jax.value_and_grad(chamfer, (0, 1)))).lower(x, x).compile()
print("temp MiB", c.memory_analysis().temp_size_in_bytes / 2**20, flush=True)
dump = re.search(r"--xla_dump_to=(\S+)", os.environ.get("XLA_FLAGS", "")).group(1)
for path in glob.glob(os.path.join(dump, "*buffer-assignment.txt")):
    with open(path) as fh:
        text = fh.read()
    allocs = re.findall(r"^allocation (\d+): size (\d+)(.*)$", text, re.M)
    big = sorted(allocs, key=lambda a: -int(a[1]))[:12]
    if not big or int(big[0][1]) < 2**20:
        continue
    print(os.path.basename(path))
    for num, size, rest in big[:4]:
        body = text.split(f"allocation {num}: size {size}")[1].split("\nallocation ")[0]
        vals = re.findall(r"value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (\S+)", body)
        print(f"  {int(size) / 2**20:8.1f} MiB{rest[:50]}: {len(vals)} values", flush=True)
        for name, vsize, off, shape in sorted(vals, key=lambda v: -int(v[1]))[:15]:
            print(
                f"      {int(vsize) / 2**20:8.1f} MiB at {int(off) / 2**20:7.1f}  {shape}  {name}"
            )
