"""``dot_product_attention``: ``jax.nn.dot_product_attention``'s call (batch, heads, grouped
key / value heads, causal, windows, lengths, bias and mask arrays) as one pairwise softmax
fold per head, plus packed-sequence ``segment_ids`` and index masks that skip what they remove.

The heads and the batch are ``vmap`` s over the fold (no copy of ``key`` / ``value`` per
group of query heads); the masks close over each example's lengths and ids, so every example
skips its own blocks."""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _eager
from ._reduce import _mask_examples, reduce_pairs

if TYPE_CHECKING:
    from jaxtyping import Array

_NAME = "foldax.dot_product_attention"


def _fail(what, fix):
    raise ValueError(f"{_NAME}: {what}; {fix}.")


def _shapes(query, key, value, layout):
    """``(B or None, T, S, N, K, H)`` after checking that the shapes agree."""
    if layout not in ("BTNH", "BNTH"):
        _fail(f"layout must be 'BTNH' or 'BNTH', got {layout!r}", "pass one of them")
    ranks = {np.ndim(a) for a in (query, key, value)}
    if len(ranks) != 1 or next(iter(ranks)) not in (3, 4):
        shapes = ", ".join(str(np.shape(a)) for a in (query, key, value))
        _fail(
            f"query, key and value must all be 4-D ({layout}) or all 3-D (no batch), got {shapes}",
            "add or remove the batch axis so that they agree",
        )
    batched = np.ndim(query) == 4
    b = np.shape(query)[0] if batched else None
    q, k, v = (np.shape(a)[1:] if batched else np.shape(a) for a in (query, key, value))
    if layout == "BNTH":  # per example (N, T, H): read as (T, N, H)
        q, k, v = ((a[1], a[0], a[2]) for a in (q, k, v))
    (t, n, h), (s, kh, hk), (sv, kv, _) = q, k, v
    if batched and not np.shape(query)[0] == np.shape(key)[0] == np.shape(value)[0]:
        _fail("query, key and value have different batch sizes", "pass one batch size")
    if hk != h:
        _fail(f"key's head size {hk} is not query's {h}", "project both to one size")
    if (sv, kv) != (s, kh):
        _fail(
            f"value has {sv} rows and {kv} heads where key has {s} and {kh}",
            "pass key and value with the same length and heads",
        )
    if kh == 0 or n % kh:
        _fail(
            f"query's {n} heads are not a multiple of key's {kh} heads",
            "pass K key / value heads that divide the N query heads (grouped-query attention)",
        )
    return b, t, s, n, kh, h


def _batched(a, b, what, shape):
    """``(a, axis)``: ``a`` of shape ``(B, *shape)`` (axis 0) or ``shape`` (shared: ``None``)."""
    if a is None:
        return None, None
    a = jnp.asarray(a)
    if b is not None and a.shape == (b, *shape):
        return a, 0
    if a.shape == tuple(shape):
        return a, None
    want = f"{(b, *shape)} or {tuple(shape)}" if b is not None else f"{tuple(shape)}"
    _fail(f"{what} has shape {a.shape}", f"pass shape {want}")


def _pairs_array(a, b, n, t, s, what):
    """A bias / mask array broadcastable to ``(B, N, T, S)`` (``(N, T, S)`` unbatched) as
    ``(a, batch axis, heads?)``: ``a`` of shape ``([B,] [N,] T, S)``, no axis broadcast to
    its full size."""
    if a is None:
        return None, None, False
    a = jnp.asarray(a)
    rank = 4 if b is not None else 3
    full = (b, n, t, s) if b is not None else (n, t, s)
    if a.ndim != rank or any(d not in (1, f) for d, f in zip(a.shape, full, strict=True)):
        _fail(f"{what} of shape {a.shape} does not broadcast to {full}", f"pass shape {full}")
    a = jnp.broadcast_to(a, (*a.shape[:-2], t, s))
    axis = None
    if b is not None:
        axis = 0 if a.shape[0] == b and b != 1 else None
        a = a if axis == 0 else a[0]
    heads = a.shape[-3] == n and n != 1
    a = a if heads else a[..., 0, :, :]
    return a, axis, heads


def _all(*masks):
    """The pairs every one of ``masks`` (``mask(i, j)`` or ``None``) keeps; ``None``: all."""
    masks = [m for m in masks if m is not None]
    if not masks:
        return None

    def keep(i, j):
        out = masks[0](i, j)
        for m in masks[1:]:
            out = out & m(i, j)
        return out

    return keep


def _index_masks(is_causal, window, q_len, kv_len, mask):
    """The index masks of the call (``None`` when every pair takes part)."""
    left, right = (window, window) if isinstance(window, int) else (window or (None, None))
    return _all(
        (lambda i, j: j <= i) if is_causal else None,
        (lambda i, j: (j >= i - left) & (j <= i + right)) if window is not None else None,
        (lambda i, j: i < q_len) if q_len is not None else None,
        (lambda i, j: j < kv_len) if kv_len is not None else None,
        mask,
    )


