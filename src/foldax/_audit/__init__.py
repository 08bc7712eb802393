"""Which buffers are live at a compiled program's memory peak, and which line of code made them.

XLA decides where every buffer lives (its buffer assignment) and when (its live ranges); it can
dump both as text (``xla_dump_to``). :func:`audit` compiles a function with that dump switched on,
reads the peak's live buffers from the ``*-live-range.txt`` file, and resolves each buffer's HLO
instruction to its JAX primitive and the user's ``file:line`` through the HLO metadata
(``op_name`` and ``stack_frame_id`` -> ``StackFrames`` -> ``FileLocations`` -> ``FileNames``).
:func:`scaling` does that at several sizes and fits how each buffer grows.

The dump and its parsing are in :mod:`._dump`, the audit and its report in :mod:`._buffers`, the
scaling fits and the check of their sizes in :mod:`._fits`; this package only re-exports them.
"""

from ._buffers import AuditReport as AuditReport
from ._buffers import Buffer as Buffer
from ._buffers import audit as audit
from ._fits import EXAMPLE_SIZES as EXAMPLE_SIZES
from ._fits import Growth as Growth
from ._fits import ScalingReport as ScalingReport
from ._fits import _scaling as _scaling
from ._fits import check_sizes as check_sizes
from ._fits import scaling as scaling

__all__ = ["AuditReport", "Buffer", "Growth", "ScalingReport", "audit", "scaling"]
