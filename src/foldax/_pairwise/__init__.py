"""Pairwise reductions ``out[i] = reduce_j kernel(x[i], y[j])`` in tiles, KeOps-style.

The ``(M, N)`` matrix of kernel values is never formed: one engine fold (:mod:`foldax._engine`)
walks blocks of ``bi`` rows of ``x`` by ``bj`` rows of ``y``, folding each tile into a monoid
state per row of ``x``; every derivative is another such fold, recomputing each tile. Memory is
``O(bi * bj + M + N)``, forward, backward and forward-mode.

``_reduce``: the public :func:`pairwise_reduce`; ``_attention``: :func:`dot_product_attention`
on it; ``_cross_entropy``: :func:`linear_cross_entropy` on it; ``_kernel``: reduction names, kernel outputs, value packing; ``_tiles``: the fold;
``_masks``: which pairs take part (masks, segment ids) and which blocks to visit;
``_intervals``: a mask's formula bounded on a block; ``_mesh``: device meshes.
"""

from ._attention import dot_product_attention as dot_product_attention
from ._cross_entropy import linear_cross_entropy as linear_cross_entropy
from ._kernel import _monoid_for as _monoid_for
from ._reduce import pairwise_reduce as pairwise_reduce
from ._tiles import _block_sizes as _block_sizes
from ._tiles import pairwise as pairwise
