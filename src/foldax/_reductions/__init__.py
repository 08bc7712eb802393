"""Reductions: the monoids that the fold engine knows how to stream.

A monoid describes one reduction as a small *state* per output slot (a tuple of arrays) with

* ``init(num, feature_shape, dtype)``: the identity state, leading axis ``num``;
* ``reduce(v, mask)``: the state of each tile, ``v`` of shape ``(G, T, *F)`` reduced over ``T``
  where ``mask`` (``(G, T)`` bool) is true;
* ``combine(a, b)``: merge two states elementwise (associative, commutative);
* ``scatter(carry, seg, st)``: merge tile states ``st`` (``(G, *F)``) into the slots ``seg``
  (``(G,)`` int, in ``[0, num]``; the value ``num`` means *drop*) of ``carry`` (``(num, *F)``);
* ``allreduce(state, axes)``: ``combine`` the states of every device along the mesh ``axes``
  (inside ``shard_map``): the default gathers the (small) states with a ``psum`` of per-device
  slots and folds them with ``combine``, so every monoid distributes; sums, extrema and
  log-sum-exps use ``psum`` / ``pmax`` instead;
* ``outputs(state)``: the fold's outputs, the public result first (``finalize``), then what the
  derivatives need that the result does not say (a count, the log-sum-exp of attention);
* ``info(outputs)``: the per-slot arrays the derivative rules read, as a differentiable function of
  the outputs (so that second-order derivatives flow through them);
* ``row_cotangent(v, mask, info, g)``: the cotangent of every reduced value given the outputs'
  cotangents ``g`` (a tuple, one per output, ``None`` where there is none), gathered per tile
  (``(G, ...)``); exactly zero where ``mask`` is false;
* ``for_derivatives``: ``None``, or a monoid whose outputs begin with this one's and that a
  differentiated fold is computed with, so that the rules above can read what it adds (a max's
  indices: the rules never re-compare recomputed values, which XLA may round differently);
* ``tangent(v, dv, mask, info)``: the outputs' tangents contributed by one tile (``(G, ...)`` per
  output, ``None`` for integer outputs), given the values' tangents ``dv``: for a value of
  several arrays, a leaf that does not vary is ``None`` (a symbolic zero; ``_base.instantiate``
  makes zeros of it where a monoid only weighs it elementwise), and a tile none of whose values
  varies is not passed at all (a product with a broadcast zero is never formed: XLA:CPU has
  computed such products from unwritten memory);
* optionally, for a reduction that picks values (max, min, their indices, the ``k`` smallest):
  ``picks(info)`` the ``(P, S)`` indices of the rows whose values each slot's outputs are (the
  slots last, whole lanes on a TPU), ``picked_tangent(info, dv)`` the outputs' tangents from
  the values' tangents ``(P, S, *F)`` at
  those pairs, and ``streamed_rows(info)`` the slots (``(S,)`` bool, or ``None``) that the
  picks do not settle: a dense fold's tangents are then taken at the picks alone
  (:mod:`foldax._engine._picks`).

A new reduction is a new monoid; the engine in :mod:`foldax._engine` never changes.
"""

from ._base import NO_INDEX as NO_INDEX
from ._base import Monoid as Monoid
from ._cross_entropy import CrossEntropy as CrossEntropy
from ._extremum import ArgExtremum as ArgExtremum
from ._extremum import ExtremumWithIndex as ExtremumWithIndex
from ._extremum import Max as Max
from ._extremum import Min as Min
from ._kmin import KMin as KMin
from ._logsumexp import LogSumExp as LogSumExp
from ._logsumexp import WeightedLogSumExp as WeightedLogSumExp
from ._prod import Prod as Prod
from ._products import SumOfProducts as SumOfProducts
from ._softmax import SoftmaxSum as SoftmaxSum
from ._sum import Mean as Mean
from ._sum import Sum as Sum
from ._var import Var as Var

SUM = Sum()
MEAN = Mean()
MAX = Max()
MIN = Min()
LOGSUMEXP = LogSumExp()
LOGMEANEXP = LogSumExp(mean=True)
PROD = Prod()
ARGMAX = ArgExtremum(True)
ARGMIN = ArgExtremum(False)
MAX_ARGMAX = ExtremumWithIndex(True)
MIN_ARGMIN = ExtremumWithIndex(False)
SOFTMAX = SoftmaxSum()

#: The reductions without parameters by name, for every family that takes a name; the
#: parametrised ones (``KMin(k)``, ``Var(ddof)``, ``WeightedLogSumExp``) are built per call.
_NAMED = (SUM, MEAN, MAX, MIN, LOGSUMEXP, LOGMEANEXP, PROD, ARGMAX, ARGMIN)
BY_NAME: dict[str, Monoid] = {m.name: m for m in (*_NAMED, MAX_ARGMAX, MIN_ARGMIN, SOFTMAX)}
