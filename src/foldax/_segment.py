"""Segment (ragged) reductions, compatible with ``jax.ops.segment_*``, that never materialize.

All public functions here are thin wrappers over :func:`_segment_reduce` /
:func:`_segment_normalize`, which receive the public name so that every error names the function
the user called.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from . import _checks, _eager, _engine, _fold, _shard
from ._engine._plan import static_ends, static_table
from ._monoid import ARGMAX, ARGMIN, LOGMEANEXP, LOGSUMEXP, MAX, MEAN, MIN, PROD, SUM, Var

if TYPE_CHECKING:
    from jaxtyping import Array, ArrayLike, Int


def _is_tracer(x) -> bool:
    return isinstance(x, jax.core.Tracer)


def _static_int_array(x):
    """``x`` as a NumPy array if it is known at trace time (not a tracer), else ``None``."""
    if _is_tracer(x):
        return None
    return np.asarray(x)


def _check_int_dtype(name, argname, dtype):
    if not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(
            f"{name}: {argname} must have an integer dtype, got {dtype}; "
            f"convert with .astype(jnp.int32)."
        )


def _num_rows(name, data) -> int:
    leaves = jax.tree.leaves(data)
    if not leaves:
        raise TypeError(f"{name}: data is an empty pytree; pass an array or a pytree of arrays.")
    shapes = [jnp.shape(x) for x in leaves]
    if any(len(s) == 0 for s in shapes):
        raise ValueError(
            f"{name}: data must have a leading axis to reduce over, got a scalar; "
            f"reshape it to (N, ...)."
        )
    n = shapes[0][0]
    if any(s[0] != n for s in shapes):
        raise ValueError(
            f"{name}: every leaf of data must have the same leading size N, got {[s[0] for s in shapes]}."
        )
    return _checks.concrete_rows(name, "the leading axis of data", n)


def _chunk(name, chunk_size):
    """An explicit ``chunk_size`` (validated), or ``None``: the engine plans from the budget."""
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int | np.integer):
        raise TypeError(
            f"{name}: chunk_size must be a Python int (static), got {type(chunk_size).__name__}."
        )
    if chunk_size <= 0:
        raise ValueError(f"{name}: chunk_size must be positive, got {chunk_size}.")
    return int(chunk_size)


def _partition(
    name, n, segment_ids, num_segments, sizes, offsets, indices_are_sorted, n_ids=None, clip=False
):
    """Validate the partition arguments and describe the partition (``clip``: clip
    ``segment_ids`` into ``[0, num_segments)`` instead of dropping those out of range).

    ``n`` counts all rows (``sizes`` / ``offsets`` describe them all), ``n_ids`` the rows that
    ``segment_ids`` labels (this device's, inside ``shard_map``; default ``n``).
    """
    given = [
        k
        for k, v in (("segment_ids", segment_ids), ("sizes", sizes), ("offsets", offsets))
        if v is not None
    ]
    if len(given) != 1:
        what = "none" if not given else " and ".join(given)
        raise ValueError(
            f"{name}: describe the partition with exactly one of segment_ids, sizes or offsets "
            f"(got {what})."
        )
    if num_segments is not None:
        num_segments = _num_segments(name, num_segments)

    if segment_ids is not None:
        n_ids = n if n_ids is None else n_ids
        return _from_segment_ids(name, n_ids, segment_ids, num_segments, indices_are_sorted, clip)

    if sizes is not None:
        arg, x = "sizes", sizes
    else:
        arg, x = "offsets", offsets
    if isinstance(x, list | tuple) and not all(
        isinstance(v, int | np.integer) and not isinstance(v, bool) for v in x
    ):
        raise TypeError(f"{name}: {arg} must contain Python ints, got {x!r:.80}.")
    if isinstance(x, list | tuple):
        x = np.asarray(x, dtype=np.int64)
    dtype = jnp.result_type(x)
    _check_int_dtype(name, arg, dtype)
    if np.ndim(x) != 1:
        raise ValueError(f"{name}: {arg} must be one-dimensional, got shape {np.shape(x)}.")
    count = np.shape(x)[0] - (1 if arg == "offsets" else 0)
    if arg == "offsets" and count < 0:
        raise ValueError(f"{name}: offsets must hold at least one entry (0 and N for one segment).")
    if num_segments is not None and num_segments != count:
        raise ValueError(
            f"{name}: num_segments={num_segments} disagrees with the {count} segments that "
            f"{arg} describes; leave num_segments out."
        )
    static = _static_int_array(x)
    if static is not None:
        sz, off = _static_bounds(name, arg, static.astype(np.int64), n)
        return _Empty(count) if count == 0 or n == 0 else _Contiguous(sz, off, count)
    # Traced: values cannot be checked at trace time (documented); foldax.debug_checks checks
    # them at run time.
    x = jnp.asarray(x).astype(jnp.int32)
    _checks.check_partition(name, arg, x, n)
    if arg == "sizes":
        sz = x
        off = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(sz)[:-1]])
    else:
        sz = jnp.diff(x)
        off = x[:-1]
    return _Empty(count) if count == 0 or n == 0 else _Contiguous(sz, off, count)


def _static_bounds(name, arg, static, n):
    """``(sizes, offsets)`` of static ``sizes`` / ``offsets`` (``arg``), checked against ``n``."""
    if arg == "sizes":
        if np.any(static < 0):
            bad = int(np.flatnonzero(static < 0)[0])
            raise ValueError(f"{name}: sizes must be >= 0, but sizes[{bad}] = {static[bad]}.")
        if int(static.sum()) != n:
            raise ValueError(
                f"{name}: sizes sum to {int(static.sum())} but data has N = {n} rows; "
                f"the segments must cover the leading axis exactly."
            )
        return static, np.concatenate([[0], np.cumsum(static)[:-1]]).astype(np.int64)
    if static[0] != 0 or static[-1] != n:
        raise ValueError(
            f"{name}: offsets must start at 0 and end at N = {n}, got {static[0]} ... {static[-1]}."
        )
    if np.any(np.diff(static) < 0):
        bad = int(np.flatnonzero(np.diff(static) < 0)[0])
        raise ValueError(
            f"{name}: offsets must be non-decreasing, but offsets[{bad}] = "
            f"{static[bad]} > offsets[{bad + 1}] = {static[bad + 1]}."
        )
    return np.diff(static), static[:-1]


def _from_segment_ids(name, n, segment_ids, num_segments, indices_are_sorted, clip=False):
    """The partition that ``segment_ids`` describe: every family's one validation and
    normalisation of ids (see :func:`_ids_input` and :func:`_working_ids`)."""
    ids, static = _ids_input(name, n, segment_ids)
    if num_segments is None:
        if static is None:
            raise ValueError(
                f"{name}: num_segments is required when segment_ids is traced (under jit, vmap "
                f"or grad); pass it as a static int."
            )
        num_segments = _num_segments(name, max(int(static.max()) + 1, 0) if static.size else 0)
    if num_segments == 0 or n == 0:
        return _Empty(num_segments)
    if static is None:
        work = _working_ids(ids, num_segments, clip, jnp)
        if indices_are_sorted:  # the caller's promise, checked inside foldax.debug_checks
            _checks.check_partition(name, "segment_ids", work if clip else ids, n)
        return _Ids(work, num_segments, bool(indices_are_sorted))
    work = _working_ids(static, num_segments, clip, np)
    err = _checks.unsorted_error(work if clip else static) if indices_are_sorted else None
    if err is not None:  # (clipped ids are checked as clipped, like traced ones)
        raise ValueError(f"{name}: {err}; sort the rows by id, or leave indices_are_sorted out.")
    if _checks.first_decrease(work) is None:  # known and sorted: contiguous, the tiled path
        bounds = np.searchsorted(work, np.arange(num_segments + 1), side="left")
        return _Contiguous(np.diff(bounds), bounds[:-1], num_segments, work)
    return _Ids(static_table(work), num_segments, False)


def _ids_input(name, n, segment_ids):
    """``(ids, static)``: ``segment_ids`` checked to be an integer (not bool) array of shape
    ``(n,)`` (a list of Python ints becomes int64 NumPy); ``static``: its NumPy value, in its own
    dtype, when known at trace time, else ``None``."""
    if isinstance(segment_ids, list | tuple):
        if not all(
            isinstance(v, int | np.integer) and not isinstance(v, bool) for v in segment_ids
        ):
            raise TypeError(
                f"{name}: segment_ids must contain Python ints, got {segment_ids!r:.80}."
            )
        try:
            segment_ids = np.asarray(segment_ids, dtype=np.int64).reshape(-1)
        except OverflowError:
            raise ValueError(
                f"{name}: segment_ids must fit in int64, got {segment_ids!r:.80}; ids outside "
                f"[0, num_segments) are dropped anyway, replace them by -1."
            ) from None
    _check_int_dtype(name, "segment_ids", jnp.result_type(segment_ids))
    if jnp.shape(segment_ids) != (n,):
        raise ValueError(
            f"{name}: segment_ids must have shape (N,) = ({n},) to match data, got "
            f"{jnp.shape(segment_ids)}."
        )
    return segment_ids, _static_int_array(segment_ids)


def _working_ids(ids, num_segments, clip, xp):
    """``ids`` (NumPy, ``xp=np``, or traced, ``xp=jnp``; any integer dtype) as int32 that never
    wrapped: clamped first, in their own dtype, into ``[0, S - 1]`` (``clip``, jax.ops'
    ``mode="clip"``) or into ``[-1, S]``, where every id out of range stays out of range (and is
    dropped). Clamping is monotone: sorted ids stay sorted. (Ids that already fit in int32 are
    only cast, unless clipped.)"""
    info, i32 = np.iinfo(ids.dtype), np.iinfo(np.int32)
    lo, hi = (0, num_segments - 1) if clip else (-1, num_segments)
    if clip or info.min < i32.min or info.max > i32.max:
        ids = xp.clip(ids, max(lo, int(info.min)), min(hi, int(info.max)))
    return ids.astype(np.int32)


def _num_segments(name, num_segments):
    """``num_segments`` checked: a static int ``>= 0`` that fits the plans' int32 indices (its
    ``S + 1`` bounds)."""
    try:
        num_segments = operator.index(num_segments)
    except TypeError:
        raise TypeError(
            f"{name}: num_segments must be a static Python int, got {type(num_segments).__name__}; "
            f"under jit mark it static (static_argnames) or pass it as a literal."
        ) from None
    if num_segments < 0:
        raise ValueError(f"{name}: num_segments must be >= 0, got {num_segments}.")
    if num_segments > _MAX_SEGMENTS:
        raise ValueError(
            f"{name}: num_segments must be at most {_MAX_SEGMENTS} (foldax indexes segments in "
            f"int32), got {num_segments}; drop the unused ids (remap them to 0 ... S - 1)."
        )
    return num_segments


#: The most segments: plans index segments and their ``S + 1`` bounds in int32.
_MAX_SEGMENTS = int(np.iinfo(np.int32).max) - 1


class _Empty:
    """No rows or no segments: the result is the monoid's identity, no loop needed."""

    def __init__(self, num_segments):
        self.num_segments = num_segments


