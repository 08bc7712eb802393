"""The one streamed fold. A fold's static description (:mod:`._spec`), the plans that walk its
reduced axis (:mod:`._plan`), the memory budget (:mod:`._budget`) and the planner's probe of a
step (:mod:`._probe`), the loop (:mod:`._loop`), the bodies of its derivatives
(:mod:`._derived`), the folds that are one XLA operation (:mod:`._direct`), and the primitive
with its batching and differentiation rules (:mod:`._primitive`, registered with JAX in
:mod:`._registration`)."""

import jax

from ._budget import current_budget as current_budget
from ._budget import memory_budget as memory_budget
from ._implementation import current_implementation as current_implementation
from ._implementation import implementation as implementation
from ._plan import PlanSpec as PlanSpec
from ._plan import static_tilings as static_tilings
from ._primitive import Fold as Fold
from ._probe import unit_bytes as unit_bytes
from ._runs import reads_once as reads_once
from ._spec import Spec as Spec


def fold(spec, arrays, consts, slots, rows):
    """Run the fold ``spec`` on four tuples of arrays; returns ``(slot outs, tots, row outs)``."""
    args = (tuple(arrays), tuple(consts), tuple(slots), tuple(rows))
    return Fold(spec, jax.tree.map(jax.typeof, args))(*args)
