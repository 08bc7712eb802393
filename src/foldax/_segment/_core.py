"""The one engine behind every ``segment_*``: validate, then fold (a monoid) or normalize
(softmax), on one device or on a mesh; it receives the public name, so every error names the
function the user called."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from .. import _checks, _eager, _shard
from .._reductions import LOGSUMEXP, MAX, MIN
from . import _fold
from ._partition import _Empty, _Ids, _is_numpy, _mode, _partition

if TYPE_CHECKING:
    pass


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
    # Known sorted ids scatter by their ids on CPU; elsewhere their contiguous tiles stay.
    plain = mesh is None and not normal and _fold.scatters(fn, aval.dtype, monoid, axes)
    if plain and jax.default_backend() == "cpu":
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


#: Eager calls run one cached executable (:mod:`foldax._eager`): ``data`` and the arrays ``fn``
#: closes over are its inputs; every other argument is static.
_eager_call = _eager.cached(
    dynamic=("data",), hoist={"fn": _eager.Hoist(_fn_examples, _fold.replay_rows, _fn_check)}
)


def _ddof(name, ddof):
    """A valid static ``ddof``: a real number >= 0."""
    if isinstance(ddof, bool) or not isinstance(ddof, int | float | np.integer | np.floating):
        raise TypeError(f"{name}: ddof must be a static Python number, got {type(ddof).__name__}.")
    if not ddof >= 0:
        raise ValueError(f"{name}: ddof must be >= 0, got {ddof}.")
    return float(ddof) if not float(ddof).is_integer() else int(ddof)
