"""foldax: reductions for JAX that never materialize their intermediate.

Segment (ragged) reductions, KeOps-style pairwise reductions and S4's kernels, computed as a
streamed fold of a monoid over chunks of a lazily computed axis: one JAX primitive whose every
derivative (reverse, forward, higher order) is itself a streamed fold, planned after every
transformation from a memory budget; on a device mesh, each device folds its own rows and the small
states are all-reduced. See the README and ``docs/`` for the story; ``foldax.memory`` measures
it and ``foldax bench`` reproduces the numbers.
"""

import importlib.metadata as _metadata

from . import memory as memory
from ._checks import debug_checks as debug_checks
from ._engine import memory_budget as memory_budget
from ._pairwise import dot_product_attention as dot_product_attention
from ._pairwise import linear_cross_entropy as linear_cross_entropy
from ._pairwise import pairwise_reduce as pairwise_reduce
from ._segment import segment_argmax as segment_argmax
from ._segment import segment_argmin as segment_argmin
from ._segment import segment_log_softmax as segment_log_softmax
from ._segment import segment_logmeanexp as segment_logmeanexp
from ._segment import segment_logsumexp as segment_logsumexp
from ._segment import segment_max as segment_max
from ._segment import segment_mean as segment_mean
from ._segment import segment_min as segment_min
from ._segment import segment_prod as segment_prod
from ._segment import segment_softmax as segment_softmax
from ._segment import segment_std as segment_std
from ._segment import segment_sum as segment_sum
from ._segment import segment_var as segment_var
from ._ssm import cauchy as cauchy
from ._ssm import vandermonde as vandermonde
from ._ssm import vandermonde_transpose as vandermonde_transpose

try:  # the installed distribution's version: pyproject.toml is its one source
    __version__ = _metadata.version("foldax")
except _metadata.PackageNotFoundError:  # imported from a checkout that is not installed
    __version__ = "0+unknown"
