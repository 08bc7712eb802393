"""Run-time checks of traced partition arguments, opt-in: ``with foldax.debug_checks():``.

Traced ``sizes`` / ``offsets`` (and ``segment_ids`` promised sorted) cannot be validated when a
reduction is traced; by default they are the caller's promise, as in ``jax.ops``. Inside
:func:`debug_checks`, reductions *traced* there also check them when they run (a host callback,
so under ``jit``, ``vmap`` and ``grad`` too) and raise a ``ValueError`` naming the function, the
argument and what is wrong. The check costs a device-to-host copy of the ``(S,)`` or ``(N,)``
array per call: a debugging aid, not a default.
"""

from __future__ import annotations

import contextlib
import operator
import threading

import jax
import numpy as np

_local = threading.local()


@contextlib.contextmanager
def debug_checks(enabled: bool = True):
    """Check traced ``sizes``, ``offsets`` and sorted ``segment_ids`` at run time.

    Reductions traced inside the context check, when they run, that traced ``sizes`` are
    ``>= 0`` and sum to ``N``, that traced ``offsets`` run from 0 to ``N`` without decreasing,
    and that traced ``segment_ids`` passed with ``indices_are_sorted=True`` are sorted; a
    violation raises a ``ValueError`` (under ``jit``, wrapped in JAX's runtime error) naming the
    function and the argument. The flag is read when a reduction is traced: a function that
    ``jax.jit`` already compiled keeps the checks it was traced with.

    Example:
      >>> import jax, jax.numpy as jnp, foldax
      >>> f = jax.jit(lambda d, s: foldax.segment_sum(d, sizes=s))
      >>> with foldax.debug_checks():
      ...     f(jnp.ones(4), jnp.array([1, 3]))
      Array([1., 3.], dtype=float32)
    """
    before = getattr(_local, "on", False)
    _local.on = bool(enabled)
    try:
        yield
    finally:
        _local.on = before


def enabled() -> bool:
    return getattr(_local, "on", False)


def first_decrease(ids):
    """The first ``i`` with ``ids[i] > ids[i + 1]``, or ``None`` if ``ids`` (NumPy) are sorted.
    Compared in their own dtype, exact for every integer dtype (``np.diff`` wraps for unsigned
    ids, and int64 cannot hold every uint64)."""
    ids = np.asarray(ids)
    bad = np.flatnonzero(ids[1:] < ids[:-1])
    return int(bad[0]) if bad.size else None


def unsorted_error(ids):
    """What is wrong with ``segment_ids`` promised sorted (``None`` if they are sorted)."""
    i = first_decrease(ids)
    if i is None:
        return None
    return (
        f"indices_are_sorted=True, but segment_ids are not sorted (segment_ids[{i}] = "
        f"{ids[i]} > segment_ids[{i + 1}] = {ids[i + 1]})"
    )


def partition_error(arg, x, n):
    """What is wrong with the values ``x`` of a partition argument (``arg``: ``"sizes"``,
    ``"offsets"`` or ``"segment_ids"``) for ``n`` rows; ``None`` if nothing. One wording for
    arguments known when traced and for those checked when they run."""
    if arg == "segment_ids":
        return unsorted_error(x)
    x = np.asarray(x, np.int64)
    if arg == "sizes":
        if np.any(x < 0):
            i = int(np.flatnonzero(x < 0)[0])
            return f"sizes must be >= 0, but sizes[{i}] = {x[i]}"
        if int(x.sum()) != n:
            return (
                f"sizes sum to {int(x.sum())} but data has N = {n} rows; the segments must "
                f"cover the leading axis exactly"
            )
    elif arg == "offsets":
        if x[0] != 0 or x[-1] != n:
            return f"offsets must start at 0 and end at N = {n}, got {x[0]} ... {x[-1]}"
        if np.any(np.diff(x) < 0):
            i = int(np.flatnonzero(np.diff(x) < 0)[0])
            return f"offsets must be non-decreasing, but offsets[{i}] = {x[i]} > offsets[{i + 1}] = {x[i + 1]}"
    return None


def check_partition(name, arg, x, n):
    """With :func:`debug_checks` on, check the traced partition argument ``x`` (``arg``:
    ``"sizes"``, ``"offsets"`` or ``"segment_ids"``) when the computation runs."""
    if not enabled():
        return

    def check(x):
        for row in np.asarray(x).reshape(-1, np.shape(x)[-1]):  # one per batch element
            err = partition_error(arg, row, n)
            if err is not None:
                raise ValueError(f"{name}: {err} (checked by foldax.debug_checks).")

    jax.debug.callback(check, x)


def static_int(name, arg, value, fix):
    """``value`` as a Python int, else a TypeError naming the function ``name`` and its argument
    ``arg``, what was given, and ``fix`` (a bool, a float or a traced array is not a static
    int)."""
    try:
        if isinstance(value, bool | np.bool_):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name}: {arg} must be a static Python int, got {type(value).__name__} "
            f"{value!r:.40}; {fix}."
        ) from None


def concrete_rows(name, what, n):
    """``n`` (the size of ``what``, an axis) as an int, or a ValueError when it is symbolic
    (``jax.export`` with symbolic shapes)."""
    if isinstance(n, int):
        return n
    try:
        return int(n)
    except Exception:
        raise ValueError(
            f"{name}: {what} has a symbolic size ({n}); foldax plans its loop "
            f"from a concrete size. Export with concrete shapes (one export per size), or pad "
            f"the rows to a fixed size (padding rows in no segment, or masked out)."
        ) from None


__all__ = [
    "check_partition",
    "concrete_rows",
    "debug_checks",
    "enabled",
    "first_decrease",
    "partition_error",
    "static_int",
    "unsorted_error",
]
