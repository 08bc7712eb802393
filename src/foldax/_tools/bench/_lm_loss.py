"""The ``lm_loss`` workload of ``foldax bench``: a language model's loss from its last hidden
states ``h`` (T, D) and its unembedding ``w`` (V, D), ``mean_t(logsumexp_v(h_t . w_v) - h_t .
w_{label_t})``, float32 and bfloat16, ``foldax.linear_cross_entropy`` against the plain program
that forms the (T, V) logits (and, where they import, Tokamax's chunked XLA loss and jax-cce),
forward and value-and-grad, each pass's ways timed in turns, beside the machine's floor: one
float32 ``h @ w.T`` of the same T, V, D measured in the same run."""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from ..._memory import report_from_compiled
from ._config import OPTIONAL_PEERS, Config, available
from ._measure import _row
from ._progress import Progress

WORKLOAD = "lm_loss"
PLAIN = "plain (T x V logits)"
FOLDAX = "foldax"
FLOOR = "GEMM floor"
TOKAMAX = "tokamax (chunked_xla)"
CCE = "jax-cce"
#: the optional peers (each runs only where it imports: both need jax >= 0.11), in turn order
OPTIONAL = (TOKAMAX, CCE)
#: the peer names of ``available`` for the optional peers
PEER_OF = {TOKAMAX: "tokamax", CCE: "jax-cce"}
#: rows of ``dh`` and of ``dw`` whose gradient is checked against float64 (all when fewer)
GRAD_ROWS = 64
#: the plain program is skipped where its XLA temp exceeds this share of the free memory
FITS = 0.6
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def bench_lm_loss(cfg: Config, prog: Progress) -> list[dict]:
    """Every row of the workload: for each ``(T, V, dtype)`` of ``cfg.lm_cases`` (D =
    ``cfg.lm_d``), the forward and value-and-grad rows of every way and of the floor."""
    rows = []
    for t, v, dtype in cfg.lm_cases:
        rows += _case_rows(cfg, prog, t, v, cfg.lm_d, dtype)
    return rows


def _plain(h, w, labels):
    """The loss as a user writes it: the (T, V) logits in float32, their log-sum-exp less the
    label's logit, averaged."""
    z = jnp.einsum("td,vd->tv", h, w, preferred_element_type=jnp.float32)
    label_z = jnp.take_along_axis(z, labels[:, None], axis=-1)[:, 0]
    return jnp.mean(jax.nn.logsumexp(z, axis=-1) - label_z)


def _foldax(h, w, labels):
    import foldax

    return foldax.linear_cross_entropy(h, w, labels)


def _tokamax(h, w_dv, labels):
    """Tokamax's chunked XLA loss; its unembedding is ``(D, V)`` (passed in that layout)."""
    import tokamax

    return tokamax.linear_softmax_cross_entropy_loss(
        h, labels, w_dv, reduction="mean", implementation="chunked_xla"
    )


def _cce(h, w, labels):
    import jax_cce

    return jax_cce.linear_cross_entropy(h, w, labels)


def _gemm(h, w):
    return h @ w.T


def _importable(impl: str) -> bool:
    """Whether an optional peer is installed and imports (on jax < 0.11 it may not)."""
    if not available(PEER_OF[impl]):
        return False
    try:
        __import__(OPTIONAL_PEERS[PEER_OF[impl]])
    except Exception:  # any failure to import means: not in this run
        return False
    return True


def _inputs(t, v, d, dtype):
    """``h`` (T, D) standard normal, ``w`` (V, D) normal with variance 1 / D (logits of unit
    scale, as at initialisation), labels uniform in [0, V): NumPy float32 / int32, rounded to
    ``dtype`` where that is narrower."""
    rng = np.random.default_rng([11, t, v])
    h = rng.standard_normal((t, d), dtype=np.float32)
    w = rng.standard_normal((v, d), dtype=np.float32) / np.float32(np.sqrt(d))
    labels = rng.integers(0, v, t).astype(np.int32)
    if dtype != "float32":
        h, w = (np.asarray(jnp.asarray(a, DTYPES[dtype]), np.float32) for a in (h, w))
    return h, w, labels


def _reference(h, w, labels, rows_h, rows_w):
    """float64 NumPy on the same values: the loss, in chunks of tokens, and the gradient's rows
    ``rows_h`` of ``dh`` and ``rows_w`` of ``dw``, from the float64 log-sum-exps."""
    h64, w64 = h.astype(np.float64), w.astype(np.float64)
    t = h.shape[0]
    lse = np.empty(t)
    for s in range(0, t, 256):
        z = h64[s : s + 256] @ w64.T
        m = z.max(1)
        lse[s : s + 256] = m + np.log(np.exp(z - m[:, None]).sum(1))
    loss = float(np.mean(lse - np.einsum("td,td->t", h64, w64[labels])))
    p = np.exp(h64[rows_h] @ w64.T - lse[rows_h, None])  # softmax of the rows' logits
    dh = (p @ w64 - w64[labels[rows_h]]) / t
    q = np.exp(h64 @ w64[rows_w].T - lse[:, None])  # (T, rows): those columns' softmax
    dw = (q - (labels[:, None] == rows_w[None, :])).T @ h64 / t
    return loss, dh, dw


def _free_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _compiled(fn, args):
    """``(executable, first-call compile seconds, XLA temp bytes)`` of ``jax.jit(fn)``: a new
    function each time, so that no cache of JAX's answers for it (the bfloat16 case's floor has the
    shapes of a float32 case's)."""
    t0 = time.perf_counter()
    exe = jax.jit(lambda *a: fn(*a)).lower(*args).compile()
    return exe, time.perf_counter() - t0, report_from_compiled(exe).temp_bytes


