"""``dot_product_attention``: ``jax.nn.dot_product_attention``'s call (batch, heads, grouped
key / value heads, causal, windows, lengths, bias and mask arrays broadcast as ``jax.nn``
broadcasts them) and Flax's ``attention_fn`` call, as one pairwise softmax fold per head, plus
packed-sequence ``segment_ids``, a soft cap on the logits, and index masks (of the head too)
that skip what they remove.

The heads and the batch are ``vmap`` s over the fold (no copy of ``key`` / ``value`` per
group of query heads); the masks close over each example's lengths and ids, so every example
skips its own blocks."""

from __future__ import annotations

import functools
import inspect
import math
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import _eager, _engine
from ._options import _NAME, _check_options, _eager_options, _fail
from ._reduce import reduce_pairs

if TYPE_CHECKING:
    from jaxtyping import Array


def _shapes(query, key, value, layout):
    """``(batch, T, S, N, K, H)`` after checking that the shapes agree; ``batch``: the shape
    of the leading batch axes (``()`` without any)."""
    if layout not in ("BTNH", "BNTH"):
        _fail(f"layout must be 'BTNH' or 'BNTH', got {layout!r}", "pass one of them")
    ranks = {np.ndim(a) for a in (query, key, value)}
    if len(ranks) != 1 or next(iter(ranks)) < 3:
        shapes = ", ".join(str(np.shape(a)) for a in (query, key, value))
        _fail(
            f"query, key and value must all be 4-D ({layout}) or all 3-D (no batch), got {shapes}",
            "add or remove the batch axis so that they agree",
        )
    batch = tuple(np.shape(query)[:-3])
    kinds = [jnp.result_type(a) for a in (query, key, value)]
    if any(jnp.issubdtype(d, jnp.complexfloating) for d in kinds):
        _fail(
            f"query, key and value must be real, got {', '.join(map(str, kinds))}",
            "cast them to a float dtype (complex attention: split real and imaginary parts)",
        )
    q, k, v = (tuple(np.shape(a)[-3:]) for a in (query, key, value))
    if layout == "BNTH":  # per example (N, T, H): read as (T, N, H)
        q, k, v = ((a[1], a[0], a[2]) for a in (q, k, v))
    (t, n, h), (s, kh, hk), (sv, kv, _) = q, k, v
    if not tuple(np.shape(query)[:-3]) == np.shape(key)[:-3] == np.shape(value)[:-3]:
        shapes = ", ".join(str(np.shape(a)[:-3]) for a in (query, key, value))
        _fail(f"query, key and value have different batch axes {shapes}", "pass one batch shape")
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
    return batch, t, s, n, kh, h


def _batched(a, batch, what, shape):
    """``(a, axis)``: ``a`` of shape ``(*batch, *shape)`` as ``(B, *shape)`` (axis 0), or
    ``shape`` (shared: ``None``); unbatched (``batch = ()``), ``(1, *shape)`` as jax.nn takes
    it is read as ``shape``."""
    if a is None:
        return None, None
    a = jnp.asarray(a)
    shape = tuple(shape)
    if batch and a.shape == (*batch, *shape):
        return a.reshape((math.prod(batch), *shape)), 0
    if a.shape == shape:
        return a, None
    if not batch and a.shape == (1, *shape):
        return a[0], None
    want = f"{(*batch, *shape)} or {shape}" if batch else f"{shape}"
    _fail(f"{what} has shape {a.shape}", f"pass shape {want}")


def _axis_names(batch):
    """The names of the axes of ``(*batch, N, T, S)``, for messages."""
    names = ("B",) if len(batch) == 1 else tuple(f"B{i}" for i in range(len(batch)))
    return (*names, "N", "T", "S")