def _head(q, k, v, *, scale, mask, ids, bias, pairs, block_size, residual):
    """One head: ``q (T, H)`` over ``k (S, H)``, ``v (S, Hv)``; ``bias`` / ``pairs`` (a
    boolean array) ``(T, S)`` or ``None``. ``out (T, Hv)``, and ``lse (T,)`` with ``residual``."""
    with_index = bias is not None  # the kernel reads the bias at the pair's indices
    x = (q, jnp.arange(q.shape[0], dtype=jnp.int32)) if with_index else q
    y = (k, v, jnp.arange(k.shape[0], dtype=jnp.int32)) if with_index else (k, v)

    def kernel(a, b):
        qa = a[0] if with_index else a
        wide = jnp.dtype(qa.dtype).itemsize >= 4
        acc = qa.dtype if wide else jnp.float32  # half-precision logits in float32
        logit = scale * jnp.dot(qa, b[0], preferred_element_type=acc)
        if with_index:
            logit = logit + bias[a[1], b[2]].astype(acc)
        return logit, b[1]

    keep = _all(mask, None if pairs is None else (lambda i, j: pairs[i, j]))
    return reduce_pairs(
        _NAME, kernel, x, y, reduction="softmax", k=None, block_size=block_size, mask=keep,
        segment_ids=ids, axis_name=None, residual=residual,
    )  # fmt: skip


def _example(q, k, v, q_len, kv_len, ids, bias, pairs, *, call, h_ax, groups, b_heads, p_heads):
    """One example (no batch axis; heads on ``h_ax``): every head, grouped query heads sharing
    their key / value head (``vmap`` s, nothing copied)."""
    mask = _index_masks(call["is_causal"], call["local_window_size"], q_len, kv_len, call["mask"])
    kh = k.shape[h_ax]
    qg = q.reshape((*q.shape[:h_ax], kh, groups, *q.shape[h_ax + 1 :]))

    def split(a, on):  # (N, T, S) -> (K, G, T, S); shared by every head: as it is
        return a.reshape((kh, groups, *a.shape[1:])) if a is not None and on else a

    bias_g, pairs_g = split(bias, b_heads), split(pairs, p_heads)
    head = lambda qh, kk, vk, bh, ph: _head(  # noqa: E731
        qh, kk, vk, scale=call["scale"], mask=mask, ids=ids, bias=bh, pairs=ph,
        block_size=call["block_size"], residual=call["return_residual"],
    )  # fmt: skip
    over = lambda on: 0 if on else None  # noqa: E731

    def kv_head(qk, kk, vk, bk, pk):
        shared = (None, None, over(b_heads), over(p_heads))
        return jax.vmap(head, (h_ax, *shared), out_axes=h_ax)(qk, kk, vk, bk, pk)

    axes = (h_ax, h_ax, h_ax, over(b_heads), over(p_heads))
    out = jax.vmap(kv_head, axes, out_axes=h_ax)(qg, k, v, bias_g, pairs_g)
    heads = kh * groups  # (K, G) -> N; spelled out: -1 is ambiguous for empty sequences
    merge = lambda a: a.reshape((*a.shape[:h_ax], heads, *a.shape[h_ax + 2 :]))  # noqa: E731
    return jax.tree.map(merge, out)


def _segment_ids(segment_ids, b, t, s):
    """``(ids, axis)``: the per-example ids (one array or a pair) and their batch axis."""
    if segment_ids is None:
        return None, None
    if isinstance(segment_ids, tuple | list):
        if len(segment_ids) != 2:
            _fail(f"segment_ids has {len(segment_ids)} parts", "pass one array or a pair")
        (iq, aq), (ik, ak) = (
            _batched(a, b, f"segment_ids[{n}]", (r,))
            for n, a, r in ((0, segment_ids[0], t), (1, segment_ids[1], s))
        )
        if aq != ak:
            iq, ik = (jnp.broadcast_to(a, (b, a.shape[-1])) for a in (iq, ik))
            aq = 0
        return (iq, ik), aq
    if t != s:
        _fail(
            f"one segment_ids array needs as many queries as keys, got T = {t}, S = {s}",
            "pass a pair (query ids (B, T), key ids (B, S))",
        )
    return _batched(segment_ids, b, "segment_ids", (t,))


_eager_call = _eager.cached(
    dynamic=(
        "query", "key", "value", "bias", "mask", "query_seq_lengths",
        "key_value_seq_lengths", "segment_ids",
    ),
    hoist={"mask": _eager.Hoist(_mask_examples)},
)  # fmt: skip


