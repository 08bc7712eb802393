"""Pallas kernels for the TPU, one per file, each with its block sizes and the rule saying
which folds it serves (:func:`serves`): the dense fold (``_contracting``), a tile of pairs
made from a block of ``x`` and a block of ``y`` (a matrix product on the MXU and the kernel's
scalar function) reduced by the fold's monoid, or summed by a derived fold, in VMEM.

Pallas is imported only when a fold may take a kernel (on a TPU, or when asked for)."""

from __future__ import annotations

import collections
import contextlib
import contextvars

#: set while a fold whose kernel failed to lower is lowered again, by the XLA loop
_REFUSING = contextvars.ContextVar("foldax_tpu_refusing", default=False)
#: the errors kernels failed to lower with, most recent last
_REFUSALS: collections.deque = collections.deque(maxlen=32)


@contextlib.contextmanager
def refusing(error):
    """While lowering a fold again after its kernel failed to lower with ``error`` (a body
    Pallas cannot lower, a gather say): no kernel serves it, the XLA loop does."""
    _REFUSALS.append(error)
    token = _REFUSING.set(True)
    try:
        yield
    finally:
        _REFUSING.reset(token)


def refused() -> bool:
    """Whether the fold being lowered is one whose kernel failed to lower (see
    :func:`refusing`): ``Fold.kernel_serves`` answers no, whatever it found before."""
    return _REFUSING.get()


def refusals() -> list:
    """The errors kernels failed to lower with (the folds they left to the XLA loop), most
    recent last: what a benchmark prints when a fold it expected on a kernel was not."""
    return list(_REFUSALS)


def _wanted(spec, platform) -> bool:
    impl = spec.implementation
    return impl != "xla" and (platform == "tpu" or impl == "pallas")


def serves(spec, in_avals, out_aval, platform, finish) -> bool:
    """Whether a kernel computes the fold ``spec`` on ``platform`` (see ``_contracting``)."""
    if not _wanted(spec, platform) or spec.plan.kind != "dense":
        return False
    from . import _contracting

    return _contracting.serves(spec, in_avals, out_aval, platform, finish)


def lower(spec, in_avals, out_aval, finish, args, *, platform):
    """The fold's outputs, computed by the kernel that :func:`serves` it."""
    from . import _contracting

    return _contracting.lower(spec, in_avals, out_aval, finish, args, platform=platform)
