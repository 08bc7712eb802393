"""Folds on a device mesh: every device folds its own rows, partial states meet in one collective.

Two ways in:

* **Inside ``jax.shard_map``** the user passes ``axis_name``: the arrays a function sees are the
  local shards, the reduced axis is split over ``axis_name``, and the result (a per-segment or
  per-row-of-``x`` state) is combined across devices with ``Monoid.allreduce``.
* **Under plain ``jax.jit``** with sharded inputs, :func:`row_axes` reads the mesh axes that split
  the reduced axis from the inputs' types (``Explicit`` mesh axes are part of the type in current
  JAX; with ``Auto`` axes only the mesh is known, and foldax splits the rows over every Auto
  axis whose size divides them), and the public function wraps itself in a ``shard_map`` over
  those axes.

Nothing of the reduced size ``N`` crosses devices: only ``(S, ...)`` states (forward) and the
cotangents of replicated inputs (backward) are all-reduced.

Cotangents. A fold's backward rule inside ``shard_map`` returns, for each input, the cotangent of *this
device's* contribution. With ``check_vma=True`` (the default) an input replicated along a mesh
axis (model parameters, ``x`` of a pairwise reduction whose ``y`` is split) must get the whole
cotangent, so it is ``psum``-ed along the axes the input's type does not vary on (closed-over
parameters are cast to varying first, and JAX's transpose of that cast is the ``psum``). With
``check_vma=False`` JAX's own convention applies: the cotangent of a replicated value is a set of
per-device shares that sum to it (that is how ``psum`` transposes to ``psum`` there), so the
reduced result's cotangent is summed before use and input cotangents stay local shares.
"""

from __future__ import annotations

import contextlib
import functools
import math

import jax
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from ._closure import trace


def varying(x) -> frozenset:
    """The manual mesh axes along which ``x`` (an array or an aval) differs between devices
    (its type's ``vma``)."""
    t = x if hasattr(x, "to_tangent_aval") else jax.typeof(x)
    mat = getattr(t, "manual_axis_type", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(t, "vma", ()))


def to_varying(tree, axes, skip=()):
    """Mark every leaf of ``tree`` as varying along ``axes`` (for loop carries that become so);
    a no-op where the enclosing ``shard_map`` does not track varying axes. ``skip``: indices of
    top-level entries of a tuple ``tree`` left as they are."""
    if not axes or not types_checked(axes):
        return tree
    if skip:
        return tuple(t if i in skip else to_varying(t, axes) for i, t in enumerate(tree))

    def one(a):
        missing = tuple(ax for ax in axes if ax not in varying(a))
        if not missing:
            return a
        if hasattr(lax, "pcast"):
            return lax.pcast(a, missing, to="varying")
        return lax.pvary(a, missing)  # pragma: no cover - older JAX

    return jax.tree.map(one, tree)


def like(tree, ref):
    """Every leaf of ``tree`` cast to vary along the axes its twin in ``ref`` varies on (a
    cotangent or tangent must be typed like its primal)."""

    def one(a, r):
        missing = tuple(varying(r) - varying(a))
        return to_varying(a, missing) if missing else a

    return jax.tree.map(one, tree, ref)


def example(a, shape, axes):
    """An example of ``shape`` with ``a``'s dtype for tracing a user function: a
    ``ShapeDtypeStruct``, or on a mesh with typed axes a (dead) zero array varying like ``a``
    and along ``axes`` (as the values the function will meet), so that the trace records the
    casts its constants need and can be replayed inside ``shard_map``."""
    dtype = jax.numpy.result_type(a)
    if not axes or not types_checked(axes):
        return jax.ShapeDtypeStruct(shape, dtype)
    return to_varying(jax.numpy.zeros(shape, dtype), tuple(varying(a) | frozenset(axes)))


def types_checked(axes) -> bool:
    """Whether the enclosing ``shard_map`` tracks varying axes (``check_vma=True``)."""
    return bool(axes) and axes[0] in varying(lax.axis_index(axes))


