"""Segment reductions on the engine: a user's ``fn`` as a fold body, and segment softmax.

Every public segment reduction is :func:`fold` (rows into per-segment monoid results) or
:func:`normalize` (one output per row: a segment softmax / log-softmax). Both build a body for
the engine (:mod:`foldax._engine`) from the user's ``fn``, which is traced once for *one* row
with the arrays it closes over hoisted into explicit constants (model parameters, tracers of an
enclosing ``vmap`` or ``grad``), and ``vmap`` ped over the rows of a step: the engine chooses the
step size when it is lowered, after every transformation, so the body must fit any step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import _engine, _shard
from ._monoid import LOGSUMEXP


def row_fn(fn, data, axes=()):
    """``(f, consts)``: ``f(consts, rows)`` maps a step's rows (a tuple of the leaves of
    ``data``, leading axis ``R``) to values ``(R, *F)``.

    ``fn`` is traced on one row, every array it closes over (parameters, tracers of enclosing
    transformations) hoisted into ``consts`` (the engine differentiates with respect to them),
    and ``vmap`` ped over the rows. On a mesh the
    example row is typed as varying along ``axes`` like the rows ``fn`` will meet, so that the
    trace records the casts its constants need.
    """
    tree = jax.tree.structure(data)
    if fn is None:
        return (lambda consts, rows: rows[0]), ()
    example = jax.tree.map(lambda a: _shard.example(a, (1, *jnp.shape(a)[1:]), axes), data)
    replay, consts = _shard.replayable(fn, example)

    def one(consts, row):
        return replay(consts)(jax.tree.unflatten(tree, [a[None] for a in row]))[0]

    return (lambda consts, rows: jax.vmap(one, (None, 0))(consts, rows)), tuple(consts)


def _tiles(v, mask):
    """Values ``(G*T, *F)`` -> ``(G, T, *F)`` for a ``(G, T)`` step."""
    return v.reshape((*mask.shape, *v.shape[1:]))


def fold(name, monoid, fn, data, plan, arrays, axes=()):
    """Reduce ``fn(rows)`` (or the rows) into ``plan.num_slots`` monoid results ``(S, *F)``.

    ``plan``: a :class:`foldax._engine.PlanSpec` over this device's rows, ``arrays`` its integer
    arrays. Inside ``shard_map`` with the rows split over ``axes``, the states are all-reduced.
    The engine's rules stream every derivative (see :mod:`foldax._engine._primitive`).
    """
    f, consts = row_fn(fn, data, axes)

    def body(consts, slots, rows, mask, index):
        return _tiles(f(consts, rows), mask), (), ()

    spec = _engine.Spec(plan, body, monoid, _engine.current_budget(), axes=axes, name=name)
    outs, _, _ = _engine.fold(spec, arrays, consts, (), jax.tree.leaves(data))
    return outs[0]


def normalize(name, fn, data, plan, arrays, log, axes=()):
    """Per-row ``fn(rows) - logsumexp_segment`` (``log``) or its ``exp`` (a segment softmax).

    Two folds: a log-sum-exp per segment, then an additive fold that writes the ``(N, *F)`` rows
    from it (rows in no segment, and rows of a segment whose log-sum-exp is -inf, are NaN). Their
    derivatives compose: the per-row fold's cotangent fold gives the log-sum-exps' cotangents
    (``-sum g * y`` per segment), which the first fold's pulls back through ``fn``.
    """
    lse = fold(name, LOGSUMEXP, fn, data, plan, arrays, axes)
    f, consts = row_fn(fn, data, axes)

    def body(consts, slots, rows, mask, index):
        v = f(consts, rows)
        (lse_t,) = slots
        lse_r = jnp.repeat(lse_t, mask.shape[1], axis=0, total_repeat_length=v.shape[0])
        z = v - lse_r
        # NaN rows (an all -inf segment, +inf or NaN values) and rows read but not owned by this
        # step (read against another segment's log-sum-exp) get no gradient: the cotangent of
        # the branch not taken is exactly 0.
        own = mask.reshape((-1,) + (1,) * (z.ndim - 1))
        bad = jnp.isnan(z) | (lse_r == -np.inf) | ~own
        z = jnp.where(bad, jnp.zeros((), z.dtype), z)
        z = z if log else jnp.exp(z)
        return (), (), (jnp.where(bad, jnp.asarray(np.nan, z.dtype), z),)

    spec = _engine.Spec(
        plan, body, None, _engine.current_budget(), fill=np.nan, axes=axes, name=name
    )
    _, _, (out,) = _engine.fold(spec, arrays, consts, (lse,), jax.tree.leaves(data))
    return out


__all__ = ["fold", "normalize", "row_fn"]