class _Contiguous:
    """Segments ``s`` = rows ``offsets[s] : offsets[s] + sizes[s]`` (NumPy = static, or traced)."""

    def __init__(self, sizes, offsets, count, ids=None):
        self.sizes, self.offsets, self.num_segments = sizes, offsets, count
        self.static = isinstance(sizes, np.ndarray)
        self.ids = ids  # the known sorted ids these segments came from (NumPy), if any

    def by_ids(self):
        """The same partition as per-row ids (an :class:`_Ids`), if it came from known ids."""
        return None if self.ids is None else _Ids(static_table(self.ids), self.num_segments, False)

    def arrays(self):
        """The traced arrays (replicated on a mesh); static ones enter in :meth:`plan`."""
        return () if self.static else (self.sizes, self.offsets)

    def _shares(self, n, devices):
        """Each device's share of the static segments' rows, ``(devices, S)``."""
        d = np.arange(devices)[:, None] * n
        lo = np.clip(self.offsets[None] - d, 0, n)
        return np.clip(self.offsets[None] + self.sizes[None] - d, 0, n) - lo

    def plan(self, n, chunk, arrays=(), axes=(), devices=1):
        """``(PlanSpec, arrays)`` over this device's ``n`` rows (all rows without ``axes``).

        Static segments keep their tile counts static (``tilings``, per device on a mesh); their
        ``(S,)`` tables enter the fold as arrays that XLA does not constant-fold
        (:func:`foldax._engine._plan.static_table`; on one device with the tile tables of every
        candidate height, :func:`foldax._engine._plan.static_ends`), clipped to a device's rows
        like traced ones on a mesh."""
        tilings = None
        if self.static:
            tilings = _engine.static_tilings(n, self._shares(n, devices))
            sizes, offsets = (static_table(a) for a in (self.sizes, self.offsets))
        else:
            sizes, offsets = arrays or (self.sizes, self.offsets)
        spec = _engine.PlanSpec("tiles", n, self.num_segments, tilings, chunk)
        if not axes:
            ends = static_ends(self.sizes, tilings) if self.static else ()
            return spec, (jnp.asarray(sizes, jnp.int32), jnp.asarray(offsets, jnp.int32), *ends)
        # Rows [start, start + n) are this device's: clip every segment to them.
        start = _shard.device_index(axes) * n
        lo = jnp.clip(jnp.asarray(offsets, jnp.int32) - start, 0, n)
        hi = jnp.clip(jnp.asarray(offsets + sizes, jnp.int32) - start, 0, n)
        return spec, (hi - lo, lo)


