"""Masks ``mask(i, j) -> bool`` over pairs of indices: checked, traced once on a pair of int32
indices, and evaluated on a tile's index arrays with the arrays they close over passed in."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import _closure


def _check_mask(name, mask, on_mesh):
    """``mask`` traced on one pair of indices: ``(Closed, consts)`` (see :func:`_pair_mask`)."""
    if not callable(mask):
        raise TypeError(f"{name}: mask must be a callable mask(i, j) -> bool, got {mask!r:.60}.")
    if on_mesh:
        raise ValueError(
            f"{name}: mask is not supported with sharded x / y or axis_name yet; call it on "
            f"one device, or fold the mask into the kernel (a -inf logit, a 0 weight)."
        )
    index = jax.ShapeDtypeStruct((), jnp.int32)
    try:
        closed, consts = _closure.trace(mask, index, index)
    except Exception as e:
        raise TypeError(
            f"{name}: mask(i, j) failed on a pair of int32 indices (write it elementwise with "
            f"jnp operations, e.g. lambda i, j: j <= i): {e}"
        ) from e
    out = closed.jaxpr.outvars
    if len(out) != 1 or out[0].aval.dtype != jnp.bool_ or out[0].aval.shape != ():
        got = ", ".join(v.aval.str_short() for v in out) or "nothing"
        raise TypeError(
            f"{name}: mask(i, j) must return one boolean per pair of indices, got {got} for "
            f"int32 scalars i, j (compare them, e.g. lambda i, j: j <= i)."
        )
    return closed, consts


def _pair_mask(closed, start, count):
    """The engine's ``pair_mask(consts, i, j)``: the user's mask (traced on one pair of
    indices), on broadcasting index arrays, reading the arrays it closes over from the fold's
    consts ``[start, start + count)``: whatever they are (jit arguments, vmapped arrays), they
    are the fold's inputs, never constants of its implementation."""

    def pair_mask(consts, i, j):
        own = tuple(consts[start : start + count])
        return jnp.vectorize(lambda a, b: closed(own, a, b))(i, j)

    return pair_mask
