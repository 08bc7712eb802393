"""The workloads of ``foldax demo`` and ``foldax bench``, each written the usual ways and with foldax.

The ragged logsumexp under vmap: a 1-D catalogue of N = 1,159,351 rows of 5 features in 123
contiguous segments of unequal sizes; per segment ``logsumexp(f(theta, x)) - log(size)`` of a
per-row model ``f``, ``vmap``-ed over a batch of ``theta`` by an outside library (a sampler).
S4's Cauchy kernel: ``sum_n v[h, n] / (z[l] - w[h, n])`` over H channels, L nodes, N poles.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from importlib import resources

import jax
import jax.numpy as jnp
import numpy as np

from .. import memory
from .._segment import segment_logsumexp

FEATURES = 5


def seed_sizes() -> list[int]:
    """The 123 unequal segment sizes of the ragged workload, shipped as package data."""
    text = resources.files("foldax._tools").joinpath("data/seed_sizes.json").read_text()
    return list(json.loads(text)["sizes"])


def model(theta, x):
    """The per-row model: a Gaussian log-density up to a constant, ``-|x - theta|^2 / 2``."""
    return -0.5 * jnp.sum((x - jnp.expand_dims(theta, -2)) ** 2, axis=-1)


def model_f64(theta, x):
    return -0.5 * np.sum((x - theta) ** 2, axis=-1)


@dataclasses.dataclass
class SeedProblem:
    x: jax.Array  # (N, 5) float32
    thetas: jax.Array  # (B, 5) float32
    sizes: list[int]

    @property
    def n(self) -> int:
        return int(self.x.shape[0])


def seed_problem(repeat=1, batch=10, seed=0, shrink=1, segments=None) -> SeedProblem:
    """The ragged logsumexp workload; ``repeat`` tiles the segment sizes (N x repeat rows); ``shrink``
    divides every size (at least 1 row each; quick runs); ``segments`` keeps the first (tests)."""
    sizes = [max(1, s // shrink) for s in seed_sizes()[:segments]] * repeat
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((sum(sizes), FEATURES), dtype=np.float32)
    thetas = 0.5 * rng.standard_normal((batch, FEATURES), dtype=np.float32)
    return SeedProblem(jnp.asarray(x), jnp.asarray(thetas), sizes)


# --- ways to compute per-segment logsumexp(f) - log(size), vmapped over theta ------------------
# Each way's ``per_theta(theta, x, *log_prior)``: with a ``log_prior`` ``(N,)`` row array beside
# ``x``, the likelihood's form with a pair of row arrays, ``f = model(theta, x) - log_prior``.


def _values(theta, x, log_prior):
    """``f`` of every row: ``model(theta, x)``, less ``log_prior[0]`` where one is given."""
    v = model(theta, x)
    return v - log_prior[0] if log_prior else v


def way_slicing_loop(sizes):
    """A slicing loop: materialize f, then one dynamic slice + logsumexp per segment."""
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()

    def per_theta(theta, x, *log_prior):
        v = _values(theta, x, log_prior)
        outs = [
            jax.nn.logsumexp(jax.lax.dynamic_slice_in_dim(v, s, n)) - np.log(n)
            for s, n in zip(starts, sizes, strict=True)
        ]
        return jnp.stack(outs)

    return per_theta


def way_global_max(sizes):
    """The usual stable way in JAX: one global max, then ``jax.ops.segment_sum`` of exp."""
    ids = np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)
    log_n = np.log(np.asarray(sizes, np.float32))

    def per_theta(theta, x, *log_prior):
        v = _values(theta, x, log_prior)
        m = jax.lax.stop_gradient(jnp.max(v))
        s = jax.ops.segment_sum(jnp.exp(v - m), ids, len(sizes), indices_are_sorted=True)
        return m + jnp.log(s) - log_n

    return per_theta


def way_foldax(sizes, chunk_size=None):
    """foldax: stream f over the rows, never materializing it, forward or backward."""
    log_n = np.log(np.asarray(sizes, np.float32))

    def per_theta(theta, x, *log_prior):
        # the rows as one pytree: (x, log_prior) where there is a prior
        data = (x, *log_prior) if log_prior else x
        lse = segment_logsumexp(
            data,
            sizes=sizes,
            fn=lambda rows: _values(theta, rows[0], rows[1:]) if log_prior else model(theta, rows),
            chunk_size=chunk_size,
        )
        return lse - log_n

    return per_theta


def way_pad_scan(sizes):
    """Padding: pad every segment to the largest, ``lax.scan`` over segments with
    a masked logsumexp. The padded ``(S, max, 5)`` copy is made once; f is one segment at a time
    forward, but the gradient keeps every segment's residuals."""
    big = max(sizes)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    rows = np.minimum(starts[:, None] + np.arange(big)[None, :], sum(sizes) - 1)  # (S, max)
    mask = np.arange(big)[None, :] < np.asarray(sizes)[:, None]
    log_n = np.log(np.asarray(sizes, np.float32))

    def per_theta(theta, x, *log_prior):
        padded = (x[rows], *(lp[rows] for lp in log_prior))  # (S, max, 5), (S, max)

        def one(_, seg):
            (xs, *lps), m = seg
            v = jnp.where(m, _values(theta, xs, lps), -jnp.inf)
            return None, jax.nn.logsumexp(v)

        _, lse = jax.lax.scan(one, None, (padded, mask))
        return lse - log_n

    return per_theta