class _Ids:
    """Per-row ``segment_ids`` (traced, or static but unsorted)."""

    def __init__(self, ids, num_segments, sorted_):
        self.ids, self.num_segments, self.sorted = ids, num_segments, sorted_

    def arrays(self):
        return (self.ids,)

    def by_ids(self):
        """The same partition walked by rows (no contiguous tiles)."""
        return _Ids(self.ids, self.num_segments, False)

    def plan(self, n, chunk, arrays=(), axes=(), devices=1):
        """``(PlanSpec, arrays)`` over this device's ``n`` rows (``arrays``: its ids)."""
        (ids,) = arrays or (self.ids,)
        if self.sorted:
            # Traced but sorted (the caller says so): contiguous segments from the ids.
            # (The ids are int32, normalised by _working_ids: the S + 1 bounds do not wrap.)
            b = jnp.searchsorted(
                ids, jnp.arange(self.num_segments + 1, dtype=jnp.int32), side="left"
            ).astype(jnp.int32)
            spec = _engine.PlanSpec("tiles", n, self.num_segments, None, chunk)
            return spec, (jnp.diff(b), b[:-1])
        return _engine.PlanSpec("rows", n, self.num_segments, None, chunk), (ids,)


def _value_aval(name, data, fn, n):
    """Shape/dtype of the values reduced per row, checking what ``fn`` returns."""
    if fn is None:
        if not hasattr(data, "shape") and jax.tree.structure(data).num_nodes != 1:
            raise TypeError(
                f"{name}: data is a pytree; pass fn= to map a chunk of rows to one array "
                f"of values (leading axis = rows)."
            )
        return jax.ShapeDtypeStruct(jnp.shape(data), jnp.result_type(data))
    if not callable(fn):
        raise TypeError(f"{name}: fn must be callable, got {type(fn).__name__}.")
    probe = min(n, 8) if n else 0
    example = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct((probe, *jnp.shape(a)[1:]), jnp.result_type(a)), data
    )
    out = jax.eval_shape(fn, example)
    if not isinstance(out, jax.ShapeDtypeStruct):
        raise TypeError(
            f"{name}: fn must return one array of values per row, got a {type(out).__name__}."
        )
    if out.ndim == 0 or out.shape[0] != probe:
        raise ValueError(
            f"{name}: fn must map a chunk of C rows to values with leading axis C; given {probe} "
            f"rows it returned shape {out.shape}. Make fn act row-wise (e.g. jax.vmap it)."
        )
    return jax.ShapeDtypeStruct((n, *out.shape[1:]), out.dtype)


