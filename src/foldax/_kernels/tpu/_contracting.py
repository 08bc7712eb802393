"""The dense fold as Pallas TPU kernels: the forward fold and every fold derived from it.

A dense pairwise fold reduces ``kernel(x[i], y[j])`` over ``j`` for every ``i``. A *pass* of
it walks a grid ``(outer, k)``: the outer axis names a block of ``x`` (``bi`` rows of every
slot array) or of ``y`` (``bj`` rows), the inner one the blocks of the other side it meets
(every block, or under a mask the ones the mask keeps a pair of). Each step loads one block of
each, makes the tile of pair values with the fold's own body (a kernel with a dot product is
one ``(bi, D) x (bj, D)`` product on the MXU, its scalar function on the VPU) and folds it into
an accumulator kept in VMEM across the inner steps; the last step writes the outer block's
outputs. Nothing of size ``M x N`` exists, and nothing per step reaches HBM.

* A monoid fold (the forward pass: attention, log-sum-exp, the LM loss, extrema) is one pass
  over the blocks of ``x``: its state is the monoid's, updated with the same ``reduce`` /
  ``combine`` / ``outputs`` that the XLA loop calls.
* An additive fold (a tangent or cotangent fold, :mod:`foldax._engine._derived`) is two: its
  sums per slot (``dq``) in a pass over the blocks of ``x``, its sums per row (``dk``, ``dv``)
  in a pass over the blocks of ``y``; each pass computes only what its outputs need.

Rows past the end of ``x`` or ``y`` are padded with copies of the last row and masked by
index. A mask's live blocks come from the fold's ``block_live`` as a table
(:mod:`._table`) read by the index maps through scalar prefetch: a block the mask removes is
never loaded, and its step does nothing.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ..._engine._derived import widened_dtype
from ..._engine._probe import peak_bytes
from . import _layout, _precision, _table

#: dtypes a TPU kernel reads; interpret mode (on a CPU) takes 64-bit ones too, for references
_TPU_DTYPES = frozenset(map(jnp.dtype, ("float32", "bfloat16", "float16", "int32", "uint32")))
_WIDE_DTYPES = frozenset(map(jnp.dtype, ("float64", "int64")))
#: the most the arrays read whole in every step (the kernel's constants) may take in VMEM
_MAX_CONST_BYTES = 2 * 2**20
#: the most entries the table of live blocks may have (it lives in SMEM)
_MAX_TABLE = 2**16
#: What a tile's body may keep live at once in VMEM (see :func:`_body_bytes`).
_BODY_BUDGET = 40 * 2**20
#: ... for a fold with keyed consts, whose kernel a vmap runs in a loop (one table per batch
#: element), where the default scoped VMEM (16 MiB) holds
_KEYED_BODY_BUDGET = 6 * 2**20
#: VMEM a step's blocks and tiles are sized to (of v5e's 128 MiB)
_VMEM_BUDGET = 48 * 2**20


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Rows of ``x`` (``rows``) and of ``y`` (``cols``) per grid step: multiples of 128 (the
    TPU's lanes, so that one-dimensional arrays block legally too)."""

    rows: int = 1024
    cols: int = 1024

    def __post_init__(self):
        for name in ("rows", "cols"):
            size = getattr(self, name)
            if size <= 0 or size % _layout.LANES:
                raise ValueError(f"BlockSizes: {name}={size} must be a positive multiple of 128.")

    def fit(self, m, n, x_row=0, y_row=0) -> BlockSizes:
        """These sizes, shrunk to ``m`` x ``n`` pairs rounded up to whole lanes, then halved
        (the longer first) until a step fits :data:`_VMEM_BUDGET`: ``x_row`` / ``y_row``
        bytes per row of each side's blocks (double-buffered), eight float32 tiles."""
        rows, cols = min(self.rows, _layout.lanes_up(m)), min(self.cols, _layout.lanes_up(n))
        while _step_bytes(rows, cols, x_row, y_row) > _VMEM_BUDGET and max(rows, cols) > 128:
            rows, cols = (rows // 2, cols) if rows >= cols and rows > 128 else (rows, cols // 2)
        return BlockSizes(max(rows, 128), max(cols, 128))

    def grid(self, m, n):
        return (-(-m // self.rows), -(-n // self.cols))


def _step_bytes(rows, cols, x_row, y_row):
    return 2 * (rows * x_row + cols * y_row) + 8 * 4 * rows * cols


#: the block sizes the kernels take (a module attribute, so that a benchmark can try others)
DEFAULT_BLOCKS = BlockSizes()


def _dtype_ok(aval, interpret) -> bool:
    dtype = jnp.dtype(aval.dtype)
    return dtype in _TPU_DTYPES or (interpret and dtype in _WIDE_DTYPES)


def serves(spec, in_avals, out_aval, platform, finish, blocks=None) -> bool:
    """Whether these kernels compute the fold ``spec`` on ``platform``: a dense pairwise fold
    (a monoid one with a monoid the kernel folds, ``Monoid.pallas``, or an additive one without
    sums over every pair), on one device, unmasked or with a mask whose live blocks can be
    listed, of arrays Mosaic reads (32- and 16-bit types), with small constants (the caller,
    :func:`foldax._kernels.tpu.serves`, has checked that ``spec.implementation`` asks for a
    kernel on ``platform``). A kernel that then fails to lower leaves the fold to the XLA loop
    (the primitive's TPU lowering rule)."""
    plan, mon = spec.plan, spec.monoid
    if plan.kind != "dense" or (mon is not None and not mon.pallas):
        return False
    # what has not yet been compiled on a TPU is taken only where the kernels are asked for
    asked = platform != "tpu" or spec.implementation == "pallas"
    if mon is not None and mon.pallas == "interpreted" and not asked:
        return False
    if spec.axes or spec.ring or spec.direct is not None or spec.slot_psum:
        return False
    arrays, consts, slots, rows = in_avals
    if arrays or out_aval[1] or (mon is not None and out_aval[2]):
        return False
    geo = _Geometry.of(spec, in_avals, blocks)
    if spec.pair_mask is not None and (spec.block_live is None or geo.gi * geo.gj > _MAX_TABLE):
        return False
    if (
        mon is not None
        and mon.pallas == "lanes"
        and not asked
        and not _in_lanes(spec, geo, in_avals)
    ):
        return False  # (its state per row is slower on a TPU than the XLA loop)
    if blocks is None and geo.body > _BODY_BUDGET:
        return False  # (a body that meets many features pair by pair: not even 128 x 128 fits)
    interpret = platform != "tpu"
    # keyed consts are read as 32-bit lanes, booleans too (under vmap their table differs per
    # batch element: Pallas runs the kernel in a loop, in the default scoped VMEM, which the
    # blocks are sized for: ``_KEYED_BODY_BUDGET``)
    keyed = [a for c, a in enumerate(consts) if c in geo.keyed]
    if not all(_dtype_ok(a, interpret) or a.dtype == jnp.bool_ for a in keyed):
        return False
    whole = [a for c, a in enumerate(consts) if c not in geo.keyed]
    if not all(_dtype_ok(a, interpret) for a in (*whole, *slots, *rows, *out_aval[2])):
        return False
    if any(a.ndim not in (1, 2) for a in (*slots, *rows)) or any(a.ndim > 2 for a in consts):
        return False
    sizes = (geo.m, geo.n)
    if any(consts[c].shape != (sizes[side],) for c, side in geo.keyed.items()):
        return False
    return sum(a.size * a.dtype.itemsize for a in whole) <= _MAX_CONST_BYTES


@dataclasses.dataclass(frozen=True)
class _Geometry:
    """A fold's grid: ``m`` slots by ``n`` rows in blocks ``b``, ``gi`` x ``gj`` of them; the
    rows' axis, whether the slots' arrays are walked with their slots last too (the fold's
    ``lanes_body``), the side (0: slots, 1: rows) of each keyed const (``Spec.keyed``), and
    the VMEM bytes the body keeps live at once for a tile of ``b`` (:func:`_body_bytes`)."""

    m: int
    n: int
    b: BlockSizes
    gi: int
    gj: int
    axis: int
    lanes: bool
    keyed: dict
    body: int = 0

    def block(self, side):
        """Rows per block of the slots' side (0) or of the rows' (1)."""
        return (self.b.rows, self.b.cols)[side]

    @classmethod
    def of(cls, spec, in_avals, blocks):
        m, n = spec.plan.num_slots, spec.plan.n
        _, _, slots, rows = in_avals
        axis = spec.plan.row_axis
        per_row = lambda arrs, ax: sum(a.size // a.shape[ax] * a.dtype.itemsize for a in arrs)  # noqa: E731
        start, most = blocks or DEFAULT_BLOCKS, getattr(spec.monoid, "kernel_tile", None)
        if most is not None and blocks is None:  # (a kernel whose code grows with its tile)
            start = BlockSizes(min(start.rows, most[0]), min(start.cols, most[1]))
        b = start.fit(m, n, per_row(slots, 0), per_row(rows, axis))
        gi, gj = b.grid(m, n)
        lanes = spec.lanes_body is not None and axis == -1 and spec.monoid is not None
        geo = cls(m, n, b, gi, gj, axis, lanes, dict(spec.keyed))
        geo = dataclasses.replace(geo, body=geo.tile_bytes(spec, in_avals))
        return geo if blocks is not None else geo.within_vmem(spec, in_avals)

    def within_vmem(self, spec, in_avals):
        """These blocks, halved (the longer first) while the tile's body would keep more than
        :data:`_BODY_BUDGET` live in VMEM (one that meets its features pair by pair makes
        ``(bi, F, bj)`` values, padded to 8 sublanes)."""
        pair = self.body / (self.b.rows * self.b.cols)
        rows, cols = self.b.rows, self.b.cols
        budget = _KEYED_BODY_BUDGET if self.keyed else _BODY_BUDGET
        while pair * rows * cols > budget and max(rows, cols) > 128:
            rows, cols = (rows // 2, cols) if rows >= cols and rows > 128 else (rows, cols // 2)
        if (rows, cols) == (self.b.rows, self.b.cols):
            return self
        b = BlockSizes(rows, cols)
        gi, gj = b.grid(self.m, self.n)
        geo = dataclasses.replace(self, b=b, gi=gi, gj=gj)
        return dataclasses.replace(geo, body=geo.tile_bytes(spec, in_avals))

    def step_avals(self, in_avals):
        """The avals of the body's arguments at one step (:func:`_tile_avals`)."""
        _, consts, slots, rows = in_avals
        if self.lanes:  # (as lower passes them: slots last)
            slots = [jax.ShapeDtypeStruct((*a.shape[1:], a.shape[0]), a.dtype) for a in slots]
        return _tile_avals(self, consts, slots, rows)

    def tile_bytes(self, spec, in_avals) -> int:
        """The VMEM bytes the fold's body keeps live at once for one tile."""
        try:
            return _body_bytes(spec, self, self.step_avals(in_avals))
        except Exception:  # (a body the kernel cannot take: its lowering fails and is refused)
            return 0


def lower(spec, in_avals, out_aval, finish, args, *, platform, blocks=None):
    """The fold's outputs ``(slot outputs, (), row outputs)``, computed by the kernels.

    ``finish(state, row_aval)``: a monoid fold's outputs of a block's states (the loop's own,
    so that both lowerings cast results alike); ``args``: the fold's four tuples of arrays."""
    geo = _Geometry.of(spec, in_avals, blocks)
    _, consts, slots, rows = args
    slots = tuple(_layout.pad_rows(a, geo.gi * geo.b.rows) for a in slots)
    if geo.lanes:  # the slots' arrays with their slots last too, as lanes_body takes them
        slots = tuple(jnp.moveaxis(a, 0, -1) for a in slots)
    rows = tuple(_layout.pad_rows(a, geo.gj * geo.b.cols, geo.axis) for a in rows)
    live = (
        None if spec.pair_mask is None else _table.live_blocks(spec, consts, geo.b, geo.gi, geo.gj)
    )
    totals = (geo.gi * geo.b.rows, geo.gj * geo.b.cols)
    consts = tuple(
        _layout.pad_rows(a, totals[geo.keyed[c]]) if c in geo.keyed else a
        for c, a in enumerate(consts)
    )
    run = functools.partial(_pass, spec, geo, (consts, slots, rows), interpret=platform != "tpu")
    if spec.monoid is not None:
        step = _monoid_step(spec, geo, finish, out_aval[0], platform)
        return (run("slots", live, step), (), ())
    slot_outs = run("slots", live, _sum_step(spec, geo, 0, out_aval[0])) if out_aval[0] else ()
    row_outs = ()
    if out_aval[2]:
        row_outs = run(
            "rows", None if live is None else live.T, _sum_step(spec, geo, 2, out_aval[2])
        )
    return (slot_outs, (), row_outs)


def _body_bytes(spec, geo, avals) -> int:
    """The VMEM bytes the fold's body keeps live at once for a tile of ``avals``: each value
    from its equation to its last use, laid out as Mosaic lays it out, none fused (a kernel
    holds each step's value whole)."""
    body = spec.lanes_body if geo.lanes else spec.body
    jaxpr = jax.make_jaxpr(body)(*avals).jaxpr
    return peak_bytes(jaxpr, _layout.vmem_bytes, frozenset())


@dataclasses.dataclass(frozen=True)
class _Step:
    """What a pass accumulates: ``state`` avals (per block of its outer side), ``init()``,
    ``update(consts, xs, ys, mask, cols, index, state) -> state`` (one tile), ``finish(state)
    -> outputs`` and the outputs' avals (whole arrays)."""

    state: tuple
    init: object
    update: object
    finish: object
    outs: tuple


def _tile_avals(geo, consts, slots, rows):
    """The avals of one step's arguments to the body: consts, a block of slots, one of rows,
    the mask, the rows' indices."""
    b = geo.b
    slot_shape = lambda a: (*a.shape[:-1], b.rows) if geo.lanes else (b.rows, *a.shape[1:])  # noqa: E731
    row_shape = lambda a: (*a.shape[:-1], b.cols) if geo.axis == -1 else (b.cols, *a.shape[1:])  # noqa: E731
    sds = jax.ShapeDtypeStruct
    return (
        tuple(
            sds((geo.block(geo.keyed[c]),) if c in geo.keyed else a.shape, a.dtype)
            for c, a in enumerate(consts)
        ),
        tuple(sds(slot_shape(a), a.dtype) for a in slots),
        tuple(sds(row_shape(a), a.dtype) for a in rows),
        sds((b.rows, b.cols), jnp.bool_),
        sds((b.cols,), jnp.int32),
    )


def _monoid_step(spec, geo, finish, out_avals, platform):
    """A monoid fold's states per row of a block, or per row and lane (:func:`_lane_form`)."""
    mon, body = spec.monoid, spec.lanes_body if geo.lanes else spec.body
    with_index = getattr(mon, "needs_index", False)
    lanes = lambda row_aval: _lane_form(spec, geo, row_aval, platform)  # noqa: E731

    def update(c, xs, ys, mask, cols, index, state):
        vals = body(c, xs, ys, mask, index)[0]
        form = lanes(mon.value_aval(vals))
        if form is not None:
            return form.add(state, vals, mask, index)
        args = (index,) if with_index else ()
        cols = None if spec.pair_mask is not None else cols
        return mon.combine_in_kernel(state, mon.reduce_in_kernel(vals, mask, cols, *args))

    def shaped(avals):
        row_aval = mon.value_aval(jax.eval_shape(body, *avals)[0])
        form = lanes(row_aval)
        if form is None:
            init = lambda: mon.init_aval(geo.b.rows, row_aval)  # noqa: E731
            return jax.eval_shape(init), init, lambda st: finish(st, row_aval)
        init = lambda: form.init(geo.b.rows, row_aval)  # noqa: E731
        return jax.eval_shape(init), init, lambda st: finish(form.finish(st), row_aval)

    return update, shaped, out_avals


def _in_lanes(spec, geo, in_avals) -> bool:
    """Whether the fold's kernel on a TPU keeps its state per lane (:func:`_lane_form`)."""
    body = spec.lanes_body if geo.lanes else spec.body
    try:
        vals = jax.eval_shape(body, *geo.step_avals(in_avals))[0]
    except Exception:  # (a body the kernel cannot take)
        return False
    return _lane_form(spec, geo, spec.monoid.value_aval(vals), "tpu") is not None


def _lane_form(spec, geo, row_aval, platform):
    """The monoid's lane-dense state (:mod:`foldax._reductions._lanes`) where it has one, for
    one scalar value per pair and blocks of whole lanes (on a TPU: 32-bit values, and where
    the kernels are asked for while it is not yet compiled there); else ``None``."""
    when = getattr(spec.monoid, "lanes_in_kernel", None)
    if when is None or not isinstance(row_aval, jax.ShapeDtypeStruct) or row_aval.shape:
        return None
    if geo.b.cols % _layout.LANES:
        return None
    if platform == "tpu" and (
        jnp.dtype(row_aval.dtype).itemsize != 4
        or (when == "interpreted" and spec.implementation != "pallas")
    ):
        return None
    return spec.monoid.lane_form(row_aval)


def _sum_step(spec, geo, part, out_avals):
    """An additive fold's sums per slot (``part`` 0) or per row (2), accumulated widened."""
    body = spec.body

    def update(c, xs, ys, mask, cols, index, state):
        sums = body(c, xs, ys, mask, index)[part]
        return tuple(s + v.astype(s.dtype) for s, v in zip(state, sums, strict=True))

    def shaped(avals):
        sums = jax.eval_shape(body, *avals)[part]
        state = tuple(jax.ShapeDtypeStruct(a.shape, widened_dtype(a.dtype)) for a in sums)
        init = lambda: tuple(jnp.zeros(a.shape, a.dtype) for a in state)  # noqa: E731
        cast = lambda st: tuple(s.astype(o.dtype) for s, o in zip(st, out_avals, strict=True))  # noqa: E731
        return state, init, cast

    return update, shaped, out_avals


def _pass(spec, geo, arrays, outer, live, step, *, interpret):
    """One pass: for each block of the ``outer`` side (``"slots"``: of ``x``; ``"rows"``: of
    ``y``), ``step`` over the blocks of the other side it meets (``live``: ``(outer, inner)``
    table, or ``None``: all); returns ``step``'s outputs, whole."""
    consts, slots, rows = arrays
    update, shaped, out_avals = step
    avals = _tile_avals(geo, consts, slots, rows)
    state, init, finish = shaped(avals)
    cols_aval = jax.ShapeDtypeStruct((geo.b.cols, 1), jnp.bool_)
    update = _precision.half_products_at_default(update, *avals[:4], cols_aval, avals[4], state)
    by_slots = outer == "slots"
    g_out, g_in = (geo.gi, geo.gj) if by_slots else (geo.gj, geo.gi)
    prefetch = () if live is None else _table.visits(live)
    inner = (lambda o, k: k) if live is None else (lambda o, k, counts, order: order[o * g_in + k])
    own = lambda o, k, *t: o  # noqa: E731
    slot_at, row_at = (own, inner) if by_slots else (inner, own)
    b = geo.b
    slot_spec = lambda a: (  # noqa: E731
        _layout.row_block(a, b.rows, -1, slot_at)
        if geo.lanes or a.shape[0] == 1
        else _layout.slot_block(a, b.rows, slot_at)
    )
    if by_slots:
        outs = [_slots_aval(a, geo) for a in out_avals]
        out_specs = [
            slot_spec(o) if o.shape[0] == 1 else _layout.slot_block(o, b.rows, own) for o in outs
        ]
    else:
        outs = [_rows_aval(a, geo) for a in out_avals]
        out_specs = [_layout.row_block(o, b.cols, geo.axis, own) for o in outs]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(prefetch),
        grid=(g_out, g_in),
        in_specs=[
            *(_const_spec(geo, c, a, (slot_at, row_at)) for c, a in enumerate(consts)),
            *(slot_spec(_layout.slot_lanes(a)) for a in slots),
            *(_layout.row_block(_layout.lanes(a), b.cols, geo.axis, row_at) for a in rows),
        ],
        out_specs=out_specs,
        scratch_shapes=[
            pltpu.VMEM(_layout.column_shape(a.shape), a.dtype) for a in jax.tree.leaves(state)
        ],
    )
    kernel = _kernel(spec, geo, avals, state, (init, update, finish), by_slots, live is not None)
    results = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=outs,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary"),
            vmem_limit_bytes=_vmem_limit(geo, avals),
        ),
        interpret=interpret,
        name=f"foldax_{_identifier(spec.name)}_{outer}",
    )(
        *prefetch,
        *(_layout.keyed(a) if c in geo.keyed else _layout.const(a) for c, a in enumerate(consts)),
        *map(_layout.slot_lanes, slots),
        *map(_layout.lanes, rows),
    )
    return tuple(_unpad(r, a, geo, by_slots) for r, a in zip(results, out_avals, strict=True))


def _const_spec(geo, c, a, at):
    """A const's block: a keyed one's block of slots or rows (see ``Spec.keyed``), as lanes;
    any other whole."""
    side = geo.keyed.get(c)
    if side is None:
        return _layout.whole(_layout.const(a))
    return _layout.row_block(_layout.keyed(a), geo.block(side), -1, at[side])


def _slots_aval(a, geo):
    """The padded slot outputs of ``a``, as the kernel keeps them (one-dimensional: lanes)."""
    total = geo.gi * geo.b.rows
    shape = (1, total) if _layout.narrow(a.shape) else (total, *a.shape[1:])
    return jax.ShapeDtypeStruct(shape, a.dtype)


def _rows_aval(a, geo):
    """The padded row outputs of ``a`` (rows on the fold's row axis), as the kernel keeps them."""
    total = geo.gj * geo.b.cols
    shape = (*a.shape[:-1], total) if geo.axis == -1 else (total, *a.shape[1:])
    return jax.ShapeDtypeStruct(shape if len(shape) > 1 else (1, total), a.dtype)


def _unpad(r, a, geo, by_slots):
    if by_slots:
        return r.reshape(geo.gi * geo.b.rows, *a.shape[1:])[: geo.m]
    if geo.axis == -1 or a.ndim == 1:
        return r.reshape(*a.shape[:-1], -1)[..., : geo.n]
    return r[: geo.n]


def _kernel(spec, geo, avals, state_avals, fns, by_slots, masked):
    """The body of one grid step ``(o, k)``: the live table (under a mask), refs of the consts,
    the slots' block, the rows' block, the outputs' block, then the accumulators' scratch."""
    init, update, finish = fns
    b = geo.b
    consts = tuple(
        _layout.keyed_reader(a, geo.keyed[c]) if c in geo.keyed else _layout.const_reader(a)
        for c, a in enumerate(avals[0])
    )
    slots, rows = (tuple(map(_layout.reader_of, part)) for part in avals[1:3])
    if not geo.lanes:  # one-dimensional slot arrays come as lanes, wanted as a column
        slots = tuple(
            (lambda r, a=a: _layout.to_column(r[...]).reshape(a.shape))
            if _layout.narrow(a.shape)
            else f
            for f, a in zip(slots, avals[1], strict=True)
        )
    nc, ns, nr = len(consts), len(slots), len(rows)
    state_leaves, state_tree = jax.tree.flatten(state_avals)
    state_readers = tuple(_layout.reader(a.shape) for a in state_leaves)
    g_in = geo.gj if by_slots else geo.gi

    def kernel(*refs):
        table, refs = (refs[:2], refs[2:]) if masked else ((), refs)
        c_refs, x_refs = refs[:nc], refs[nc : nc + ns]
        y_refs, refs = refs[nc + ns : nc + ns + nr], refs[nc + ns + nr :]
        num_outs = len(refs) - len(state_leaves)
        o_refs, s_refs = refs[:num_outs], refs[num_outs:]
        o, k = pl.program_id(0), pl.program_id(1)
        inner = table[1][o * g_in + k] if masked else k
        i, j = (o, inner) if by_slots else (inner, o)

        def state():
            leaves = [f(r) for f, r in zip(state_readers, s_refs, strict=True)]
            return jax.tree.unflatten(state_tree, leaves)

        def store(refs, values):
            for r, v in zip(refs, jax.tree.leaves(values), strict=True):
                _layout.write(r, v)

        @pl.when(k == 0)
        def _():
            store(s_refs, init())

        def step():
            read = lambda fs, rs: tuple(f(r) for f, r in zip(fs, rs, strict=True))  # noqa: E731
            c = read(consts, c_refs)
            mask, cols = _tile_mask(spec, geo, c, i, j, by_slots)
            index = j * b.cols + lax.broadcasted_iota(jnp.int32, (b.cols,), 0)
            xs, ys = read(slots, x_refs), read(rows, y_refs)
            store(s_refs, update(c, xs, ys, mask, cols, index, state()))

        if masked:
            pl.when(k < table[0][o])(step)
        else:
            step()

        @pl.when(k == pl.num_programs(1) - 1)
        def _():
            outs = jax.tree.leaves(finish(state()))
            if by_slots:  # a one-dimensional result per slot is written as lanes
                outs = [
                    _layout.to_lanes(v.reshape(-1)) if _layout.narrow(v.shape) else v for v in outs
                ]
            store(o_refs, outs)

    return kernel


def _tile_mask(spec, geo, consts, i, j, by_slots):
    """``(mask (bi, bj), cols (bj, 1))``: the pairs of tile ``(i, j)`` that take part (rows of
    ``x`` beyond its end too, in a pass that sums over them), and which of its columns are rows
    of ``y``."""
    b, m, n = geo.b, geo.m, geo.n
    whole_rows = by_slots or m % b.rows == 0
    if spec.pair_mask is None and n % b.cols == 0 and whole_rows:  # masks the compiler drops
        return jnp.ones((b.rows, b.cols), jnp.bool_), jnp.ones((b.cols, 1), jnp.bool_)
    first = j * b.cols
    cols = first + lax.broadcasted_iota(jnp.int32, (b.cols, 1), 0) < n
    jj = first + lax.broadcasted_iota(jnp.int32, (1, b.cols), 1)
    ii = i * b.rows + lax.broadcasted_iota(jnp.int32, (b.rows, 1), 0)
    mask = jnp.broadcast_to(jj < n, (b.rows, b.cols))
    if not whole_rows:
        mask = mask & (ii < m)
    if spec.pair_mask is not None:
        take = {"take": _layout.take_block} if spec.keyed else {}
        mask = mask & jnp.broadcast_to(spec.pair_mask(consts, ii, jj, **take), mask.shape)
    return mask, cols


def _vmem_limit(geo, avals):
    """Scoped VMEM for one step: its blocks double-buffered (padded as Mosaic lays them out),
    a few float32 tiles, and what the body keeps live (``geo.body``)."""
    rows = sum(_layout.vmem_bytes(a) for a in avals[1])
    cols = sum(_layout.vmem_bytes(a) for a in avals[2])
    need = _step_bytes(geo.b.rows, geo.b.cols, rows / geo.b.rows, cols / geo.b.cols)
    return int(min(100 * 2**20, max(32 * 2**20, 2 * need, need + geo.body)))


@functools.cache
def _identifier(name):
    return "".join(ch if ch.isalnum() else "_" for ch in name) or "fold"


__all__ = ["BlockSizes", "lower", "serves"]
