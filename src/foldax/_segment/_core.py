"""The one engine behind every ``segment_*``: validate, then fold (a monoid) or normalize
(softmax), on one device or on a mesh; it receives the public name, so every error names the
function the user called."""

from __future__ import annotations

import inspect
import math
import weakref
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from .. import _checks, _closure, _eager, _jax, _shard
from .._reductions import LOGSUMEXP, MAX, MEAN, MIN
from . import _fold, _policy
from ._partition import (
    _MAX_SEGMENTS,
    SortedIds,
    _Contiguous,
    _Empty,
    _Ids,
    _is_numpy,
    _mode,
    _partition,
    sorted_bounds,
    working_ids,
)

if TYPE_CHECKING:
    pass


def _num_rows(name, data, fn) -> int:
    leaves = jax.tree.leaves(data)
    if not leaves:
        raise TypeError(f"{name}: data is an empty pytree; pass an array or a pytree of arrays.")
    shapes = [jnp.shape(x) for x in leaves]
    if any(len(s) == 0 for s in shapes):
        fix = (
            "close over it in fn instead"
            if fn is not None
            else "a scalar is broadcast over segment_ids or static sizes / offsets (as jax.ops "
            "does), so describe the partition with exactly one of them"
        )
        raise ValueError(
            f"{name}: data must have a leading axis N of rows to reduce over, got a scalar; {fix}."
        )
    n = shapes[0][0]
    if any(s[0] != n for s in shapes):
        raise ValueError(
            f"{name}: every leaf of data must have the same leading size N, got {[s[0] for s in shapes]}."
        )
    return _checks.concrete_rows(name, "the leading axis of data", n)


def _broadcast_rows(name, data, segment_ids, sizes, offsets, axes):
    """Plain ``data`` broadcast over the rows, as ``jax.ops`` broadcasts it over the ids: a
    scalar becomes ``(N,)``, a leading axis of 1 becomes ``N`` (``F = data.shape[1:]`` stays).
    ``N`` is the length of ``segment_ids``, or the rows that static ``sizes`` / ``offsets``
    describe (this device's rows inside ``shard_map``: ids only). Any other leading size than
    ``N`` or 1 is an error, as in ``jax.ops``."""
    n = _rows_described(segment_ids, sizes, offsets, axes)
    shape = jnp.shape(data)
    by = "segment_ids" if segment_ids is not None else "sizes" if sizes is not None else "offsets"
    given = any(v is not None for v in (segment_ids, sizes, offsets))
    if n is None and not shape and given:  # (no partition at all: the partition's check explains)
        if segment_ids is not None:
            raise ValueError(
                f"{name}: segment_ids must have shape (N,), got {np.shape(segment_ids)}."
            )
        raise ValueError(
            f"{name}: data is a scalar, but {by} does not give the number of rows N at trace "
            f"time (traced, or inside shard_map); pass data of shape (N, ...)."
        )
    if n is None or (shape and shape[0] == n):
        return data
    if shape and shape[0] != 1:
        raise ValueError(
            f"{name}: data has leading size {shape[0]} but {by} describes {n} rows; pass data "
            f"of shape ({n}, ...), or a scalar or a leading size of 1 to broadcast (as jax.ops "
            f"does)."
        )
    return jnp.broadcast_to(data, (n, *shape[1:]))


def _rows_described(segment_ids, sizes, offsets, axes):
    """The rows the partition labels when known at trace time (else ``None``): the length of
    one-dimensional ``segment_ids``, the sum of static ``sizes``, the last of static ``offsets``
    (never inside ``shard_map``, where those describe every device's rows)."""
    if segment_ids is not None:
        shape = np.shape(segment_ids)
        return shape[0] if len(shape) == 1 else None
    x = sizes if sizes is not None else offsets
    if x is None or axes or isinstance(x, _jax.Tracer):
        return None
    try:
        x = np.asarray(x)
    except (TypeError, ValueError):
        return None
    if x.ndim != 1 or not x.size or not np.issubdtype(x.dtype, np.integer):
        return None  # the partition's checks explain
    return int(x.sum()) if sizes is not None else int(x[-1])


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


