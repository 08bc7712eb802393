"""foldax.memory.audit / scaling and `foldax audit`: find the buffer that grows and its line."""

import inspect
import subprocess
import sys
from pathlib import Path

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