#: What ``foldax demo`` compares (the bench adds the pad-and-scan approach).
DEMO_WAYS = ("slicing loop", "global-max segment_sum", "foldax")

WAYS = {
    "slicing loop": way_slicing_loop,
    "global-max segment_sum": way_global_max,
    "pad-and-scan": way_pad_scan,
    "foldax": way_foldax,
}


def forward_and_grad(per_theta, rows: int = 1):
    """``(thetas, x) -> (B, S)`` per-segment values and ``(thetas, x) -> (B, 5)`` gradients;
    ``rows = 2``: ``(thetas, x, log_prior)``, the form with a pair of row arrays."""
    axes = (0,) + (None,) * rows
    fwd = jax.vmap(per_theta, in_axes=axes)
    if rows == 1:  # named arguments: memory audits name the buffers after them

        def loss(theta, x):
            return per_theta(theta, x).sum()
    else:

        def loss(theta, x, log_prior):
            return per_theta(theta, x, log_prior).sum()

    return fwd, jax.vmap(jax.grad(loss), in_axes=axes)


def reference(problem: SeedProblem, log_prior=None):
    """Float64 NumPy reference: per-segment values ``(B, S)`` and gradients ``(B, 5)`` (of
    ``model - log_prior`` where a ``log_prior`` ``(N,)`` is given)."""
    x = np.asarray(problem.x, np.float64)
    lp = 0.0 if log_prior is None else np.asarray(log_prior, np.float64)
    offs = np.concatenate([[0], np.cumsum(problem.sizes)])
    vals, grads = [], []
    for theta in np.asarray(problem.thetas, np.float64):
        v = model_f64(theta, x) - lp
        row, g = [], np.zeros(FEATURES)
        for i, n in enumerate(problem.sizes):
            seg = v[offs[i] : offs[i + 1]]
            m = seg.max()
            w = np.exp(seg - m)
            s = w.sum()
            row.append(m + np.log(s) - np.log(n))
            # d/dtheta of logsumexp = softmax-weighted mean of df/dtheta = (x - theta)
            g += (w[:, None] * (x[offs[i] : offs[i + 1]] - theta)).sum(0) / s
        vals.append(row)
        grads.append(g)
    return np.array(vals), np.array(grads)