def _check_one_argument(name, data, fn):
    """``fn`` takes the chunk of rows as one argument, a pytree like ``data``: a clear error
    where ``data`` is a tuple or list and ``fn`` takes its parts as separate parameters."""
    if not isinstance(data, tuple | list) or len(data) < 2:
        return
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins and the like: nothing to tell
        return
    try:
        sig.bind(data)
        return
    except TypeError:
        pass
    try:
        sig.bind(*data)
    except TypeError:
        return
    kind = type(data).__name__
    raise TypeError(
        f"{name}: fn is called with one argument, the chunk of rows as a {kind} like data "
        f"(here {len(data)} arrays), but it takes {len(data)} separate parameters; unpack "
        f"inside it: fn=lambda rows: f(*rows)."
    )


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
    _check_one_argument(name, data, fn)
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
    empty=None,
):
    """The one engine behind every ``segment_*``: validate, then fold (``op``: a monoid) or
    normalize (``op``: ``"softmax"`` / ``"log_softmax"``), on one device or on a mesh.

    ``empty`` (``segment_mean``'s, whose second output is the count): the result of a segment
    with no rows, in place of the monoid's own (``0 / 0``)."""
    if fn is None and _one_value_rows(data, segment_ids):
        # rows of one value held as (N, 1, ...): reduced as the (N,) values they are (a tile's
        # last axis is what XLA vectorises: of size 1, a log-sum-exp's walk ran 2x slower)
        hints = (indices_are_sorted, unique_indices, bucket_size, mode)
        out = _segment(
            name, op, data.reshape(data.shape[:1]), segment_ids, num_segments, *hints,
            sizes=sizes, offsets=offsets, chunk_size=chunk_size, axis_name=axis_name, empty=empty,
        )  # fmt: skip
        return jax.tree.map(lambda o: o.reshape(*o.shape[:1], *data.shape[1:]), out)
    normal = isinstance(op, str)
    monoid = LOGSUMEXP if normal else op
    clip = _mode(name, mode, unique_indices, bucket_size)
    axes = _shard.axis_tuple(name, axis_name)
    if fn is None:
        data = _plain_data(name, data, segment_ids, sizes, offsets, axes)
    n = n_rows = _num_rows(name, data, fn)  # this device's rows inside shard_map, else all rows
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
    if op is MEAN:
        empty = _empty_value(name, empty, aval.dtype)
    mesh, axes, devices = _placement(data, segment_ids, axes, n)
    n_global = n * devices if mesh is None else n
    part = _partition(
        name, n_global, segment_ids, num_segments, sizes, offsets, indices_are_sorted, n_rows, clip
    )
    chunk = _chunk(name, chunk_size)
    # Known sorted ids (and static sizes / offsets) scatter by their ids on CPU where the walk
    # is not faster, and always on a TPU (there the walk took 38x jax.ops' time); elsewhere
    # their contiguous tiles stay.
    if normal:
        scatters = _fold.normalizes_by_scatters(fn, aval.dtype, axes, chunk, n, aval.shape[1:])
    else:
        scatters = bool(_fold.scatters(fn, aval.dtype, monoid, axes))
    backend = jax.default_backend()
    by_ids = scatters and mesh is None and backend in ("cpu", "tpu")
    if by_ids and (backend == "tpu" or not _walks(part, n_global, aval.shape[1:], normal)):
        part = getattr(part, "by_ids", lambda: None)() or part
    # jraph's softmax program (what a user writes with jax.ops) on CPU and TPU; the extrema's
    # scatters with counts on CPU, where they were measured
    softmax_rows = by_ids and normal
    scatters = by_ids and backend == "cpu"

    if isinstance(part, _Empty):
        return _no_rows(monoid, normal, aval, part.num_segments, empty)

    n_local = n_global // devices

    def local(data, arrays, fn):
        plan, arrays = part.plan(n_local, chunk, arrays, axes, devices)
        if softmax_rows and plan.kind == "rows":
            log = op == "log_softmax"
            return _fold.normalize_rows(name, data, plan, arrays, log, platform=backend)
        if normal:
            return _fold.normalize(name, fn, data, plan, arrays, op == "log_softmax", axes)
        by_scatters = scatters and plan.kind == "rows"
        if by_scatters and _fold.extremum_by_scatters(monoid, aval.dtype, chunk, n, aval.shape[1:]):
            return _fold.extremum_rows(name, monoid, data, plan, arrays)
        if empty is None:
            return _fold.fold(name, monoid, fn, data, plan, arrays, axes)
        out, count, *_ = _fold.fold(name, monoid, fn, data, plan, arrays, axes, all_outputs=True)
        return _fill_empty(out, count, empty)

    if mesh is None:
        return local(data, part.arrays(), fn)
    return _on_mesh(mesh, axes, local, data, part, fn, normal)


