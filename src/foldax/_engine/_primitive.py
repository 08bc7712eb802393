"""The one streamed fold, as a JAX primitive with its own rules.

A fold instance computes, over the steps of a plan (:mod:`foldax._engine._plan`)::

    for each step:  (G slots) x (T rows) tile, mask
        vals, tots, rowvals = body(consts, slots[tile's slots], rows[step's rows], mask, index)
        slot states  <- merge(monoid.reduce(vals, mask))    (or += vals: an *additive* fold)
        tot sums     += tots
        row buffers  += rowvals  (at the step's own rows)

and returns ``(slot outputs, tot sums, row buffers)``: ``monoid.outputs(states)`` per slot
(segments, rows of ``x``), sums over everything, and one value per row. The arguments are four
tuples of arrays: the plan's integer ``arrays``, ``consts`` (whole in every step), ``slots``
(leading axis = slots, gathered per tile) and ``rows`` (leading axis = rows; last axis for dense
plans).

Every rule produces another fold, so that every order of differentiation streams:

* ``jvp``: an additive fold of ``jax.jvp(body)``, turned into the outputs'
  tangents by ``monoid.tangent`` (the primal outputs' ``monoid.info`` enters as slots);
* ``transpose`` (``jax.grad`` is ``jvp`` then ``transpose``): an additive fold of
  ``jax.vjp(body)`` pulled back from the outputs' cotangents (``monoid.row_cotangent``):
  cotangents of ``consts`` are tot sums, of ``slots`` slot sums, of ``rows`` row buffers. The
  transpose of a tangent fold is its parent's cotangent fold;
* ``batch``: :class:`Batched`, which ``vmap`` s the fold's implementation after scaling its plan
  for the batch (the planner sees every enclosing ``vmap``), and derives its rules from the
  unbatched instance's.

The primitive itself (how JAX sees a fold) is in :mod:`._registration`. Nothing per step is
saved between passes: the residuals of every rule are its inputs and the
small per-slot outputs.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from .. import _shard
from .._jax import Zero
from .._kernels import tpu as tpu_kernels
from . import _direct, _flat, _picks, _registration, _runs
from ._derived import Shape, _fill, _jvp_body, _pick, _unflag, _vjp_body, widened_dtype
from ._loop import _finish, _run, _typed_out_avals
from ._probe import plan_units, unit_bytes, whole_rows
from ._registration import Primitive
from ._spec import Spec, _aval, _is_float, _is_zero, _shaped, _zero_tangent


class _Rules(Primitive):
    """Differentiation and batching rules shared by :class:`Fold` and :class:`Batched`: each
    rule derives another fold (``derive``) and calls it."""

    def _counts(self):
        _, consts, slots, rows = self.in_avals
        return len(consts), len(slots), len(rows)

    def _shape(self, nz, gnz=()):
        nc, ns, nr = self._counts()
        return Shape(nc, ns, self.num_info(), nr, tuple(nz), tuple(gnz))

    # -- forward mode --------------------------------------------------------------------------

    def _tangents(self, args, outs, tangents):
        arrays, consts, slots, rows = args
        flat_t = [t for part in tangents[1:] for t in part]
        flat_p = [p for part in (consts, slots, rows) for p in part]
        nz = tuple(
            not _is_zero(t) and _is_float(_aval(p)) for t, p in zip(flat_t, flat_p, strict=True)
        )
        if not any(nz):
            return jax.tree.map(_zero_tangent, self.out_aval)
        nc, ns, _ = self._counts()
        dc, ds, dr = _parts(flat_t, nz, nc, ns)
        derived = self.derive("jvp", self._shape(nz))
        t = derived(arrays, (*consts, *dc), (*slots, *self.info(outs), *ds), (*rows, *dr))
        if self.spec.monoid is None:
            return t
        it = iter(t[0])
        slot = tuple(
            next(it).astype(a.dtype) if _is_float(a) else _zero_tangent(a) for a in self.out_aval[0]
        )
        return (slot, (), ())

    def jvp(self, primals, tangents):
        fold = self.for_derivatives()
        outs = fold(*primals)
        if _picks.applies(fold):  # at the pairs the fold picks (max, min, k-min)
            t = _picks.rule(fold, primals, outs, tangents)
        else:
            t = fold._tangents(primals, outs, tangents)
        if fold is self:
            return outs, t
        return self._own(outs), self._own(t)

    def _own(self, outs):
        """This fold's outputs, of those of its :meth:`for_derivatives` form."""
        return (tuple(outs[0][: len(self.out_aval[0])]), *outs[1:])

    # -- reverse mode --------------------------------------------------------------------------

    def _cotangents(self, args, outs, g, nz, info=None):
        """Cotangents ``(consts, slots, rows)`` (``None`` where not wanted) from the outputs'."""
        arrays, consts, slots, rows = args
        # Integer inputs (counts, indices, keys) take no cotangent: a symbolic zero, never a
        # float0 array that a derived fold would have to add up.
        flat = (*consts, *slots, *rows)
        nz = tuple(f and _is_float(_aval(a)) for f, a in zip(nz, flat, strict=True))
        out_leaves = jax.tree.leaves(self.out_aval)
        g_leaves = jax.tree.leaves(g, is_leaf=_is_zero)
        gnz = tuple(
            not _is_zero(x) and _is_float(a) for x, a in zip(g_leaves, out_leaves, strict=True)
        )
        if not any(nz) or not any(gnz):
            return None
        no, nt = len(self.out_aval[0]), len(self.out_aval[1])
        g_slot = self.prepare_slot_cotangents(_pick(g_leaves[:no], gnz[:no]))
        g_tot = _pick(g_leaves[no : no + nt], gnz[no : no + nt])
        g_row = _pick(g_leaves[no + nt :], gnz[no + nt :])
        if info is None:
            info = self.info(outs) if self.num_info() else ()
        derived = self.derive("vjp", self._shape(nz, gnz))
        ct_s, ct_c, ct_r = derived(
            arrays, (*consts, *g_tot), (*slots, *info, *g_slot), (*rows, *g_row)
        )
        nc, ns, nr = self._counts()
        nz_c, nz_s, nz_r = nz[:nc], nz[nc : nc + ns], nz[nc + ns :]
        # (in the inputs' dtypes already: the derived fold's Spec.out_dtypes)
        cts = (
            _fill([None] * nc, nz_c, ct_c),
            _fill([None] * ns, nz_s, ct_s),
            _fill([None] * nr, nz_r, ct_r),
        )
        return self.finish_cotangents(args, cts)

    def _tangent_parent(self):
        """``(parent, shape)`` if this fold is the tangent fold (``derive("jvp", shape)``) of
        ``parent``, batched like this one; else None."""
        if isinstance(self, Batched):
            got = self.inner._tangent_parent()
            if got is None:
                return None
            parent, shape = got
            a, c, s, r = self.dims
            dims = (a, c[: shape.nc], s[: shape.ns], r[: shape.nr])
            return Batched(parent, self.size, dims), shape
        return self.spec.origin

    def transpose(self, out_ct, *args):
        """Transpose in the arguments given as accumulators (``jax.grad`` is ``jvp`` then this).
        A tangent fold transposed in all of its tangents is the parent's cotangent fold; any
        other additive fold is linear in its tangent or cotangent inputs (``_transpose_linear``)."""
        got = self._tangent_parent()
        if got is None or not self._transpose_tangent_fold(*got, out_ct, args):
            self._transpose_linear(out_ct, *args)

    def _transpose_tangent_fold(self, parent, shape, out_ct, args) -> bool:
        """The parent's cotangent fold (mesh handling included), when exactly the tangent
        inputs are being transposed; False (nothing done) otherwise."""
        arrays, consts, slots, rows = args
        nc, ns, ni, nr = shape.nc, shape.ns, shape.ni, shape.nr
        tangents = [*consts[nc:], *slots[ns + ni :], *rows[nr:]]
        primals = [*consts[:nc], *slots[: ns + ni], *rows[:nr]]
        if not all(_is_accum(t) for t in tangents) or any(_is_accum(p) for p in primals):
            return False
        p_args = (arrays, tuple(consts[:nc]), tuple(slots[:ns]), tuple(rows[:nr]))
        g = out_ct if parent.spec.monoid is None else _parent_cotangent(parent, out_ct[0])
        cts = parent._cotangents(p_args, None, g, shape.nz, info=tuple(slots[ns : ns + ni]))
        if cts is not None:
            flat = [c for part in cts for c in part]
            _accumulate_flat(tangents, [c for c, f in zip(flat, shape.nz, strict=True) if f])
        return True

    def _transpose_linear(self, out_ct, *args):
        """The cotangent fold at zeros for the arguments being transposed."""
        flat = [a for part in args[1:] for a in part]
        nz = tuple(_is_accum(a) for a in flat)
        vals = [jnp.zeros(a.aval.shape, a.aval.dtype) if _is_accum(a) else a for a in flat]
        nc, ns, _ = self._counts()
        parts = (tuple(vals[:nc]), tuple(vals[nc : nc + ns]), tuple(vals[nc + ns :]))
        _accumulate(flat, self._cotangents((args[0], *parts), None, out_ct, nz))

    # -- batching ------------------------------------------------------------------------------

    def batch(self, axis_data, args, dims):
        def move(a, d):
            return a if d is None else jnp.moveaxis(a, d, 0)

        leaf = lambda x: x is None  # noqa: E731
        if all(d is None for d in jax.tree.leaves(dims, is_leaf=leaf)):
            return self(*args), jax.tree.map(lambda _: None, self.out_aval)
        args = jax.tree.map(move, args, dims, is_leaf=leaf)
        flags = jax.tree.map(lambda d: None if d is None else 0, dims, is_leaf=leaf)
        out = Batched(self, axis_data.size, flags)(*args)
        return out, jax.tree.map(lambda _: 0, self.out_aval)

    # -- structure -----------------------------------------------------------------------------

    def structure(self):
        """``(static, jaxpr)``: what this fold computes when it is run, for comparing the folds
        of two traces (a new rule object each, :func:`foldax._closure.jaxpr_key`): its static
        description (the spec less its callables, the avals) and the jaxpr of its
        implementation on its input avals (on this backend), which holds what the callables
        compute. Traces afresh: the eager cache calls it once per rule object."""
        platform = "cpu" if jax.default_backend() == "cpu" else None
        expand = functools.partial(_registration._expand, fold_rule=self, platform=platform)
        avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in self.in_avals_flat]
        return self.static(), jax.make_jaxpr(expand)(*avals)

    # -- hooks ---------------------------------------------------------------------------------

    def prepare_slot_cotangents(self, g_slot):
        return g_slot

    def finish_cotangents(self, args, cts):
        return cts


