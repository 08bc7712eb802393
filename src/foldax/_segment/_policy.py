"""Which program a segment reduction of plain data (no ``fn``) runs on CPU: XLA's scatter by
per-row ids, or the tile walk over contiguous segments -- fitted to measurements
(``dev/segment-policy/measure.py``; the table is in ``docs/design.md``).

A scatter costs a few nanoseconds per row whatever the row holds (its index), plus a little per
value; the walk reduces a tile of rows as one vectorised block, so it costs per value and per
segment (each segment's tiles). The walk wins on narrow rows in long segments (one value per
row, hundreds of rows per segment: 3-6x faster than ``jax.ops``), the scatter everywhere else.
A segment softmax scatters (its walk writes every row through two folds: 1.1-7x jraph's
program's time for rows of 2 to 64 values), except rows of one value in segments of a
thousand rows or more, where its walk takes 0.2-0.4x. Arbitrary (unsorted) ids always
scatter; traced ``sizes`` / ``offsets`` always walk (per-row ids would cost a cumulative sum
over the rows, about twice the scatter).
"""

from __future__ import annotations

import math

#: the walk's rows hold at most this many values (the product of the trailing shape)
WALK_MAX_VALUES = 4
#: ... and its segments hold at least this many rows on average
WALK_MIN_ROWS_PER_SEGMENT = 256
#: a softmax (one output per row) walks rows of one value in segments this long on average
SOFTMAX_WALK_MIN_ROWS = 1000


def walks_contiguous(
    n: int, num_segments: int, features: tuple[int, ...], per_row: bool = False
) -> bool:
    """Whether ``num_segments`` contiguous segments of ``n`` rows of plain values of trailing
    shape ``features`` are walked in tiles rather than scattered by per-row ids (``per_row``:
    a softmax, one output per row)."""
    values = math.prod(features)
    if per_row:
        return values == 1 and n >= SOFTMAX_WALK_MIN_ROWS * max(num_segments, 1)
    return values <= WALK_MAX_VALUES and n >= WALK_MIN_ROWS_PER_SEGMENT * max(num_segments, 1)


__all__ = [
    "SOFTMAX_WALK_MIN_ROWS",
    "WALK_MAX_VALUES",
    "WALK_MIN_ROWS_PER_SEGMENT",
    "walks_contiguous",
]