def reduce_cotangent(ct, primal, axes):
    """``psum`` the cotangent ``ct`` of ``primal`` along the ``axes`` that ``primal`` is replicated on.

    Without type information (``check_vma=False``) JAX represents the cotangent of a replicated
    value as per-device partial sums that ``shard_map``'s transpose adds up, so the local
    cotangent is returned as it is.
    """
    if ct is None or not axes or not types_checked(axes):
        return ct
    over = tuple(ax for ax in axes if ax in varying(ct) and ax not in varying(primal))
    return lax.psum(ct, over) if over else ct


def replicated_cotangent(g, axes):
    """The cotangent ``g`` of a result that is replicated over ``axes``, whole on every device.

    With ``check_vma=False`` JAX hands each device a share (they sum to the cotangent, which is
    how ``psum`` transposes to ``psum`` there): add the shares up.
    """
    if not axes or types_checked(axes):
        return g
    return jax.tree.map(lambda a: lax.psum(a, axes), g)


def axis_tuple(name, axis_name) -> tuple:
    """Validate ``axis_name`` (a mesh axis name or a tuple of them, bound by ``shard_map``)."""
    if axis_name is None:
        return ()
    axes = axis_name if isinstance(axis_name, tuple | list) else (axis_name,)
    if not axes or not all(isinstance(a, str) for a in axes):
        raise TypeError(
            f"{name}: axis_name must be a mesh axis name (str) or a tuple of them, got {axis_name!r}."
        )
    for a in axes:
        try:
            lax.axis_size(a)
        except (NameError, ValueError, KeyError):
            raise ValueError(
                f"{name}: axis_name={a!r} is not a mesh axis bound here. Pass axis_name only "
                f"inside jax.shard_map over a mesh with that axis (under plain jax.jit, sharded "
                f"inputs are distributed without it)."
            ) from None
    return tuple(axes)


def device_count(axes) -> int:
    return math.prod(lax.axis_size(a) for a in axes) if axes else 1


def device_index(axes):
    """This device's position along ``axes`` (row-major, like a spec entry ``(a, b)``)."""
    return lax.axis_index(axes if len(axes) > 1 else axes[0])