def _one_value_rows(data, segment_ids) -> bool:
    """Whether plain ``data`` is rows of one value each, with trailing axes of size 1 (and as
    many rows as ``segment_ids`` where they are given)."""
    shape = getattr(data, "shape", None)
    if shape is None or len(shape) < 2 or any(d != 1 for d in shape[1:]):
        return False
    return segment_ids is None or jnp.shape(segment_ids)[:1] == shape[:1]


def _walks(part, n, features, per_row) -> bool:
    """Whether contiguous segments (static ``sizes`` / ``offsets``, known or promised sorted ids)
    stay walked on CPU rather than scattered by ids (:func:`._policy.walks_contiguous`)."""
    contiguous = isinstance(part, _Contiguous) or getattr(part, "sorted", False)
    return contiguous and _policy.walks_contiguous(n, part.num_segments, tuple(features), per_row)


def _plain_data(name, data, segment_ids, sizes, offsets, axes):
    """Plain ``data`` (no ``fn``) as an array broadcast over the rows (:func:`_broadcast_rows`);
    a Python scalar or list becomes a JAX array, as ``jax.ops`` takes it."""
    if not hasattr(data, "shape"):
        if isinstance(data, list | tuple) and any(np.ndim(a) > 0 for a in data):
            raise TypeError(
                f"{name}: data is a {type(data).__name__} of arrays; pass fn= to map a chunk of "
                f"rows to one array of values, or stack them first (jnp.stack)."
            )
        if not isinstance(data, list | tuple | float | int | complex):
            return data  # a pytree: the value checks explain
        data = jnp.asarray(data)
    return _broadcast_rows(name, data, segment_ids, sizes, offsets, axes)


def _placement(data, segment_ids, axes, n):
    """``(mesh, axes, devices)``: where the fold runs. Inside ``shard_map`` (``axes`` given) no
    mesh of its own; else the mesh and axes that split the rows of ``data`` / ``segment_ids``
    (from their types), or the explicit mesh they are replicated on, or none."""
    if axes:
        return None, axes, _shard.device_count(axes)
    ids = [segment_ids] if segment_ids is not None and not _is_numpy(segment_ids) else []
    leaves = jax.tree.leaves(data) + ids
    found = _shard.row_axes(leaves, n)
    if found is not None:
        mesh, axes = found
        return mesh, axes, math.prod(mesh.shape[a] for a in axes)
    # replicated on a mesh: run there (unsplit) rather than mix mesh types
    return _shard.on_explicit_mesh(leaves), axes, _shard.device_count(axes)


def _no_rows(monoid, normal, aval, num_segments, empty):
    """The result when there are no rows or no segments: every segment is empty."""
    if normal:
        return jnp.full(aval.shape, np.nan, aval.dtype)
    if empty is not None:
        return jnp.full((num_segments, *aval.shape[1:]), empty, aval.dtype)
    out = monoid.finalize(monoid.init(num_segments, aval.shape[1:], aval.dtype))
    return out.astype(aval.dtype) if jnp.issubdtype(out.dtype, jnp.floating) else out


