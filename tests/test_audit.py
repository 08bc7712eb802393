"""foldax.memory.audit / scaling and `foldax audit`: find the buffer that grows and its line."""

import dataclasses
import inspect
import subprocess
import sys
from pathlib import Path

import _callables
import jax
import jax.numpy as jnp
import pytest

import foldax
from foldax import memory

H, L = 16, 256


def naive_cauchy(v, z, w):
    return (v[:, None, :] / (z[None, :, None] - w[:, None, :])).sum(-1)  # CAUCHY LINE


CAUCHY_LINE = next(
    i + 1
    for i, line in enumerate(Path(__file__).read_text().splitlines())
    if line.rstrip().endswith("# CAUCHY LINE")
)


def _step(kernel):
    def loss(v, z, w):
        return jnp.sum(jnp.abs(kernel(v, z, w)) ** 2)

    return jax.grad(loss, argnums=(0, 1, 2))


def _make(kernel):
    def make(n):
        c = lambda *s: jax.ShapeDtypeStruct(s, jnp.complex64)  # noqa: E731
        return _step(kernel), (c(H, n), c(L), c(H, n))

    return make


def test_audit_names_the_cauchy_buffer_and_line():
    fn, args = _make(naive_cauchy)(64)
    rep = memory.audit(fn, *args, top=3)
    top = rep.buffers[0]
    assert {H, L, 64} <= set(top.shape), rep
    assert top.kind == "temp"
    assert top.dtype == "c64"
    assert top.nbytes == H * L * 64 * 8
    assert top.source.endswith(f"test_audit.py:{CAUCHY_LINE}"), rep
    assert top.primitive in {"div", "mul", "neg", "sub"}
    assert rep.totals.temp_bytes >= top.nbytes
    text = str(rep)
    assert "c64[16,256,64]" in text and f"test_audit.py:{CAUCHY_LINE}" in text


@pytest.mark.slow
def test_scaling_exponent_naive_vs_foldax():
    naive = memory.scaling(_make(naive_cauchy), [64, 128, 256])
    assert naive.exponent >= 0.9, naive
    assert naive.growing, naive
    g = naive.growing[0]
    assert g.exponent >= 0.9
    assert g.source.endswith(f"test_audit.py:{CAUCHY_LINE}")
    assert g.shapes[-1] == (H, L, 256)

    fx = memory.scaling(_make(foldax.cauchy), [64, 128, 256])
    # Nothing O(H L N): what grows is the size of the gradient itself, O(H N) (the cotangents
    # of v and w, complex64, accumulated in the loop), and nothing comes near the naive buffer.
    grown = fx.temp_bytes[-1] - fx.temp_bytes[0]
    assert grown <= 2 * 2 * H * (256 - 64) * 8, fx
    assert max(fx.temp_bytes) < naive.temp_bytes[-1] / 2, (fx, naive)


def test_scaling_says_when_nothing_grows():
    def make(n):
        return (lambda x: jnp.sin(x).sum(), (jax.ShapeDtypeStruct((1024,), jnp.float32),))

    rep = memory.scaling(make, [1, 2, 4])
    assert rep.growing == ()
    assert "no buffer live at the peak grows with N" in str(rep)


def test_scaling_needs_two_sizes():
    with pytest.raises(ValueError, match=r"foldax\.memory\.scaling"):
        memory.scaling(_make(naive_cauchy), [8])


def test_audit_reports_compile_errors_with_the_name():
    def broken(x):
        return jnp.dot(x, jnp.ones((3, 3)))  # (4,) @ (3, 3) fails at trace time

    with pytest.raises(RuntimeError, match=r"foldax.memory.audit\(broken\).*compile"):
        memory.audit(broken, jnp.ones(4))


def test_report_without_memory_analysis_is_a_clear_error():
    class NoAnalysis:
        def memory_analysis(self):
            return None

    with pytest.raises(RuntimeError, match=r"foldax.memory.report\(f\).*no compiled memory"):
        memory.report_from_compiled(NoAnalysis(), "f")


