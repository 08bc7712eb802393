"""The ``keops_users`` workload of ``foldax bench``: what KeOps' users write, foldax against
pykeops on CPU, each pair of ways timed in turns: a kernel matrix times ``R`` vectors, the 10
nearest neighbours (3-D points and 784-pixel images), the Chamfer distance of 8 pairs of clouds
with its gradient under ``vmap``, and the machine's floor for a Gaussian kernel sum (the rates
of ``exp`` and of multiply-adds measured in the same run)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..._memory import report
from ._config import Config, available
from ._measure import _row, _sq
from ._progress import Progress

WORKLOAD = "keops_users"
PEER = "pykeops (CPU)"
FLOOR = "floor"
#: the k of the k-nearest-neighbour rows
K_NN = 10
#: the pixels of the high-dimensional k-NN case (28 x 28 images)
PIXELS = 784
#: the Gaussian kernel's arithmetic beside its exp, per pair: 3 subtractions, 1 multiply and 2
#: multiply-adds for |a - b|^2, 1 addition to sum (the negation folds into exp's scaling)
GAUSS_OPS = 7


def bench_keops_users(cfg: Config, prog: Progress) -> list[dict]:
    """Every row of the workload: the kernel matrix times V (each R of ``cfg.keops_rs``), k-NN
    in 3-D and 784-D, the Chamfer distance with its gradient, the Gaussian sum's floor."""
    n = cfg.keops_n
    rng = np.random.default_rng(7)
    x, y = (rng.standard_normal((n, 3), dtype=np.float32) for _ in range(2))
    v = rng.standard_normal((n, max(cfg.keops_rs)), dtype=np.float32)
    prog.note(f"keops_users M = N = {n:,}: float64 reference")
    ref_kv, ref_knn = _reference_3d(x, y, np.hstack([v, np.ones((n, 1), np.float32)]), K_NN)
    rows = _kernel_matrix_rows(cfg, prog, x, y, v, ref_kv[:, :-1])
    rows += _knn_rows(cfg, prog, x, y, ref_knn)
    rows += _chamfer_rows(cfg, prog)
    rows += _floor_rows(cfg, prog, x, y, ref_kv[:, -1])
    return rows


def _in_turns(cfg: Config, prog: Progress, label: str, fns: dict, args: tuple) -> dict:
    """``{name: (seconds, output, temp bytes)}`` of foldax (a function of ``args``, jitted) and
    pykeops (a function of nothing; skipped with a progress line when absent), timed in turns
    after a warm-up that compiles both."""
    from .. import workloads as w

    calls = {
        name: fn if name == PEER else functools.partial(jax.jit(fn), *args)
        for name, fn in fns.items()
    }
    for name in fns:
        prog.step(f"{label}: {name}")
    if PEER not in fns:
        prog.step(f"{label}: pykeops skipped")
    times = w.median_times(calls, repeats=cfg.repeats)
    return {
        name: (
            times[name],
            calls[name](),
            None if name == PEER else report(fn, *args).temp_bytes,
        )
        for name, fn in fns.items()
    }


def _reference_3d(x, y, v, k):
    """float64 NumPy, in chunks of rows: the Gaussian kernel matrix times ``v`` and the ``k``
    nearest rows of ``y`` to each of ``x`` (those of ``np.argsort(d, kind="stable")[:, :k]``)."""
    x64, y64, v64 = (a.astype(np.float64) for a in (x, y, v))
    kv, knn = [], []
    for s in range(0, x.shape[0], 500):
        d = sum((x64[s : s + 500, None, c] - y64[None, :, c]) ** 2 for c in range(x.shape[1]))
        kv.append(np.exp(-d) @ v64)
        knn.append(_stable_kmin(d, k))
    return np.concatenate(kv), np.concatenate(knn)


def _stable_kmin(d, k):
    """``np.argsort(d, axis=1, kind="stable")[:, :k]``, by a partition: the rows whose k-th
    value is tied beyond the first ``k`` are sorted whole."""
    part = np.sort(np.argpartition(d, k - 1, axis=1)[:, :k], axis=1)  # ties: lower index first
    vals = np.take_along_axis(d, part, 1)
    out = np.take_along_axis(part, np.argsort(vals, axis=1, kind="stable"), 1)
    tied = (d <= vals.max(1, keepdims=True)).sum(1) > k
    if tied.any():
        out[tied] = np.argsort(d[tied], axis=1, kind="stable")[:, :k]
    return out


