"""On a TPU: which of the in-place head-pair kernel's operations Mosaic compiles (each probe in
a process of its own: a compiler crash ends only it).

    PYTHONPATH=$PYTHONPATH:$PWD/src python dev/tpu/bitcast_probe.py [only PROBE,...]
"""

from __future__ import annotations

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

U32, BF16 = jnp.uint32, jnp.bfloat16
R, D, HALF = 512 * 16, 128, 8  # a block of 512 positions of 16 heads


def run(kernel, out_dtype, out_rows, words=False):
    x = jax.random.normal(jax.random.key(0), (R, D), BF16)
    arg = jax.lax.bitcast_convert_type(x.reshape(R // 2, 2, D).swapaxes(1, 2), U32) if words else x
    scratch = [pltpu.VMEM((R // 2, D), U32)] if kernel is scratch_strided else []
    f = pl.pallas_call(
        kernel,
        grid=(HALF,),
        in_specs=[pl.BlockSpec(arg.shape, lambda p: (0, 0))],
        out_specs=pl.BlockSpec((out_rows, D), lambda p: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((out_rows, D), out_dtype),
        scratch_shapes=scratch,
    )
    return x, np.asarray(jax.jit(f)(arg))


def value_bitcast(x_ref, o_ref):  # the whole block's value as words
    o_ref[...] = pltpu.bitcast(x_ref[...], U32)


def ref_bitcast(x_ref, o_ref):  # the block's ref as words, loaded whole
    o_ref[...] = x_ref.bitcast(U32)[...]


def ref_strided(x_ref, o_ref):  # every 8th word row from the program id
    p = pl.program_id(0)
    o_ref[pl.ds(p * 512, 512), :] = x_ref.bitcast(U32)[pl.ds(p, 512, stride=HALF), :]


def store_strided(x_ref, o_ref):  # words stored every 8th row of a bfloat16 output
    p = pl.program_id(0)
    words = pltpu.bitcast(x_ref[pl.ds(0, 1024), :], U32)  # (512, D)
    o_ref.bitcast(U32)[pl.ds(p, 512, stride=HALF), :] = words


def shifts(x_ref, o_ref):  # the unpacking's integer operations
    w = pltpu.bitcast(x_ref[...], U32)
    low = jax.lax.bitcast_convert_type(w << 16, jnp.float32)
    high = jax.lax.bitcast_convert_type(w & U32(0xFFFF0000), jnp.float32)
    o_ref[...] = jax.lax.bitcast_convert_type(low + high, U32)


def scratch_strided(x_ref, o_ref, w_ref):  # words kept in a uint32 scratch, loaded strided
    p = pl.program_id(0)

    @pl.when(p == 0)
    def _():
        w_ref[...] = pltpu.bitcast(x_ref[...], U32)

    o_ref[pl.ds(p * 512, 512), :] = w_ref[pl.ds(p, 512, stride=HALF), :]


def u32_strided(x_ref, o_ref):  # a uint32 input loaded strided (no bitcast)
    p = pl.program_id(0)
    o_ref[pl.ds(p * 512, 512), :] = x_ref[pl.ds(p, 512, stride=HALF), :]


PROBES = {
    "value_bitcast": (value_bitcast, U32, R // 2),
    "ref_bitcast": (ref_bitcast, U32, R // 2),
    "ref_strided": (ref_strided, U32, R // 2),
    "store_strided": (store_strided, BF16, R),
    "shifts": (shifts, U32, R // 2),
    "scratch_strided": (scratch_strided, U32, R // 2),
    "u32_strided": (u32_strided, U32, R // 2),
}
if len(sys.argv) > 2:  # probes named after the first argument: run these only
    PROBES = {k: v for k, v in PROBES.items() if k in sys.argv[2].split(",")}


def check(name):
    kernel, dtype, rows = PROBES[name]
    x, out = run(kernel, dtype, rows, words=name == "u32_strided")
    words = np.asarray(x).view(np.uint16).reshape(R // 2, 2, D)
    want = (words[:, 1].astype(np.uint32) << 16) | words[:, 0]  # rows 2r (low), 2r + 1 (high)
    if name in ("value_bitcast", "ref_bitcast"):
        ok = np.array_equal(out, want)
    elif name in ("ref_strided", "scratch_strided", "u32_strided"):
        ok = np.array_equal(out, want.reshape(512, HALF, D).transpose(1, 0, 2).reshape(-1, D))
    else:
        ok = None  # compiled and ran; the values are not checked
    print(f"{name}: compiled and ran; values {'as expected' if ok else ok}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] != "only":
        check(sys.argv[1])
    else:
        for name in PROBES:
            r = subprocess.run([sys.executable, __file__, name], capture_output=True, text=True)
            lines = [x for x in (r.stdout + r.stderr).splitlines() if name in x or "Error" in x]
            print(f"{name}: rc {r.returncode}: {' | '.join(lines[-3:])[:600]}", flush=True)