def _pairs_array(a, batch, n, t, s, what):
    """A bias / mask array that broadcasts to ``(*batch, N, T, S)`` as ``jax.nn``'s does
    (leading axes added, then NumPy broadcasting), as ``(a, batch axis, heads?)``: ``a`` of
    shape ``([B,] [N,] T or 1, S or 1)``; the batch and head axes kept only where they vary,
    nothing broadcast to its full size (one batch axis: nothing copied)."""
    if a is None:
        return None, None, False
    a = jnp.asarray(a)
    given, full, names = a.shape, (*batch, n, t, s), _axis_names(batch)
    extra = a.ndim - len(full)
    if extra > 0 and all(d == 1 for d in a.shape[:extra]):  # jax.nn's (1, N, T, S) unbatched
        a, extra = a.reshape(a.shape[extra:]), 0
    padded = (1,) * max(-extra, 0) + a.shape
    if extra > 0:
        bad = [f"it has {len(given)} axes, at most {len(full)}"]
    else:
        pad = zip(names, full, padded, strict=True)
        bad = [f"{name} = {f} where it has {d}" for name, f, d in pad if d not in (1, f)]
    if bad:
        _fail(
            f"{what} of shape {given} does not broadcast to ({', '.join(names)}) = {full}: "
            + ", ".join(bad),
            f"pass a shape whose axes, aligned on the right, are 1 or those sizes "
            f"(e.g. {(n, t, s)}, {(1, 1, s)} or {full})",
        )
    a = a.reshape(padded)
    lead, rest = padded[: len(batch)], padded[len(batch) :]
    axis = None
    if batch and any(d != 1 for d in lead) and math.prod(batch) != 1:
        a = jnp.broadcast_to(a, (*batch, *rest)).reshape((math.prod(batch), *rest))
        axis = 0
    else:
        a = a.reshape(rest)
    heads = rest[0] == n and n != 1
    a = a if heads else a[..., 0, :, :]
    return a, axis, heads


def _at(a, i, j):
    """``a[i, j]`` of a ``(T or 1, S or 1)`` array: a size-1 axis is read at 0."""
    return a[i if a.shape[0] != 1 else 0, j if a.shape[1] != 1 else 0]


def _takes_head(mask):
    """Whether a mask callable is ``mask(h, t, s)`` (three positional parameters without
    defaults) rather than ``mask(t, s)``."""
    try:
        params = inspect.signature(mask).parameters.values()
    except (TypeError, ValueError):  # no signature to read: the common form
        return False
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    required = [p for p in params if p.kind in positional and p.default is p.empty]
    return len(required) == 3


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


def _window(window):
    """``local_window_size`` as ``(left, right)`` (``(None, None)``: no window)."""
    return (window, window) if isinstance(window, int) else (window or (None, None))


def _index_masks(is_causal, window, q_len, kv_len, mask):
    """The index masks of the call (``None`` when every pair takes part)."""
    left, right = _window(window)
    return _all(
        (lambda i, j: j <= i) if is_causal else None,
        (lambda i, j: (j >= i - left) & (j <= i + right)) if window is not None else None,
        (lambda i, j: i < q_len) if q_len is not None else None,
        (lambda i, j: j < kv_len) if kv_len is not None else None,
        mask,
    )


def _band(call):
    """``(left, right)``: the most the call's causal mask and window keep, ``t - left <= s <=
    t + right`` (``None``: unbounded on that side; ``None`` for both: no band)."""
    left, right = _window(call["local_window_size"])
    if call["is_causal"]:
        right = 0 if right is None else min(right, 0)
    return None if left is None and right is None else (left, right)


def _logits(call, bias, with_index):
    """``logit(a, b)`` of a query row ``a`` and a key row ``b`` (with their indices where
    ``with_index``): scaled, the bias added, soft-capped, in float32 for half precision."""
    scale, cap, precision = call["scale"], call["logits_soft_cap"], call["precision"]

    def logit(a, b):
        qa = a[0] if with_index else a
        wide = jnp.dtype(qa.dtype).itemsize >= 4
        acc = qa.dtype if wide else jnp.float32  # half-precision logits in float32
        z = scale * jnp.dot(qa, b[0], precision=precision, preferred_element_type=acc)
        if bias is not None:
            z = z + _at(bias, a[1], b[-1]).astype(acc)
        if cap is not None:
            z = cap * jnp.tanh(z / cap)
        return z

    return logit