def _column_err(got, ref):
    """The largest error relative to the largest magnitude of its column of ``ref`` (entries of
    a kernel matrix times random-signed vectors can be near 0)."""
    got = np.asarray(got, np.float64).reshape(ref.shape)
    return float(np.max(np.abs(got - ref) / np.max(np.abs(ref), axis=0)))


def _kernel_matrix_rows(cfg: Config, prog: Progress, x, y, v, ref) -> list[dict]:
    """The Gaussian kernel matrix times V of shape (N, R), each R of ``cfg.keops_rs``."""
    import foldax

    def fold(x, y, v):
        return foldax.pairwise_reduce(
            lambda a, b: jnp.exp(-jnp.sum((a - b[0]) ** 2)) * b[1], x, (y, v)
        )

    rows = []
    for r in cfg.keops_rs:
        vr = np.ascontiguousarray(v[:, :r])
        fns = {"foldax": fold}
        if available("pykeops"):
            from pykeops.numpy import LazyTensor

            d2 = ((LazyTensor(x[:, None, :]) - LazyTensor(y[None, :, :])) ** 2).sum(-1)
            kmat = (-d2).exp()
            fns[PEER] = lambda kmat=kmat, vr=vr: kmat @ vr
        args = (jnp.asarray(x), jnp.asarray(y), jnp.asarray(vr))
        case = f"kernel matrix times V, M = N = {x.shape[0]:,}, D = 3, R = {r}"
        for name, (secs, got, temp) in _in_turns(
            cfg, prog, f"{WORKLOAD} R = {r}", fns, args
        ).items():
            err = _column_err(got, ref[:, :r])
            rows.append(_row(WORKLOAD, case, name, "forward", temp, secs, err, r=r))
    return rows


def _knn_rows(cfg: Config, prog: Progress, x, y, ref3) -> list[dict]:
    """The ``K_NN`` nearest rows of ``y`` to each of ``x`` (3-D points, M = N), then of 784-pixel
    training images to query images; the error column is the fraction of indices that differ
    from NumPy's on float64 distances."""
    import foldax

    def fold(x, y):
        return foldax.pairwise_reduce(
            lambda a, b: jnp.sum((a - b) ** 2), x, y, reduction="kmin", k=K_NN
        )[1]

    rng = np.random.default_rng(8)
    train, queries = cfg.keops_digits
    pix_y = rng.random((train, PIXELS), dtype=np.float32)
    pix_x = rng.random((queries, PIXELS), dtype=np.float32)
    prog.note(f"{WORKLOAD} k-NN D = {PIXELS}: float64 reference")
    cases = {
        f"k-NN, k = {K_NN}, M = N = {x.shape[0]:,}, D = 3": (x, y, ref3),
        f"k-NN, k = {K_NN}, {queries:,} queries, {train:,} rows, D = {PIXELS}": (
            pix_x,
            pix_y,
            _knn_reference(pix_x, pix_y, K_NN),
        ),
    }
    rows = []
    for case, (xq, yt, ref) in cases.items():
        fns = {"foldax": fold}
        if available("pykeops"):
            from pykeops.numpy import LazyTensor

            d2 = ((LazyTensor(xq[:, None, :]) - LazyTensor(yt[None, :, :])) ** 2).sum(-1)
            fns[PEER] = lambda d2=d2: d2.Kmin_argKmin(K_NN, 1)[1]
        label = f"{WORKLOAD} k-NN D = {xq.shape[1]}"
        for name, (secs, got, temp) in _in_turns(
            cfg, prog, label, fns, (jnp.asarray(xq), jnp.asarray(yt))
        ).items():
            err = float(np.mean(np.asarray(got).astype(np.int64) != ref))
            rows.append(_row(WORKLOAD, case, name, "forward", temp, secs, err, k=K_NN))
    return rows


