"""Which lowering a fold takes: the engine's XLA loop, or an accelerator kernel where one
serves it (:mod:`foldax._kernels`).

``None`` (the default) picks per platform: a Pallas kernel on a TPU for the folds it serves,
the XLA loop everywhere else. ``"xla"`` always takes the loop; ``"pallas"`` takes the kernel
wherever it serves the fold, on a CPU in Pallas' interpret mode (how the kernels are tested
without a TPU). Read when a reduction is traced, like the memory budget, and kept in the fold's
:class:`~foldax._engine.Spec` (so that it is part of every cache key).
"""

from __future__ import annotations

import contextlib
import threading

IMPLEMENTATIONS = (None, "xla", "pallas")

_local = threading.local()


def check(name, implementation):
    """``implementation`` if it is one foldax knows, else a ``ValueError`` naming ``name``."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"{name}: implementation={implementation!r:.40} is not one foldax knows; pass None "
            f"(the fastest for the platform), 'xla' (the streamed XLA fold) or 'pallas' (the "
            f"Pallas kernel where one serves the reduction; interpreted on a CPU)."
        )
    return implementation


@contextlib.contextmanager
def implementation(name):
    """Fold every reduction traced inside this context with ``name``'s lowering."""
    previous = getattr(_local, "value", None)
    _local.value = check("foldax.implementation", name)
    try:
        yield name
    finally:
        _local.value = previous


def current_implementation():
    """The implementation in force: the innermost :func:`implementation`, else ``None``."""
    return getattr(_local, "value", None)