def _fill_empty(out, count, empty):
    """``out`` ``(S, *F)`` with ``empty`` where the per-segment ``count`` ``(S,)`` is 0. The
    cotangent of those segments is dropped here, so none reaches (or poisons) the fold."""
    none = (count == 0).reshape(count.shape + (1,) * (out.ndim - count.ndim))
    return jnp.where(none, jnp.asarray(empty, out.dtype), out)


def _on_mesh(mesh, axes, local, data, part, fn, per_row):
    """Run ``local`` under ``shard_map``: rows (``data``, ids) split over ``axes``; traced
    ``sizes`` / ``offsets`` and the arrays ``fn`` closes over are replicated.

    ``fn`` is traced here for a block of rows and replayed inside (``vmap`` ped), with the arrays it
    closes over passed in explicitly (:func:`foldax._shard.run_replayed`).
    """
    split = P(axes or None)
    arrays = part.arrays()
    # The ids are split like the rows; traced sizes / offsets are replicated.
    arr_specs = tuple(split if isinstance(part, _Ids) else P() for _ in arrays)
    replay, consts = _replayable(fn, data)

    def body(data, arrays, consts):
        return local(data, arrays, replay(consts))

    data_specs = jax.tree.map(_shard.rows_spec(axes), data)
    out = split if per_row else P()
    return _shard.run_replayed(
        body, mesh, axes, (data, arrays), (data_specs, arr_specs), consts, out
    )


def _replayable(fn, data):
    """``(replay, consts)``: ``replay(consts)`` is ``fn`` (row-wise) with every array it closes
    over (``consts``) passed in explicitly (see :func:`foldax._segment._fold.row_fn`)."""
    if fn is None:
        return (lambda consts: None), []
    with _shard.unmeshed():
        f, consts = _fold.row_fn(fn, data)
    return (lambda consts: lambda rows: f(consts, tuple(jax.tree.leaves(rows)))), list(consts)


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


def _eager_arguments(arguments):
    """The arguments an eager call is keyed and run with: ``segment_ids`` given as an array
    (NumPy, or a jax.Array on one device) is an input of the executable, never a value it is
    compiled for. Read once per jax.Array (NumPy ids on every call) are cheap facts that pick the
    program: whether the ids are sorted (the call is then told so, as by
    ``indices_are_sorted=True``: contiguous segments) and, where ``num_segments`` is left out,
    the largest id (which gives it); sorted ids passed again by the next call also carry their
    segments' bounds (:func:`_sorted_hint`). NumPy ids in a dtype that JAX would narrow (int64
    without ``jax_enable_x64``) are narrowed here when they fit. Whatever is odd (a wrong dtype or
    shape, a broken promise of sorted ids) runs uncached, to raise the call's own error."""
    ids = arguments.get("segment_ids")
    if isinstance(ids, _jax.Tracer):  # of an eager vmap / grad: keyed by its shape and dtype
        if arguments.get("num_segments") is None:
            raise _closure.Unkeyable  # (the uncached call explains)
        return arguments
    if not isinstance(ids, jax.Array | np.ndarray):  # None, or a list: read as a value
        return arguments
    if isinstance(ids, jax.Array) and len(ids.sharding.device_set) > 1:
        raise _closure.Unkeyable  # a mesh's ids: where they lie decides the program
    if ids.ndim != 1 or ids.dtype.kind not in "iu":  # (not bool either)
        raise _closure.Unkeyable
    ordered, lo, hi = _closure.read_once(ids, "segment_ids", _id_facts)
    if arguments.get("indices_are_sorted") and not ordered:
        raise _closure.Unkeyable
    told = dict(arguments, indices_are_sorted=bool(ordered or arguments.get("indices_are_sorted")))
    if arguments.get("num_segments") is None:
        told["num_segments"] = max(hi + 1, 0) if ids.size else 0
    if _again(ids) and ordered:
        told["indices_are_sorted"] = _sorted_hint(ids, told) or True
    if isinstance(ids, np.ndarray) and jax.dtypes.canonicalize_dtype(ids.dtype) != ids.dtype:
        if ids.size and not (_INT32.min <= lo and hi <= _INT32.max):
            raise _closure.Unkeyable
        told["segment_ids"] = ids.astype(np.int32)
    return told


