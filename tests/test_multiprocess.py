"""Two processes on this machine, one CPU device each, joined by ``jax.distributed`` (gloo CPU
collectives): a segment reduction with a fitted ``fn``, its gradient and a pairwise reduction on
a row-sharded global array match float64 references on both (see ``multiprocess_case.py``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_agree_with_float64():
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # one device per process
    procs = [
        subprocess.Popen(
            [sys.executable, str(HERE / "multiprocess_case.py"), str(i), "2", str(port)],
            env=env,
            cwd=HERE.parent,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240)[0])
    finally:
        for p in procs:
            p.kill()
    for i, (p, out) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-4000:]}"
        assert f"process {i}: ok" in out, out[-4000:]