def _is_accum(a) -> bool:
    return hasattr(a, "accum") and hasattr(a, "freeze")


def _accumulate(accums, cts):
    if cts is not None:
        _accumulate_flat(accums, [c for part in cts for c in part])


def _accumulate_flat(accums, flat):
    for acc, ct in zip(accums, flat, strict=True):
        if ct is not None and _is_accum(acc):
            acc.accum(ct)


def _parent_cotangent(parent, slot_cts):
    """The parent's output cotangents from its tangent fold's: that fold's slot outputs are
    the parent's float slot outputs."""
    it = iter(slot_cts)
    zero = lambda a: Zero(a.to_tangent_aval())  # noqa: E731
    slot = tuple(next(it) if _is_float(a) else zero(a) for a in parent.out_aval[0])
    return (slot, *(tuple(map(zero, part)) for part in parent.out_aval[1:]))


def _parts(flat, nz, nc, ns):
    """The flagged leaves of ``consts + slots + rows``, split back into the three."""
    return _unflag(_pick(flat, nz), nz, nc, ns)


#: The fields of a :class:`Spec` that hold callables (or, ``origin``, the rule of another
#: trace): a fold's structure holds what they compute instead (:meth:`_Rules.structure`).
_CALLABLES = frozenset({"body", "pair_mask", "block_live", "origin", "lanes_body"})