def _segment(
    name,
    op,
    data,
    segment_ids=None,
    num_segments=None,
    indices_are_sorted=False,
    unique_indices=False,
    bucket_size=None,
    mode=None,
    *,
    sizes=None,
    offsets=None,
    fn=None,
    chunk_size=None,
    axis_name=None,
):
    """The one engine behind every ``segment_*``: validate, then fold (``op``: a monoid) or
    normalize (``op``: ``"softmax"`` / ``"log_softmax"``), on one device or on a mesh."""
    normal = isinstance(op, str)
    monoid = LOGSUMEXP if normal else op
    clip = _mode(name, mode, unique_indices, bucket_size)
    if fn is None and not hasattr(data, "shape"):
        if isinstance(data, list | tuple) and any(np.ndim(a) > 0 for a in data):
            raise TypeError(
                f"{name}: data is a {type(data).__name__} of arrays; pass fn= to map a chunk of "
                f"rows to one array of values, or stack them first (jnp.stack)."
            )
        data = jnp.asarray(data) if isinstance(data, list | tuple | float | int) else data
    axes = _shard.axis_tuple(name, axis_name)
    n = n_rows = _num_rows(name, data)  # this device's rows inside shard_map, else all rows
    aval = _value_aval(name, data, fn, n)
    if aval.dtype == jnp.bool_ and op in (MAX, MIN):  # as jax.ops: any / all, a bool result
        f = (lambda r: r) if fn is None else fn
        hints = (indices_are_sorted, unique_indices, bucket_size, mode)
        out = _segment(
            name, op, data, segment_ids, num_segments, *hints, sizes=sizes, offsets=offsets,
            fn=lambda r: f(r).astype(jnp.uint8), chunk_size=chunk_size, axis_name=axis_name,
        )  # fmt: skip
        return out.astype(jnp.bool_)
    monoid.check_dtype(name, "fn(data)" if fn is not None else "data", aval.dtype)
    mesh = None
    devices = _shard.device_count(axes)
    if not axes:
        ids = [segment_ids] if segment_ids is not None and not _is_numpy(segment_ids) else []
        leaves = jax.tree.leaves(data) + ids
        found = _shard.row_axes(leaves, n)
        if found is not None:
            mesh, axes = found
            devices = math.prod(mesh.shape[a] for a in axes)
        else:  # replicated on a mesh: run there (unsplit) rather than mix mesh types
            mesh = _shard.on_explicit_mesh(leaves)
    n_global = n * devices if mesh is None else n
    part = _partition(
        name, n_global, segment_ids, num_segments, sizes, offsets, indices_are_sorted, n_rows, clip
    )
    chunk = _chunk(name, chunk_size)
    if mesh is None and _fold.scatters(fn, aval.dtype, monoid, axes):
        part = getattr(part, "by_ids", lambda: None)() or part

    if isinstance(part, _Empty):
        if normal:
            return jnp.full(aval.shape, np.nan, aval.dtype)
        state = monoid.init(part.num_segments, aval.shape[1:], aval.dtype)
        out = monoid.finalize(state)
        return out.astype(aval.dtype) if jnp.issubdtype(out.dtype, jnp.floating) else out

    n_local = n_global // devices

    def local(data, arrays, fn):
        plan, arrays = part.plan(n_local, chunk, arrays, axes, devices)
        if normal:
            return _fold.normalize(name, fn, data, plan, arrays, op == "log_softmax", axes)
        return _fold.fold(name, monoid, fn, data, plan, arrays, axes)

    if mesh is None:
        return local(data, part.arrays(), fn)
    return _on_mesh(mesh, axes, local, data, part, fn, normal)


def _mode(name, mode, unique_indices, bucket_size) -> bool:
    """Validate ``jax.ops``' hints; whether ``mode`` clips out-of-range ids (else they drop)."""
    if not isinstance(unique_indices, bool | np.bool_):
        raise TypeError(f"{name}: unique_indices must be a bool, got {unique_indices!r:.40}.")
    if bucket_size is not None and (
        isinstance(bucket_size, bool) or not isinstance(bucket_size, int | np.integer)
    ):
        raise TypeError(f"{name}: bucket_size must be None or a Python int, got {bucket_size!r}.")
    if bucket_size is not None and bucket_size <= 0:
        raise ValueError(f"{name}: bucket_size must be positive, got {bucket_size}.")
    if mode is None:
        return False
    try:
        parsed = jax.lax.GatherScatterMode.from_any(mode)
    except (ValueError, KeyError, TypeError):
        parsed = None
    if parsed not in _MODES:
        raise ValueError(
            f"{name}: mode must be None, 'clip', 'drop', 'fill' or 'promise_in_bounds' "
            f"(jax.lax.GatherScatterMode), got {mode!r}."
        )
    return parsed == jax.lax.GatherScatterMode.CLIP


_MODES = (
    jax.lax.GatherScatterMode.CLIP,
    jax.lax.GatherScatterMode.FILL_OR_DROP,
    jax.lax.GatherScatterMode.PROMISE_IN_BOUNDS,
)


def _is_numpy(x) -> bool:
    return isinstance(x, np.ndarray | list | tuple)


def _on_mesh(mesh, axes, local, data, part, fn, per_row):
    """Run ``local`` under ``shard_map``: rows (``data``, ids) split over ``axes``; traced
    ``sizes`` / ``offsets`` and the arrays ``fn`` closes over are replicated.

    ``fn`` is traced here for a block of rows and replayed inside (``vmap`` ped), with the arrays it
    closes over passed in explicitly (``shard_map`` cannot close over arrays on Explicit axes).
    The ``shard_map`` leaves varying-axes typing off (``check_vma=False``): a replayed trace has
    untyped constants; the fold's rules follow the matching cotangent convention.
    """
    split = P(axes or None)
    arrays = part.arrays()
    # The ids are split like the rows; traced sizes / offsets are replicated.
    arr_specs = tuple(split if isinstance(part, _Ids) else P() for _ in arrays)
    replay, consts = _replayable(fn, data)

    def body(data, arrays, consts):
        return local(data, arrays, replay(consts))

    data = _shard.place(data, mesh, _shard.rows_spec(axes))
    arrays = tuple(
        _shard.place(a, mesh, lambda _, s=s: s) for a, s in zip(arrays, arr_specs, strict=True)
    )
    consts = _shard.place(consts, mesh, lambda a: P())
    run = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(jax.tree.map(_shard.rows_spec(axes), data), arr_specs, [P() for _ in consts]),
        out_specs=split if per_row else P(),
        axis_names=_shard.manual_axes(mesh, axes),
        check_vma=False,
    )
    return run(data, arrays, consts)


