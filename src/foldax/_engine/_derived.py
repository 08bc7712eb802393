"""Derived bodies: every derivative of a fold is an additive fold, whose body is ``jax.jvp`` or
``jax.vjp`` of its parent's."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .. import _shard
from .._jax import depends_on
from ._spec import Spec, _index


def _pick(leaves, flags):
    return [x for x, f in zip(leaves, flags, strict=True) if f]


def _fill(leaves, flags, some):
    it = iter(some)
    return [next(it) if f else x for x, f in zip(leaves, flags, strict=True)]


def _partial(f, primals, flags):
    """``f`` of the flagged leaves of ``primals`` (a tuple of three tuples), the others fixed."""
    flat, tree = jax.tree.flatten(primals)

    def g(*some):
        return f(*jax.tree.unflatten(tree, _fill(flat, flags, some)))

    return g, _pick(flat, flags)


def _rows_own(kind, mask):
    """Which rows of a step's chunk it owns, from its ``(G, T)`` mask."""
    return jnp.any(mask, axis=0) if kind == "dense" else mask.reshape(-1)


def _mask_rows(row_axis, own, a):
    """``a`` (rows on ``row_axis``) zeroed on the rows a step does not own."""
    shape = (-1,) + (1,) * (a.ndim - 1) if row_axis == 0 else (-1,)
    return jnp.where(own.reshape(shape), a, jnp.zeros((), a.dtype))


@dataclasses.dataclass(frozen=True)
class Shape:
    """How a derived fold's arguments extend its parent's: parent counts and flags."""

    nc: int  # consts
    ns: int  # slots
    ni: int  # info (per-slot arrays from the parent's outputs)
    nr: int  # rows
    nz: tuple  # flags over the parent's consts + slots + rows: differentiated
    gnz: tuple = ()  # flags over the parent's outputs (slot, tot, row): cotangent given

    def split(self, consts, slots, rows):
        c, extra_c = consts[: self.nc], consts[self.nc :]
        s, info, extra_s = (
            slots[: self.ns],
            slots[self.ns : self.ns + self.ni],
            slots[self.ns + self.ni :],
        )
        r, extra_r = rows[: self.nr], rows[self.nr :]
        return (tuple(c), tuple(s), tuple(r)), info, (extra_c, extra_s, extra_r)


def _jvp_body(parent: Spec, shape: Shape):
    """The tangent fold's body: ``jax.jvp`` of the parent's, turned into output tangents."""

    def body(consts, slots, rows, mask, index):
        primals, info, tangents = shape.split(consts, slots, rows)
        f, nz_primals = _partial(
            lambda c, s, r: parent.body(c, s, r, mask, index), primals, shape.nz
        )
        tangents = _shard.like(tuple(t for part in tangents for t in part), tuple(nz_primals))
        out, dout = jax.jvp(f, tuple(nz_primals), tangents)
        if parent.monoid is None:
            return dout
        ts = _monoid_tangent(parent, f, nz_primals, out[0], dout[0], (mask, info, index))
        return tuple(t for t in ts if t is not None), (), ()

    return body


def _monoid_tangent(parent: Spec, f, primals, vals, dvals, where):
    """The monoid's tangent of a tile's values ``vals`` from their tangents ``dvals``, where
    every leaf that does not depend on the differentiated inputs is ``None`` (a symbolic
    zero: the monoid leaves its terms out); all of them: zeros, the monoid not called.

    ``jax.jvp`` gives such a leaf as a broadcast zero. A matrix product of a tile with it
    (softmax's ``p @ dvalues`` when only the logits vary) is a contraction with a broadcast
    constant, which XLA:CPU's YNNPACK fusions compute from memory they never wrote when a
    reduction shares the fusion (2,048 x 64 tiles and up, jax 0.10.2 to 0.12): NaN or 1e300
    in every row, varying from call to call. Leaving the term out is exact and cheaper."""
    mask, info, index = where
    index = _index(parent, index)
    tangent = lambda v, d: parent.monoid.tangent(v, d, mask, info, *index)  # noqa: E731
    live = depends_on(lambda *p: jax.tree.leaves(f(*p)[0]), *primals)
    leaves, tree = jax.tree.flatten(dvals)
    if all(live):
        return tangent(vals, dvals)
    if not any(live):
        shapes = jax.eval_shape(tangent, vals, dvals)
        return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)
    some = [d if k else None for d, k in zip(leaves, live, strict=True)]
    return tangent(vals, jax.tree.unflatten(tree, some))


def _vjp_body(parent: Spec, shape: Shape, out_avals):
    """The cotangent fold's body: ``jax.vjp`` of the parent's, pulled back from the outputs'
    cotangents (gathered per tile, or read per row); returns ``(slot cts, const cts, row cts)``."""
    kind = parent.plan.kind

    def body(consts, slots, rows, mask, index):
        primals, info, given = shape.split(consts, slots, rows)
        g_tot, g_slot, g_row = given
        if parent.monoid is not None:
            f, nz_primals = _partial(
                lambda c, s, r: parent.body(c, s, r, mask, index)[0], primals, shape.nz
            )
            vals, pull = jax.vjp(f, *_inputs(parent, nz_primals))
            flags = shape.gnz[: len(out_avals[0])]
            it = iter(g_slot)
            g = tuple(next(it) if fl else None for fl in flags)
            ct = parent.monoid.row_cotangent(vals, mask, info, g, *_index(parent, index))
            ct = _shard.like(ct, vals)
        else:
            f, nz_primals = _partial(
                lambda c, s, r: parent.body(c, s, r, mask, index), primals, shape.nz
            )
            out, pull = jax.vjp(f, *_inputs(parent, nz_primals))
            own = _rows_own(kind, mask)
            axis = parent.plan.row_axis
            given_flat = iter([*g_slot, *g_tot, *(_mask_rows(axis, own, a) for a in g_row)])
            leaves, tree = jax.tree.flatten(out)
            ct = jax.tree.unflatten(
                tree,
                [
                    next(given_flat) if fl else jnp.zeros_like(x)
                    for x, fl in zip(leaves, shape.gnz, strict=True)
                ],
            )
            ct = _shard.like(ct, out)
        ct_c, ct_s, ct_r = _unflag(tuple(map(widened, pull(ct))), shape.nz, shape.nc, shape.ns)
        return tuple(ct_s), tuple(ct_c), tuple(ct_r)

    return body


def _inputs(spec: Spec, primals):
    """The tile's inputs a cotangent fold pulls back from: widened where the kernel widens them
    first anyway (``spec.widen``), so that no share is rounded to half precision."""
    return tuple(map(widened, primals)) if spec.widen else tuple(primals)


def widened(ct):
    """A cotangent as the cotangent fold sums it: half-precision ones in float32 (each tile's
    share is rounded once, never the running sum; the fold narrows each total once, when it is
    complete: ``Spec.out_dtypes``)."""
    if ct is None or not hasattr(ct, "dtype"):
        return ct
    wide = widened_dtype(ct.dtype)
    return ct if wide == ct.dtype else ct.astype(wide)


def widened_dtype(dtype):
    """The dtype a cotangent fold sums ``dtype`` in: float32 for half-precision floats."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
        return jnp.dtype(jnp.float32)
    return dtype


def _unflag(picked, nz, nc, ns):
    """Flagged leaves of ``consts + slots + rows`` (``nz``: flags over all of them), split back
    into the three."""
    a = sum(nz[:nc])
    b = a + sum(nz[nc : nc + ns])
    return picked[:a], picked[a:b], picked[b:]
