"""``dot_product_attention``'s scalar options: checked, and read as the Python floats they act
as (NumPy scalars and 0-d arrays of any width too), for the call and for its eager cache."""

from __future__ import annotations

import math
import numbers

import jax.numpy as jnp

_NAME = "foldax.dot_product_attention"


def _fail(what, fix):
    raise ValueError(f"{_NAME}: {what}; {fix}.")


def _real(value):
    """A concrete real scalar -- a Python, NumPy or 0-d array's int or float, of any width --
    as a Python float, else ``None`` (a bool, a complex, a traced value, anything else)."""
    if isinstance(value, bool):
        return None
    if not isinstance(value, numbers.Real):  # NumPy scalars, 0-d NumPy and JAX arrays
        dtype = getattr(value, "dtype", None)
        if dtype is None or getattr(value, "ndim", None) != 0:
            return None
        if not any(jnp.issubdtype(dtype, kind) for kind in (jnp.integer, jnp.floating)):
            return None
    try:
        return float(value)
    except (TypeError, OverflowError):  # (ConcretizationTypeError is a TypeError)
        return None


def _check_options(dropout_rate, deterministic, module, implementation, cap):
    """Refuse what Flax's or ``jax.nn``'s options ask for and this function cannot do, and a
    soft cap that is not a positive number; ``(dropout_rate, cap)`` as Python floats."""
    rate, given_cap = _real(dropout_rate), cap
    cap = None if given_cap is None else _real(given_cap)
    if given_cap is not None and not (cap is not None and 0 < cap < math.inf):
        _fail(
            f"logits_soft_cap must be a positive number, got {given_cap!r}",
            "pass a finite cap > 0 or None",
        )
    if implementation not in (None, "xla", "pallas", "cudnn"):
        _fail(
            f"implementation must be None, 'xla', 'pallas' or 'cudnn', got {implementation!r}",
            "leave it out (the fastest for the platform: the Pallas kernels on a TPU, the "
            "streamed XLA fold elsewhere)",
        )
    if rate is None or not 0 <= rate < 1:
        _fail(
            f"dropout_rate must be a number in [0, 1), got {dropout_rate!r}",
            "pass the share of attention weights to drop, e.g. 0.1",
        )
    if module is not None:
        _fail(
            "a module was passed to sow the attention weights, which are never formed",
            "call the module with sow_weights=False (or use Flax's attention_fn to inspect them)",
        )
    return rate, cap


def _eager_options(arguments):
    """The arguments an eager call is keyed and run with: a real-scalar ``dropout_rate`` or
    ``logits_soft_cap`` of any type as the Python float it acts as (``np.float32(0.25)``,
    ``0.25`` and a 0-d array of it run one executable); anything else as given (the call then
    raises its own error)."""
    told = dict(arguments)
    for name in ("dropout_rate", "logits_soft_cap"):
        if name in told and (number := _real(told[name])) is not None:
            told[name] = number
    return told