def _replayable(fn, data):
    """``(replay, consts)``: ``replay(consts)`` is ``fn`` (row-wise) with every array it closes
    over (``consts``) passed in explicitly (see :func:`foldax._fold.row_fn`)."""
    if fn is None:
        return (lambda consts: None), []
    with _shard.unmeshed():
        f, consts = _fold.row_fn(fn, data)
    return (lambda consts: lambda rows: f(consts, tuple(jax.tree.leaves(rows)))), list(consts)


_PARTITION_DOC = """
    Args:
      data: array ``(N, ...)``, or a pytree of arrays sharing the leading axis ``N`` when ``fn``
        is given. Reduced over its leading axis.
      segment_ids: int array ``(N,)`` of any integer dtype (signed or unsigned): the segment of
        every row. Ids outside ``[0, num_segments)`` are dropped, as in ``jax.ops`` (compared
        exactly, whatever their dtype: ``jax.ops`` converts them to int32 first). Sorted ids
        (``indices_are_sorted`` or known at trace time) take the fast contiguous path.
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


def _doc(summary, math, returns, numerics, example, backward):
    return f"""{summary}

    .. math:: {math}
{_PARTITION_DOC}
    Returns:
      {returns}

    Numerics:
      {numerics}

    Memory: temp memory is ``O(chunk_size)``, independent of ``N`` and, under ``vmap``, of the
    batch (steps shrink with it); ``fn(data)`` is never materialized whole. Derivatives
    (``jax.grad``, ``jax.jvp``, ``jax.jacfwd``, ``jax.hessian``) are streamed folds too: {backward}

    Example:
{example}
    """


_BWD_FOLD = (
    "they save only the inputs and an ``(S, ...)`` summary per segment, and recompute ``fn`` "
    "chunk by chunk; they reach ``data`` and every array ``fn`` closes over."
)
_BWD_NORM = (
    "they save the inputs and the ``(S, ...)`` log-sum-exps; the backward pass folds one "
    "per-segment sum of the cotangent, then recomputes ``fn`` chunk by chunk to pull it back."
)
_EX = """      >>> import jax.numpy as jnp, foldax
      >>> x = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0])
