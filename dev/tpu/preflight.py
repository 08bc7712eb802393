# ruff: noqa: E731
"""Before spending device time: lower the TPU runs' workloads for a TPU from this CPU (no TPU
needed to lower) and print, per workload, the kernels it takes, each kernel's blocks, grid,
the scoped VMEM it asks for and what its body keeps live, and any kernel refused (left to the
XLA loop). Lowering does not compile: Mosaic's own errors (a layout it cannot take, scoped VMEM
it runs out of under a loop) show only on the TPU.

    PYTHONPATH=$PYTHONPATH:$PWD/src python dev/tpu/preflight.py [NAME ...]
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp

import foldax
from foldax._kernels import tpu as kernels
from foldax._kernels.tpu import _contracting

MiB = 2**20
sds = jax.ShapeDtypeStruct
f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32
sq = lambda a, b: jnp.sum((a - b) ** 2)
gauss = lambda a, c: jnp.exp(-jnp.sum((a - c[0]) ** 2)) * c[1]
tot = lambda f: lambda *a: jnp.sum(f(*a).astype(f32))


def attention(causal):
    return lambda q, k, v: foldax.dot_product_attention(q, k, v, is_causal=causal)


def chamfer(x, y):
    near = lambda a, b: foldax.pairwise_reduce(sq, a, b, reduction="min")
    return jnp.mean(near(x, y)) + jnp.mean(near(y, x))


def knn(q, x):
    return foldax.pairwise_reduce(sq, q, x, reduction="kmin", k=10, implementation="pallas")


qkv = (sds((1, 16_384, 16, 128), bf16),) * 3
WORKLOADS = {
    "attention grad T=16k": (jax.grad(tot(attention(False)), (0, 1, 2)), qkv),
    "attention causal grad T=16k": (jax.grad(tot(attention(True)), (0, 1, 2)), qkv),
    "lce value_and_grad": (
        jax.value_and_grad(foldax.linear_cross_entropy, (0, 1)),
        (sds((8192, 2048), bf16), sds((65_536, 2048), bf16), sds((8192,), i32)),
    ),
    "gauss sum grad N=98k": (
        jax.grad(lambda x, b: jnp.sum(foldax.pairwise_reduce(gauss, x, (x, b))), (0, 1)),
        (sds((98_304, 3), f32), sds((98_304, 1), f32)),
    ),
    "chamfer+grad 4 pairs N=16k": (
        jax.vmap(jax.value_and_grad(chamfer, (0, 1))),
        (sds((4, 16_384, 3), f32),) * 2,
    ),
    "chamfer+grad N=98k": (jax.value_and_grad(chamfer, (0, 1)), (sds((98_304, 3), f32),) * 2),
    "knn k=10 D=784 (asked for)": (knn, (sds((10_240, 784), f32), sds((60_000, 784), f32))),
    "chamfer+grad N=98k (asked for)": (
        lambda x, y: _asked(jax.value_and_grad(chamfer, (0, 1)), x, y),
        (sds((98_304, 3), f32),) * 2,
    ),
}


def _asked(f, *args):
    with foldax._engine.implementation("pallas"):
        return f(*args)


def main(names):
    seen, forms = [], []
    real = _contracting._vmem_limit
    real_form = _contracting._lane_form

    def form_spy(*a):
        form = real_form(*a)
        forms.append(type(form).__name__ if form is not None else None)
        return form

    _contracting._lane_form = form_spy

    def spy(geo, avals):
        limit = real(geo, avals)
        seen.append((geo.b, (geo.gi, geo.gj), limit, geo.body, bool(geo.keyed)))
        return limit

    _contracting._vmem_limit = spy
    for name, (f, args) in WORKLOADS.items():
        if names and not any(n in name for n in names):
            continue
        seen.clear()
        forms.clear()
        kernels._REFUSALS.clear()
        text = jax.jit(f).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
        print(f"{name}: {text.count('tpu_custom_call')} kernels, "
              f"{'an XLA loop too' if 'stablehlo.while' in text else 'no XLA loop'}")  # fmt: skip
        for b, grid, limit, body, keyed in seen:
            print(f"  blocks {b.rows}x{b.cols} grid {grid[0]}x{grid[1]}: asks {limit / MiB:.0f} "
                  f"MiB of VMEM, body keeps {body / MiB:.1f} MiB{' (keyed)' if keyed else ''}")  # fmt: skip
        if any(forms):
            print(f"  states per lane: {sorted({f for f in forms if f})}")
        for e in kernels.refusals():
            print(f"  refused: {str(e)[:300]}")


if __name__ == "__main__":
    main(sys.argv[1:])
