"""jax.vmap of every segment reduction (the registry, one program for all of them): over the
data, nested, over closed-over params and over traced partitions, against the float64
references; and temp memory under large outer vmaps (asserted through foldax.memory): a vmap does
not multiply the plan, the tiles shrink with the batch (or, for folds large enough, the batch
is walked element by element).

The vmaps of pairwise_reduce's values are in test_pairwise.py (test_transformations); vmaps of
derivatives in test_grad.py and test_hessian.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    EVERY,
    SEGMENT,
    Partition,
    apply,
    expect_each,
    jit_each,
    op,
    permute_rows,
    random_partition,
    sample,
    weights,
)

import foldax
from foldax._tools import workloads as w
from foldax.memory import report

pytestmark = pytest.mark.slow  # every test here compiles vmapped programs for seconds

F32 = np.float32
MB = 10**6


# ----------------------------------------------------------------------------------------------
# Every segment reduction under vmap, against the float64 references


@pytest.mark.parametrize("form", ["sizes", "sorted_ids"])
def test_vmap_over_data(form, rng):
    part = random_partition(rng, num_segments=8)
    s = part.num_segments
    batches = [sample(rng, EVERY, part.ids, s) for _ in range(3)]
    xs = {n: np.stack([b[n] for b in batches]) for n in EVERY}

    def call(n, xs):
        return jax.vmap(lambda r: apply(n, r, part.ids, s, form, chunk_size=7))(xs[n])

    outs = jit_each(EVERY, call)(xs)
    for b in range(3):
        expect_each(
            {n: o[b] for n, o in outs.items()},
            {n: x[b] for n, x in xs.items()},
            part.ids,
            s,
            err_msg=f"batch {b}",
        )


def test_nested_vmap(rng):
    part = random_partition(rng, num_segments=6)
    xs = sample(rng, EVERY, part.ids, 6, feature_shape=(2, 3))
    ids, xs = permute_rows(rng, part.ids, xs)
    xs = {n: np.moveaxis(x, 0, -1) for n, x in xs.items()}  # (2, 3, N)
    s = part.num_segments

    def call(n, xs):
        idsj = jnp.asarray(ids)
        return jax.vmap(jax.vmap(lambda r: op(n)(r, idsj, s, chunk_size=5)))(xs[n])

    outs = jit_each(EVERY, call)(xs)
    for a in range(2):
        for b in range(3):
            expect_each(
                {n: o[a, b] for n, o in outs.items()}, {n: x[a, b] for n, x in xs.items()}, ids, s
            )


def test_vmap_over_closed_over_params(rng):
    part = random_partition(rng, num_segments=7)
    xs = sample(rng, EVERY, part.ids, part.num_segments, feature_shape=(5,))
    ws = weights(rng, (4, 5, 2))
    sizes = part.sizes.tolist()

    def call(n, xs, ws):
        dom = SEGMENT[n].domain
        f = lambda w: op(n)(xs[n], sizes=sizes, fn=lambda rows: dom(rows @ w), chunk_size=6)  # noqa: E731
        return jax.vmap(f)(ws)

    outs = jit_each(EVERY, call)(xs, jnp.asarray(ws))
    for b in range(4):
        values = {
            n: SEGMENT[n].domain(x.astype(np.float64) @ ws[b].astype(np.float64))
            for n, x in xs.items()
        }
        expect_each({n: o[b] for n, o in outs.items()}, values, part.ids, part.num_segments)


def test_vmap_over_traced_sizes(rng):
    """A batch of different partitions of the same N (the plan is built under vmap)."""
    n, s = 30, 5
    parts = [rng.multinomial(n, np.ones(s) / s) for _ in range(3)]
    parts[0][1] = 0
    parts[0][0] = n - parts[0][2:].sum()
    base = rng.standard_normal((3, n))
    shifted = {}
    for name in EVERY:
        shifts = SEGMENT[name].shifts
        if shifts not in shifted:
            shifted[shifts] = base + rng.choice(np.asarray(shifts), size=(3, 1))
    x = {k: np.asarray(SEGMENT[k].domain(shifted[SEGMENT[k].shifts]), F32) for k in EVERY}
    f = jit_each(
        EVERY,
        lambda name, x, sz: jax.vmap(lambda x, sz: op(name)(x, sizes=sz, chunk_size=4))(
            x[name], sz
        ),
    )
    outs = f(x, jnp.asarray(np.stack(parts), jnp.int32))
    for b in range(3):
        p = Partition(np.asarray(parts[b]))
        expect_each({k: o[b] for k, o in outs.items()}, {k: v[b] for k, v in x.items()}, p.ids, s)


# ----------------------------------------------------------------------------------------------
# Memory: an outer vmap does not multiply the plan


def _sqdist(a, b):
    return jnp.sum((a - b) ** 2)


@pytest.fixture(scope="module")
def seed_batched():
    sizes = w.seed_sizes()
    x = jax.ShapeDtypeStruct((sum(sizes), w.FEATURES), jnp.float32)
    out = {}
    for b in (10, 100, 1000):
        fwd, grad = w.forward_and_grad(w.way_foldax(sizes))
        th = jax.ShapeDtypeStruct((b, w.FEATURES), jnp.float32)
        out[b] = (report(fwd, th, x).temp_bytes, report(grad, th, x).temp_bytes)
    with foldax.memory_budget(8_000_000):
        th = jax.ShapeDtypeStruct((1000, w.FEATURES), jnp.float32)
        out["8MB", 1000] = (report(fwd, th, x).temp_bytes, report(grad, th, x).temp_bytes)
    return out


def test_seed_workload_under_vmap_stays_within_the_budget(seed_batched):
    """The seed workload vmapped over B = 10, 100, 1000 parameter vectors at default settings:
    temp <= 32 MB forward and <= 64 MB for the gradient, whatever B; a smaller budget binds."""
    for b in (10, 100, 1000):
        f, g = seed_batched[b]
        assert f <= 32 * MB and g <= 64 * MB, seed_batched
    f, g = seed_batched["8MB", 1000]
    assert f <= 12 * MB and g <= 16 * MB, seed_batched
    # the (B, S) per-segment states are the only thing allowed to grow with B
    assert seed_batched[1000][0] <= seed_batched[10][0] + 16 * 1000 * 123 * 4, seed_batched


def test_pairwise_and_cauchy_under_large_vmap():
    """B = 256 copies of a pairwise reduction (and S4's H = 256 channels): the tiles shrink with
    the batch, so temp stays far below one batch of (M, N) tiles and flat in N."""
    temps = {}
    fwd = jax.vmap(lambda x, y: foldax.pairwise_reduce(_sqdist, x, y, reduction="min"), (0, None))
    grad = jax.grad(lambda v, z: jnp.sum(jnp.abs(foldax.cauchy(v, z, v))), argnums=(0, 1))
    for n in (256, 1024):
        # min's tile is 1024 columns wide when the budget allows: N from one tile to four
        x = jax.ShapeDtypeStruct((256, 64, 3), jnp.float32)
        y = jax.ShapeDtypeStruct((4 * n, 3), jnp.float32)
        v = jax.ShapeDtypeStruct((256, n), jnp.complex64)
        z = jax.ShapeDtypeStruct((64,), jnp.complex64)
        temps[n] = (report(fwd, x, y).temp_bytes, report(grad, v, z).temp_bytes)
    (p1, c1), (p4, c4) = temps[256], temps[1024]
    assert p4 <= 1.15 * p1 + 4096, temps
    # the gradient's own (H, N) cotangents grow with N; nothing (H, L, N) does
    assert c4 <= 1.15 * c1 + 3 * 256 * (1024 - 256) * 8, temps
    from foldax._engine._budget import DEFAULT_BUDGET

    assert max(p4, c4) <= DEFAULT_BUDGET < 256 * 64 * 1024 * 4, temps  # < one batch of tiles


def test_a_batch_of_large_pairwise_folds_is_walked_element_by_element(rng):
    """Where each element of a batch takes many full steps of its own, the batch runs one
    element after another, each with the whole budget (batched tiles would only be smaller):
    values, gradients and forward-mode derivatives equal each element's own, and temp stays
    flat in the batch beyond the per-element outputs."""
    from foldax._engine import _primitive

    x = jnp.asarray(rng.standard_normal((3, 40, 3)), F32)
    y = jnp.asarray(rng.standard_normal((3, 300, 3)), F32)
    min_of = lambda x, y: foldax.pairwise_reduce(_sqdist, x, y, reduction="min")  # noqa: E731
    sum_of = lambda x, y: foldax.pairwise_reduce(_sqdist, x, y)  # noqa: E731
    with foldax.memory_budget(1024):  # 64 pairs a step: 40 x 300 walks alone
        fold = jax.make_jaxpr(jax.vmap(min_of))(x, y)
        for f in (min_of, sum_of):
            loss = lambda x, y, f=f: jnp.sum(jnp.sin(f(x, y)))  # noqa: E731
            vmapped = jax.jit(jax.vmap(jax.value_and_grad(loss, (0, 1))))(x, y)
            tangent = jax.jit(jax.vmap(lambda x, y, f=f: jax.jvp(f, (x, y), (y[:40], jnp.cos(y)))))
            each = [jax.value_and_grad(loss, (0, 1))(x[b], y[b]) for b in range(3)]
            jvps = [jax.jvp(f, (x[b], y[b]), (y[b, :40], jnp.cos(y[b]))) for b in range(3)]
            for b in range(3):
                for got, want in zip(
                    jax.tree.leaves((vmapped, tangent(x, y))),
                    jax.tree.leaves((each[b], jvps[b])),
                    strict=True,
                ):
                    assert np.isfinite(want).all()  # assert_allclose takes NaN == NaN
                    np.testing.assert_allclose(got[b], want, rtol=2e-5, atol=2e-5)
    (rule,) = [e.params["fold_rule"] for e in fold.jaxpr.eqns if "fold_rule" in e.params]
    assert _primitive._walks_alone(rule.inner), "the batch was expected to walk alone"

    def temp(b):
        xs = jax.ShapeDtypeStruct((b, 256, 3), jnp.float32)
        ys = jax.ShapeDtypeStruct((b, 16384, 3), jnp.float32)
        grad = jax.vmap(jax.grad(lambda x, y: jnp.sum(min_of(x, y)), (0, 1)))
        return report(jax.vmap(min_of), xs, ys).temp_bytes, report(grad, xs, ys).temp_bytes

    (f4, g4), (f32, g32) = temp(4), temp(32)
    # per element: y walked transposed (one copy of it; jax 0.12's XLA keeps it), and for the
    # gradient y's cotangent and the picks' indices (the gradients themselves are outputs)
    copy = 28 * 16384 * 3 * 4
    assert f32 <= 1.1 * f4 + copy + 2**20, (f4, f32)
    assert g32 <= 1.1 * g4 + 2 * copy + 28 * 256 * 16 + 2**20, (g4, g32)


@pytest.mark.parametrize(
    "call",
    [
        lambda t, x: foldax.segment_var(x, sizes=_sizes(x), fn=lambda r: jnp.sin(r @ t)),
        lambda t, x: foldax.segment_prod(x, sizes=_sizes(x), fn=lambda r: jnp.cos(r @ t)),
        lambda t, x: foldax.pairwise_reduce(
            lambda a, b: (jnp.dot(a, b * t), 1.0 + jnp.sin(b[0])), x[:64], x, reduction="logsumexp"
        ),
        lambda t, x: foldax.pairwise_reduce(
            lambda a, b: (jnp.dot(a, b * t), b),
            x[:64],
            x,
            reduction="softmax",
            mask=lambda i, j: j <= i * 64,
        ),
        lambda t, x: foldax.vandermonde_transpose(
            x[:, 0], jax.lax.complex(t[:2], t[:2]), jax.lax.complex(-1.0 - t[2:] ** 2, t[2:])
        ),
    ],
    ids=["segment_var", "segment_prod", "weighted_lse", "masked_softmax", "vandermonde_t"],
)
def test_new_reductions_under_a_vmap_of_128_keep_memory_flat_in_n(call):
    """Gradients of the new reductions inside ``jax.vmap`` over B = 128 parameter vectors:
    temp memory does not grow when N grows 4x (the planner counts the batch)."""

    def temp(n):
        t = jax.ShapeDtypeStruct((128, 4), jnp.float32)
        x = jax.ShapeDtypeStruct((n, 4), jnp.float32)
        grad = jax.vmap(jax.grad(lambda t, x: jnp.sum(jnp.abs(call(t, x))) ** 1), (0, None))
        return report(grad, t, x).temp_bytes

    small, big = temp(4096), temp(16384)
    assert big <= 1.15 * small + 24 * (16384 - 4096), (small, big)  # + O(N) input-sized copies


def _sizes(x):
    n = x.shape[0]
    return [n // 4, 0, n // 2, n - n // 4 - n // 2]