"""


def _attach(fn, summary, math, returns, numerics, example, backward=_BWD_FOLD):
    fn.__doc__ = _doc(summary, math, returns, numerics, _EX + example, backward)
    return fn


def _fn_examples(arguments):
    """The rows ``fn`` is traced on: a block of rows of ``data`` (arrays with a leading axis)."""
    data = arguments["data"]
    if not all(isinstance(a, jax.Array | np.ndarray) and a.ndim for a in jax.tree.leaves(data)):
        raise TypeError("not a pytree of arrays")  # the uncached call explains
    return (_fold.example_rows(data, _fold.ROW_BLOCK),)


def _fn_check(closed):
    """``fn`` maps a block of rows to one array of values per row."""
    (out,) = closed.jaxpr.outvars
    if out.aval.ndim == 0 or out.aval.shape[0] != _fold.ROW_BLOCK:
        raise ValueError("not row-wise")  # the uncached call explains


#: Eager calls run one cached executable (:mod:`foldax._eager`): ``data`` and the arrays ``fn``
#: closes over are its inputs; every other argument is static.
_eager_call = _eager.cached(
    dynamic=("data",), hoist={"fn": _eager.Hoist(_fn_examples, _fold.replay_rows, _fn_check)}
)


@_eager_call
def segment_sum(
    data: ArrayLike | Any,
    segment_ids: Int[Array, " N"] | None = None,
    num_segments: int | None = None,
    indices_are_sorted: bool = False,
    unique_indices: bool = False,
    bucket_size: int | None = None,
    mode: str | jax.lax.GatherScatterMode | None = None,
    *,
    sizes: Any = None,
    offsets: Any = None,
    fn: Callable | None = None,
    chunk_size: int | None = None,
    axis_name: str | tuple[str, ...] | None = None,
) -> Array:
    return _segment("foldax.segment_sum", SUM, **locals())


@_eager_call
def segment_mean(
    data: ArrayLike | Any,
    segment_ids: Int[Array, " N"] | None = None,
    num_segments: int | None = None,
    indices_are_sorted: bool = False,
    unique_indices: bool = False,
    bucket_size: int | None = None,
    mode: str | jax.lax.GatherScatterMode | None = None,
    *,
    sizes: Any = None,
    offsets: Any = None,
    fn: Callable | None = None,
    chunk_size: int | None = None,
    axis_name: str | tuple[str, ...] | None = None,
) -> Array:
    return _segment("foldax.segment_mean", MEAN, **locals())


@_eager_call
def segment_max(
    data: ArrayLike | Any,
    segment_ids: Int[Array, " N"] | None = None,
    num_segments: int | None = None,
    indices_are_sorted: bool = False,
    unique_indices: bool = False,
    bucket_size: int | None = None,
    mode: str | jax.lax.GatherScatterMode | None = None,
    *,
    sizes: Any = None,
    offsets: Any = None,
    fn: Callable | None = None,
    chunk_size: int | None = None,
    axis_name: str | tuple[str, ...] | None = None,
) -> Array:
    return _segment("foldax.segment_max", MAX, **locals())


@_eager_call
def segment_min(
    data: ArrayLike | Any,
    segment_ids: Int[Array, " N"] | None = None,
    num_segments: int | None = None,
    indices_are_sorted: bool = False,
    unique_indices: bool = False,
    bucket_size: int | None = None,
    mode: str | jax.lax.GatherScatterMode | None = None,
    *,
    sizes: Any = None,
    offsets: Any = None,
    fn: Callable | None = None,
    chunk_size: int | None = None,
    axis_name: str | tuple[str, ...] | None = None,
) -> Array:
    return _segment("foldax.segment_min", MIN, **locals())


@_eager_call
def segment_logsumexp(
    data: ArrayLike | Any,
    segment_ids: Int[Array, " N"] | None = None,
    num_segments: int | None = None,
    indices_are_sorted: bool = False,
    unique_indices: bool = False,
    bucket_size: int | None = None,
    mode: str | jax.lax.GatherScatterMode | None = None,
    *,
    sizes: Any = None,
    offsets: Any = None,
    fn: Callable | None = None,
    chunk_size: int | None = None,
    axis_name: str | tuple[str, ...] | None = None,
) -> Array:
    return _segment("foldax.segment_logsumexp", LOGSUMEXP, **locals())


@_eager_call
def segment_logmeanexp(
    data: ArrayLike | Any,
    segment_ids: Int[Array, " N"] | None = None,
    num_segments: int | None = None,
    indices_are_sorted: bool = False,
    unique_indices: bool = False,
    bucket_size: int | None = None,
    mode: str | jax.lax.GatherScatterMode | None = None,
    *,
    sizes: Any = None,
    offsets: Any = None,
    fn: Callable | None = None,
    chunk_size: int | None = None,
    axis_name: str | tuple[str, ...] | None = None,
) -> Array:
    return _segment("foldax.segment_logmeanexp", LOGMEANEXP, **locals())


@_eager_call
def segment_log_softmax(
    data: ArrayLike | Any,
    segment_ids: Int[Array, " N"] | None = None,
    num_segments: int | None = None,
    indices_are_sorted: bool = False,
    unique_indices: bool = False,
    bucket_size: int | None = None,
    mode: str | jax.lax.GatherScatterMode | None = None,
    *,
    sizes: Any = None,
    offsets: Any = None,
    fn: Callable | None = None,
    chunk_size: int | None = None,
    axis_name: str | tuple[str, ...] | None = None,
) -> Array:
    return _segment("foldax.segment_log_softmax", "log_softmax", **locals())


@_eager_call
def segment_softmax(
    data: ArrayLike | Any,
    segment_ids: Int[Array, " N"] | None = None,
    num_segments: int | None = None,
    indices_are_sorted: bool = False,
    unique_indices: bool = False,
    bucket_size: int | None = None,
    mode: str | jax.lax.GatherScatterMode | None = None,
    *,
    sizes: Any = None,
    offsets: Any = None,
    fn: Callable | None = None,
    chunk_size: int | None = None,
    axis_name: str | tuple[str, ...] | None = None,
) -> Array:
    return _segment("foldax.segment_softmax", "softmax", **locals())


@_eager_call
def segment_prod(
    data: ArrayLike | Any,
    segment_ids: Int[Array, " N"] | None = None,
    num_segments: int | None = None,
    indices_are_sorted: bool = False,
    unique_indices: bool = False,
    bucket_size: int | None = None,
    mode: str | jax.lax.GatherScatterMode | None = None,
    *,
    sizes: Any = None,
    offsets: Any = None,
    fn: Callable | None = None,
    chunk_size: int | None = None,
    axis_name: str | tuple[str, ...] | None = None,
) -> Array:
    return _segment("foldax.segment_prod", PROD, **locals())


@_eager_call
def segment_argmax(
    data: ArrayLike | Any,
    segment_ids: Int[Array, " N"] | None = None,
    num_segments: int | None = None,
    indices_are_sorted: bool = False,
    unique_indices: bool = False,
    bucket_size: int | None = None,
    mode: str | jax.lax.GatherScatterMode | None = None,
    *,
    sizes: Any = None,
    offsets: Any = None,
    fn: Callable | None = None,
    chunk_size: int | None = None,
    axis_name: str | tuple[str, ...] | None = None,
) -> Array:
    return _segment("foldax.segment_argmax", ARGMAX, **locals())


@_eager_call
def segment_argmin(
    data: ArrayLike | Any,
    segment_ids: Int[Array, " N"] | None = None,
    num_segments: int | None = None,
    indices_are_sorted: bool = False,
    unique_indices: bool = False,
    bucket_size: int | None = None,
    mode: str | jax.lax.GatherScatterMode | None = None,
    *,
    sizes: Any = None,
    offsets: Any = None,
    fn: Callable | None = None,
    chunk_size: int | None = None,
    axis_name: str | tuple[str, ...] | None = None,
) -> Array:
    return _segment("foldax.segment_argmin", ARGMIN, **locals())


@_eager_call
def segment_var(
    data: ArrayLike | Any,
    segment_ids: Int[Array, " N"] | None = None,
    num_segments: int | None = None,
    indices_are_sorted: bool = False,
    unique_indices: bool = False,
    bucket_size: int | None = None,
    mode: str | jax.lax.GatherScatterMode | None = None,
    *,
    ddof: int | float = 0,
    sizes: Any = None,
    offsets: Any = None,
    fn: Callable | None = None,
    chunk_size: int | None = None,
    axis_name: str | tuple[str, ...] | None = None,
) -> Array:
    kw = locals()
    op = Var(_ddof("foldax.segment_var", kw.pop("ddof")), std=False)
    return _segment("foldax.segment_var", op, **kw)


@_eager_call
def segment_std(
    data: ArrayLike | Any,
    segment_ids: Int[Array, " N"] | None = None,
    num_segments: int | None = None,
    indices_are_sorted: bool = False,
    unique_indices: bool = False,
    bucket_size: int | None = None,
    mode: str | jax.lax.GatherScatterMode | None = None,
    *,
    ddof: int | float = 0,
    sizes: Any = None,
    offsets: Any = None,
    fn: Callable | None = None,
    chunk_size: int | None = None,
    axis_name: str | tuple[str, ...] | None = None,
) -> Array:
    kw = locals()
    op = Var(_ddof("foldax.segment_std", kw.pop("ddof")), std=True)
    return _segment("foldax.segment_std", op, **kw)


def _ddof(name, ddof):
    """A valid static ``ddof``: a real number >= 0."""
    if isinstance(ddof, bool) or not isinstance(ddof, int | float | np.integer | np.floating):
        raise TypeError(f"{name}: ddof must be a static Python number, got {type(ddof).__name__}.")
    if not ddof >= 0:
        raise ValueError(f"{name}: ddof must be >= 0, got {ddof}.")
    return float(ddof) if not float(ddof).is_integer() else int(ddof)


_RED = "``(num_segments, *F)`` where ``F`` is the trailing shape of the values."
_attach(
    segment_sum,
    "Per-segment sum of ``fn(data)`` (or ``data``), streamed.",
    r"\mathrm{out}_s = \sum_{i \in s} v_i",
    _RED,
    "an empty segment sums to 0. NaN or inf propagate to their segment only.",
    """      >>> foldax.segment_sum(x, sizes=[2, 0, 3])
      Array([ 3.,  0., 12.], dtype=float32)