def spec_axes(entry) -> tuple:
    """The mesh axes of one ``PartitionSpec`` entry (``None``, a name or a tuple of names)."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple | list) else (entry,)


def mesh_of(leaves):
    """The (abstract) mesh of the first leaf that lives on one with non-manual axes, or None."""
    for a in leaves:
        sharding = getattr(jax.typeof(a), "sharding", None)
        mesh = getattr(sharding, "mesh", None)
        if mesh is None or not getattr(mesh, "axis_names", ()):
            continue
        types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
        if any(t != AxisType.Manual for t in types.values()):
            return mesh
    return None


def row_axes(leaves, n, auto=True):
    """How the leading axis of ``leaves`` is split: ``(mesh, axes)`` or ``None`` (one device).

    Explicit axes: the axes of the first leaf's leading spec entry. Auto axes (the sharding is
    not in the type; only with ``auto``): every Auto axis in mesh order, as long as their
    product divides ``n``.
    """
    mesh = mesh_of(leaves)
    if mesh is None:
        return None
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    for a in leaves:
        spec = jax.typeof(a).sharding.spec
        if len(spec) and spec[0] is not None:
            axes = tuple(ax for ax in spec_axes(spec[0]) if types[ax] == AxisType.Explicit)
            if axes:
                return mesh, axes
    picked, size = [], 1
    for ax in mesh.axis_names if auto else ():
        s = mesh.shape[ax]
        if types[ax] == AxisType.Auto and s > 1 and n % (size * s) == 0:
            picked.append(ax)
            size *= s
    return (mesh, tuple(picked)) if picked else None


def rows_spec(axes):
    """``leaf -> PartitionSpec``: the leading axis (rows) split over ``axes``, the rest whole."""
    return lambda a: P(axes or None, *([None] * (jax.numpy.ndim(a) - 1)))


def explicit_axes(mesh) -> frozenset:
    return frozenset(
        ax for ax, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == AxisType.Explicit
    )


def manual_axes(mesh, split) -> frozenset:
    """The axes a foldax ``shard_map`` takes over: the ``split`` ones, and every Explicit axis
    (replicated inputs stay replicated; inside, nothing is typed by an Explicit mesh, whose
    constants created without a mesh could not be mixed with the inputs)."""
    return frozenset(split) | explicit_axes(mesh)


def on_explicit_mesh(leaves):
    """The mesh of ``leaves`` if it has Explicit axes (even when nothing is split), else None."""
    mesh = mesh_of(leaves)
    return mesh if mesh is not None and explicit_axes(mesh) else None


def replayable(fn, *examples):
    """``(replay, consts)``: ``fn`` traced once on ``examples``, ``replay(consts)`` the same
    function with every array it closes over (``consts``) passed in explicitly.

    ``shard_map`` cannot close over arrays split on Explicit axes, so the arrays a user's
    ``fn`` / ``kernel`` closes over enter it as (replicated) inputs instead.
    """
    with unmeshed():
        closed, consts = trace(fn, *examples)
    return (lambda consts: functools.partial(closed, consts)), [
        jax.numpy.asarray(c) for c in consts
    ]


def unmeshed():
    """A context with no mesh, for tracing a user's function that will be replayed inside a
    ``shard_map``: an equation records the mesh it was traced under (``jax.set_mesh``'s, with
    Explicit axes) and would check it against the Manual axes it meets when replayed. Inside a
    ``shard_map`` (Manual axes in context) the context stays: the trace needs its axes."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = jax.sharding.AxisType.Manual
    if mesh.empty or any(t == manual for t in mesh.axis_types):
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ()))


def run_replayed(body, mesh, axes, inputs, specs, consts, out_specs):
    """``body(*inputs, consts)`` under one ``shard_map`` over ``mesh``: ``inputs[i]`` (a pytree)
    split as ``specs[i]`` (a pytree of ``PartitionSpec`` like it), ``consts`` (the arrays a
    replayed user callable closes over, see :func:`replayable`) replicated, the ``axes``
    splitting the rows and every Explicit axis manual. Inputs on Explicit axes are resharded
    to their specs first. Varying-axes typing is off (``check_vma=False``): a replayed trace
    has untyped constants, and the fold's rules follow the matching cotangent convention."""
    inputs = [
        jax.tree.map(lambda a, s: place(a, mesh, lambda _: s), x, spec)
        for x, spec in zip(inputs, specs, strict=True)
    ]
    consts = place(consts, mesh, lambda a: P())
    run = jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(*specs, [P() for _ in consts]),
        out_specs=out_specs,
        axis_names=manual_axes(mesh, axes),
        check_vma=False,
    )
    return run(*inputs, consts)


def place(tree, mesh, spec_of):
    """Reshard every leaf to ``spec_of(leaf)`` on ``mesh`` where its mesh axes are Explicit
    (``shard_map`` requires the types to match); with Auto axes ``shard_map`` does it itself."""
    if not explicit_axes(mesh):
        return tree
    sharding = lambda a: jax.sharding.NamedSharding(mesh, spec_of(a))  # noqa: E731
    return jax.tree.map(lambda a: jax.reshard(a, sharding(a)), tree)


__all__ = [
    "axis_tuple",
    "device_count",
    "device_index",
    "like",
    "manual_axes",
    "on_explicit_mesh",
    "place",
    "reduce_cotangent",
    "replayable",
    "replicated_cotangent",
    "row_axes",
    "rows_spec",
    "run_replayed",
    "spec_axes",
    "to_varying",
    "types_checked",
    "unmeshed",
    "varying",
]