@pytest.mark.slow
def test_cli_audit(tmp_path):
    target = tmp_path / "target.py"
    target.write_text(
        inspect.cleandoc(
            """
            import jax, jax.numpy as jnp

            def make(n):
                def step(x):
                    return jnp.sort(jnp.outer(x, x), axis=0).sum()  # THE LINE
                return step, (jax.ShapeDtypeStruct((n,), jnp.float32),)
            """
        )
    )
    out = subprocess.run(
        [sys.executable, "-m", "foldax", "audit", f"{target}:make", "--sizes", "32,64,128"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "f32[128,128]" in out
    assert "target.py:5" in out
    assert "fitted exponent 2.0" in out


@pytest.mark.slow
def test_cli_audit_bad_target():
    out = subprocess.run(
        [sys.executable, "-m", "foldax", "audit", "no_such_file.py:make"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "no such file" in out.stderr


def test_cli_audit_plot(tmp_path):
    """`--plot` writes a PNG (the `plot` extra; skipped where matplotlib is absent)."""
    pytest.importorskip("matplotlib")
    target = tmp_path / "t.py"
    target.write_text(
        "import jax, jax.numpy as jnp\n"
        "def make(n):\n"
        "    return (lambda x: jnp.sort(jnp.outer(x, x), 0).sum(),\n"
        "            (jax.ShapeDtypeStruct((n,), jnp.float32),))\n"
    )
    png = tmp_path / "out.png"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "foldax",
            "audit",
            f"{target}:make",
            "--sizes",
            "16,32",
            "--plot",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------------------------
# Sources: the user's line, an argument, a constant; never foldax's own audit code

CLOSED_OVER = jnp.ones((512, 512))


def matmul_closed_over(x):
    return x @ CLOSED_OVER  # CLOSED-OVER LINE


CLOSED_OVER_LINE = next(
    i + 1
    for i, line in enumerate(Path(__file__).read_text().splitlines())
    if line.rstrip().endswith("# CLOSED-OVER LINE")
)


def test_audit_names_the_users_closed_over_array_not_foldax():
    """A closed-over array is a constant of the function: XLA keeps it as a buffer, which the
    HLO metadata places where the function was traced (inside foldax.memory.audit)."""
    rep = memory.audit(matmul_closed_over, jax.ShapeDtypeStruct((512, 512), jnp.float32))
    assert all("foldax/_audit/" not in b.source for b in rep.buffers), rep
    (const,) = [b for b in rep.buffers if b.source.startswith("constant")]
    assert const.shape == (512, 512) and const.nbytes == 512 * 512 * 4, rep
    assert const.source.endswith(f"test_audit.py:{CLOSED_OVER_LINE})"), rep
    assert const.source.startswith("constant (used at "), rep
    assert const.primitive == ""
    (arg,) = [b for b in rep.buffers if b.kind == "argument"]
    assert (arg.source, arg.primitive) == ("argument x", ""), rep
    (out,) = [b for b in rep.buffers if b.kind == "output"]
    assert (
        out.source.endswith(f"test_audit.py:{CLOSED_OVER_LINE}") and out.primitive == "dot_general"
    )
    assert "foldax/_audit/" not in str(rep) and f"test_audit.py:{CLOSED_OVER_LINE})" in str(rep)


def test_audit_closed_over_array_in_a_gradient_and_a_non_splat_constant(rng):
    table = jnp.asarray(rng.standard_normal((256, 256)), jnp.float32)

    def loss(x):
        return jnp.sum(jnp.sin(x @ table))  # TABLE LINE

    line = next(
        i + 1
        for i, text in enumerate(Path(__file__).read_text().splitlines())
        if text.rstrip().endswith("# TABLE LINE")
    )
    rep = memory.audit(jax.grad(loss), jax.ShapeDtypeStruct((256, 256), jnp.float32))
    assert all("foldax/_audit/" not in b.source for b in rep.buffers), rep
    (const,) = [b for b in rep.buffers if b.source.startswith("constant")]
    # XLA keeps a non-splat constant in a constant allocation, not in temp memory
    assert const.kind == "constant" and const.shape == (256, 256), rep
    assert const.source.endswith(f"test_audit.py:{line})"), rep
    assert rep.totals.temp_bytes < 2 * 256 * 256 * 4


def test_audit_tuple_outputs_and_loop_states_have_their_element_shapes():
    def two(x):
        return jnp.sin(x), jnp.cos(x)

    rep = memory.audit(two, jax.ShapeDtypeStruct((1000,), jnp.float32))
    outs = sorted(b.primitive for b in rep.buffers if b.kind == "output" and b.shape == (1000,))
    assert outs == ["cos", "sin"], rep

    make = _example(EXAMPLES / "audit_s4.py", "with_foldax")
    rep = memory.audit(*_call(make, 512), top=20)
    states = [b for b in rep.buffers if b.source == "loop state"]
    assert states and all(b.dtype != "tuple" for b in states if b.nbytes > 1024), rep
    # the cotangents of v and w accumulated in the fold's loop share the outputs' buffers
    assert ("output", (256, 512)) in {(b.kind, b.shape) for b in states}, rep


def _call(make, n):
    fn, args = make(n)
    return (fn, *args)


# ----------------------------------------------------------------------------------------------
# foldax.memory.scaling's sizes


def _never(n):
    raise AssertionError("sizes are checked before anything is compiled")


@pytest.mark.parametrize(
    ("sizes", "error", "match"),
    [
        ([64, 64], ValueError, r"sizes must be distinct .*64 is repeated.*two distinct sizes"),
        ([64, 64, 128], ValueError, r"sizes must be distinct .*64 is repeated"),
        ([8], ValueError, r"sizes needs at least two sizes"),
        ([], ValueError, r"sizes needs at least two sizes"),
        ([0, 8], ValueError, r"sizes must be distinct positive numbers: 0 is not positive"),
        ([-4, 8], ValueError, r"sizes must be distinct positive numbers: -4 is not positive"),
        ([64.0, 128], TypeError, r"sizes must be whole numbers \(int\).*got 64\.0"),
        ([True, 8], TypeError, r"sizes must be whole numbers"),
        (["64", 128], TypeError, r"sizes must be whole numbers"),
        (64, TypeError, r"sizes must be a sequence of whole numbers"),
        ("64,128", TypeError, r"sizes must be a sequence of whole numbers"),
    ],
)
def test_scaling_refuses_bad_sizes(sizes, error, match):
    with pytest.raises(error, match=r"^foldax\.memory\.scaling: " + match) as info:
        memory.scaling(_never, sizes)
    assert "e.g. sizes=[" in str(info.value)


def test_scaling_sorts_sizes_and_takes_numpy_integers():
    import numpy as np

    def make(n):
        return (
            lambda x: jnp.sort(jnp.outer(x, x), 0).sum(),
            (jax.ShapeDtypeStruct((n,), jnp.float32),),
        )

    rep = memory.scaling(make, [np.int64(128), 32, 64])
    assert rep.sizes == (32, 64, 128) and all(type(s) is int for s in rep.sizes)
    assert rep.temp_bytes[0] < rep.temp_bytes[1] < rep.temp_bytes[2]
    assert round(rep.exponent) == 2 and rep.fold_steps == (None, None, None) and not rep.note


def test_the_command_line_and_scaling_share_one_check_of_sizes():
    from foldax import _audit
    from foldax._tools import cli as _cli

    assert _cli.check_sizes is _audit.check_sizes
    with pytest.raises(_cli.UsageError, match=r"^--sizes must be distinct .*64 is repeated"):
        _cli._parse_sizes("64,64")
    assert _cli._parse_sizes("512, 64,256") == [64, 256, 512]


# ----------------------------------------------------------------------------------------------
# Sizes too small for a fold to take several steps


def _example(path, name):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"_example_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


EXAMPLES = Path(__file__).parent.parent / "examples"


@pytest.mark.slow
def test_scaling_says_when_the_folds_ran_in_one_step():
    """At N = 64, 256, 512 the segment workload's folds hold every row in one step: temp memory
    grows with N (exponent ~1.6), which tells nothing about whether it stays flat."""
    make = _example(EXAMPLES / "audit_segment.py", "with_foldax")
    rep = memory.scaling(make, [64, 256, 512])
    assert rep.fold_steps == (1, 1, 1), rep
    assert rep.exponent > 0.5, rep
    assert "ran in one step" in rep.note and "too small to tell" in rep.note, rep
    assert "note: at N=64, 256, 512 foldax's folds ran in one step" in str(rep)


@pytest.mark.slow
def test_scaling_of_a_fold_with_several_steps_has_no_note():
    def make(n):
        def f(x):
            return foldax.segment_logsumexp(x, sizes=[n // 3, n - n // 3], chunk_size=1024)

        return f, (jax.ShapeDtypeStruct((n,), jnp.float32),)

    rep = memory.scaling(make, [8192, 16384, 32768])
    assert all(s is not None and s >= 8 for s in rep.fold_steps), rep
    assert abs(rep.exponent) < 0.1 and rep.note == "", rep
    assert "note:" not in str(rep)


# ----------------------------------------------------------------------------------------------
# Any callable: Equinox transforms and modules, bound methods, partials, non-array arguments


@pytest.mark.parametrize("case", sorted(_callables.CASES))
def test_audit_of_any_callable_equals_the_plain_jitted_function(case):
    (fn, args, kwargs), (plain, plain_args) = _callables.CASES[case]
    got = memory.audit(fn, *args, top=50, **kwargs)
    want = memory.audit(jax.jit(plain), *plain_args, top=50)
    assert dataclasses.replace(got.totals, name="") == dataclasses.replace(want.totals, name="")
    assert (got.peak_bytes, got.peak_kinds) == (want.peak_bytes, want.peak_kinds), (got, want)
    layout = lambda rep: sorted((b.nbytes, b.kind, b.shape) for b in rep.buffers)  # noqa: E731
    assert layout(got) == layout(want), (got, want)


def test_audit_names_the_arrays_of_an_equinox_module():
    (fn, args, _), _ = _callables.CASES["eqx.filter_grad"]
    sources = {b.source for b in memory.audit(fn, *args, top=50).buffers}
    assert {"argument model.w", "argument model.extra['scale']", "argument x"} <= sources, sources
    (fn, args, _), _ = _callables.CASES["module method"]
    sources = {b.source for b in memory.audit(fn, *args, top=50).buffers}
    assert {"argument self.w", "argument self.extra['scale']", "argument x"} <= sources, sources


# ----------------------------------------------------------------------------------------------
# The printed audit: relative paths, the user's lines only, plain names, every source explained


def _line_of(marker):
    return next(
        i + 1
        for i, line in enumerate(Path(__file__).read_text().splitlines())
        if line.rstrip().endswith(marker)
    )


REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_audit_paths_are_relative_to_the_working_directory(monkeypatch):
    fn, args = _make(naive_cauchy)(64)
    monkeypatch.chdir(REPO)
    text = str(memory.audit(fn, *args, top=3))
    assert f" tests/test_audit.py:{CAUCHY_LINE} " in text, text
    assert str(REPO) not in text, text
    monkeypatch.chdir(REPO / "tests")
    rep = memory.audit(fn, *args, top=3)
    assert rep.buffers[0].source == f"test_audit.py:{CAUCHY_LINE}", rep


def segment_loss(x):
    return foldax.segment_logsumexp(x, sizes=[5000, 15000], chunk_size=1024).sum()  # SEGMENT LINE


def test_audit_shows_the_users_line_for_what_foldax_made(monkeypatch):
    """Buffers foldax's engine made (its loops, their states and constants) are put on the line
    that called foldax; no line of foldax itself is printed."""
    import re

    monkeypatch.chdir(REPO)
    rep = memory.audit(jax.grad(segment_loss), jax.ShapeDtypeStruct((20000,), jnp.float32), top=50)
    text = str(rep)
    assert "src/foldax/" not in text and "foldax/_" not in text, text
    assert set(re.findall(r"[\w./-]+\.py:\d+", text)) == {
        f"tests/test_audit.py:{_line_of('# SEGMENT LINE')}"
    }, text
    loop = [b for b in rep.buffers if b.primitive == "while"]
    assert loop and all(b.source.startswith("tests/test_audit.py:") for b in loop), rep


def test_audit_prints_argument_names_without_escapes():
    def f(params, x):
        return jnp.sort(jnp.outer(x, params["a"]), axis=0).sum() + params["b"].sum()

    params = {"a": jnp.ones(256), "b": jnp.ones(300)}
    rep = memory.audit(f, params, jnp.ones(256), top=50)
    text = str(rep)
    assert "argument params['a']" in text and "argument params['b']" in text, text
    assert "\\'" not in text and "\\'" not in "".join(b.op_name for b in rep.buffers), text


def test_audit_explains_buffers_xla_made_and_unknown_sources(monkeypatch):
    """XLA splits the Cauchy kernel's sum in two stages; the first stage's buffer has no line of
    its own: it is shown with the line that uses it, and the printout says what that means."""
    monkeypatch.chdir(REPO)
    fn, args = _make(naive_cauchy)(64)
    rep = memory.audit(fn, *args, top=50)
    line = f"tests/test_audit.py:{CAUCHY_LINE}"
    made = [b for b in rep.buffers if b.source.startswith("made by XLA")]
    assert made and all(b.source == f"made by XLA (used at {line})" for b in made), rep
    text = str(rep)
    assert "\nmade by XLA: a buffer XLA's optimizations made" in text, text
    assert all(b.source for b in rep.buffers), rep  # nothing left as a bare "?"
    # a source still unknown prints as "?", with what it means
    unknown = dataclasses.replace(rep, buffers=(dataclasses.replace(rep.buffers[0], source=""),))
    assert "?: no line of Python recorded for it" in str(unknown), unknown
    assert "?:" not in text


def test_audit_says_what_live_at_the_peak_counts():
    """The figure live at the peak counts memory shared in place once, splits by kind, and the
    printout says why it differs from XLA's temp total."""
    (fn, args, _), _ = _callables.CASES["module method"]  # its output is written in place
    rep = memory.audit(fn, *args, top=50)
    kinds = dict(rep.peak_kinds)
    assert rep.peak_bytes == sum(kinds.values()), rep
    t = rep.totals
    assert rep.peak_bytes - kinds.get("constant", 0) <= t.temp_bytes + t.argument_bytes + (
        t.output_bytes
    ), rep
    assert kinds.get("temp", 0) <= t.temp_bytes and kinds["argument"] == t.argument_bytes, rep
    lines = str(rep).splitlines()
    assert lines[1].startswith(f"live at the peak: {memory.format_bytes(rep.peak_bytes)} ("), lines
    assert lines[2] == f"XLA's totals: {t.figures()}", lines
    assert "XLA's temp total: all its scratch memory" in lines[3], lines
    assert "which also holds buffers live at other moments" in lines[3], lines


def test_audit_with_a_persistent_compilation_cache(tmp_path):
    """With JAX's persistent compilation cache on, an executable may come from the cache, of
    which XLA dumps nothing: the audit compiles its own, and leaves the cache on."""
    from jax.experimental.compilation_cache import compilation_cache

    f = lambda x: foldax.segment_sum(jnp.exp(x), sizes=[3, 5])  # noqa: E731
    x = jnp.ones(8)
    names = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    before = [getattr(jax.config, n) for n in names]
    for n, v in zip(names, (str(tmp_path), 0, 0), strict=True):
        jax.config.update(n, v)
    compilation_cache.reset_cache()
    try:
        jax.jit(f).lower(x).compile()  # now in the cache
        assert any(tmp_path.iterdir())
        first, again = memory.audit(f, x), memory.audit(f, x)
        assert first.peak_bytes == again.peak_bytes
        assert jax.config.jax_enable_compilation_cache
    finally:
        for n, v in zip(names, before, strict=True):
            jax.config.update(n, v)
        compilation_cache.reset_cache()