""",
)
_attach(
    segment_mean,
    "Per-segment mean of ``fn(data)`` (or ``data``), streamed.",
    r"\mathrm{out}_s = \frac{1}{n_s} \sum_{i \in s} v_i",
    _RED,
    "an empty segment gives NaN (0/0). NaN propagates to its segment only. Real or complex values.",
    """      >>> foldax.segment_mean(x, sizes=[2, 0, 3])
      Array([1.5, nan, 4. ], dtype=float32)
""",
)
_attach(
    segment_max,
    "Per-segment maximum of ``fn(data)`` (or ``data``), streamed.",
    r"\mathrm{out}_s = \max_{i \in s} v_i",
    _RED,
    "an empty segment gives -inf (the dtype's minimum for integers). NaN propagates to its "
    "segment. The gradient is split evenly among tied maxima, like ``jnp.max``. Bool values give a bool "
    "result (any / all; an empty segment gives False), as in ``jax.ops``.",
    """      >>> foldax.segment_max(x, sizes=[2, 0, 3])
      Array([  2., -inf,   5.], dtype=float32)
""",
)
_attach(
    segment_min,
    "Per-segment minimum of ``fn(data)`` (or ``data``), streamed.",
    r"\mathrm{out}_s = \min_{i \in s} v_i",
    _RED,
    "an empty segment gives +inf (the dtype's maximum for integers). NaN propagates to its "
    "segment. The gradient is split evenly among tied minima, like ``jnp.min``. Bool values give a bool "
    "result (any / all; an empty segment gives True), as in ``jax.ops``.",
    """      >>> foldax.segment_min(x, sizes=[2, 0, 3])
      Array([ 1., inf,  3.], dtype=float32)
""",
)
_attach(
    segment_logsumexp,
    "Per-segment log-sum-exp of ``fn(data)`` (or ``data``), each segment shifted by its own max.",
    r"\mathrm{out}_s = m_s + \log \sum_{i \in s} e^{v_i - m_s},\quad m_s = \max_{i \in s} v_i",
    _RED,
    "an empty segment gives -inf; -inf entries contribute nothing; +inf gives +inf; NaN gives "
    "NaN for its segment only. Segments far below the others (e.g. by 1000) keep full "
    "precision: there is no global shift. Gradients are ``softmax`` weights, 0 for empty "
    "segments and -inf entries (never NaN).",
    """      >>> foldax.segment_logsumexp(jnp.log(x), sizes=[2, 0, 3]).round(4)
      Array([1.0986,   -inf, 2.4849], dtype=float32)
""",
)
_attach(
    segment_logmeanexp,
    "Per-segment log-mean-exp of ``fn(data)`` (or ``data``): ``logsumexp - log(size)``.",
    r"\mathrm{out}_s = \log \frac{1}{n_s} \sum_{i \in s} e^{v_i}",
    _RED,
    "an empty segment gives NaN; otherwise as :func:`segment_logsumexp`.",
    """      >>> foldax.segment_logmeanexp(jnp.log(x), sizes=[2, 0, 3]).round(4)
      Array([0.4055,    nan, 1.3863], dtype=float32)
""",
)
_ROW = "``(N, *F)``: one value per row, like ``fn(data)``."
_attach(
    segment_log_softmax,
    "Per-row log-softmax of ``fn(data)`` (or ``data``) within each segment.",
    r"\mathrm{out}_i = v_i - \log \sum_{j \in s(i)} e^{v_j}",
    _ROW,
    "rows whose segment id is out of range, and rows of a segment that is all -inf, give NaN. "
    "The result is written chunk by chunk; its temp memory does not grow with ``N``.",
    """      >>> out = foldax.segment_log_softmax(jnp.log(x), sizes=[2, 0, 3])
      >>> [round(v, 4) for v in out.tolist()]
      [-1.0986, -0.4055, -1.3863, -1.0986, -0.8755]
