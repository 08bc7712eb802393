"""Segment (ragged) reductions, compatible with ``jax.ops.segment_*``, that never materialize:
the public functions (:mod:`._sums`, :mod:`._extrema`, :mod:`._softmax`), thin wrappers over
one engine (:mod:`._core`) that validates the partition (:mod:`._partition`) and folds
``fn`` over it (:mod:`._fold`)."""

from ._extrema import segment_argmax as segment_argmax
from ._extrema import segment_argmin as segment_argmin
from ._extrema import segment_max as segment_max
from ._extrema import segment_min as segment_min
from ._softmax import segment_log_softmax as segment_log_softmax
from ._softmax import segment_logmeanexp as segment_logmeanexp
from ._softmax import segment_logsumexp as segment_logsumexp
from ._softmax import segment_softmax as segment_softmax
from ._sums import segment_mean as segment_mean
from ._sums import segment_prod as segment_prod
from ._sums import segment_std as segment_std
from ._sums import segment_sum as segment_sum
from ._sums import segment_var as segment_var