def _head(q, k, v, hid, bias, pairs, *, call, mask, ids, drop):
    """One head (query head index ``hid``, or ``None``): ``q (T, H)`` over ``k (S, H)``,
    ``v (S, Hv)``; ``bias`` / ``pairs`` (a boolean array) ``(T or 1, S or 1)`` or ``None``;
    ``drop``: the dropout key of the example (and its index), or ``None``. ``out (T, Hv)``, and
    ``lse (T,)`` with ``call["return_residual"]``."""
    by_head = call["head_mask"]
    # an array of every pair skips the blocks it drops (from a table of its cells); one
    # broadcast along an axis is read by index
    whole = pairs is not None and pairs.shape == (q.shape[0], k.shape[0])
    keep = _all(
        mask,
        None if by_head is None else (lambda i, j: by_head(hid, i, j)),
        None if pairs is None or whole else (lambda i, j: _at(pairs, i, j)),
    )
    fold = functools.partial(
        reduce_pairs, _NAME, k=None, block_size=call["block_size"], mask=keep, segment_ids=ids,
        axis_name=None, pairs=pairs if whole else None, band=_band(call),
    )  # fmt: skip
    if drop is not None:
        return _dropout_head(q, k, v, hid, bias, call=call, fold=fold, drop=drop)
    with_index = bias is not None  # the kernel reads the bias at the pair's indices
    x = (q, jnp.arange(q.shape[0], dtype=jnp.int32)) if with_index else q
    y = (k, v, jnp.arange(k.shape[0], dtype=jnp.int32)) if with_index else (k, v)
    logit = _logits(call, bias, with_index)
    kernel = lambda a, b: (logit(a, b), b[1])  # noqa: E731
    return fold(kernel, x, y, reduction="softmax", residual=call["return_residual"])


def _dropout_head(q, k, v, hid, bias, *, call, fold, drop):
    """One head with dropout on its attention weights: ``softmax(logits) * keep / (1 - rate)``
    times the values, as two folds of the same logits. The keep mask of a pair is a hash of the
    key and the pair's indices (``fold_in`` of the row's key with the column's index): drawn per
    tile, never stored, the same in every pass and for every tiling.

    ``out_t = (1 / (1 - rate)) sum_{s kept} p_ts v_s = exp(lse_kept_t - lse_t) / (1 - rate)
    * softmax_kept(v)_t``: the softmax over the kept pairs (dropped ones get the logit -inf)
    rescaled by the share of the row's weight they hold; ``lse_t`` of every pair is the second
    fold."""
    rate, broadcast = call["dropout"]
    key, example = drop
    if not broadcast:  # a mask per example and head
        key = jax.random.fold_in(jax.random.fold_in(key, example), hid)
    t_idx = jnp.arange(q.shape[0], dtype=jnp.int32)
    s_idx = jnp.arange(k.shape[0], dtype=jnp.int32)
    rows = jax.random.key_data(jax.vmap(lambda t: jax.random.fold_in(key, t))(t_idx))
    logit = _logits(call, bias, True)
    threshold = np.uint32(min(round(rate * 2.0**32), 2**32 - 1))

    def kept(a, b):
        bits = jax.random.key_data(
            jax.random.fold_in(jax.random.wrap_key_data(a[2], impl="threefry2x32"), b[-1])
        )[0]
        z = logit(a, b)
        return jnp.where(bits >= threshold, z, jnp.asarray(-np.inf, z.dtype)), b[1]

    out, lse_kept = fold(kept, (q, t_idx, rows), (k, v, s_idx), reduction="softmax", residual=True)
    lse = fold(logit, (q, t_idx), (k, s_idx), reduction="logsumexp")
    gap = jnp.where(lse > -np.inf, lse_kept - lse, -np.inf)
    factor = jnp.exp(gap) / (1.0 - rate)
    out = out * factor[:, None].astype(out.dtype)
    return (out, lse) if call["return_residual"] else out


