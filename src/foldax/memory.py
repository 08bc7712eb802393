"""Memory measured by XLA's compiled memory analysis: deterministic, so it can be asserted in tests.

>>> import jax.numpy as jnp, foldax
>>> r = foldax.memory.report(lambda x: jnp.exp(x).sum(), jnp.ones((1000,)))
>>> r.argument_bytes
4000
"""

from ._audit import AuditReport as AuditReport
from ._audit import Buffer as Buffer
from ._audit import Growth as Growth
from ._audit import ScalingReport as ScalingReport
from ._audit import audit as audit
from ._audit import scaling as scaling
from ._memory import MemoryReport as MemoryReport
from ._memory import format_bytes as format_bytes
from ._memory import report as report
from ._memory import report_from_compiled as report_from_compiled

__all__ = [
    "AuditReport",
    "Buffer",
    "Growth",
    "MemoryReport",
    "ScalingReport",
    "audit",
    "format_bytes",
    "report",
    "report_from_compiled",
    "scaling",
]
