"""Nearest rows by squared distance in high dimension, at the speed of a matrix product, with the
results of the user's own formula.

``jnp.sum((a - b) ** 2)`` over ``D`` features costs ``3 D`` operations a pair one by one; written
``|a|^2 + |b|^2 - 2 a.b`` it is a matrix product per tile, many times faster for large ``D``, but
its rounding (cancellation: an error up to about ``D u (|a|^2 + |b|^2)``) can reorder near
neighbours. A min-family reduction (min, argmin, min_argmin, kmin) of such a kernel is therefore
computed in three steps: the ``K'`` nearest candidates of every row by the matrix-product form
(a k-min fold); the user's kernel evaluated exactly at those candidates and ranked; and a
certificate that no other column can rank before them (the candidates' ``K'``-th approximate
distance, less both formulas' error bounds, exceeds the ``k``-th exact one). The rows it does not
certify (near ties at the edge of the candidates, non-finite inputs) are reduced again, alone,
with the user's kernel over every column. The results are the user's kernel's: its values at the
pairs its own ranking picks, ties by the lower index.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from .. import _jax
from .._engine._picks import in_chunks
from .._reductions import ArgExtremum, ExtremumWithIndex, KMin, Min
from ._masks import only_rows

#: Features from which the matrix-product form is used (below, the pairs one by one are as fast).
MIN_FEATURES = 32
#: Candidates kept beyond the ``k`` asked for, so that a tie or a near tie at the ``k``-th is
#: still among them.
EXTRA = 8


def at_pairs(conv, consts, x, y, idx):
    """``kernel(x_i, y_j)`` at ``j = idx[i, p]``: ``(M, P)`` of the kernel's output element ``p``
    (``idx`` ``(M, P)``; a scalar kernel is every ``p``'s; ``idx`` is clamped to the rows). The
    rows of ``y`` are gathered for a block of rows of ``x`` at a time."""
    n = jax.tree.leaves(y)[0].shape[0]
    pair = lambda a, b: jnp.ravel(conv(a, b, *consts))  # noqa: E731

    def row(args):  # one row of x at its P columns
        xi, at = args
        vals = jax.vmap(pair, (None, 0))(xi, jax.tree.map(lambda a: a[at], y))  # (P, F)
        return vals[:, 0] if vals.shape[-1] == 1 else jnp.diagonal(vals)

    width = idx.shape[1] * sum(a.size // n * a.dtype.itemsize for a in jax.tree.leaves(y))
    return in_chunks(row, (x, jnp.minimum(idx, n - 1)), width)


def _var(v):
    return not isinstance(v, _jax.Literal)


def _squared_distance(jaxpr, num_x):
    """``(ix, iy)``: the leaves of ``x`` and ``y`` whose squared distance the jaxpr is, else
    ``None``. The forms ``jnp.sum((a - b) ** 2)``, ``jnp.sum(jnp.square(a - b))`` and
    ``jnp.sum(d * d)`` for ``d = a - b`` (either order), over every feature."""
    made = {v: e for e in jaxpr.eqns for v in e.outvars}
    (out,) = jaxpr.outvars
    total = made.get(out) if _var(out) else None
    if total is None or total.primitive.name != "reduce_sum" or out.aval.shape != ():
        return None
    sq = made.get(total.invars[0]) if _var(total.invars[0]) else None
    if sq is None:
        return None
    name, ins = sq.primitive.name, sq.invars
    squares = (
        (name == "integer_pow" and sq.params.get("y") == 2)
        or name == "square"
        or (name == "mul" and ins[0] is ins[1])
    )
    if not squares:
        return None
    d = ins[0]
    diff = made.get(d) if _var(d) else None
    if diff is None or diff.primitive.name != "sub" or not all(map(_var, diff.invars)):
        return None
    invars = list(jaxpr.invars)
    a, b = diff.invars
    if a not in invars or b not in invars or a.aval != b.aval:
        return None
    ia, ib = invars.index(a), invars.index(b)
    if ia >= num_x:
        ia, ib = ib, ia
    return (ia, ib - num_x) if ia < num_x <= ib else None


def _handled(monoid) -> bool:
    if isinstance(monoid, KMin):
        return True
    return isinstance(monoid, ArgExtremum | Min) and not monoid.is_max


def nearest(conv, consts, xi, yj, monoid, fold_of):
    """A ``run(monoid, consts, x, y, mask)`` computing min-family folds of the squared-distance
    kernel ``conv`` through matrix products (see the module), or ``None`` where ``conv`` is no
    such kernel in at least :data:`MIN_FEATURES` dimensions of float32 / float64, or ``monoid``
    is no min-family reduction. ``fold_of(kernel)``: the plain fold's ``run`` of a kernel."""
    if not _handled(monoid):
        return None
    jaxpr, _ = _jax.open_jaxpr(jax.make_jaxpr(conv)(xi, yj, *consts))
    found = _squared_distance(jaxpr, len(jax.tree.leaves(xi)))
    if found is None:
        return None
    ix, iy = found
    aval = jax.tree.leaves(xi)[ix]
    if math.prod(aval.shape) < MIN_FEATURES or aval.dtype not in (jnp.float32, jnp.float64):
        return None
    plain = fold_of(conv)

    def approx(a, b, *c):
        p, q = jnp.ravel(jax.tree.leaves(a)[ix]), jnp.ravel(jax.tree.leaves(b)[iy])
        dot = jnp.dot(p, q, precision=jax.lax.Precision.HIGHEST)
        return jnp.sum(p * p) + jnp.sum(q * q) - 2 * dot

    def run(mon, consts, x, y, mask):
        if mask is not None or not _handled(mon):
            return plain(mon, consts, x, y, mask)
        return _certified(conv, consts, x, y, mon, fold_of(approx), plain, (ix, iy))

    return run


def _bound(x, y, ix, iy):
    """``(err (M,), ok (M,))``: per row of ``x``, a bound on ``|approx - exact|`` over every
    column, both formulas' rounding included; rows whose inputs (or any of ``y``'s) are not
    finite are not ``ok``."""
    a, b = jax.tree.leaves(x)[ix], jax.tree.leaves(y)[iy]
    a, b = a.reshape(a.shape[0], -1), b.reshape(b.shape[0], -1)
    d = a.shape[1]
    u = float(jnp.finfo(a.dtype).eps) / 2
    gamma = (d + 8) * u / (1 - (d + 8) * u)
    na, nb = jnp.sum(a * a, axis=1), jnp.sum(b * b, axis=1)
    # a norm is finite exactly when its row is (and does not overflow; a row that does is
    # left to the exact fold too): no (N, D) mask is made
    ok = jnp.isfinite(na) & jnp.all(jnp.isfinite(nb))
    # |fl(|a|^2 + |b|^2 - 2 a.b) - D| <= gamma (|a|^2 + |b|^2 + 2 |a||b|) <= 2 gamma (|a|^2 + |b|^2)
    # (norms computed with their own rounding: a factor 1 + gamma more)
    err = 2 * gamma * (1 + gamma) * (na + jnp.max(nb)) * (1 + gamma)
    return err, ok, gamma


def _certified(conv, consts, x, y, mon, approx, plain, leaves):
    """``mon``'s outputs from candidates ranked exactly, and for the rows not certified, from
    the plain fold restricted to them."""
    n = jax.tree.leaves(y)[0].shape[0]
    k = mon.k if isinstance(mon, KMin) else 1
    cand = min(n, max(2 * k, k + EXTRA))
    fixed = jax.lax.stop_gradient((x, y))
    av, ai = approx(KMin(cand), (), *fixed, None)[0]
    ev = at_pairs(conv, consts, x, y, ai)  # differentiable: the derivatives at these pairs
    key = jax.lax.stop_gradient(ev)
    key, ei, ev = jax.lax.sort((key, ai, ev), dimension=1, num_keys=2)  # ties: lower index
    err, ok, gamma = _bound(*fixed, *leaves)
    floor = (av[:, -1] - err) * (1 - gamma)  # no other column's exact value is below it
    sure = ok & ((floor > key[:, k - 1]) | (cand == n))
    outs = _outputs(mon, key, ei, ev, k)
    again = plain(mon, consts, x, y, only_rows(None, ~sure), rows_first=True)[0]
    pick = lambda a, b: jnp.where(sure.reshape((-1,) + (1,) * (a.ndim - 1)), a, b)  # noqa: E731
    return tuple(pick(a, b) for a, b in zip(outs, again, strict=True)), mon


def _outputs(mon, key, ei, ev, k):
    """``mon``'s outputs from the candidates' exact values ``key`` and indices ``ei``,
    ascending (ties by index), and ``ev``: the values again, differentiable."""
    if isinstance(mon, KMin):
        return (ev[:, :k], ei[:, :k])
    if isinstance(mon, ExtremumWithIndex):
        return (ev[:, 0], ei[:, 0])
    if isinstance(mon, ArgExtremum):
        return (ei[:, 0],)
    # min: its derivative split evenly between the tied candidates (every tie is one)
    tied = key == key[:, :1]
    count = jnp.sum(tied, axis=1, dtype=jnp.int32)
    mean = jnp.sum(jnp.where(tied, ev, 0), axis=1) / jnp.maximum(count, 1).astype(ev.dtype)
    return (key[:, 0] + (mean - jax.lax.stop_gradient(mean)), count)