def _example(
    q, k, v, q_len, kv_len, ids, bias, pairs, drop, *, call, h_ax, groups, b_heads, p_heads
):
    """One example (no batch axis; heads on ``h_ax``): every head, grouped query heads sharing
    their key / value head (``vmap`` s, nothing copied)."""
    mask = _index_masks(call["is_causal"], call["local_window_size"], q_len, kv_len, call["mask"])
    kh = k.shape[h_ax]
    qg = q.reshape((*q.shape[:h_ax], kh, groups, *q.shape[h_ax + 1 :]))
    # the query heads' indices, for a mask of the head or a dropout mask per head (nothing to
    # carry otherwise)
    hids = jnp.arange(kh * groups, dtype=jnp.int32).reshape(kh, groups)
    per_head = call["dropout"] is not None and not call["dropout"][1]
    hids = hids if call["head_mask"] is not None or per_head else None

    def split(a, on):  # (N, T, S) -> (K, G, T, S); shared by every head: as it is
        return a.reshape((kh, groups, *a.shape[1:])) if a is not None and on else a

    bias_g, pairs_g = split(bias, b_heads), split(pairs, p_heads)
    head = functools.partial(_head, call=call, mask=mask, ids=ids, drop=drop)
    over = lambda on: 0 if on else None  # noqa: E731
    shared = (over(hids is not None), over(b_heads), over(p_heads))

    def kv_head(qk, kk, vk, hk, bk, pk):
        return jax.vmap(head, (h_ax, None, None, *shared), out_axes=h_ax)(qk, kk, vk, hk, bk, pk)

    axes = (h_ax, h_ax, h_ax, *shared)
    out = jax.vmap(kv_head, axes, out_axes=h_ax)(qg, k, v, hids, bias_g, pairs_g)
    heads = kh * groups  # (K, G) -> N; spelled out: -1 is ambiguous for empty sequences
    merge = lambda a: a.reshape((*a.shape[:h_ax], heads, *a.shape[h_ax + 2 :]))  # noqa: E731
    return jax.tree.map(merge, out)


def _segment_ids(segment_ids, batch, t, s):
    """``(ids, axis)``: the per-example ids (one array or a pair) and their batch axis."""
    if segment_ids is None:
        return None, None
    if isinstance(segment_ids, tuple | list):
        if len(segment_ids) != 2:
            _fail(f"segment_ids has {len(segment_ids)} parts", "pass one array or a pair")
        (iq, aq), (ik, ak) = (
            _batched(a, batch, f"segment_ids[{n}]", (r,))
            for n, a, r in ((0, segment_ids[0], t), (1, segment_ids[1], s))
        )
        if aq != ak:
            iq, ik = (jnp.broadcast_to(a, (math.prod(batch), a.shape[-1])) for a in (iq, ik))
            aq = 0
        return (iq, ik), aq
    if t != s:
        _fail(
            f"one segment_ids array needs as many queries as keys, got T = {t}, S = {s}",
            "pass a pair (query ids (B, T), key ids (B, S))",
        )
    return _batched(segment_ids, batch, "segment_ids", (t,))


def _mask_array(mask):
    """An array ``mask`` as booleans (Flax's convention for numbers: nonzero keeps)."""
    if mask is None or callable(mask):
        return None
    mask = jnp.asarray(mask)
    if mask.dtype == jnp.bool_:
        return mask
    if not any(jnp.issubdtype(mask.dtype, kind) for kind in (jnp.integer, jnp.floating)):
        _fail(
            f"mask must be boolean, numbers (nonzero keeps) or a callable, got {mask.dtype}",
            "pass a boolean array, or bias= for additive masks",
        )
    return mask != 0


