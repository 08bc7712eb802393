"""``linear_cross_entropy``: a language model's loss ``logsumexp_v(h . w_v) - h . w_label``
from its last hidden states and its unembedding, one pairwise cross-entropy fold over the
vocabulary: the ``(T, V)`` logits are never formed, forward or backward."""

from __future__ import annotations

import math
import operator
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .. import _eager, _engine, _shard
from .._reductions import CrossEntropy
from ._reduce import reduce_pairs

if TYPE_CHECKING:
    from jaxtyping import Array, Float, Integer

_NAME = "foldax.linear_cross_entropy"
_REDUCTIONS = ("mean", "sum", "none")
#: How many times the planner's probe over-counts this fold's bytes per pair: it counts every
#: intermediate of a tile's jaxpr unfused (64 bytes a pair), where XLA's fused tile keeps 9
#: (forward) to 13 (with the gradient). Planned with the budget it would count, a tile is the
#: matrix product the budget really allows: 1,024 tokens x 1,024 vocabulary rows at the default
#: (9.0 / 13.2 MB temp at T = 8,192, V = 131,072, D = 512; 256 x 1,024 otherwise, 1.13x slower
#: with its gradient on 2 CPU cores).
_PROBE_OVERCOUNT = 4


def _fail(what, fix, kind=ValueError):
    raise kind(f"{_NAME}: {what}; {fix}.")


def _checked(h, w, labels, w_layout, reduction, logit_soft_cap, label_smoothing, z_loss):
    """``(h, w (V, D), labels)`` as arrays, after checking what can be checked statically."""
    _check_host_labels(labels)
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


def _check_host_labels(labels):
    """Labels given on the host (NumPy, lists) that JAX's integers cannot hold (64-bit values
    without ``jax_enable_x64``) are refused: ``jnp.asarray`` would wrap them onto other ids."""
    if isinstance(labels, jax.Array) or not isinstance(labels, np.ndarray | list | tuple | int):
        return
    host = np.asarray(labels)
    if host.dtype.kind not in "iu" or not host.size:
        return
    info = np.iinfo(jnp.asarray(host.reshape(-1)[:0]).dtype)
    low, high = host.min(), host.max()
    if low < info.min or high > info.max:
        bad = low if low < info.min else high
        _fail(
            f"labels holds {bad}, which JAX's {info.dtype} cannot hold (it would wrap onto "
            "another token id)",
            "pass token ids in [0, V) (or turn on jax_enable_x64 for 64-bit labels)",
        )


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


def _kernel(acc, cap, eps, v):
    """The pair kernel ``(z, q)``: the (soft-capped) logit of a token and a vocabulary row, and
    the row's target weight for the token, ``(1 - eps) [row == label] + eps / V``."""
    # Python numbers where the option is known: no array for the fold to carry as a constant
    # (and differentiate); a traced one (a schedule) is an array, and takes its derivative
    e = _concrete(eps)
    e = jnp.asarray(eps, acc) if e is None else e
    smooth = not _is_zero(eps)
    hit, rest = (1 - e, e / v) if smooth else (1.0, None)

    def kernel(a, b):
        (h, label), (w, row) = a, b
        q = jnp.where(row == label, jnp.asarray(hit, acc), jnp.zeros((), acc))
        return _capped(_dot(h, w, acc), cap), q if rest is None else q + jnp.asarray(rest, acc)

    return kernel


@_eager.cached(dynamic=("h", "w", "labels"))
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

    Memory and derivatives: one fold over tiles of tokens by vocabulary rows computes each
    token's log-sum-exp and its target's logit together (the cross-entropy against target
    weights ``q = (1 - eps) onehot + eps / V``), ``O(tile + T)`` temp beyond the inputs; no row
    of ``w`` is gathered per label. Its gradient is one streamed fold too: it saves the ``(T,)``
    log-sum-exps and recomputes each tile of logits, pulling ``p - q`` back into ``dh`` and
    ``dw`` in float32 (for half-precision inputs each tile's share is formed from the widened
    tile and the sums are narrowed once, at the end: the gradients are as accurate as the plain
    loss's with float32 logits). For a half-precision ``w`` that fold walks the vocabulary's
    blocks outermost, so each block of ``dw`` is complete (summed over every token) when it is
    rounded: no float32 ``(V, D)`` buffer, only ``dh``'s ``(T, D)``. ``jax.jvp``,
    ``jax.hessian`` and ``vmap`` compose as with every fold; a ``vmap`` over sequences that
    share ``w`` is one fold over all their tokens (``w``'s gradient summed inside it).

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
    hf = h.reshape(math.prod(shape), d)  # (not -1: D may be 0, and T is known)
    first, v = _vocabulary(axes, w.shape[0])
    # ignored / in range decided in the labels' own dtype, before the (then exact) cast: no
    # wide label, and no wide ``ignore_index``, wraps onto a row or onto ``ignore_index``
    labels = labels.reshape(-1)
    kept, valid = _kept(labels, ignore_index), _in_range(labels, v)
    lab = jnp.where(valid, labels.astype(jnp.int32), -1)  # -1: no row's id
    ids = first + jnp.arange(w.shape[0], dtype=jnp.int32)  # the global id of each row of w
    with _engine.memory_budget(_PROBE_OVERCOUNT * _engine.current_budget()):
        loss, lse = reduce_pairs(
            _NAME, _kernel(acc, logit_soft_cap, label_smoothing, v), (hf, lab), (w, ids),
            reduction=CrossEntropy(), k=None, block_size=block_size, mask=None,
            segment_ids=None, axis_name=axis_name, widen=True,
        )  # fmt: skip
    if not _is_zero(z_loss):
        loss = loss + jnp.asarray(z_loss, acc) * lse**2
    loss = jnp.where(kept, jnp.where(valid, loss, jnp.nan), jnp.zeros((), loss.dtype))
    loss = loss.astype(acc)
    if reduction == "none":
        out = loss.reshape(shape)
    elif reduction == "sum":
        out = jnp.sum(loss)
    else:
        out = jnp.sum(loss) / jnp.sum(kept).astype(acc)
    return (out, lse.reshape(shape).astype(acc)) if return_lse else out


def _kept(labels, ignore_index):
    """Which labels differ from ``ignore_index``, compared in the labels' dtype: an index that
    dtype cannot hold matches no label (it is never narrowed onto one)."""
    if isinstance(ignore_index, float | np.floating) and float(ignore_index).is_integer():
        ignore_index = int(ignore_index)
    try:
        i = operator.index(ignore_index)
    except TypeError:  # a non-integral float, an array: compared as JAX promotes them
        return labels != ignore_index
    info = jnp.iinfo(labels.dtype)
    if not info.min <= i <= info.max:
        return jnp.ones(labels.shape, bool)
    return labels != jnp.asarray(i, labels.dtype)


def _in_range(labels, v):
    """Which labels lie in ``[0, v)``, compared in the labels' dtype (signed or unsigned)."""
    info = jnp.iinfo(labels.dtype)
    ok = labels >= 0 if info.min < 0 else jnp.ones(labels.shape, bool)
    if v <= info.max:  # (else every label of that dtype is below v)
        ok = ok & (labels < jnp.asarray(v, labels.dtype))
    return ok


def _concrete(value):
    """A concrete option as a Python float, else ``None`` (a traced one, e.g. a schedule)."""
    try:
        return float(value)
    except (TypeError, jax.errors.ConcretizationTypeError):
        return None


def _is_zero(value):
    """Whether an option is a concrete 0 (then its term is left out of the program)."""
    return _concrete(value) == 0.0