def max_rel_err(got, want) -> float:
    """The largest relative error over the entries where ``want`` is finite; inf where an
    infinite (or NaN) entry of ``want`` is not matched exactly (an empty segment's -inf)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    fin = np.isfinite(want)
    if not np.array_equal(got[~fin], want[~fin], equal_nan=True):
        return float("inf")
    if not fin.any():
        return 0.0
    return float(np.max(np.abs(got[fin] - want[fin]) / np.maximum(np.abs(want[fin]), 1e-30)))


class Timing(float):
    """A median time in seconds (a ``float``: arithmetic and JSON see the median) that also
    carries the spread it came from: ``low`` and ``high``, the fastest and slowest of the
    ``rounds`` timed calls."""

    low: float
    high: float
    rounds: int

    def __new__(cls, samples) -> Timing:
        samples = [float(t) for t in samples]
        self = super().__new__(cls, statistics.median(samples))
        self.low, self.high, self.rounds = min(samples), max(samples), len(samples)
        return self

    def __reduce__(self):  # pickles (and copies) keep the spread
        return _timing_of, (float(self), self.low, self.high, self.rounds)

    def spread(self) -> dict:
        """``{"seconds_min", "seconds_max", "rounds"}``: the spread, as results record it."""
        return {"seconds_min": self.low, "seconds_max": self.high, "rounds": self.rounds}


def _timing_of(median: float, low: float, high: float, rounds: int) -> Timing:
    t = Timing([median])
    t.low, t.high, t.rounds = low, high, rounds
    return t


def median_time(fn: Callable, *args, repeats: int = 5, warmup: int = 1) -> Timing:
    """Median wall time of ``fn(*args)`` in seconds, after ``warmup`` calls (a :class:`Timing`:
    a float that also carries the fastest and slowest call)."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return Timing(ts)


def median_times(fns: dict[str, Callable], repeats: int = 5, warmup: int = 1) -> dict[str, Timing]:
    """Median wall time in seconds of each of ``fns`` (no arguments), timed in turns -- one call
    of each per round -- so that a change in the machine's speed meets all of them alike. Each
    is a :class:`Timing`: a float that also carries the fastest and slowest call."""
    for fn in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(fn())
    ts = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            ts[name].append(time.perf_counter() - t0)
    return {name: Timing(t) for name, t in ts.items()}


@dataclasses.dataclass
class Row:
    way: str
    pass_: str  # "forward" or "gradient"
    temp_bytes: int
    seconds: float | None
    rel_err: float | None


def measure_seed(
    problem: SeedProblem,
    ways=DEMO_WAYS,
    repeats: int = 5,
    time_it: bool = True,
    ref=None,
    progress: Callable[[str], None] | None = None,
) -> list[Row]:
    """Temp memory, median time and error of every way, forward and gradient, in one run."""
    rows = []
    for way in ways:
        fwd, grad = forward_and_grad(WAYS[way](problem.sizes))
        for pass_, fn, want in (
            ("forward", fwd, None if ref is None else ref[0]),
            ("gradient", grad, None if ref is None else ref[1]),
        ):
            if progress:
                progress(f"{way} {pass_}")
            rep = memory.report(fn, problem.thetas, problem.x)
            jf = jax.jit(fn)
            secs = median_time(jf, problem.thetas, problem.x, repeats=repeats) if time_it else None
            err = None if want is None else max_rel_err(jf(problem.thetas, problem.x), want)
            rows.append(Row(way, pass_, rep.temp_bytes, secs, err))
    return rows


# --- S4's Cauchy kernel, H channels, L nodes, N poles --------------------------------------

S4_H, S4_L = 256, 1024


@dataclasses.dataclass
class S4Problem:
    v: jax.Array  # (H, N) complex64 residues
    z: jax.Array  # (L,) complex64 nodes, shared by the channels
    w: jax.Array  # (H, N) complex64 poles

    @property
    def n(self) -> int:
        return int(self.v.shape[-1])