def _dropout(rate, deterministic, rng, broadcast, batch):
    """``(call entry, drop, drop's batch axes)`` of Flax's dropout options: ``(rate,
    broadcast)`` and ``(key, example index)`` where dropout applies, else ``None`` s."""
    if deterministic or rate == 0:
        return None, None, None
    if rng is None:
        _fail(
            f"dropout_rate={rate} without deterministic=True needs dropout_rng",
            "pass a key (dropout_rng=jax.random.key(0)), or deterministic=True",
        )
    rng = rng if isinstance(rng, jax.Array) else jnp.asarray(rng)
    if not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        if rng.dtype != jnp.uint32 or rng.ndim != 1:
            _fail(
                f"dropout_rng must be a PRNG key, got {rng.dtype}{list(rng.shape)}",
                "pass jax.random.key(seed) or jax.random.PRNGKey(seed)",
            )
        rng = jax.random.wrap_key_data(rng)
    if rng.ndim:
        _fail(f"dropout_rng must be one key, got shape {rng.shape}", "pass a single key")
    # two words drawn from the key by its own generator seed a threefry key, whose fold_in
    # hashes every index in (another generator's fold_in may only xor it in, e.g. unsafe_rbg)
    rng = jax.random.wrap_key_data(jax.random.bits(rng, (2,), jnp.uint32), impl="threefry2x32")
    examples = jnp.arange(math.prod(batch), dtype=jnp.int32) if batch else jnp.int32(0)
    return (float(rate), bool(broadcast)), (rng, examples), (None, 0 if batch else None)


def _mask_examples(arguments):
    """What ``mask`` is traced on: two or three (with the head) int32 indices."""
    return (jax.ShapeDtypeStruct((), jnp.int32),) * (3 if _takes_head(arguments["mask"]) else 2)


def _mask_replay(closed, consts):
    """The cached trace of ``mask``, called as the user's was (with or without the head)."""
    run = functools.partial(closed, consts)
    if closed.in_tree.num_leaves == 3:
        return lambda h, t, s: run(h, t, s)
    return lambda t, s: run(t, s)