def _knn_reference(x, y, k):
    """The ``k`` nearest rows of ``y`` to each of ``x`` on float64 squared distances
    (``|x|^2 + |y|^2 - 2 x.y`` in float64, in chunks of rows), stable: ties by index."""
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    yy = (y64**2).sum(1)
    out = []
    for s in range(0, x.shape[0], 250):
        xs = x64[s : s + 250]
        d = (xs**2).sum(1)[:, None] + yy[None, :] - 2.0 * (xs @ y64.T)
        out.append(_stable_kmin(d, k))
    return np.concatenate(out)


def _chamfer_rows(cfg: Config, prog: Progress) -> list[dict]:
    """The Chamfer distance of ``B`` pairs of clouds with its gradient in both clouds: foldax's
    ``jax.vmap(jax.value_and_grad(chamfer, (0, 1)))`` against pykeops' batched LazyTensors
    with torch's autograd (skipped without pykeops or torch). Error: the loss of the first
    pair against float64."""
    import foldax

    def chamfer(x, y):
        near_x = foldax.pairwise_reduce(_sq, x, y, reduction="min")
        near_y = foldax.pairwise_reduce(_sq, y, x, reduction="min")
        return jnp.mean(near_x) + jnp.mean(near_y)

    b, n, m = cfg.keops_chamfer
    rng = np.random.default_rng(9)
    xs = rng.standard_normal((b, n, 3), dtype=np.float32)
    ys = rng.standard_normal((b, m, 3), dtype=np.float32)
    prog.note(f"{WORKLOAD} Chamfer: float64 reference (first pair)")
    ref_loss, ref_grads = _chamfer_reference(xs[0], ys[0])
    fns = {"foldax": jax.vmap(jax.value_and_grad(chamfer, (0, 1)))}
    if available("pykeops") and available("torch.segment_reduce"):
        fns[PEER] = _keops_chamfer(xs, ys)
    case = f"Chamfer distance and its gradient, {b} pairs of {n:,} x {m:,} points, D = 3"
    rows = []
    for name, (secs, got, temp) in _in_turns(
        cfg, prog, f"{WORKLOAD} Chamfer", fns, (jnp.asarray(xs), jnp.asarray(ys))
    ).items():
        loss, grads = np.asarray(got[0], np.float64), [np.asarray(g, np.float64) for g in got[1]]
        err = abs(loss[0] - ref_loss) / ref_loss
        grad_err = max(
            float(np.max(np.abs(g[0] - r)) / np.max(np.abs(r)))
            for g, r in zip(grads, ref_grads, strict=True)
        )
        rows.append(
            _row(WORKLOAD, case, name, "gradient", temp, secs, err, pairs=b, grad_rel_err=grad_err)
        )
    return rows


def _keops_chamfer(xs, ys):
    """The Chamfer loss of each pair and its gradient as a KeOps user writes it: KeOps does not
    differentiate a ``min`` reduction, so the nearest indices come from ``argmin`` on batched
    LazyTensors and the distances are gathered in torch, which differentiates them."""
    import torch
    from pykeops.torch import LazyTensor

    def run():
        x = torch.from_numpy(xs).requires_grad_()
        y = torch.from_numpy(ys).requires_grad_()
        xd, yd = x.detach(), y.detach()
        d2 = ((LazyTensor(xd[:, :, None, :]) - LazyTensor(yd[:, None, :, :])) ** 2).sum(-1)
        i, j = d2.argmin(2), d2.argmin(1)  # (B, N, 1) and (B, M, 1)
        near_x = torch.gather(y, 1, i.expand(-1, -1, 3))
        near_y = torch.gather(x, 1, j.expand(-1, -1, 3))
        loss = ((x - near_x) ** 2).sum(-1).mean(1) + ((y - near_y) ** 2).sum(-1).mean(1)
        loss.sum().backward()
        return loss.detach().numpy(), (x.grad.numpy(), y.grad.numpy())

    return run