def _args(arrays, consts, slots, rows):
    return (tuple(arrays), tuple(consts), tuple(slots), tuple(rows))


class Fold(_Rules):
    """One streamed fold (see the module docstring): ``Fold(spec, avals)(arrays, consts, slots,
    rows)``, ``avals`` the four tuples' avals."""

    def __init__(self, spec: Spec, avals):
        self.in_avals = avals
        self.out_aval = _typed_out_avals(spec, avals)
        self.params = dict(spec=spec)
        super().__init__()

    def expand(self, *args, platform=None):
        """The fold's implementation, lowered for ``platform`` (``"cpu"``, ...)."""
        spec, args = self.spec, jax.tree.map(jnp.asarray, args)
        if self.kernel_serves(platform):
            return tpu_kernels.lower(
                spec, self.in_avals, self.out_aval, _finish_states(spec), args, platform=platform
            )
        row_bytes = functools.partial(unit_bytes, spec, self.in_avals)
        if _direct.applies(spec.direct, spec, platform, row_bytes):
            if spec.direct == "whole":
                return _run(_direct.whole(spec), spec.plan.n, self.out_aval, *args)
            if spec.direct in _direct.RUNS:
                return _runs.lower(spec, self.out_aval, self._walk, *args)
            return _direct.lower(spec.direct, self.out_aval, spec.plan, *args, platform=platform)
        return self._walk(*args)

    def kernel_serves(self, platform) -> bool:
        """Whether an accelerator kernel (:mod:`foldax._kernels`) computes this fold."""
        key = ("_kernel_serves", platform)
        if tpu_kernels.refused():  # its kernel failed to lower: lowered again by the loop
            return False
        if key not in self.__dict__:  # (static checks: cheap)
            self.__dict__[key] = tpu_kernels.serves(
                self.spec, self.in_avals, self.out_aval, platform, _finish_states(self.spec)
            )
        return self.__dict__[key]

    def _walk(self, *args):
        """The fold as the engine's loop walks it."""
        spec, avals = self.spec, self.in_avals
        whole = whole_rows(spec, avals)  # (then the step's size is known: no probe of it)
        units = 0 if whole else plan_units(spec, avals)
        return _run(spec, units, self.out_aval, *args, whole=whole)

    def scaled(self, k):
        return Fold(self.spec.replace(scale=self.spec.scale * k), self.in_avals)

    def static(self):
        """The spec's hashable description (its callables left out: :meth:`structure`) and the
        input avals."""
        fields = (f.name for f in dataclasses.fields(self.spec) if f.name not in _CALLABLES)
        return ("Fold", tuple((k, getattr(self.spec, k)) for k in fields), self.in_avals)

    @property
    def derived(self):
        """Whether this fold is the tangent fold of another (transposed by that one's rules)."""
        return self.spec.origin is not None

    def for_derivatives(self):
        """The fold a differentiated call computes: this one, or where the monoid asks for it
        (``Monoid.for_derivatives``: outputs beginning with this fold's, and more that the
        derivative rules read) the same fold with that monoid. Direct folds reduce the rows
        themselves, never a recomputed value, and keep theirs."""
        form = getattr(self.spec.monoid, "for_derivatives", None)
        if form is None or self.spec.direct is not None:
            return self
        return Fold(self.spec.replace(monoid=form), self.in_avals)

    def num_info(self):
        if self.spec.monoid is None:
            return 0
        return len(jax.eval_shape(lambda o: tuple(self.spec.monoid.info(o)), self.out_aval[0]))

    def info(self, outs):
        return () if self.spec.monoid is None else tuple(self.spec.monoid.info(outs[0]))

    def derive(self, kind, shape):
        spec = self.spec
        if kind == "jvp":
            body = _jvp_body(spec, shape)
            psum = spec.monoid is not None or spec.slot_psum
        else:
            body, psum = _vjp_body(spec, shape, self.out_aval), False
        origin = (self, shape) if kind == "jvp" else None
        direct = _direct.derived(spec.direct, kind, shape)
        narrow = spec.out_dtypes if kind == "jvp" else _cotangent_dtypes(self.in_avals, shape)
        return _Derived(
            spec.replace(
                plan=spec.plan if kind == "jvp" else spec.plan.for_cotangents(),
                body=body,
                monoid=None,
                fill=0.0,
                slot_psum=psum,
                origin=origin,
                direct=direct,
                out_dtypes=narrow,
                lanes_body=None,
            )
        )

    def prepare_slot_cotangents(self, g_slot):
        if self.spec.monoid is not None and self.spec.axes:
            return [_shard.replicated_cotangent(g, self.spec.axes) for g in g_slot]
        return g_slot

    def finish_cotangents(self, args, cts):
        """On a mesh, the cotangent of an input replicated along the fold's axes is the sum of
        every device's share (where types are tracked; see :mod:`foldax._shard`)."""
        axes = self.spec.axes + self.spec.ring
        if not axes:
            return cts
        return tuple(
            [_shard.reduce_cotangent(c, a, axes) for c, a in zip(part, primals, strict=True)]
            for part, primals in zip(cts, args[1:], strict=True)
        )