""",
    _BWD_NORM,
)
_attach(
    segment_softmax,
    "Per-row softmax of ``fn(data)`` (or ``data``) within each segment.",
    r"\mathrm{out}_i = e^{v_i} / \sum_{j \in s(i)} e^{v_j}",
    _ROW,
    "rows whose segment id is out of range, and rows of a segment that is all -inf, give NaN. "
    "Each segment's rows sum to 1.",
    """      >>> out = foldax.segment_softmax(jnp.log(x), sizes=[2, 0, 3])
      >>> [round(v, 4) for v in out.tolist()]
      [0.3333, 0.6667, 0.25, 0.3333, 0.4167]

      With a model evaluated chunk by chunk (``fn``), differentiable in its parameters:

      >>> w = jnp.array([0.5, -1.0])
      >>> rows = jnp.stack([x, x**2], axis=1)               # (N, 2) features
      >>> fn = lambda r: r @ w                              # (C, 2) -> (C,)
      >>> foldax.segment_softmax(rows, sizes=[2, 3], fn=fn).sum().round(4)
      Array(2., dtype=float32)
""",
    _BWD_NORM,
)
_attach(
    segment_prod,
    "Per-segment product of ``fn(data)`` (or ``data``), streamed.",
    r"\mathrm{out}_s = \prod_{i \in s} v_i",
    _RED,
    "an empty segment gives 1. The state is the product of the non-zero values and the number "
    "of zeros (half precision multiplies in float32), so the gradient never divides by 0: with "
    "no zero it is ``out / v_i``, with one zero the product of the others at that zero (0 "
    "elsewhere), with two or more zeros 0. A zero with NaN or inf in its segment gives NaN "
    "(0 * inf), like ``jnp.prod``. Unlike ``jax.ops.segment_prod``, the gradient is "
    "defined for repeated and unsorted ids. Integers wrap on overflow, like ``jnp.prod``.",
    """      >>> foldax.segment_prod(x, sizes=[2, 0, 3])
      Array([ 2.,  1., 60.], dtype=float32)
""",
)
_VAR_NUMERICS = (
    "The state is ``(count, mean, M2)`` merged with Chan et al.'s update (each tile's mean and "
    "squared deviations are exact two-pass sums), never ``E[v^2] - E[v]^2``: at a mean of 1e4 "
    "float32 keeps ~1e-6 relative precision. Half precision accumulates in float32. ``ddof`` "
    "(keyword, a static number >= 0) divides by ``n - ddof``; a segment with ``n <= ddof`` "
    "(an empty one included) gives NaN (NumPy gives NaN or inf) and a zero gradient."
)
_attach(
    segment_var,
    "Per-segment variance of ``fn(data)`` (or ``data``), streamed and numerically stable.",
    r"\mathrm{out}_s = \frac{1}{n_s - \mathrm{ddof}} \sum_{i \in s} (v_i - \bar v_s)^2",
    _RED,
    _VAR_NUMERICS + " Gradient: ``2 (v_i - mean) / (n - ddof)``.",
    """      >>> foldax.segment_var(x, sizes=[2, 0, 3], ddof=1)
      Array([0.5, nan, 1. ], dtype=float32)
""",
)
_attach(
    segment_std,
    "Per-segment standard deviation of ``fn(data)`` (or ``data``): ``sqrt(segment_var)``.",
    r"\mathrm{out}_s = \Big(\frac{1}{n_s - \mathrm{ddof}} \sum_{i \in s} (v_i - \bar v_s)^2"
    r"\Big)^{1/2}",
    _RED,
    _VAR_NUMERICS + " Where the standard deviation is 0 the gradient is 0 (not NaN).",
    """      >>> foldax.segment_std(x, sizes=[2, 0, 3]).round(4)
      Array([0.5   ,    nan, 0.8165], dtype=float32)
""",
)
_ARG = (
    "``(num_segments, *F)`` int32: the global row (index into the leading axis of ``data``) of "
    "each segment's extreme, per trailing element; -1 for an empty segment."
)
_attach(
    segment_argmax,
    "Per-segment argmax of ``fn(data)`` (or ``data``): the row of each segment's maximum.",
    r"\mathrm{out}_s = \min \{\, i \in s : v_i = \max_{j \in s} v_j \,\}",
    _ARG,
    "the first row of ties, like ``jnp.argmax``; NaN counts as the maximum (its first row), "
    "like NumPy. An empty segment (and every segment of an empty ``data``) gives -1.",
    """      >>> foldax.segment_argmax(x, jnp.array([1, 0, 1, 0, 3]), 3)  # id 3: dropped
      Array([ 3,  2, -1], dtype=int32)
""",
    "an index has no derivative; the forward pass saves nothing.",
)
_attach(
    segment_argmin,
    "Per-segment argmin of ``fn(data)`` (or ``data``): the row of each segment's minimum.",
    r"\mathrm{out}_s = \min \{\, i \in s : v_i = \min_{j \in s} v_j \,\}",
    _ARG,
    "the first row of ties, like ``jnp.argmin``; NaN counts as the minimum (its first row), "
    "like NumPy. An empty segment (and every segment of an empty ``data``) gives -1.",
    """      >>> foldax.segment_argmin(x, jnp.array([1, 0, 1, 0, 3]), 3)
      Array([ 1,  0, -1], dtype=int32)
""",
    "an index has no derivative; the forward pass saves nothing.",
)
