"""The documentation the segment reductions share: their partition arguments and what their
derivatives save, filled into each docstring where it says ``{partition}`` / ``{memory}``."""

_PARTITION_DOC = """
    Args:
      data: array ``(N, ...)``, or a pytree of arrays sharing the leading axis ``N`` when ``fn``
        is given. Reduced over its leading axis. Without ``fn``, a scalar or a leading axis of
        1 is broadcast over the ``N`` rows that ``segment_ids`` (or static ``sizes`` /
        ``offsets``) label, as ``jax.ops`` broadcasts it: ``(1, *F)`` -> ``(N, *F)``.
      segment_ids: int array ``(N,)`` of any integer dtype (signed or unsigned): the segment of
        every row. Ids outside ``[0, num_segments)`` are dropped, as in ``jax.ops`` (compared
        exactly, whatever their dtype: ``jax.ops`` converts them to int32 first). Sorted ids
        (``indices_are_sorted``, known at trace time, or read by an eager call) take the fast
        contiguous path.
      num_segments: static int. Required with traced ``segment_ids``; implied by ``sizes`` /
        ``offsets``.
      sizes: contiguous segments given by their sizes ``(S,)``, summing to ``N``. Python ints /
        NumPy (static, validated) or an int array (traced, with static length; the caller's
        promise, checked at run time inside :func:`foldax.debug_checks`).
      offsets: contiguous segments given by their ``S + 1`` boundaries ``0 = o_0 <= ... <= o_S = N``
        (static or traced, like ``sizes``).
      fn: optional callable mapping a chunk of rows (same pytree as ``data``, leading axis ``C``)
        to values ``(C, ...)``; it must act row-wise (random draws: one key per row, e.g.
        ``jax.random.fold_in(key, i)`` with row indices ``i`` passed in ``data``). It may close
        over arrays (e.g. model parameters, keys); gradients flow to them. ``fn(data)`` is never
        materialized whole.
      chunk_size: static int, rows per step of the streamed loop, per element of an enclosing
        ``vmap`` (default: chosen when the computation is compiled, from the memory budget and
        the batch of every enclosing ``vmap``; see :func:`foldax.memory_budget`).
      indices_are_sorted: whether ``segment_ids`` are sorted (enables the contiguous path for
        traced ids). Known ids are checked (a ValueError if they are not sorted); traced ids are
        the caller's promise, as in ``jax.ops``, checked at run time inside
        :func:`foldax.debug_checks`.
      unique_indices: ``jax.ops``' hint that no two rows share an id. Accepted and ignored: the
        result is the same either way (no undefined behaviour when the hint is wrong).
      bucket_size: ``jax.ops``' hint to sum ids in buckets. Accepted (a positive int or
        ``None``) and ignored: the rows are already streamed in chunks (``chunk_size``).
      mode: what out-of-range ``segment_ids`` do, as in ``jax.ops``: ``"clip"`` clips them
        into ``[0, num_segments)``; ``None`` (default), ``"drop"`` / ``"fill"`` and
        ``"promise_in_bounds"`` drop them (negative ids too). A string or a
        ``jax.lax.GatherScatterMode``; irrelevant with ``sizes`` / ``offsets``.
      axis_name: inside ``jax.shard_map`` only: the mesh axis name (or tuple) over which the rows
        are split. ``data`` / ``segment_ids`` are then this device's rows (in device order),
        ``sizes`` / ``offsets`` describe all rows, and the result is combined across devices
        (per-row results stay this device's rows). Not needed under ``jax.jit``: sharded inputs
        are detected from their types. See ``docs/distributed.md``.
"""

_MEMORY = (
    "Memory: temp memory is ``O(chunk_size)``, independent of ``N`` and, under ``vmap``, of the\n"
    "    batch (steps shrink with it); ``fn(data)`` is never materialized whole. Derivatives\n"
    "    (``jax.grad``, ``jax.jvp``, ``jax.jacfwd``, ``jax.hessian``) are streamed folds too: "
)
_BWD_FOLD = (
    "they save only the inputs and an ``(S, ...)`` summary per segment, and recompute ``fn`` "
    "chunk by chunk; they reach ``data`` and every array ``fn`` closes over."
)
_BWD_NORM = (
    "they save the inputs and the ``(S, ...)`` log-sum-exps; the backward pass folds one "
    "per-segment sum of the cotangent, then recomputes ``fn`` chunk by chunk to pull it back."
)
_BWD_EXTREMUM = _BWD_FOLD + (
    " Rows that exist (no ``fn``) under ``segment_ids``, unbatched on CPU with no explicit "
    "``chunk_size``, differentiate as ``jax.ops``' program does, saving which rows attain "
    "their segment's extreme (``N * F`` booleans, not the rows)."
)
_BWD_INDEX = "an index has no derivative; the forward pass saves nothing."


def _documented(backward=_BWD_FOLD):
    """Fill a segment reduction's docstring: ``Args: {partition}`` becomes the partition
    arguments, ``Memory: {memory}`` what memory it takes and what its derivatives save
    (``backward``)."""

    def fill(fn):
        doc = fn.__doc__.replace("\n    Args: {partition}\n", _PARTITION_DOC)
        fn.__doc__ = doc.replace("Memory: {memory}", _MEMORY + backward)
        return fn

    return fill
