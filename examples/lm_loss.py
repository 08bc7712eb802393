"""A small language model's training step with ``foldax.linear_cross_entropy``: its loss without
the (tokens x vocabulary) logits.

The model is a Flax module (token embedding, two pre-norm residual MLP blocks mixing each token
with the mean of the tokens before it, an unembedding ``nn.Dense`` whose kernel is ``(D, V)``).
The usual step forms ``logits = h @ kernel``, then the cross-entropy: at 8 sequences of 1,024
tokens over a 32,768-word vocabulary those logits are 1 GiB in float32 and the step's gradient
keeps more: the step's temp is 2.3 GB. With ``linear_cross_entropy(h, kernel, labels,
w_layout="DV")`` the loss is a streamed fold and the step's temp is 145 MB, most of it the
model's own (the embedding's gradient, the blocks' activations). Run it:

    .venv/bin/python examples/lm_loss.py          # about 35 s on 2 CPU cores
    .venv/bin/python examples/lm_loss.py --smoke  # small sizes, seconds

It prints the XLA temp memory of one jitted training step both ways (compiled, not run), then
trains the model a few steps both ways from the same start and checks that the losses agree.
"""

from __future__ import annotations

import argparse

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import foldax
from foldax.memory import format_bytes, report

IGNORE = -100  # padding: the last tokens of each sequence have no target


class TinyLM(nn.Module):
    vocab: int
    width: int

    @nn.compact
    def __call__(self, tokens):
        """``(B, T)`` tokens -> ``(B, T, D)`` hidden states and the ``(D, V)`` unembedding."""
        h = nn.Embed(self.vocab, self.width)(tokens)
        for _ in range(2):
            x = nn.LayerNorm()(h)
            before = jnp.cumsum(x, axis=1) / jnp.arange(1, x.shape[1] + 1)[:, None]
            h = h + nn.Dense(self.width)(jax.nn.gelu(nn.Dense(2 * self.width)(x + before)))
        h = nn.LayerNorm()(h)
        out = nn.Dense(self.vocab, use_bias=False, name="unembed")
        out(h[:, :1])  # creates the kernel
        return h, out.variables["params"]["kernel"]


def loss_foldax(model, params, tokens, labels):
    h, kernel = model.apply(params, tokens)
    return foldax.linear_cross_entropy(h, kernel, labels, ignore_index=IGNORE, w_layout="DV")


def loss_plain(model, params, tokens, labels):
    """The usual way: every logit formed."""
    h, kernel = model.apply(params, tokens)
    logits = h @ kernel
    kept = labels != IGNORE
    nll = (
        jax.nn.logsumexp(logits, axis=-1)
        - jnp.take_along_axis(logits, jnp.where(kept, labels, 0)[..., None], axis=-1)[..., 0]
    )
    return jnp.sum(jnp.where(kept, nll, 0.0)) / jnp.sum(kept)


def make_step(loss, model, lr=0.05):
    def step(params, tokens, labels):
        value, grads = jax.value_and_grad(loss, argnums=1)(model, params, tokens, labels)
        return value, jax.tree.map(lambda p, g: p - lr * g, params, grads)

    return jax.jit(step)


def batch(key, b, t, vocab):
    tokens = jax.random.randint(key, (b, t + 1), 0, vocab)
    labels = tokens[:, 1:].at[:, -4:].set(IGNORE)  # the next token; 4 padded positions
    return tokens[:, :-1], labels


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="small sizes, seconds")
    smoke = parser.parse_args().smoke
    b, t, vocab, width = (2, 64, 512, 32) if smoke else (8, 1024, 32768, 128)
    model = TinyLM(vocab, width)
    params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    tokens, labels = batch(jax.random.key(1), b, t, vocab)
    steps = {
        "plain (logits formed)": make_step(loss_plain, model),
        "foldax": make_step(loss_foldax, model),
    }

    print(f"{b} sequences of {t:,} tokens, vocabulary {vocab:,}, width {width}")
    print("training step, XLA temp memory (compiled, not run):")
    for name, step in steps.items():
        print(f"  {name:24s} {format_bytes(report(step, params, tokens, labels).temp_bytes)}")

    print("training, same start, same batches:")
    losses = {}
    for name, step in steps.items():
        p, got = params, []
        for k in range(3):
            tokens, labels = batch(jax.random.key(10 + k), b, t, vocab)
            value, p = step(p, tokens, labels)
            got.append(float(value))
        losses[name] = got
        print(f"  {name:24s} " + "  ".join(f"{v:.5f}" for v in got))
    a, c = (np.asarray(v) for v in losses.values())
    agree = np.allclose(a, c, rtol=1e-4)
    print(
        f"agreement check: {'passed' if agree else 'FAILED'} (max rel {np.max(abs(a - c) / abs(a)):.1e})"
    )
    if not agree:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