def s4_problem(n: int, h: int = S4_H, length: int = S4_L, seed: int = 0) -> S4Problem:
    """Random S4-like inputs: poles in the left half-plane, nodes on the unit circle's image."""
    rng = np.random.default_rng(seed)
    v = (rng.standard_normal((h, n)) + 1j * rng.standard_normal((h, n))) / np.sqrt(n)
    w = -0.5 - rng.uniform(0, 1, (h, n)) + 1j * np.pi * rng.uniform(-n, n, (h, n)) / n
    omega = np.exp(-2j * np.pi * np.arange(length) / length)
    z = 2 * (1 - omega) / (1 + omega + 1e-3)  # bilinear transform of the roots of unity
    c64 = lambda a: jnp.asarray(a.astype(np.complex64))  # noqa: E731
    return S4Problem(c64(v), c64(z), c64(w))


def s4_naive(v, z, w):
    """Plain broadcast: materializes the (H, L, N) array."""
    return (v[:, None, :] / (z[None, :, None] - w[:, None, :])).sum(-1)


def s4_vmap_style(v, z, w):
    """Nested vmap: a Cauchy kernel over N, vmapped over L and over the H channels."""

    def cauchy_one(v, omega, lambd):
        return (v / (omega - lambd)).sum()

    per_channel = jax.vmap(cauchy_one, in_axes=(None, 0, None))
    return jax.vmap(per_channel, in_axes=(0, None, 0))(v, z, w)


def s4_foldax(v, z, w):
    from .._ssm import cauchy

    return cauchy(v, z, w)


S4_WAYS = {
    "naive broadcast": s4_naive,
    "nested vmap": s4_vmap_style,
    "foldax.cauchy": s4_foldax,
}


def s4_loss(kernel_fn):
    """A real training-like loss of the kernel: ``sum |k|^2``."""
    return lambda v, z, w: jnp.sum(jnp.abs(kernel_fn(v, z, w)) ** 2)


def s4_grad(kernel_fn):
    return jax.grad(s4_loss(kernel_fn), argnums=(0, 1, 2))


def s4_reference(problem: S4Problem, block: int = 32):
    """complex128 kernel and gradients of ``sum |k|^2``, computed ``block`` channels at a time."""
    with jax.enable_x64(True):
        v, z, w = (
            jnp.asarray(np.asarray(a), jnp.complex128) for a in (problem.v, problem.z, problem.w)
        )
        fwd = jax.jit(s4_naive)
        grad = jax.jit(s4_grad(s4_naive))
        ks, gv, gw, gz = [], [], [], 0
        for s in range(0, v.shape[0], block):
            sl = slice(s, s + block)
            ks.append(np.asarray(fwd(v[sl], z, w[sl])))
            a, b, c = grad(v[sl], z, w[sl])
            gv.append(np.asarray(a))
            gz = gz + np.asarray(b)
            gw.append(np.asarray(c))
        return np.concatenate(ks), (np.concatenate(gv), gz, np.concatenate(gw))


def max_rel_err_tree(got, want) -> float:
    """Largest relative error over arrays, each relative to its own largest magnitude; NaN
    where any error is NaN (``max`` would drop a NaN after the first leaf)."""
    got, want = jax.tree.leaves(got), jax.tree.leaves(want)
    errs = [
        float(np.max(np.abs(np.asarray(g) - w)) / max(np.max(np.abs(w)), 1e-30))
        for g, w in zip(got, want, strict=True)
    ]
    return float("nan") if any(np.isnan(errs)) else max(errs)


