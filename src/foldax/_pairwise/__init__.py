"""Pairwise reductions ``out[i] = reduce_j kernel(x[i], y[j])`` in tiles, KeOps-style.

The ``(M, N)`` matrix of kernel values is never formed: one engine fold (:mod:`foldax._engine`)
walks blocks of ``bi`` rows of ``x`` by ``bj`` rows of ``y``, folding each tile into a monoid
state per row of ``x``; every derivative is another such fold, recomputing each tile. Memory is
``O(bi * bj + M + N)``, forward, backward and forward-mode.

``_reduce``: the public :func:`pairwise_reduce`; ``_kernel``: reduction names, kernel outputs,
value packing; ``_tiles``: the fold; ``_masks``: pair masks; ``_mesh``: device meshes.
"""

from ._kernel import _monoid_for as _monoid_for
from ._reduce import pairwise_reduce as pairwise_reduce
from ._tiles import _block_sizes as _block_sizes
from ._tiles import pairwise as pairwise
