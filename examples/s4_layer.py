"""A complete S4D layer (diagonal state-space model) whose memory does not grow with N.

The convolution kernel of each of the H channels is a Vandermonde product over the N/2 poles of
conjugate pairs, K[h, l] = 2 Re sum_n C'[h, n] exp(dt[h] A[h, n] l); written naively it
materializes an (H, N/2, L) complex array forward and again for the gradient. With
``foldax.vandermonde`` it is a streamed pairwise reduction, so a training step's temp memory is the
same for N = 64 and N = 512. Run it:

    .venv/bin/python examples/s4_layer.py          # about 20 s on 2 CPU cores
    .venv/bin/python examples/s4_layer.py --smoke  # small sizes, about 8 s

It prints the XLA temp memory of one jitted training step (naive kernel vs foldax, N = 64 and
512) and then trains a small classifier on random data for a few steps with the foldax kernel.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import foldax
from foldax.memory import format_bytes, report


def init_params(key, h, n, classes):
    """S4D-Lin initialisation: A = -1/2 + i pi n, C ~ N(0, 1/2) complex, log dt ~ U[log 1e-3, log 1e-1]."""
    k1, k2, k3, k4, k5 = jax.random.split(key, 5)
    half = n // 2
    return {
        "encoder": jax.random.normal(k1, (1, h)) * 0.5,
        "log_dt": jax.random.uniform(k2, (h,), minval=np.log(1e-3), maxval=np.log(1e-1)),
        "a_re": jnp.full((h, half), np.log(0.5)),
        "a_im": jnp.broadcast_to(jnp.pi * jnp.arange(half), (h, half)),
        "c": jax.random.normal(k3, (h, half, 2)) * np.sqrt(0.5),
        "d": jax.random.normal(k4, (h,)),
        "decoder": jax.random.normal(k5, (h, classes)) / np.sqrt(h),
    }


def ssm_kernel(params, length, vandermonde):
    """The (H, L) real convolution kernel (zero-order-hold discretisation)."""
    a = -jnp.exp(params["a_re"]) + 1j * params["a_im"]  # (H, N/2)
    dt = jnp.exp(params["log_dt"])[:, None]
    c = params["c"][..., 0] + 1j * params["c"][..., 1]
    dta = dt * a
    coef = c * (jnp.exp(dta) - 1) / a
    return vandermonde(coef, dta, length)


def naive_vandermonde(v, x, length):
    """Materializes (H, N/2, L): what S4D code usually writes."""
    powers = jnp.exp(x[..., None] * jnp.arange(length))
    return 2 * jnp.real(jnp.sum(v[..., None] * powers, axis=-2))


def foldax_vandermonde(v, x, length):
    return foldax.vandermonde(v, x, length, conjugate=True)


def s4d_layer(params, u, vandermonde):
    """u: (B, L, H) -> (B, L, H): causal convolution with the SSM kernel via FFT, plus D u."""
    length = u.shape[1]
    k = ssm_kernel(params, length, vandermonde)  # (H, L)
    uf = jnp.fft.rfft(u, n=2 * length, axis=1)
    kf = jnp.fft.rfft(k.T, n=2 * length, axis=0)
    y = jnp.fft.irfft(uf * kf[None], n=2 * length, axis=1)[:, :length]
    return y + u * params["d"]


def model(params, x, vandermonde):
    """x: (B, L) sequences -> (B, classes) logits."""
    u = x[..., None] @ params["encoder"]  # (B, L, H)
    y = jax.nn.gelu(s4d_layer(params, u, vandermonde))
    return y.mean(axis=1) @ params["decoder"]


def loss_fn(params, x, labels, vandermonde):
    logits = model(params, x, vandermonde)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


def train_step(params, x, labels, vandermonde, lr=1e-2):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, labels, vandermonde)
    return jax.tree.map(lambda p, g: p - lr * g, params, grads), loss


def step_memory(h, n, length, batch, vandermonde):
    params = init_params(jax.random.key(0), h, n, 10)
    x = jax.ShapeDtypeStruct((batch, length), jnp.float32)
    labels = jax.ShapeDtypeStruct((batch,), jnp.int32)
    return report(lambda p, x, y: train_step(p, x, y, vandermonde), params, x, labels).temp_bytes


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--h", type=int, default=256, help="channels")
    ap.add_argument("--length", type=int, default=1024, help="sequence length L")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument(
        "--smoke", action="store_true", help="small sizes, foldax's memory only, about 8 s"
    )
    args = ap.parse_args(argv)
    kernels = {"naive": naive_vandermonde, "foldax": foldax_vandermonde}
    if args.smoke:  # compiling is most of the cost: fewer programs, not only smaller ones
        args.h, args.length, args.batch, args.steps = 8, 64, 2, 1
        del kernels["naive"]

    print(
        f"Temp memory of one jitted training step, H = {args.h}, L = {args.length}, batch {args.batch}:"
    )
    for name, vdm in kernels.items():
        figures = [step_memory(args.h, n, args.length, args.batch, vdm) for n in (64, 512)]
        print(
            f"  {name:6s}  N = 64: {format_bytes(figures[0]):>9s}   N = 512: {format_bytes(figures[1]):>9s}"
            f"   ratio {figures[1] / figures[0]:.2f}"
        )

    key = jax.random.key(1)
    params = init_params(key, args.h, 64, 10)
    step = jax.jit(lambda p, x, y: train_step(p, x, y, foldax_vandermonde))
    for i in range(args.steps):
        kx, ky, key = jax.random.split(key, 3)
        x = jax.random.normal(kx, (args.batch, args.length))
        labels = jax.random.randint(ky, (args.batch,), 0, 10)
        params, loss = step(params, x, labels)
        print(f"step {i}: loss {float(loss):.4f}")
    # The foldax kernel equals the naive one.
    k1 = ssm_kernel(params, args.length, foldax_vandermonde)
    k2 = ssm_kernel(params, args.length, naive_vandermonde)
    print(f"kernel max abs difference, foldax vs naive: {float(jnp.max(jnp.abs(k1 - k2))):.2e}")


if __name__ == "__main__":
    main()
