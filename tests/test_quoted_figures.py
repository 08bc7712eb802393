"""Every XLA temp memory figure that README.md and docs/ quote is what the code compiles today.

Temp memory is XLA's compile-time estimate (``foldax.memory.report``): deterministic for a jax
version and backend, so a quoted figure the code no longer gives is stale text. ``QUOTES`` holds
one row per quoted passage: the file, the passage as a template whose ``{name:spec}`` fields are
figures, and the group of programs that computes them (compile-only, nothing runs). Each group
is one test. The figures were made with jax 0.10.2 on CPU; elsewhere the figures are skipped.

A spec formats bytes: empty as ``foldax.memory.format_bytes`` writes them ("92.7 MB"), ``MB0``
in whole MB ("93 MB"), ``MB1`` / ``MB2`` with one / two decimals, ``KB0`` and ``GB0`` likewise,
in lower case without the unit ("31.0"); a ratio (a float) takes Python's specs (``.0f``). The console outputs of ``foldax audit`` in
docs/memory-audit.md are checked whole by ``tests/test_docs.py``.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import string
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import foldax
from foldax import workloads as w
from foldax.memory import format_bytes, report, report_from_compiled

ROOT = Path(__file__).resolve().parent.parent
#: where the quoted figures were made
MADE_WITH = ("0.10.2", "cpu")

#: (file, passage with {figure:spec} fields, group of programs that computes the figures)
QUOTES = [
    ("README.md", "costs plain JAX {gm_fwd:MB0} of scratch memory forward and {gm_grad:MB0} for the gradient", "ragged"),
    ("README.md", "({fx_fwd:MB1} forward and {fx_grad:MB1} for the gradient on that workload, {r_fwd:.0f}× and {r_grad:.0f}× less", "ragged"),
    ("docs/design.md", "the global-max `segment_sum` program that materialises `f` for every row ({gm_fwd:MB0} and {gm_grad:MB0} of temp)", "ragged"),
    ("README.md", 'the gradient needs {b1000} of temp memory, as with 100 vectors ({b100}) or 10 ({b10}), and {budget} within `foldax.memory_budget("2MB")`', "ragged_batch"),
    ("README.md", "its temp is {fx_fwd_8k} forward and {fx_grad_8k} with its gradient, where the plain loss's is {plain_fwd_8k} and {plain_grad_8k}", "lm_loss"),
    ("docs/lm-loss.md", "| 2,048 x 32,768 | {plain_fwd_2k} / {plain_grad_2k} | {fx_fwd_2k} / {fx_grad_2k} |", "lm_loss"),
    ("docs/lm-loss.md", "| 8,192 x 131,072 | {plain_fwd_8k} / {plain_grad_8k} | {fx_fwd_8k} / {fx_grad_8k} |", "lm_loss"),
    ("docs/lm-loss.md", "the float32 logits alone are {logits_8k}", "lm_loss"),
    ("README.md", "its training step's temp {foldax:MB0} against {plain} with the logits formed", "lm_loss_example"),
    ("examples/lm_loss.py", "the step's temp is {plain}.", "lm_loss_example"),
    ("examples/lm_loss.py", "the step's temp is {foldax:MB0}, most of it", "lm_loss_example"),
    ("README.md", "needs {r64:.2f}x (N = 64) to {r256:.2f}x (N = 256) the memory of the same step with no Cauchy sum at all ({fx64:mb1} / {fx256} against {none64:mb1} / {none256}), where the naive kernel needs {naive64:.0f}x to {naive256:.0f}x", "flax_s4"),
    ("docs/kernels-graphs-transport.md", "the gradient needs {fx1:KB0} of temp memory for one model and {fx4} for four with foldax, against {dense1} and {dense4} with the kernel matrix", "equinox_gp"),
    ("examples/equinox_gp.py", "the gradient needs {fx1:KB0} of temp memory for one model and {fx4} for four (``filter_vmap``) with foldax, against {dense1} and {dense4} with the kernel matrix", "equinox_gp"),
    ("docs/kernels-graphs-transport.md", "temp memory is {fx_fwd} against {ops_fwd} forward and {fx_grad} against {ops_grad} for the gradient", "graph_attention"),
    ("examples/graph_attention.py", "XLA temp memory forward {fx_fwd} against {ops_fwd} (both), gradient {fx_grad} against {ops_grad}", "graph_attention"),
    ("docs/kernels-graphs-transport.md", "need {fx10k:KB0} of temp memory at n = m = 10,000, against {dense10k} dense", "sinkhorn"),
    ("docs/kernels-graphs-transport.md", "at n = m = 100,000, {fx100k} against {dense100k:GB0}", "sinkhorn"),
    ("examples/sinkhorn.py", "need {fx10k:KB0} of temp memory with foldax at n = m = 10,000, against {dense10k} for dense plain JAX", "sinkhorn"),
    ("examples/sinkhorn.py", "at n = m = 100,000, {fx100k} against {dense100k:GB0}", "sinkhorn"),
    ("docs/kernels-graphs-transport.md", "{dense10k} dense and {ott10k:MB0} with OTT-JAX; at n = m = 100,000, {fx100k} against {dense100k:GB0} and {ott100k:GB0}", "sinkhorn_ott"),
    ("examples/sinkhorn.py", "for dense plain JAX and {ott10k:MB0} for OTT-JAX; at n = m = 100,000, {fx100k} against {dense100k:GB0} and {ott100k:GB0}", "sinkhorn_ott"),
    ("docs/ragged-logsumexp.md", "1 chain(s): foldax.segment_logmeanexp {fx1} padded + masked logsumexp {pad1} ({r1:.0f}x)", "numpyro_events"),
    ("docs/ragged-logsumexp.md", "4 chain(s): foldax.segment_logmeanexp {fx4} padded + masked logsumexp {pad4} ({r4:.0f}x)", "numpyro_events"),
    ("docs/s4-cauchy.md", "forward ({naive_array} at H = 256, L = 1024, N = 512)", "s4_array"),
    ("docs/design.md", "to {fx:MB0}, where `jax.ops.segment_max`'s takes {ops:MB0}", "messages_max"),
    ("docs/distributed.md", "at N x 10, {eight:MB2} against {one:MB2} forward", "sharded"),
]  # fmt: skip

GROUPS = {}


def group(fn):
    """A group of figures: ``fn()`` -> ``{name: bytes or ratio}``, computed once, with JAX's
    default promotion rules (the examples are users' code: this suite's are stricter)."""

    @functools.cache
    def computed():
        with jax.numpy_dtype_promotion("standard"), jax.numpy_rank_promotion("allow"):
            return fn()

    GROUPS[fn.__name__] = computed
    return fn


def example(name: str):
    """``examples/NAME.py`` imported as a module (registered, as Flax modules need)."""
    key = f"_quoted_figures_{name}"
    if key in sys.modules:
        return sys.modules[key]
    spec = importlib.util.spec_from_file_location(key, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[key] = module
    spec.loader.exec_module(module)
    return module


def sds(*shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


@group
def ragged():
    """The ragged logsumexp under vmap of 10 theta, N = 1,159,351 (the demo's workload)."""
    sizes = w.seed_sizes()
    thetas, x = sds(10, w.FEATURES), sds(sum(sizes), w.FEATURES)
    out = {}
    for key, way in (("gm", w.way_global_max), ("fx", w.way_foldax)):
        fwd, grad = w.forward_and_grad(way(sizes))
        out[f"{key}_fwd"] = report(fwd, thetas, x).temp_bytes
        out[f"{key}_grad"] = report(grad, thetas, x).temp_bytes
    out["r_fwd"] = out["gm_fwd"] / out["fx_fwd"]
    out["r_grad"] = out["gm_grad"] / out["fx_grad"]
    return out


@group
def ragged_batch():
    """The gradient's temp under vmap of 10, 100, 1000 theta, and within a smaller budget, as
    examples/seed_vmap_memory.py prints it."""
    ex = example("seed_vmap_memory")
    sizes = w.seed_sizes()
    out = {f"b{b}": ex.temps(sizes, b, forward=False)[1] for b in (10, 100, 1000)}
    with foldax.memory_budget(ex.BUDGET):
        out["budget"] = ex.temps(sizes, 1000, forward=False)[1]
    return out


def _plain_loss(h, wv, labels):
    """The loss as usually written: the (T, V) logits, their log-sum-exp less the label's."""
    z = jnp.einsum("td,vd->tv", h, wv, preferred_element_type=jnp.float32)
    label_z = jnp.take_along_axis(z, labels[:, None], axis=-1)[:, 0]
    return jnp.mean(jax.nn.logsumexp(z, axis=-1) - label_z)


@group
def lm_loss():
    """``linear_cross_entropy`` against the plain loss, D = 512, float32: forward and value
    and gradient (with respect to h and w)."""
    out = {}
    for tag, t, v in (("2k", 2048, 32768), ("8k", 8192, 131072)):
        args = (sds(t, 512), sds(v, 512), sds(t, dtype=jnp.int32))
        for key, loss in (("plain", _plain_loss), ("fx", foldax.linear_cross_entropy)):
            out[f"{key}_fwd_{tag}"] = report(loss, *args).temp_bytes
            out[f"{key}_grad_{tag}"] = report(jax.value_and_grad(loss, (0, 1)), *args).temp_bytes
        out[f"logits_{tag}"] = t * v * 4
    return out


@group
def lm_loss_example():
    """examples/lm_loss.py's training step, both ways, at its full sizes."""
    ex = example("lm_loss")
    model = ex.TinyLM(32768, 128)
    params = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    tokens = sds(8, 1024, dtype=jnp.int32)
    return {
        "plain": report(ex.make_step(ex.loss_plain, model), params, tokens, tokens).temp_bytes,
        "foldax": report(ex.make_step(ex.loss_foldax, model), params, tokens, tokens).temp_bytes,
    }


@group
def flax_s4():
    """examples/flax_s4.py's training step at its defaults (H = 128, L = 1024), N = 64 and 256:
    foldax.cauchy, the naive kernel and the stand-in with no Cauchy sum."""
    ex = example("flax_s4")
    out = {}
    for n in (64, 256):
        for key, kernel in (
            ("fx", foldax.cauchy),
            ("naive", ex.cauchy_naive),
            ("none", ex.cauchy_stand_in),
        ):
            params, (xs, ys), step = ex.make_step(kernel, 128, n, 1024)
            out[f"{key}{n}"] = report(step, params, xs, ys).temp_bytes
        out[f"r{n}"] = out[f"fx{n}"] / out[f"none{n}"]
        out[f"naive{n}"] = out[f"naive{n}"] / out[f"none{n}"]
    return out


@group
def equinox_gp():
    """examples/equinox_gp.py's gradient memory at 20,000 training points."""
    figures = example("equinox_gp").gradient_memory(20_000, 250, 4, 100)
    return {f"{way.replace('foldax', 'fx')}{n}": b for (way, n), b in figures.items()}


@group
def graph_attention():
    """examples/graph_attention.py's GAT layer, V = 20,000, E = 400,000, H = 4, F = 32."""
    ex = example("graph_attention")
    graph = ex.make_graph(20_000, 400_000, 32)
    args = (ex.init_params(jax.random.key(0), 32, 4, 32), *graph)
    out = {}
    for key, label in (("fx", "foldax"), ("ops", "jax.ops")):
        layer = ex.ways()[label]
        for p, fn in (("fwd", layer), ("grad", jax.grad(ex.loss_of(layer)))):
            out[f"{key}_{p}"] = report_from_compiled(jax.jit(fn).lower(*args).compile()).temp_bytes
    return out


def _sinkhorn(labels):
    ex = example("sinkhorn")
    out = {}
    for tag, n in (("10k", 10_000), ("100k", 100_000)):
        figures = ex.memory(n, 0.5, 100)
        for key, label in labels.items():
            out[f"{key}{tag}"] = figures[label]
    return out


@group
def sinkhorn():
    """examples/sinkhorn.py's cost and gradient at n = m = 10,000 and 100,000."""
    return _sinkhorn({"fx": "foldax.pairwise_reduce", "dense": "dense plain JAX"})


@group
def sinkhorn_ott():
    """The same with OTT-JAX's dense PointCloud (where OTT-JAX is installed)."""
    if not example("sinkhorn").HAS_OTT:
        pytest.skip("OTT-JAX is not installed: pip install -e '.[examples]'")
    labels = {"fx": "foldax.pairwise_reduce", "dense": "dense plain JAX"}
    return _sinkhorn({**labels, "ott": "OTT-JAX dense PointCloud"})


@group
def numpyro_events():
    """examples/numpyro_events.py's potential gradient, 1 and 4 chains, foldax and padded."""
    ex = example("numpyro_events")
    sizes, x = ex.make_events()
    x_padded, mask = ex.pad_events(x, sizes)
    log_n = jnp.log(jnp.asarray(sizes, jnp.float32))
    out = {}
    for c in (1, 4):
        out[f"fx{c}"] = ex.potential_grad_temp(ex.model_foldax, x, sizes, chains=c)
        out[f"pad{c}"] = ex.potential_grad_temp(ex.model_padded, x_padded, mask, log_n, chains=c)
        out[f"r{c}"] = out[f"pad{c}"] / out[f"fx{c}"]
    return out


@group
def s4_array():
    """The naive S4 kernel's (H, L, N) complex64 array, as XLA's audit lists it."""
    from foldax.memory import audit

    ex = example("audit_s4")
    fn, args = ex.naive(512)
    return {"naive_array": max(b.nbytes for b in audit(fn, *args).buffers)}


@group
def messages_max():
    """A segment max of messages made in the same jit (dev/direct-scatter/messages_memory.py):
    the gradient, unsorted ids, foldax against jax.ops."""
    e, v, h, f = 200_000, 20_000, 8, 16
    ids = jax.random.randint(jax.random.key(0), (e,), 0, v)
    args = (sds(v, h, f), sds(e, h), ids, ids, sds(v, h, f))
    out = {}
    for key, op in (("fx", foldax.segment_max), ("ops", jax.ops.segment_max)):

        def grad(hh, att, snd, rcv, wt, op=op):
            def loss(hh, att):
                y = op(hh[snd] * att[..., None], rcv, v)
                return jnp.sum(jnp.where(jnp.isfinite(y), y, 0) * wt)

            return jax.grad(loss, (0, 1))(hh, att)

        out[key] = report(grad, *args).temp_bytes
    return out


SHARDED = """
import jax, jax.numpy as jnp
from foldax._tools import workloads as w
from foldax.memory import report_from_compiled
sizes = w.seed_sizes() * 10
n = sum(sizes) + (-sum(sizes)) % 8
fwd, _ = w.forward_and_grad(w.way_foldax_padded(sizes, n))
mesh = jax.make_mesh((8,), ("rows",))
split = jax.sharding.NamedSharding(mesh, jax.P("rows"))
thetas = jax.ShapeDtypeStruct((10, w.FEATURES), jnp.float32)
for rows in (jax.ShapeDtypeStruct((n, w.FEATURES), jnp.float32),
             jax.ShapeDtypeStruct((n, w.FEATURES), jnp.float32, sharding=split)):
    print(report_from_compiled(jax.jit(fwd).lower(thetas, rows).compile()).temp_bytes)
"""


@group
def sharded():
    """The ragged workload at N x 10, forward, per device on 1 and on 8 host devices."""
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SHARDED)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    one, eight = (int(s) for s in proc.stdout.split())
    return {"one": one, "eight": eight}


