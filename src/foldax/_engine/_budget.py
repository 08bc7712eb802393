"""The memory budget: how many bytes one streamed step may keep live, over the whole batch.

A step of the fold holds one chunk of rows (or one tile of pairs) and everything the user's
``fn`` / ``kernel`` computes from it, for every element of every enclosing ``vmap``. The planner
(:mod:`foldax._engine._plan`) sizes steps so that this working set stays within

* the budget: :data:`DEFAULT_BUDGET` unless a :func:`memory_budget` context says otherwise; it
  bounds the scratch memory whatever the outer batch is;
* a per-backend step size: on CPU a step larger than the caches only costs memory, so steps stop
  growing at :data:`CPU_STEP` (8 MiB and 2^18 rows per batch element for a segment reduction,
  8 MiB and 2^14 pairs for a pairwise one), except that a reduction with a preferred dense tile
  (min, argmin, k-min) grows its steps to that tile within the budget, large enough for XLA:CPU
  to spread them over its threads; on GPU the budget itself is the step size (fewer, larger
  steps); on TPU too, except that a step whose tile fuses into its reduction (it keeps no
  value per pair) takes :data:`TPU_FUSED_STEP` pairs per batch element.
"""

from __future__ import annotations

import contextlib
import fractions
import numbers
import re
import threading

#: The default budget for one step's working set, all batch elements together.
DEFAULT_BUDGET = 16 * 2**20
#: Steps on CPU stop growing (bytes over the batch, and rows or pairs per batch element) at these
#: sizes, whatever the budget: a larger step only costs memory there. Keyed by plan: segment rows
#: (tiles, rows) or pairs (dense).
CPU_STEP = {"rows": (8 * 2**20, 2**18), "pairs": (8 * 2**20, 2**14)}
#: Pairs per batch element of a TPU step whose tile fuses into its reduction (the step keeps
#: no value per pair, only its inputs): the budget does not bind such a step, and each step of
#: the loop costs a TPU several microseconds (S4's Cauchy gradient, H = 256, L = 16,384,
#: N = 512, on a v5e: 190 ms in 16 MiB steps, 112 ms in steps of 2^22 pairs, 103 ms as one
#: tile of 2^23, 101 ms broadcast; temp 0.6 MiB or less in every case).
TPU_FUSED_STEP = 2**24
#: What a pair may cost and still count as fused: the probe's own inputs (a mask, 1 byte)
FUSED_PAIR_BYTES = 2.0

_local = threading.local()
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_UNIT_NAMES = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB; any case"


def parse_bytes(value, name="foldax.memory_budget") -> int:
    """An int (also a NumPy integer), or a string like ``"64MB"`` / ``"1.5 GiB"`` / ``"1TiB"``,
    as a positive number of bytes (a fractional number of bytes is rounded down)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral | str):
        number = isinstance(value, numbers.Number) or hasattr(value, "dtype")
        what = repr(value) if number and len(repr(value)) <= 40 else type(value).__name__
        real = isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral)
        hint = " (write int(...) for a whole number of bytes)" if real else ""
        raise TypeError(
            f"{name}: give a number of bytes (int) or a string like '64MB', got {what}{hint}."
        )
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
        unit = m and m.group(2).lower()
        if not m or unit not in _UNITS:
            raise ValueError(
                f"{name}: cannot read {value!r} as a size; write e.g. 8000000, '64MB', '512KiB' "
                f"or '1GB' (units: {_UNIT_NAMES})."
            )
        nbytes = int(fractions.Fraction(m.group(1)) * _UNITS[unit])
    else:
        nbytes = int(value)
    if nbytes <= 0:
        raise ValueError(f"{name}: the budget must be positive, got {value!r}.")
    return nbytes


@contextlib.contextmanager
def memory_budget(nbytes):
    """Bound the scratch memory of every foldax reduction traced inside this context.

    The budget counts one streamed step's working set over the whole batch: the rows (or tile of
    pairs) of a step, what ``fn`` / ``kernel`` computes from them, for every element of every
    enclosing ``jax.vmap`` (including a framework's, e.g. Flax's ``nn.vmap`` or numpyro's
    plates), forward, backward and forward-mode alike. Steps shrink as the batch grows so that
    the total stays near the budget. Explicit ``chunk_size`` / ``block_size`` arguments win.

    The budget is read when a reduction is *traced*: put the context around the call that traces
    (``jax.jit(f)(x)``, ``jax.grad(f)(x)``, a model's ``apply``), also when the call happens
    inside another library. A function JAX has already traced and cached (a ``jax.jit`` called
    before with the same shapes) keeps the budget it was traced with.

    Args:
      nbytes: a positive int (or NumPy integer), or a string such as ``"64MB"``, ``"512KiB"``,
        ``"1.5 GiB"``, ``"1TB"`` (units B, KB, MB, GB, TB in powers of 1000, KiB, MiB, GiB, TiB in
        powers of 1024; any case).

    Example:
      >>> import jax, jax.numpy as jnp, foldax
      >>> x = jnp.ones((10_000, 5))
      >>> f = lambda t: foldax.segment_logsumexp(x, sizes=[4000, 6000], fn=lambda r: r @ t)
      >>> with foldax.memory_budget("4MB"):
      ...     out = jax.vmap(f)(jnp.ones((100, 5)))
      >>> out.shape
      (100, 2)
    """
    value = parse_bytes(nbytes)
    previous = getattr(_local, "budget", None)
    _local.budget = value
    try:
        yield value
    finally:
        _local.budget = previous


def current_budget() -> int:
    """The budget in force: the innermost :func:`memory_budget`, else :data:`DEFAULT_BUDGET`."""
    budget = getattr(_local, "budget", None)
    return DEFAULT_BUDGET if budget is None else budget


__all__ = [
    "CPU_STEP",
    "DEFAULT_BUDGET",
    "FUSED_PAIR_BYTES",
    "TPU_FUSED_STEP",
    "current_budget",
    "memory_budget",
    "parse_bytes",
]
