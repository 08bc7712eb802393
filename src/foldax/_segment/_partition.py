"""Partitions: ``segment_ids``, ``sizes`` or ``offsets`` validated once for every segment
reduction, and described as what the engine walks (contiguous tiles, or rows with ids)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from .. import _checks, _closure, _engine, _jax, _shard
from .._engine._plan import static_ends, static_table

if TYPE_CHECKING:
    pass


def _is_tracer(x) -> bool:
    return isinstance(x, _jax.Tracer)


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
    err = _checks.partition_error(arg, static, n)
    if err is not None:
        raise ValueError(f"{name}: {err}.")
    if arg == "sizes":
        return static, np.concatenate([[0], np.cumsum(static)[:-1]]).astype(np.int64)
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
        if isinstance(indices_are_sorted, SortedIds):  # sorted ids whose bounds were read
            part = indices_are_sorted.partition(n, num_segments, clip, work)
            if part is not None:
                return part
        promised = bool(indices_are_sorted)
        return _Ids(work, num_segments, promised, in_range=clip, ordered=promised)
    work = _working_ids(static, num_segments, clip, np)
    err = _checks.unsorted_error(work if clip else static) if indices_are_sorted else None
    if err is not None:  # (clipped ids are checked as clipped, like traced ones)
        raise ValueError(f"{name}: {err}; sort the rows by id, or leave indices_are_sorted out.")
    if _checks.first_decrease(work) is None:  # known and sorted: contiguous, the tiled path
        bounds = sorted_bounds(work, num_segments)
        return _Contiguous(np.diff(bounds), bounds[:-1], num_segments, work)
    return _Ids(static_table(work), num_segments, False, in_range=_within(work, num_segments))


class SortedIds:
    """``indices_are_sorted`` as an eager call passes it (:func:`foldax._segment._core.
    _sorted_hint`) for ids it has read, found sorted and met in the call before (a loop over one
    partition): besides the promise, their segments' bounds ``(S + 1,)`` (:func:`sorted_bounds`,
    for ``n`` ids, ``clip`` or not, into ``num_segments``), so that the call plans its walk as
    for known ids, while the ids stay an input of the executable (whose key holds a digest of
    the bounds, never the ids)."""

    def __init__(self, n, num_segments, clip, bounds):
        self.n, self.num_segments, self.clip, self.bounds = n, num_segments, clip, bounds
        self._key = (n, num_segments, clip, _closure.value_key(bounds))

    def __eq__(self, other):
        return isinstance(other, SortedIds) and self._key == other._key

    def __hash__(self):
        return hash(self._key)

    def partition(self, n, num_segments, clip, work):
        """The :class:`_Contiguous` segments of the traced ids ``work`` (for ``n`` ids into
        ``num_segments``, ``clip`` or not), or ``None`` where the bounds were read for another
        partition."""
        if (self.n, self.num_segments, self.clip) != (n, num_segments, clip):
            return None
        b = self.bounds
        return _Contiguous(np.diff(b), b[:-1], num_segments, work, b[0] == 0 and b[-1] == n)


def sorted_bounds(work, num_segments) -> np.ndarray:
    """The bounds ``(S + 1,)`` of the contiguous segments of sorted NumPy working ids
    (:func:`_working_ids`) into ``num_segments``, int64: segment ``s`` is rows
    ``bounds[s] : bounds[s + 1]`` (rows before ``bounds[0]`` or from ``bounds[-1]`` are
    dropped). ``O(S log N)``."""
    return np.searchsorted(work, np.arange(num_segments + 1), side="left").astype(np.int64)


def working_ids(ids, num_segments, clip):
    """NumPy ``ids`` as the int32 working ids of a partition into ``num_segments`` (clipped
    into range, or those out of range kept out of it)."""
    return _working_ids(np.asarray(ids), num_segments, clip, np)


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
    fix = "under jit mark it static (static_argnames) or pass it as a literal"
    num_segments = _checks.static_int(name, "num_segments", num_segments, fix)
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
    """Segments ``s`` = rows ``offsets[s] : offsets[s] + sizes[s]`` (NumPy = static, or traced).

    ``ids``: the sorted ids these segments came from, if any: known (NumPy), or traced ids whose
    bounds an eager call read (:class:`SortedIds`; ``in_range``: whether none is dropped)."""

    def __init__(self, sizes, offsets, count, ids=None, in_range=None):
        self.sizes, self.offsets, self.num_segments = sizes, offsets, count
        self.static = isinstance(sizes, np.ndarray)
        self.ids, self.in_range = ids, in_range

    def by_ids(self):
        """The same partition as per-row ids (an :class:`_Ids`), if it is static (known ids, or
        static sizes / offsets: every row's segment is known at trace time; or traced ids with
        static bounds, scattered by themselves)."""
        if not self.static:
            return None
        ids = self.ids
        if ids is not None and not isinstance(ids, np.ndarray):
            return _Ids(ids, self.num_segments, False, bool(self.in_range), ordered=True)
        if ids is None:
            ids = np.repeat(np.arange(self.num_segments, dtype=np.int32), self.sizes)
        in_range = _within(ids, self.num_segments)
        table = static_table(ids.astype(np.int32))
        return _Ids(table, self.num_segments, False, in_range, ordered=True)

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


def _within(ids, num_segments) -> bool:
    """Whether static ``ids`` all lie in ``[0, num_segments)`` (none is dropped)."""
    return bool(ids.size == 0 or (ids.min() >= 0 and ids.max() < num_segments))


class _Ids:
    """Per-row ``segment_ids`` (traced, or static but unsorted); ``sorted_``: walked as
    contiguous tiles; ``in_range``: every id is known to lie in ``[0, num_segments)`` (static ids
    that do, or ids clipped into range); ``ordered``: the ids are known or promised to be sorted
    (XLA's scatters are told so)."""

    def __init__(self, ids, num_segments, sorted_, in_range=False, ordered=False):
        self.ids, self.num_segments, self.sorted = ids, num_segments, sorted_
        self.in_range, self.ordered = in_range, ordered

    def arrays(self):
        return (self.ids,)

    def by_ids(self):
        """The same partition walked by rows (no contiguous tiles)."""
        return _Ids(self.ids, self.num_segments, False, self.in_range, self.ordered)

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
        spec = _engine.PlanSpec(
            "rows", n, self.num_segments, None, chunk, in_range=self.in_range,
            sorted_ids=self.ordered,
        )  # fmt: skip
        return spec, (ids,)


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