UNITS = {"KB": 1e3, "MB": 1e6, "GB": 1e9}


class _Figures(string.Formatter):
    """``{name:spec}`` of a figure: bytes as the docs write them, ratios as Python does."""

    def format_field(self, value, spec):
        unit = spec[:2].upper()
        if unit in UNITS:  # "MB1": "31.0 MB"; "mb1": "31.0"
            number = f"{value / UNITS[unit]:.{int(spec[2:])}f}"
            return number if spec[:2].islower() else f"{number} {unit}"
        if spec == "" and isinstance(value, int):
            return format_bytes(value)
        return format(value, spec)


def _flat(text: str) -> str:
    """Text with every run of whitespace one space: line breaks do not matter."""
    return re.sub(r"\s+", " ", text)


def _as_pattern(template: str) -> re.Pattern:
    """The passage with any figure in place of each field."""
    parts = re.split(r"\{[^}]*\}", _flat(template))
    return re.compile(r"[\d.,]+(?: [KMG]?B)?".join(map(re.escape, parts)))


def test_every_quoted_passage_is_in_its_file():
    """Each row's passage, figures aside, is still in its file (a reworded passage must have its
    row updated, or its figures would go unchecked), and each group is defined."""
    for rel, template, name in QUOTES:
        assert name in GROUPS, f"no group {name!r}"
        text = _flat((ROOT / rel).read_text())
        assert _as_pattern(template).search(text), f"{rel} no longer says: {template}"
    assert {name for *_, name in QUOTES} == set(GROUPS)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(GROUPS))
def test_quoted_figures_are_what_the_code_compiles(name):
    if (jax.__version__, jax.default_backend()) != MADE_WITH:
        pytest.skip(f"the figures quoted were made with jax {MADE_WITH[0]} on {MADE_WITH[1]}")
    figures = GROUPS[name]()
    wrong = []
    for rel, template, group_name in QUOTES:
        if group_name != name:
            continue
        want = _Figures().format(_flat(template), **figures)
        if want not in _flat((ROOT / rel).read_text()):
            wrong.append(f"{rel} should say: {want}")
    assert not wrong, "quoted figures differ from what the code compiles today:\n" + "\n".join(
        wrong
    )