def _cotangent_dtypes(avals, shape):
    """A cotangent fold's ``Spec.out_dtypes``: its outputs (the cotangents of the flagged slots,
    consts and rows) in their inputs' dtypes, where any is narrower than the float32 sums the
    fold keeps (:func:`._derived.widened`); else ``None``."""
    _, consts, slots, rows = avals
    nc, ns = len(consts), len(slots)
    flat = [a.dtype for part in (consts, slots, rows) for a in part]
    c, s, r = _unflag(tuple(_pick(flat, shape.nz)), shape.nz, nc, ns)
    dtypes = (tuple(s), tuple(c), tuple(r))
    if all(widened_dtype(d) == d for part in dtypes for d in part):
        return None
    return dtypes


class _Derived:
    """A derived fold, built when it is called (its arguments' avals are known then)."""

    def __init__(self, spec):
        self.spec = spec

    def build(self, avals):
        return Fold(self.spec, avals)

    def __call__(self, *args):
        args = _args(*args)
        return self.build(jax.tree.map(_aval, args))(*args)


class _DerivedBatched(_Derived):
    """A derived fold of a batched fold: the inner fold's derivative, batched like it."""

    def __init__(self, inner, size, dims):
        self.inner, self.size, self.dims = inner, size, dims

    def build(self, avals):
        def unmap(a, d):
            return a if d is None else _shaped(a, a.shape[1:])

        inner = self.inner.build(jax.tree.map(unmap, avals, self.dims, is_leaf=_leaf_none))
        return Batched(inner, self.size, self.dims)


