"""``linear_cross_entropy``: a language model's loss ``logsumexp_v(h . w_v) - h . w_label``
from its last hidden states and its unembedding, one pairwise log-sum-exp fold over the
vocabulary: the ``(T, V)`` logits are never formed, forward or backward."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _shard
from ._reduce import reduce_pairs

if TYPE_CHECKING:
    from jaxtyping import Array, Float, Integer

_NAME = "foldax.linear_cross_entropy"
_REDUCTIONS = ("mean", "sum", "none")


def _fail(what, fix, kind=ValueError):
    raise kind(f"{_NAME}: {what}; {fix}.")


def _checked(h, w, labels, w_layout, reduction, logit_soft_cap, label_smoothing, z_loss):
    """``(h, w (V, D), labels)`` as arrays, after checking what can be checked statically."""
    h, w, labels = (jnp.asarray(a) for a in (h, w, labels))
    for arg, a in (("h", h), ("w", w)):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            _fail(f"{arg} has dtype {a.dtype}", f"pass {arg} as a floating-point array")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        _fail(f"labels has dtype {labels.dtype}", "pass the target token ids as integers")
    if w_layout not in ("VD", "DV"):
        _fail(f"w_layout must be 'VD' or 'DV', got {w_layout!r}", "pass one of them")
    if w.ndim != 2:
        _fail(f"w has shape {w.shape}", f"pass the unembedding as a 2-D ({w_layout}) matrix")
    if w_layout == "DV":  # one transposed copy of w: the fold walks its vocabulary rows
        w = w.T
    if h.ndim < 1 or h.shape[-1] != w.shape[1]:
        what = "D" if w_layout == "VD" else "D (w's first axis)"
        _fail(
            f"h has shape {h.shape} and w {'(V, D)' if w_layout == 'VD' else '(D, V)'} "
            f"{w.shape if w_layout == 'VD' else w.T.shape}",
            f"pass h (..., D) with the same {what} as w, or set w_layout to w's layout",
        )
    if labels.shape != h.shape[:-1]:
        _fail(
            f"labels has shape {labels.shape} where h {h.shape} asks for {h.shape[:-1]}",
            "pass one label per row of h",
        )
    if reduction not in _REDUCTIONS:
        _fail(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}", "pass one of them")
    _check_number("logit_soft_cap", logit_soft_cap, positive=True, none_ok=True)
    _check_number("label_smoothing", label_smoothing, at_most_one=True)
    _check_number("z_loss", z_loss)
    return h, w, labels


def _check_number(arg, value, positive=False, none_ok=False, at_most_one=False):
    """A scalar option: checked where it is concrete (a traced one, e.g. a schedule, is not)."""
    if value is None:
        if not none_ok:
            _fail(f"{arg} is None", "pass a number")
        return
    if np.ndim(value):
        _fail(f"{arg} has shape {np.shape(value)}", "pass a scalar")
    try:
        v = float(value)
    except (TypeError, jax.errors.ConcretizationTypeError):
        return
    low = "positive" if positive else "non-negative"
    if not math.isfinite(v) or v < 0 or (positive and v == 0) or (at_most_one and v > 1):
        limit = " and at most 1" if at_most_one else ""
        _fail(f"{arg} must be {low}{limit}, got {value!r}", f"pass a {low} number{limit}")


def _accumulator(h, w):
    """The dtype logits and sums are kept in: float32 for half-precision inputs, else theirs."""
    dtype = jnp.promote_types(h.dtype, w.dtype)
    return jnp.dtype(jnp.float32) if dtype.itemsize < 4 else dtype


def _dot(a, b, acc):
    """``a . b`` in ``acc``: half-precision operands widened tile by tile, so that each tile's
    products, and their derivatives, are summed in float32."""
    return jnp.dot(a.astype(acc), b.astype(acc), preferred_element_type=acc)


def _capped(z, cap):
    if cap is None:
        return z
    c = jnp.asarray(cap, z.dtype)
    return c * jnp.tanh(z / c)


def _vocabulary(axes, v_local):
    """``(first, V)``: this device's first vocabulary row and the whole vocabulary's size."""
    if not axes:
        return 0, v_local
    size = math.prod(lax.axis_size(a) for a in axes)
    return _shard.device_index(axes) * v_local, size * v_local


def _gathered(axes, local):
    return lax.psum(local, axes) if axes else local


def _label_logits(h, w, labels, first, acc, cap):
    """``z[t, labels[t]]`` ``(N,)``, each from its own row of ``w`` (on a mesh, the device that
    holds the label's row gives it; the others 0); and whether this device holds it."""
    local = labels - first
    here = (local >= 0) & (local < w.shape[0])
    rows = jnp.take(w, jnp.clip(local, 0, w.shape[0] - 1), axis=0)
    z = jnp.einsum("nd,nd->n", h, rows, preferred_element_type=acc)
    return jnp.where(here, _capped(z, cap), jnp.zeros((), acc))


def _mean_logits(h, w, acc, cap, block_size, axes, v):
    """``mean_v z[t, v]`` ``(N,)``: without a cap ``h . mean_v w_v``; with one, a sum fold."""
    if cap is None:
        total = _gathered(axes, jnp.sum(w, axis=0, dtype=acc))
        return jnp.einsum("nd,d->n", h, total, preferred_element_type=acc) / v

    def kernel(a, b):
        return _capped(_dot(a, b, acc), cap)

    s = reduce_pairs(
        _NAME, kernel, h, w, reduction="sum", k=None, block_size=block_size, mask=None,
        segment_ids=None, axis_name=axes or None,
    )  # fmt: skip
    return s / v


def linear_cross_entropy(
    h: Float[Array, "*batch D"],
    w: Float[Array, "V D"],
    labels: Integer[Array, "*batch"],
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    z_loss: float = 0.0,
    logit_soft_cap: float | None = None,
    label_smoothing: float = 0.0,
    return_lse: bool = False,
    w_layout: str = "VD",
    block_size: Any = None,
    axis_name: Any = None,
):
    """The cross-entropy of a linear classifier over a vocabulary -- a language model's loss --
    without its logits: ``(T, V)`` is never formed, forward or backward.

    With ``z[t, v] = c * tanh(h[t] . w[v] / c)`` (``c = logit_soft_cap``; ``h[t] . w[v]``
    without one) and ``lse[t] = logsumexp_v z[t, v]``, each kept token's loss is::

        loss[t] = lse[t] - (1 - eps) * z[t, labels[t]] - eps * mean_v z[t, v] + z_loss * lse[t]**2

    (``eps = label_smoothing``: ``optax.losses.softmax_cross_entropy`` with labels
    ``(1 - eps) * onehot + eps / V``; ``z_loss`` as PaLM's). Tokens whose label is
    ``ignore_index`` lose 0 and are not counted; a label outside ``[0, V)`` that is not
    ``ignore_index`` gives NaN (never another row of ``w``).

    Args:
      h: ``(..., D)`` hidden states (e.g. ``(B, T, D)``), any float dtype.
      w: ``(V, D)`` unembedding (``nn.Linear``'s weight, Liger / Cut Cross-Entropy's
        layout), or ``(D, V)`` with ``w_layout="DV"`` (Flax ``Dense``'s kernel; one transposed
        copy of ``w`` is made).
      labels: ``(...)`` integer target ids, ``h``'s leading shape.
      ignore_index: static label of tokens to skip (PyTorch's ``-100``).
      reduction: static ``"mean"`` (over kept tokens; NaN if none is kept, as PyTorch),
        ``"sum"`` or ``"none"`` (``(...)``, 0 at ignored tokens).
      z_loss, label_smoothing: non-negative scalars (``label_smoothing <= 1``).
      logit_soft_cap: ``None`` or a positive scalar ``c`` (Gemma 2's final-logit soft cap).
      return_lse: also return ``lse`` ``(...)`` (float32 for half precision inputs).
      w_layout: static ``"VD"`` or ``"DV"``.
      block_size: static ``(tokens, vocabulary rows)`` per tile (default: planned).
      axis_name: inside ``shard_map``, the mesh axis (or axes) that split ``w``'s vocabulary:
        each device holds ``V / devices`` rows in order, ``labels`` are global ids; only
        per-token statistics cross devices.

    Returns:
      The loss: a scalar (``"mean"``, ``"sum"``) or ``(...)`` (``"none"``), float32 for
      half-precision inputs (logits, sums and gradients are accumulated in float32), else the
      inputs' dtype; with ``return_lse`` the pair ``(loss, lse)``.

    Memory and derivatives: one log-sum-exp fold over tiles of tokens by vocabulary rows
    (``O(tile + T + V)`` temp beyond the inputs; with half-precision inputs on CPU, XLA also
    widens the whole of ``w`` to float32 once, before the loop, as it multiplies half-precision
    matrices in float32; and the gradient of ``w`` is summed in a float32 ``(V, D)`` buffer). Its gradient is streamed too: it saves the
    ``(T,)`` log-sum-exps and recomputes each tile of logits, accumulating ``dh`` and ``dw``;
    the label logits' gradient is a gather of ``T`` rows of ``w`` and their scatter back.
    ``jax.jvp``, ``jax.hessian`` and ``vmap`` compose as with every fold.

    Example:
      >>> import jax.numpy as jnp, foldax
      >>> h = jnp.array([[1.0, 0.0], [0.0, 1.0]])
      >>> w = jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])  # V = 3 rows of D = 2
      >>> foldax.linear_cross_entropy(h, w, jnp.array([0, -100]), reduction="none")
      Array([0.86199474, 0.        ], dtype=float32)
      >>> foldax.linear_cross_entropy(h, w, jnp.array([0, -100]))  # the mean over kept tokens
      Array(0.86199474, dtype=float32)
    """
    h, w, labels = _checked(
        h, w, labels, w_layout, reduction, logit_soft_cap, label_smoothing, z_loss
    )
    axes = _shard.axis_tuple(_NAME, axis_name)
    acc = _accumulator(h, w)
    shape, d = labels.shape, h.shape[-1]
    hf, lab = h.reshape(-1, d), labels.reshape(-1).astype(jnp.int32)
    first, v = _vocabulary(axes, w.shape[0])
    cap = logit_soft_cap

    def kernel(a, b):
        return _capped(_dot(a, b, acc), cap)

    lse = reduce_pairs(
        _NAME, kernel, hf, w, reduction="logsumexp", k=None, block_size=block_size, mask=None,
        segment_ids=None, axis_name=axis_name,
    )  # fmt: skip
    eps, z2 = (jnp.asarray(a, acc) for a in (label_smoothing, z_loss))
    loss = lse - (1 - eps) * _gathered(axes, _label_logits(hf, w, lab, first, acc, cap))
    if not _is_zero(label_smoothing):
        loss = loss - eps * _mean_logits(hf, w, acc, cap, block_size, axes, v)
    if not _is_zero(z_loss):
        loss = loss + z2 * lse**2
    kept = lab != ignore_index
    valid = (lab >= 0) & (lab < v)
    loss = jnp.where(kept, jnp.where(valid, loss, jnp.nan), jnp.zeros((), loss.dtype))
    loss = loss.astype(acc)
    if reduction == "none":
        out = loss.reshape(shape)
    elif reduction == "sum":
        out = jnp.sum(loss)
    else:
        out = jnp.sum(loss) / jnp.sum(kept).astype(acc)
    return (out, lse.reshape(shape).astype(acc)) if return_lse else out


def _is_zero(value):
    """Whether an option is a concrete 0 (then its term is left out of the program)."""
    try:
        return float(value) == 0.0
    except (TypeError, jax.errors.ConcretizationTypeError):
        return False