@_eager_call
def dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: Any = None,
    key_value_seq_lengths: Any = None,
    local_window_size: int | tuple[int, int] | None = None,
    segment_ids: Any = None,
    return_residual: bool = False,
    layout: str = "BTNH",
    block_size: int | tuple[int, int] | None = None,
) -> Array | tuple[Array, Array]:
    r"""Scaled dot-product attention, called as ``jax.nn.dot_product_attention``, without the
    ``(T, S)`` matrix of logits and skipping the blocks of pairs its masks remove.

    .. math::
       \mathrm{out}_{t} = \sum_{s} \mathrm{softmax}_s\big(\mathrm{scale}\; q_t \cdot k_s
       + \mathrm{bias}_{ts}\big)\, v_s \quad\text{over the pairs } (t, s) \text{ kept}

    Args:
      query: ``(B, T, N, H)`` (``layout="BTNH"``, as ``jax.nn``), ``(B, N, T, H)``
        (``"BNTH"``), or either without ``B``.
      key: ``(B, S, K, H)`` (or as ``query``'s layout); ``K`` divides ``N``: grouped-query
        attention (``K = 1``: multi-query), each group of ``N / K`` query heads reads one
        key / value head (no copy is made).
      value: ``(B, S, K, Hv)``, like ``key``.
      bias: optional array broadcastable to ``(B, N, T, S)`` added to the logits (its
        gradient is returned too). An array of pairs: use it where the bias is data.
      mask: optional boolean array broadcastable to ``(B, N, T, S)`` (``True``: take part),
        or a callable ``mask(t, s) -> bool`` of the indices of a query and a key (see
        :func:`foldax.pairwise_reduce`; it may close over traced arrays). An index mask
        whose formula bounds on a block skips blocks without looking at their pairs; an
        array is read at every pair.
      scale: the logits' scale (default ``1 / sqrt(H)``). Static.
      is_causal: keep ``s <= t``. Static.
      query_seq_lengths: optional ``(B,)`` ints: queries ``t >= length`` get 0.
      key_value_seq_lengths: optional ``(B,)`` ints: keys ``s >= length`` take no part.
      local_window_size: optional ``w`` or ``(left, right)``: keep ``t - left <= s <= t +
        right``. Static.
      segment_ids: optional ``(B, T)`` ints when ``T = S`` (packed sequences: each token
        attends within its document), or a pair ``((B, T), (B, S))`` of query and key ids:
        keep pairs with equal ids. With sorted ids, whole blocks across documents are skipped,
        listed from each block's range of ids.
      return_residual: also return the log-sum-exp of each query's kept logits (to combine
        partial results, as blockwise and ring attention do). Static.
      layout: ``"BTNH"`` or ``"BNTH"``. Static.
      block_size: static ``int`` or ``(bt, bs)``: queries and keys per tile (default: from
        the memory budget, see :func:`foldax.memory_budget`).

    Returns:
      ``out`` of ``query``'s shape with ``value``'s head size and dtype; with
      ``return_residual``, ``(out, lse)``, ``lse`` float32 ``(B, T, N)`` (``(B, N, T)`` for
      ``"BNTH"``). A query with no kept key gets 0 (and ``lse = -inf``), with zero gradients;
      ``jax.nn``'s XLA path averages every value there instead, except for the queries its
      ``query_seq_lengths`` removes, which are 0 there too.

    Memory: ``O(tile + T + S)`` per head, forward and backward; the gradient saves the inputs
    and the log-sum-exp and recomputes every live tile (reaching ``query``, ``key``,
    ``value`` and ``bias``).

    Example:
      >>> import jax, jax.numpy as jnp, foldax
      >>> q = k = v = jax.random.normal(jax.random.key(0), (2, 8, 4, 16))  # B, T, N, H
      >>> docs = jnp.array([[0, 0, 0, 1, 1, 1, 1, 2]] * 2)  # three packed sequences
      >>> out = foldax.dot_product_attention(q, k, v, is_causal=True, segment_ids=docs)
      >>> out.shape
      (2, 8, 4, 16)
    """
    b, t, s, n, kh, h = _shapes(query, key, value, layout)
    call = dict(
        scale=1.0 / math.sqrt(h) if scale is None and h else 1.0 if scale is None else scale,
        is_causal=bool(is_causal),
        local_window_size=local_window_size,
        mask=mask if callable(mask) else None,
        block_size=block_size,
        return_residual=bool(return_residual),
    )
    pairs = None if mask is None or callable(mask) else jnp.asarray(mask)
    if pairs is not None and pairs.dtype != jnp.bool_:
        _fail(
            f"mask must be boolean or a callable, got {pairs.dtype}",
            "pass bias= for additive masks",
        )
    bias, b_ax, b_heads = _pairs_array(bias, b, n, t, s, "bias")
    pairs, p_ax, p_heads = _pairs_array(pairs, b, n, t, s, "mask")
    q_len, ql_ax = _batched(query_seq_lengths, b, "query_seq_lengths", ())
    kv_len, kl_ax = _batched(key_value_seq_lengths, b, "key_value_seq_lengths", ())
    ids, id_ax = _segment_ids(segment_ids, b, t, s)
    one = functools.partial(
        _example, call=call, h_ax=1 if layout == "BTNH" else 0, groups=n // kh,
        b_heads=b_heads, p_heads=p_heads,
    )  # fmt: skip
    args = (query, key, value, q_len, kv_len, ids, bias, pairs)
    if b is None:
        return one(*args)
    return jax.vmap(one, (0, 0, 0, ql_ax, kl_ax, id_ax, b_ax, p_ax))(*args)