def _leaf_none(x):
    return x is None


class Batched(_Rules):
    """A fold under ``vmap``: the inner fold's implementation ``vmap`` ped, its plan scaled by
    the batch size first (so that a step's working set over the whole batch stays within the
    budget). Its rules are the inner fold's, batched the same way."""

    def __init__(self, inner, size, dims):
        def unmap(a, d):
            return a if d is None else _shaped(a, (size, *a.shape))

        dims = _freeze(dims)
        self.in_avals = jax.tree.map(unmap, inner.in_avals, dims, is_leaf=_leaf_none)
        self.out_aval = jax.tree.map(lambda a: unmap(a, 0), inner.out_aval)
        self.params = dict(inner=inner, size=size, dims=dims)
        super().__init__()

    @property
    def spec(self):
        return self.inner.spec

    def expand(self, *args, platform=None):
        if self.size == 0:  # an empty batch: empty outputs, nothing to plan or run
            return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), self.out_aval)
        flat = self._flat()
        if flat is not None:
            outs = flat.expand(*_flat.merge_args(args, self.dims, self.size), platform=platform)
            return (tuple(_flat.split(o, self.size) for o in outs[0]), (), ())
        if _walks_alone(self.inner, platform):
            return _one_by_one(self.inner, self.size, self.dims, args, platform)
        inner = functools.partial(self.inner.scaled(self.size).expand, platform=platform)
        vmapped = jax.vmap(inner, in_axes=self.dims, out_axes=0, axis_size=self.size)
        return vmapped(*args)

    def _flat(self):
        """This batch as one fold over every element's slots (:mod:`._flat`), or None; only for
        a fold with slot outputs alone (sums over rows, and row outputs, are per element)."""
        if "_flat_fold" not in self.__dict__:
            ok = isinstance(self.inner, Fold) and not (self.out_aval[1] or self.out_aval[2])
            ok = ok and _flat.flattenable(self.inner, self.dims)
            spec, avals = self.inner.spec, self.inner.in_avals
            self._flat_fold = (
                Fold(_flat.flat_spec(spec, self.size), _flat.flat_avals(avals, self.size))
                if ok
                else None
            )
        return self._flat_fold

    def _cotangents(self, args, outs, g, nz, info=None):
        """As :meth:`_Rules._cotangents`; a batch that shares its rows and consts takes the
        cotangent fold of its flattened form (:mod:`._flat`): the rows' and consts' cotangents
        come summed over the batch from one fold."""
        flat = self._flat()
        if flat is None:
            return super()._cotangents(args, outs, g, nz, info)
        merge = lambda x: x if _is_zero(x) else _flat.merge(x, 0, self.size)  # noqa: E731
        g = jax.tree.map(merge, g, is_leaf=_is_zero)
        if info is None:
            info = self.info(outs) if self.num_info() else ()
        info = tuple(merge(x) for x in info)
        cts = flat._cotangents(_flat.merge_args(args, self.dims, self.size), None, g, nz, info)
        if cts is None:
            return None
        consts, slots, rows = cts
        slots = [
            None if c is None else _unmerge(_flat.split(c, self.size), d)
            for c, d in zip(slots, self.dims[2], strict=True)
        ]
        return consts, slots, rows

    def scaled(self, k):
        return Batched(self.inner.scaled(k), self.size, self.dims)

    def static(self):
        return ("Batched", self.size, self.dims, self.inner.static())

    @property
    def derived(self):
        return self.inner.derived

    def for_derivatives(self):
        inner = self.inner.for_derivatives()
        return self if inner is self.inner else Batched(inner, self.size, self.dims)

    def num_info(self):
        return self.inner.num_info()

    def info(self, outs):
        return jax.vmap(self.inner.info)(outs)

    def derive(self, kind, shape):
        arrays_d, consts_d, slots_d, rows_d = self.dims
        nc, ns, _ = self._counts()
        if kind == "jvp":  # a tangent is batched like its primal
            extra_c, extra_s, extra_r = _parts([*consts_d, *slots_d, *rows_d], shape.nz, nc, ns)
        else:  # the outputs, and so their cotangents, are all batched
            no, nt = len(self.out_aval[0]), len(self.out_aval[1])
            extra_s = [0] * sum(shape.gnz[:no])
            extra_c = [0] * sum(shape.gnz[no : no + nt])
            extra_r = [0] * sum(shape.gnz[no + nt :])
        dims = (
            arrays_d,
            (*consts_d, *extra_c),
            (*slots_d, *([0] * shape.ni), *extra_s),
            (*rows_d, *extra_r),
        )
        return _DerivedBatched(self.inner.derive(kind, shape), self.size, _freeze(dims))

    def prepare_slot_cotangents(self, g_slot):
        return self.inner.prepare_slot_cotangents(g_slot)

    def finish_cotangents(self, args, cts):
        """The inner fold's finishing (per batch element), then the cotangents of arguments
        that are not batched here summed over the batch."""
        dims = self.dims[1:]
        cts = jax.vmap(self.inner.finish_cotangents, in_axes=(self.dims, 0))(args, cts)
        return tuple(
            [
                c if c is None or d is not None else jnp.sum(c, axis=0)
                for c, d in zip(p, pd, strict=True)
            ]
            for p, pd in zip(cts, dims, strict=True)
        )