_eager_call = _eager.cached(
    dynamic=(
        "query", "key", "value", "bias", "mask", "query_seq_lengths",
        "key_value_seq_lengths", "segment_ids", "dropout_rng",
    ),
    hoist={"mask": _eager.Hoist(_mask_examples, _mask_replay)},
    prepare=_eager_options,
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
    implementation: str | None = None,
    return_residual: bool = False,
    residual_gradient: bool = False,
    logits_soft_cap: float | None = None,
    segment_ids: Any = None,
    layout: str = "BTNH",
    block_size: int | tuple[int, int] | None = None,
    dtype: Any = None,
    precision: Any = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dropout_rng: Any = None,
    broadcast_dropout: bool = True,
    module: Any = None,
) -> Array | tuple[Array, Array]:
    r"""Scaled dot-product attention, called as ``jax.nn.dot_product_attention`` (or as Flax's
    ``attention_fn``), without the ``(T, S)`` matrix of logits and skipping the blocks of pairs
    its masks remove.

    With Flax, pass ``attention_fn=foldax.dot_product_attention`` to
    ``nn.MultiHeadDotProductAttention`` or ``nnx.MultiHeadAttention``: its masks, batch axes and
    keywords are taken as Flax's own attention takes them, dropout included; sowing the
    attention weights is refused (they are never formed).

    .. math::
       \mathrm{out}_{t} = \sum_{s} \mathrm{softmax}_s\big(\mathrm{cap}(\mathrm{scale}\;
       q_t \cdot k_s + \mathrm{bias}_{ts})\big)\, v_s \quad\text{over the pairs } (t, s)
       \text{ kept}

    Args:
      query: ``(B, T, N, H)`` (``layout="BTNH"``, as ``jax.nn``), ``(B, N, T, H)``
        (``"BNTH"``), either without ``B``, or with several leading batch axes
        ``(B1, B2, ..., T, N, H)`` (as Flax passes them; then ``B`` below stands for all of
        them, in the lengths, the ids, the masks, the bias and the outputs alike).
      key: ``(B, S, K, H)`` (or as ``query``'s layout); ``K`` divides ``N``: grouped-query
        attention (``K = 1``: multi-query), each group of ``N / K`` query heads reads one
        key / value head (no copy is made).
      value: ``(B, S, K, Hv)``, like ``key``.
      bias: optional array added to the logits, broadcastable to ``(B, N, T, S)`` as in
        ``jax.nn``: leading axes of size 1 are added, then NumPy broadcasting applies, so
        ``(S,)``, ``(T, S)``, ``(N, T, S)``, ``(B, 1, 1, S)``... all work (in ``"BNTH"`` too;
        the axes are always in this order). Its gradient is returned too. A bias shared by
        every example or head is never copied per example or head.
      mask: optional array broadcastable like ``bias`` (``True``, or for numbers as Flax's
        ``nn.make_attention_mask`` makes them, nonzero: take part; an additive ``0 / -inf``
        mask goes in ``bias``), or a callable of the indices of a query and a key,
        ``mask(t, s) -> bool``, or of the query head too, ``mask(h, t, s) -> bool`` (``h``
        the query head's index in ``[0, N)``; the two are told apart by their number of
        positional parameters without defaults). A callable may close over traced arrays (see
        :func:`foldax.pairwise_reduce`); an index mask whose formula bounds on a block skips
        blocks without looking at their pairs; so does an array of every query and key
        (``(..., T, S)``), from a table of which 128 x 128 cells keep a pair, made once per
        call; an array broadcast along ``T`` or ``S`` is read at every pair.
      scale: the logits' scale (default ``1 / sqrt(H)``). Static.
      is_causal: keep ``s <= t``. Static.
      query_seq_lengths: optional ``(B,)`` ints: queries ``t >= length`` get 0.
      key_value_seq_lengths: optional ``(B,)`` ints: keys ``s >= length`` take no part.
      local_window_size: optional ``w`` or ``(left, right)``: keep ``t - left <= s <= t +
        right``. Static.
      implementation: ``None`` (or ``"cudnn"``, accepted as ``jax.nn`` does and taken as
        ``None``): the fastest for the platform, Pallas kernels on a TPU, the streamed XLA
        fold elsewhere; ``"xla"``: the XLA fold everywhere; ``"pallas"``: the kernels (in
        Pallas' interpret mode off a TPU: slow, for tests). A call the kernels cannot serve
        takes the XLA fold.
      return_residual: also return the log-sum-exp of each query's kept logits (to combine
        partial results, as blockwise and ring attention do). Static.
      residual_gradient: differentiate through the log-sum-exp. By default it is a
        ``stop_gradient`` ed value, as ``jax.nn`` returns it; pass ``True`` where a loss
        reads it (combining partial attentions, whose weights depend on it). Static.
      logits_soft_cap: optional ``cap``: the logits (scaled, bias added) become
        ``cap * tanh(logits / cap)`` before masking and softmax (Gemma 2's soft cap). Static.
      segment_ids: optional ``(B, T)`` ints when ``T = S`` (packed sequences: each token
        attends within its document), or a pair ``((B, T), (B, S))`` of query and key ids:
        keep pairs with equal ids. With sorted ids, whole blocks across documents are skipped,
        listed from each block's range of ids.
      layout: ``"BTNH"`` or ``"BNTH"``. Static.
      block_size: static ``int`` or ``(bt, bs)``: queries and keys per tile (default: from
        the memory budget, see :func:`foldax.memory_budget`, and the mask: under a mask the
        gradient takes tiles of 512, which skip more of what it removes at the same cost per
        pair).
      dtype: Flax's: ``query``, ``key`` and ``value`` are cast to it (``None``: as given).
      precision: the precision of the logits' products (``jax.lax.Precision``), as Flax's.
      dropout_rate: Flax's: the share of attention weights dropped, ``0 <= rate < 1``; the
        kept ones are divided by ``1 - rate``. Static. Each pair's keep bit is a hash of
        ``dropout_rng`` and the pair's indices, drawn per tile (never stored, the same in the
        backward pass and for every ``block_size``); the bits are not those Flax draws. The
        output takes two folds of the logits (the softmax over the kept pairs and the
        log-sum-exp over all): on CPU about 1.5 times the time without dropout forward and 2
        times with the gradient (still a fraction of Flax's dense dropout attention).
      deterministic: Flax's: no dropout when ``True``. Static.
      dropout_rng: a PRNG key (``jax.random.key`` or a raw ``PRNGKey``), needed when dropout
        applies.
      broadcast_dropout: Flax's: one keep mask shared by every example and head (``True``) or
        one per example and head. Static.
      module: Flax's module to sow the attention weights into; the weights are never formed,
        so it must be ``None`` (``sow_weights=False``).

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
      >>> per_head = lambda h, t, s: s > t - 2 * (h + 1)  # a window per head
      >>> foldax.dot_product_attention(q, k, v, mask=per_head, is_causal=True).shape
      (2, 8, 4, 16)
    """
    dropout_rate, logits_soft_cap = _check_options(
        dropout_rate, deterministic, module, implementation, logits_soft_cap
    )
    if dtype is not None:
        query, key, value = (jnp.asarray(a, dtype) for a in (query, key, value))
    batch, t, s, n, kh, h = _shapes(query, key, value, layout)
    takes_head = callable(mask) and _takes_head(mask)
    call = dict(
        scale=1.0 / math.sqrt(h) if scale is None and h else 1.0 if scale is None else scale,
        is_causal=bool(is_causal),
        local_window_size=local_window_size,
        mask=mask if callable(mask) and not takes_head else None,
        head_mask=mask if takes_head else None,
        block_size=block_size,
        return_residual=bool(return_residual),
        logits_soft_cap=logits_soft_cap,
        precision=precision,
    )
    call["dropout"], drop, drop_ax = _dropout(
        dropout_rate, deterministic, dropout_rng, broadcast_dropout, batch
    )
    bias, b_ax, b_heads = _pairs_array(bias, batch, n, t, s, "bias")
    pairs, p_ax, p_heads = _pairs_array(_mask_array(mask), batch, n, t, s, "mask")
    q_len, ql_ax = _batched(query_seq_lengths, batch, "query_seq_lengths", ())
    kv_len, kl_ax = _batched(key_value_seq_lengths, batch, "key_value_seq_lengths", ())
    ids, id_ax = _segment_ids(segment_ids, batch, t, s)
    one = functools.partial(
        _example, call=call, h_ax=1 if layout == "BTNH" else 0, groups=n // kh,
        b_heads=b_heads, p_heads=p_heads,
    )  # fmt: skip
    chosen = implementation if implementation in ("xla", "pallas") else None
    with _engine.implementation(chosen or _engine.current_implementation()):
        flat = lambda a: a.reshape((math.prod(batch), *a.shape[len(batch) :]))  # noqa: E731
        args = (query, key, value) if len(batch) < 2 else tuple(map(flat, (query, key, value)))
        args = (*map(jnp.asarray, args), q_len, kv_len, ids, bias, pairs, drop)
        if not batch:
            out = one(*args)
        else:
            out = jax.vmap(one, (0, 0, 0, ql_ax, kl_ax, id_ax, b_ax, p_ax, drop_ax))(*args)
            out = jax.tree.map(lambda a: a.reshape((*batch, *a.shape[1:])), out)
    if return_residual and not residual_gradient:
        out = (out[0], jax.lax.stop_gradient(out[1]))
    return out