def measure_s4(
    ns=(64, 256, 512),
    ways=tuple(S4_WAYS),
    repeats: int = 3,
    time_it: bool = True,
    progress: Callable[[str], None] | None = None,
    h: int = S4_H,
    length: int = S4_L,
) -> list[dict]:
    """Temp memory, median time and error vs complex128 of each way, forward and gradient."""
    rows = []
    for n in ns:
        problem = s4_problem(n, h=h, length=length)
        args = (problem.v, problem.z, problem.w)
        if progress:
            progress(f"N={n}: complex128 reference")
        ref_k, ref_g = s4_reference(problem)
        for way in ways:
            kf = S4_WAYS[way]
            for pass_, fn, want in (("forward", kf, ref_k), ("gradient", s4_grad(kf), ref_g)):
                if progress:
                    progress(f"N={n}: {way} {pass_}")
                temp = memory.report(fn, *args).temp_bytes
                jf = jax.jit(fn)
                secs = median_time(jf, *args, repeats=repeats) if time_it else None
                err = max_rel_err_tree(jf(*args), want)
                rows.append(
                    dict(n=n, way=way, pass_=pass_, temp_bytes=temp, seconds=secs, rel_err=err)
                )
    return rows


# --- the ragged workload on a device mesh -------------------------------------------------------


def way_foldax_padded(sizes, n_padded):
    """foldax with the rows padded to ``n_padded`` (a multiple of the device count): padding
    rows get the segment id ``S``, which is dropped (the ids stay sorted: the tiled path)."""
    s = len(sizes)
    ids = np.full(n_padded, s, np.int32)
    ids[: sum(sizes)] = np.repeat(np.arange(s, dtype=np.int32), sizes)
    log_n = np.log(np.asarray(sizes, np.float32))

    def per_theta(theta, x):
        return segment_logsumexp(x, ids, s, fn=lambda rows: model(theta, rows)) - log_n

    return per_theta


def measure_seed_sharded(
    repeat: int = 10,
    repeats: int = 5,
    progress: Callable[[str], None] | None = None,
    shrink: int = 1,
) -> list[dict]:
    """The ragged workload (N x ``repeat``) on one device and with the rows split over all of
    ``jax.devices()``, side by side in this process: per-device memory, median time, error.

    Run it in a process started with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` to
    simulate 8 devices on a CPU.
    """
    devices = jax.device_count()
    problem = seed_problem(repeat=repeat, shrink=shrink)
    ref = reference(problem)
    n_pad = problem.n + (-problem.n) % devices
    x = jnp.concatenate([problem.x, jnp.zeros((n_pad - problem.n, FEATURES), jnp.float32)])
    mesh = jax.make_mesh((devices,), ("rows",))
    x_split = jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.P("rows")))
    fwd, grad = forward_and_grad(way_foldax_padded(problem.sizes, n_pad))
    out = []
    for pass_, fn, want in (("forward", fwd, ref[0]), ("gradient", grad, ref[1])):
        for count, rows in ((1, x), (devices, x_split)):
            if progress:
                progress(f"{pass_} on {count} device(s)")
            compiled = jax.jit(fn).lower(problem.thetas, rows).compile()
            rep = memory.report_from_compiled(compiled)
            text = compiled.as_text()
            secs = median_time(compiled, problem.thetas, rows, repeats=repeats)
            out.append(
                {
                    "pass": pass_,
                    "devices": count,
                    "n": problem.n,
                    "temp_bytes": rep.temp_bytes,
                    "argument_bytes": rep.argument_bytes,
                    "seconds": secs,
                    **secs.spread(),
                    "rel_err": max_rel_err(compiled(problem.thetas, rows), want),
                    "all_gather": "all-gather" in text or "all-to-all" in text,
                }
            )
    return out


def main(argv) -> int:
    """``sharded REPEAT REPEATS [SHRINK]``: :func:`measure_seed_sharded`, printed as JSON."""
    if argv[:1] != ["sharded"] or not 3 <= len(argv) <= 4:
        print("usage: python -m foldax.workloads sharded REPEAT REPEATS [SHRINK]", file=sys.stderr)
        return 2
    repeat, repeats, *shrink = (int(a) for a in argv[1:4])
    print(json.dumps(measure_seed_sharded(repeat, repeats, shrink=(shrink or [1])[0])))
    return 0


if __name__ == "__main__":  # python -m foldax._tools.workloads sharded REPEAT REPEATS [SHRINK]
    sys.exit(main(sys.argv[1:]))
