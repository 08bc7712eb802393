"""The one streamed fold: plans (:mod:`._plan`), the memory budget (:mod:`._budget`) and the
primitive with its batching and differentiation rules (:mod:`._primitive`)."""

import jax

from ._budget import current_budget as current_budget
from ._budget import memory_budget as memory_budget
from ._plan import PlanSpec as PlanSpec
from ._plan import static_tilings as static_tilings
from ._primitive import Fold as Fold
from ._primitive import Spec as Spec
from ._primitive import unit_bytes as unit_bytes


def fold(spec, arrays, consts, slots, rows):
    """Run the fold ``spec`` on four tuples of arrays; returns ``(slot outs, tots, row outs)``."""
    args = (tuple(arrays), tuple(consts), tuple(slots), tuple(rows))
    return Fold(spec, jax.tree.map(jax.typeof, args))(*args)