def _unmerge(ct, d):
    """A slot argument's cotangent ``(B, M, ...)``: itself where the argument is batched, its sum
    over the batch where it is shared."""
    return ct if d is not None else jnp.sum(ct, axis=0)


#: Full steps an element's own fold must take for a batch to be walked one element at a time.
ALONE_STEPS = 64


def _walks_alone(inner, platform=None) -> bool:
    """Whether a batch of ``inner`` folds runs as a loop over its elements, each with the whole
    budget, rather than as one fold of batched tiles: a dense fold whose every element already
    takes many full steps (then batching makes each tile smaller and slower, about 25% on
    XLA:CPU, and saves no step)."""
    spec = getattr(inner, "spec", None)
    if not isinstance(inner, Fold) or spec.plan.kind != "dense" or spec.axes or spec.ring:
        return False
    if inner.kernel_serves(platform):  # a kernel's batch is another axis of its grid
        return False
    if spec.direct is not None or whole_rows(spec, inner.in_avals):
        return False
    units = plan_units(spec, inner.in_avals)
    return units > 0 and spec.plan.num_slots * spec.plan.n >= ALONE_STEPS * units


def _one_by_one(inner, size, dims, args, platform):
    """``inner``'s implementation over the batch of ``args`` (batched along axis 0 where
    ``dims`` says so), one element after another."""
    flat, tree = jax.tree.flatten(args)
    flags = jax.tree.flatten(dims, is_leaf=_leaf_none)[0]
    batched = [a for a, d in zip(flat, flags, strict=True) if d is not None]

    def one(some):
        it = iter(some)
        whole = [next(it) if d is not None else a for a, d in zip(flat, flags, strict=True)]
        return inner.expand(*jax.tree.unflatten(tree, whole), platform=platform)

    return jax.lax.map(one, batched)


def _freeze(dims):
    return tuple(tuple(p) for p in dims)


__all__ = ["Batched", "Fold"]


def _finish_states(spec):
    """``finish(state, row_aval)``: a monoid fold's outputs from its states, as the loop makes
    them (for a kernel that folds the same states)."""
    return functools.partial(_finish, spec)