_INT32 = np.iinfo(np.int32)


def _id_facts(ids):
    """``(sorted, smallest, largest)`` of 1-D integer ids (both ``0`` when there are none)."""
    a = np.asarray(ids)
    if not a.size:
        return True, 0, 0
    return _checks.first_decrease(a) is None, int(a.min()), int(a.max())


#: The ids of the last eager call (a weak reference), to tell a loop over the same ids apart.
_LAST_IDS = [lambda: None]


def _again(ids) -> bool:
    """Whether ``ids`` is the very array the previous eager call with ids had (a loop over one
    graph, not over batches: only then are its bounds worth a program of their own)."""
    again = _LAST_IDS[0]() is ids
    try:
        _LAST_IDS[0] = weakref.ref(ids)
    except TypeError:
        _LAST_IDS[0] = lambda: None
    return again


def _sorted_hint(ids, told):
    """Sorted ids passed again: a :class:`._partition.SortedIds` with their segments' bounds
    (``O(S)``, in the key by digest), which plan the call as for known ids, where the segments
    are long enough for the contiguous walk (:mod:`._policy`) to gain from that over the
    bounds a traced-ids program computes; else ``None``."""
    s = told.get("num_segments")
    if not isinstance(s, int) or isinstance(s, bool) or not 0 < s <= _MAX_SEGMENTS:
        return None
    if ids.shape[0] < _policy.WALK_MIN_ROWS_PER_SEGMENT * s:
        return None
    try:
        clip = _mode("", told.get("mode"), told.get("unique_indices", False), None)
    except (TypeError, ValueError):
        return None
    read = lambda a: SortedIds(a.shape[0], s, clip, sorted_bounds(working_ids(a, s, clip), s))  # noqa: E731
    return _closure.read_once(ids, ("bounds", s, clip), read)


#: Eager calls run one cached executable (:mod:`foldax._eager`): ``data``, ``segment_ids``
#: given as an array and the arrays ``fn`` closes over are its inputs; every other argument
#: (``sizes``, ``offsets``, ids given as a list) is static, keyed by value.
_eager_call = _eager.cached(
    dynamic=("data", "segment_ids"),
    hoist={"fn": _eager.Hoist(_fn_examples, _fold.replay_rows, _fn_check)},
    prepare=_eager_arguments,
)


def _ddof(name, ddof):
    """A valid static ``ddof``: a real number >= 0."""
    if isinstance(ddof, bool) or not isinstance(ddof, int | float | np.integer | np.floating):
        raise TypeError(f"{name}: ddof must be a static Python number, got {type(ddof).__name__}.")
    if not ddof >= 0:
        raise ValueError(f"{name}: ddof must be >= 0, got {ddof}.")
    return float(ddof) if not float(ddof).is_integer() else int(ddof)


def _empty_value(name, empty, dtype):
    """A valid static ``empty`` (a real number; complex for complex values)."""
    kinds = int | float | complex | np.integer | np.floating | np.complexfloating
    if isinstance(empty, bool | np.bool_) or not isinstance(empty, kinds):
        raise TypeError(
            f"{name}: empty (the result of a segment with no rows) must be a static Python "
            f"number such as 0.0 or float('nan'), got {type(empty).__name__}."
        )
    if np.iscomplexobj(empty) and not jnp.issubdtype(dtype, jnp.complexfloating):
        raise TypeError(
            f"{name}: empty={empty!r} is complex but the values are {dtype}; pass a real number."
        )
    return empty