def _chamfer_reference(x, y):
    """The Chamfer loss of one pair and its gradients in float64 (NumPy, in chunks of rows)."""
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    col_min = np.full(y.shape[0], np.inf)
    col_arg = np.zeros(y.shape[0], np.int64)
    row_min, row_arg = [], []
    for s in range(0, x.shape[0], 500):
        d = sum((x64[s : s + 500, None, c] - y64[None, :, c]) ** 2 for c in range(3))
        row_min.append(d.min(1))
        row_arg.append(d.argmin(1))
        cm = d.min(0)
        better = cm < col_min
        col_min = np.where(better, cm, col_min)
        col_arg = np.where(better, s + d.argmin(0), col_arg)
    row_min, row_arg = np.concatenate(row_min), np.concatenate(row_arg)
    loss = row_min.mean() + col_min.mean()
    dx = 2 * (x64 - y64[row_arg]) / x.shape[0]  # d/dx of the first mean, d/dy below
    dy = -2 * (x64 - y64[row_arg]) / x.shape[0]
    gx, gy = dx.copy(), np.zeros_like(y64)
    np.add.at(gy, row_arg, dy)
    ey = 2 * (y64 - x64[col_arg]) / y.shape[0]
    gy += ey
    np.add.at(gx, col_arg, -ey)
    return loss, (gx, gy)


def _floor_rows(cfg: Config, prog: Progress, x, y, ref) -> list[dict]:
    """The machine's floor for the Gaussian kernel sum ``sum_j exp(-|x_i - y_j|^2)``: the rates
    of XLA's ``exp`` and of float32 multiply-adds (those of a matrix product: the vector units'
    peak), timed in turns with foldax's sum; the floor is the pairs' exps and other arithmetic
    at those rates, and the ratio column of foldax's row is its time relative to the floor's."""
    from .. import workloads as w

    side, mm = cfg.keops_floor, cfg.keops_floor // 2
    rng = np.random.default_rng(10)
    a, b = (jnp.asarray(rng.uniform(-1.0, 1.0, side).astype(np.float32)) for _ in range(2))
    mat = jnp.asarray(rng.standard_normal((mm, mm), dtype=np.float32))
    fns = {
        "exp": (_exps, (a, b)),
        "matrix product": (lambda m: m @ m, (mat,)),
        "foldax": (_gauss_sum, (jnp.asarray(x), jnp.asarray(y))),
    }
    for name in fns:
        prog.step(f"{WORKLOAD} floor: {name}")
    calls = {name: functools.partial(jax.jit(fn), *args) for name, (fn, args) in fns.items()}
    times = w.median_times(calls, repeats=cfg.repeats)
    temps = {name: report(fn, *args).temp_bytes for name, (fn, args) in fns.items()}
    exp_rate, fma_rate = side * side / times["exp"], mm**3 / times["matrix product"]
    floor = x.shape[0] * y.shape[0] * (1 / exp_rate + GAUSS_OPS / fma_rate)
    case = (
        f"Gaussian kernel sum, M = N = {x.shape[0]:,}, D = 3; floor = pairs x (1 exp at the exp "
        f"rate + {GAUSS_OPS} ops at the multiply-add rate: 3 sub, 1 mul, 2 fma, 1 add)"
    )
    err = w.max_rel_err(calls["foldax"](), ref)
    return [
        _row(
            WORKLOAD,
            f"floor: exp rate, row sums of exp(a_i * b_j) over {side:,} x {side:,} float32: "
            f"{exp_rate:.2e} exp/s",
            "jnp.exp (jitted)",
            "forward",
            temps["exp"],
            times["exp"],
            None,
            rate=exp_rate,
        ),
        _row(
            WORKLOAD,
            f"floor: multiply-add rate, float32 matrix product {mm:,} x {mm:,} x {mm:,}: "
            f"{fma_rate:.2e} multiply-adds/s ({2 * fma_rate:.2e} flop/s)",
            "jnp.matmul (jitted)",
            "forward",
            temps["matrix product"],
            times["matrix product"],
            None,
            rate=fma_rate,
        ),
        _row(WORKLOAD, case, FLOOR, "forward", None, floor, None, baseline=FLOOR),
        _row(
            WORKLOAD,
            case,
            "foldax",
            "forward",
            temps["foldax"],
            times["foldax"],
            err,
            baseline=FLOOR,
        ),
    ]


def _exps(a, b):
    """The row sums of ``exp(a_i * b_j)``: exps of values made in registers (one multiply and
    one add each), not read from memory."""
    return jnp.sum(jnp.exp(a[:, None] * b[None, :]), axis=1)


def _gauss_sum(x, y):
    """foldax's Gaussian kernel sum ``sum_j exp(-|x_i - y_j|^2)``."""
    import foldax

    return foldax.pairwise_reduce(lambda p, q: jnp.exp(-_sq(p, q)), x, y)
