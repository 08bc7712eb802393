"""An S4 layer written the way Flax users write it, with ``foldax.cauchy`` inside ``nn.vmap``.

The layer is one SSM per channel (a ``nn.Module`` over ``(L,)`` sequences and ``(N,)`` parameter
vectors), lifted over the ``H`` channels with ``nn.vmap``, as in the well-known annotated S4. Its
kernel is the DPLR generating function evaluated at the roots of unity, a Cauchy sum
``sum_n v[n] / (z[l] - w[n])``. Written naively, every channel materializes an ``(L, N)``
matrix, ``H`` of them under ``nn.vmap``; ``foldax.cauchy`` streams it, and because foldax plans
its tiles after every ``vmap`` (Flax's included), the default settings need no tuning.

Run ``python examples/flax_s4.py`` (about 4.5 minutes on 2 CPU cores; ``--smoke``, about 25 s): it
trains a few steps, then prints the training step's XLA temp memory and time for the Cauchy sum
written three ways: naive, foldax (default settings and hand-picked block sizes), and an O(L + N)
stand-in that computes no Cauchy sum at all (the floor for everything else in the step).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import foldax
from foldax.memory import format_bytes, report


def cauchy_naive(v, z, w):
    """``(N,), (L,), (N,) -> (L,)`` with the ``(L, N)`` matrix materialized."""
    return jnp.sum(v[None, :] / (z[:, None] - w[None, :]), axis=-1)


def cauchy_stand_in(v, z, w):
    """An O(L + N) function of the same arguments: what the step costs without the Cauchy sum."""
    return jnp.sum(v) / (z - jnp.mean(w))


def dplr_kernel(cauchy: Callable, lam, p, b, c, step, length):
    """The SSM convolution kernel ``(L,)`` of one channel with diagonal-plus-low-rank state
    matrix ``diag(lam) - p p*``, from its generating function at the ``L`` roots of unity
    (a Woodbury identity over four Cauchy sums of ``(N,)`` vectors)."""
    angle = -2 * jnp.pi * jnp.arange(length, dtype=jnp.float32) / length
    omega = jnp.exp(jax.lax.complex(jnp.zeros_like(angle), angle))  # roots of unity
    z = (2.0 / step).astype(jnp.complex64) * (1.0 - omega) / (1.0 + omega)
    cs, ps = jnp.conj(c), jnp.conj(p)
    k00, k01 = cauchy(cs * b, z, lam), cauchy(cs * p, z, lam)
    k10, k11 = cauchy(ps * b, z, lam), cauchy(ps * p, z, lam)
    at_roots = 2.0 / (1.0 + omega) * (k00 - k01 * k10 / (1.0 + k11))
    return jnp.fft.ifft(at_roots, length).real


class SSM(nn.Module):
    """One channel: ``(L,)`` in, ``(L,)`` out, ``N`` complex states."""

    n: int
    length: int
    cauchy: Callable

    @nn.compact
    def __call__(self, u):
        n = self.n
        cplx = lambda name, scale: jax.lax.complex(  # noqa: E731
            self.param(name + "_re", nn.initializers.normal(scale), (n,)),
            self.param(name + "_im", nn.initializers.normal(scale), (n,)),
        )
        # HiPPO-like poles: negative real parts, spread imaginary parts
        poles = jax.lax.complex(jnp.full((n,), -0.5), jnp.pi * jnp.arange(n, dtype=jnp.float32))
        lam = poles + cplx("dlam", 0.01)
        p, b, c = cplx("p", 0.5), cplx("b", 1.0), cplx("c", 0.5)
        log_step = self.param("log_step", nn.initializers.uniform(1.0), (1,))
        step = jnp.exp(log_step - 7.0)[0]
        d = self.param("d", nn.initializers.ones, (1,))
        k = dplr_kernel(self.cauchy, lam, p, b, c, step, self.length)
        # causal convolution through the FFT
        y = jnp.fft.irfft(jnp.fft.rfft(u, 2 * self.length) * jnp.fft.rfft(k, 2 * self.length))
        return y[: self.length] + d[0] * u


class S4Block(nn.Module):
    """``H`` channels, each its own SSM, lifted with ``nn.vmap`` (parameters split per channel)."""

    h: int
    n: int
    length: int
    cauchy: Callable

    @nn.compact
    def __call__(self, x):  # (L, d_in)
        x = nn.Dense(self.h)(x)
        layer = nn.vmap(
            SSM,
            in_axes=1,
            out_axes=1,
            variable_axes={"params": 1},
            split_rngs={"params": True},
        )(self.n, self.length, self.cauchy)
        return nn.Dense(1)(nn.gelu(layer(x)))[:, 0]


def make_step(cauchy, h, n, length):
    """The model, its parameters, a batch, and the jitted training step (loss, gradients)."""
    model = S4Block(h, n, length, cauchy)
    batch_model = jax.vmap(model.apply, in_axes=(None, 0))
    rng = np.random.default_rng(0)
    xs = jnp.asarray(rng.standard_normal((4, length, 2)), jnp.float32)
    ys = jnp.asarray(np.sin(np.cumsum(np.asarray(xs[..., 0]), axis=1) / 10), jnp.float32)
    params = model.init(jax.random.key(0), xs[0])

    def loss(params, xs, ys):
        return jnp.mean((batch_model(params, xs) - ys) ** 2)

    return params, (xs, ys), jax.jit(jax.value_and_grad(loss))


def measure(cauchy, h, n, length, repeats=5):
    """XLA temp bytes of the training step and its median time."""
    params, (xs, ys), step = make_step(cauchy, h, n, length)
    temp = report(step, params, xs, ys).temp_bytes
    jax.block_until_ready(step(params, xs, ys))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(step(params, xs, ys))
        times.append(time.perf_counter() - t0)
    return temp, statistics.median(times)


def ways():
    """The Cauchy sum written the ways compared (label -> function)."""
    out = {"naive (L, N) per channel": cauchy_naive, "foldax.cauchy (defaults)": foldax.cauchy}
    for bs in ((16, 16), (64, 64), (256, 64)):
        out[f"foldax.cauchy block_size={bs}"] = lambda v, z, w, bs=bs: foldax.cauchy(
            v, z, w, block_size=bs
        )
    out["O(L + N) stand-in (no Cauchy sum)"] = cauchy_stand_in
    return out


def train(h, n, length, steps):
    params, (xs, ys), step = make_step(foldax.cauchy, h, n, length)
    lr = 0.02
    for i in range(steps):
        loss, grads = step(params, xs, ys)
        params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
        if i in (0, steps - 1):
            print(f"  step {i}: loss {float(loss):.4f}")
    return float(loss)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="small sizes, about 25 s")
    parser.add_argument("--channels", type=int, default=128, help="H (default: 128)")
    parser.add_argument("--length", type=int, default=1024, help="L (default: 1024)")
    parser.add_argument("--states", type=int, nargs="+", default=[64, 256], help="N values")
    args = parser.parse_args(argv)
    h, length, states = args.channels, args.length, args.states
    if args.smoke:
        h, length, states = 8, 64, [16]
    print(f"Training an S4 block (H = {h}, L = {length}, N = {states[0]}) with foldax.cauchy:")
    loss = train(h, states[0], length, 3 if args.smoke else 20)
    assert np.isfinite(loss)
    for n in states:
        print(f"\nTraining step, H = {h}, L = {length}, N = {n} (XLA temp memory, median time):")
        for label, fn in ways().items():
            if args.smoke and "block_size" in label:
                continue
            temp, t = measure(fn, h, n, length, repeats=2 if args.smoke else 5)
            print(f"  {label:38s} {format_bytes(temp):>10s}  {t * 1000:8.1f} ms")


if __name__ == "__main__":
    main()
