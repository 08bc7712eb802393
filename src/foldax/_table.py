"""The one plain-text table printer: the audit's buffers, the command line's and the bench's
tables."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def table(rows: Iterable[Sequence], header: Sequence[str], *, right: Iterable[int] = ()) -> str:
    """``rows`` under ``header`` and a rule of dashes, columns two spaces apart, each as wide as
    its widest cell; left-aligned except the columns numbered in ``right``."""
    rows = [tuple(map(str, r)) for r in rows]
    header = tuple(map(str, header))
    widths = [max(map(len, col)) for col in zip(header, *rows, strict=True)]
    right = set(right)
    line = "  ".join(f"{{:{'>' if i in right else '<'}{w}}}" for i, w in enumerate(widths))
    rule = line.format(*("-" * w for w in widths))
    return "\n".join([line.format(*header), rule, *(line.format(*r) for r in rows)])
