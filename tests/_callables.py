"""Callables of every kind users hand to foldax.memory, each with the plain jitted function of
arrays that computes the same thing (tests/test_memory.py, tests/test_audit.py).

``CASES``: ``id -> ((fn, args, kwargs), (plain, plain_args))``.
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

F, B = 64, 32


class Model(eqx.Module):
    """An Equinox module with a dict field (an array and a Python int) and a static field."""

    w: jax.Array
    extra: dict
    activation: str = eqx.field(static=True)

    def __call__(self, x):
        h = getattr(jnp, self.activation)(x @ self.w)
        return h ** self.extra["power"] * self.extra["scale"]


def loss(model, x):
    return jnp.sum(model(x) ** 2)


class Scaler:
    """A plain Python class: its bound method closes over the array it holds."""

    def __init__(self, w):
        self.w = w

    def apply(self, x):
        return jnp.sin(x @ self.w).sum()


def scaled(x, w, how):
    """A function with a string argument."""
    return getattr(jnp, how)(x @ w).sum(0)


def _arrays():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((F, F)), jnp.float32)
    scale = jnp.asarray(1.5, jnp.float32)
    x = jnp.asarray(rng.standard_normal((B, F)), jnp.float32)
    return w, scale, x


def _model(w, scale):
    return Model(w, {"scale": scale, "power": 3}, "tanh")


def cases():
    w, scale, x = _arrays()
    model = _model(w, scale)
    via_model = lambda w, scale, x: loss(_model(w, scale), x)  # noqa: E731
    scaler = Scaler(w)
    return {
        "eqx.filter_grad": (
            (eqx.filter_grad(loss), (model, x), {}),
            (jax.grad(via_model, argnums=(0, 1)), (w, scale, x)),
        ),
        "eqx.filter_jit": ((eqx.filter_jit(loss), (model, x), {}), (via_model, (w, scale, x))),
        "module": ((model, (x,), {}), (lambda w, scale, x: _model(w, scale)(x), (w, scale, x))),
        "module method": (
            (model.__call__, (x,), {}),
            (lambda w, scale, x: _model(w, scale)(x), (w, scale, x)),
        ),
        "bound method": ((scaler.apply, (x,), {}), (lambda x: scaler.apply(x), (x,))),
        "partial": (
            (functools.partial(scaled, how="cos"), (x, w), {}),
            (lambda x, w: scaled(x, w, "cos"), (x, w)),
        ),
        "string argument": (
            (scaled, (x, w, "sin"), {}),
            (lambda x, w: scaled(x, w, "sin"), (x, w)),
        ),
        "jitted, static argument": (
            (jax.jit(scaled, static_argnames="how"), (x, w), {"how": "tanh"}),
            (lambda x, w: scaled(x, w, "tanh"), (x, w)),
        ),
    }


CASES = cases()