def _in_turns(cfg: Config, label: str, prog: Progress, calls: dict) -> tuple[dict, dict]:
    """``({name: median seconds}, {name: warm-up output})``: each call's warm-up (in order),
    then ``cfg.lm_repeats`` rounds of one call of each."""
    from .. import workloads as w

    outs = {}
    for name, call in calls.items():
        prog.step(f"{label}: {name}")
        out = jax.block_until_ready(call())
        if name != FLOOR:  # the floor's (T, V) product is not kept
            outs[name] = out
        del out
    return w.median_times(calls, repeats=cfg.lm_repeats, warmup=0), outs


def _case_rows(cfg: Config, prog: Progress, t: int, v: int, d: int, dtype: str) -> list[dict]:
    """One ``(T, V, D, dtype)``: the forward ways timed in turns with the floor, then the
    value-and-grad ways in turns; errors against float64."""
    h, w, labels = _inputs(t, v, d, dtype)
    rng = np.random.default_rng([12, t, v])
    rows_h = np.sort(rng.choice(t, min(t, GRAD_ROWS), replace=False))
    some = rng.choice(v, min(v, GRAD_ROWS // 2), replace=False)  # and as many rows of labels
    rows_w = np.unique(np.concatenate([labels[: GRAD_ROWS // 2], some]))
    name = f"T = {t:,}, V = {v:,}, D = {d}, {dtype}"
    prog.note(f"{WORKLOAD} {name}: float64 reference")
    ref = _reference(h, w, labels, rows_h, rows_w)

    hj, wj = jnp.asarray(h, DTYPES[dtype]), jnp.asarray(w, DTYPES[dtype])
    lj = jnp.asarray(labels)
    ways = {PLAIN: (_plain, (hj, wj, lj)), FOLDAX: (_foldax, (hj, wj, lj))}
    skipped = [impl for impl in OPTIONAL if not _importable(impl)]
    if TOKAMAX not in skipped:
        ways[TOKAMAX] = (_tokamax, (hj, jnp.asarray(wj.T), lj))
    if CCE not in skipped:
        ways[CCE] = (_cce, (hj, wj, lj))

    floor_args = (jnp.asarray(h), jnp.asarray(w))
    programs, note = _programs(ways, floor_args)
    case = name + note

    rows = []
    floor = 0.0
    for pass_ in ("forward", "gradient"):
        label = f"{WORKLOAD} {name} {pass_}"
        calls = {FLOOR: functools.partial(programs[FLOOR, "forward"][0], *floor_args)}
        if pass_ == "gradient":
            calls = {}
        for impl, (_, args) in ways.items():
            calls[impl] = functools.partial(programs[impl, pass_][0], *args)
        times, outs = _in_turns(cfg, label, prog, calls)
        for impl in (PLAIN, *OPTIONAL):
            if impl not in ways:
                why = "too large for the free memory" if impl == PLAIN else "not importable"
                prog.step(f"{label}: {impl} skipped ({why})")
        floors = 1 if pass_ == "forward" else 3  # the plain gradient's products: z, dh, dw
        floor = times.get(FLOOR, floor)
        _, compile_floor, temp_floor = programs[FLOOR, "forward"]
        first = pass_ == "forward"
        row = functools.partial(_row, WORKLOAD, case, t=t, v=v, d=d, dtype=dtype)
        rows.append(
            row(
                FLOOR,
                pass_,
                temp_floor if first else None,
                floors * floor,
                None,
                compile_seconds=compile_floor if first else None,
                floor_fraction=None,
                grad_rel_err=None,
            )
        )
        for impl in ways:
            _, compile_secs, temp = programs[impl, pass_]
            loss, grads = (outs[impl], None) if first else outs[impl]
            err = abs(float(loss) - ref[0]) / abs(ref[0])
            grad_err = None if grads is None else _grad_err(impl, grads, ref, rows_h, rows_w)
            fraction = floors * floor / times[impl]
            rows.append(
                row(
                    impl,
                    pass_,
                    temp,
                    times[impl],
                    err,
                    compile_seconds=compile_secs,
                    floor_fraction=fraction,
                    grad_rel_err=grad_err,
                )
            )
    return rows


def _programs(ways: dict, floor_args) -> tuple[dict, str]:
    """``({(impl, pass): (executable, compile seconds, temp bytes)}, note)``: every way's
    forward and value-and-grad programs and the floor's; the plain way is dropped from ``ways``
    (and the note says why) where its temp would not fit in the free memory."""
    programs = {(FLOOR, "forward"): _compiled(_gemm, floor_args)}
    for impl, (fn, args) in ways.items():
        programs[impl, "forward"] = _compiled(fn, args)
        programs[impl, "gradient"] = _compiled(jax.value_and_grad(fn, (0, 1)), args)
    free = _free_bytes()
    plain_temp = max(programs[PLAIN, p][2] for p in ("forward", "gradient"))
    if free is None or plain_temp <= FITS * free:
        return programs, ""
    del ways[PLAIN]
    return programs, (
        f"; {PLAIN} skipped: its XLA temp ({plain_temp / 2**30:.1f} GiB) exceeds "
        f"{FITS:.0%} of the free memory ({free / 2**30:.1f} GiB)"
    )


def _grad_err(impl, grads, ref, rows_h, rows_w) -> float:
    """The largest error of the checked rows of ``dh`` and ``dw``, each relative to the largest
    magnitude of its reference rows."""
    dh, dw = (np.asarray(jnp.asarray(g, jnp.float32), np.float64) for g in grads)
    if impl == TOKAMAX:  # its dw is (D, V)
        dw = dw.T
    return max(
        float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
        for got, want in ((dh[rows_h], ref[1]), (dw[rows_w], ref[2]))
    )
