"""How a program's memory grows with a size: :func:`scaling` audits it at several sizes and
fits the exponent of temp memory and of each buffer (:class:`ScalingReport`, :class:`Growth`);
:func:`check_sizes` checks the sizes, for it and for the command line."""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from .._memory import format_bytes
from .._table import table
from ._buffers import Buffer, legend


@dataclasses.dataclass(frozen=True)
class Growth:
    """A buffer (identified by primitive, source and rank) and its bytes at each size."""

    primitive: str
    source: str
    shapes: tuple[tuple[int, ...], ...]
    nbytes: tuple[int, ...]
    exponent: float


@dataclasses.dataclass(frozen=True)
class ScalingReport:
    """Temp memory at several sizes, its fitted exponent, and the buffers that grow.

    ``fold_steps``: :attr:`AuditReport.fold_steps` at each size. ``note``: ``""``, or what the
    sizes cannot tell: when temp memory grows but foldax's folds ran in one step at all sizes but
    at most one, a step held the whole problem (a fold's memory grows with the problem until a
    step is full), so the fit says nothing of whether memory stays flat at larger sizes.
    """

    name: str
    sizes: tuple[int, ...]
    temp_bytes: tuple[int, ...]
    exponent: float
    growing: tuple[Growth, ...]
    fold_steps: tuple[int | None, ...] = ()
    note: str = ""

    def __str__(self) -> str:
        lines = [
            f"temp memory against {self.name}: "
            + ", ".join(
                f"{self.name}={s}: {format_bytes(t)}"
                for s, t in zip(self.sizes, self.temp_bytes, strict=True)
            )
            + f"; fitted exponent {self.exponent:.2f}"
        ]
        if not self.growing:
            lines.append(f"no buffer live at the peak grows with {self.name}.")
        else:
            rows = [
                (
                    f"{g.exponent:.2f}",
                    " -> ".join(format_bytes(b) for b in g.nbytes),
                    str(list(g.shapes[-1])),
                    g.primitive,
                    g.source or "?",
                )
                for g in self.growing
            ]
            lines.append(
                table(rows, (f"exponent in {self.name}", "bytes", "shape", "primitive", "source"))
            )
            explained = legend([r[4] for r in rows])
            if explained:
                lines.append(explained)
        if self.note:
            lines.append(f"note: {self.note}")
        return "\n".join(lines)


def _fit(sizes, values) -> float:
    """Least-squares slope of log(values) against log(sizes), over the sizes where the value is
    not 0: 0 when it is 0 everywhere, ``inf`` when it is 0 at every size but the largest."""
    v = np.asarray(values, np.float64)
    pos = v > 0
    if not pos.any():
        return 0.0
    if pos.sum() < 2:
        return math.inf if pos[-1] else 0.0
    x = np.log(np.asarray(sizes, np.float64)[pos])
    return float(np.polyfit(x, np.log(v[pos]), 1)[0])


def scaling(
    make: Callable[[int], tuple[Callable, Sequence[Any]]],
    sizes: Sequence[int],
    *,
    name: str = "N",
    top: int = 50,
    threshold: float = 0.1,
    min_fraction: float = 0.01,
) -> ScalingReport:
    """How temp memory, and each buffer live at the peak, grows with a size.

    ``make(size)`` returns ``(fn, args)``; each is compiled (not run) and audited. The exponent of
    temp memory in the size is fitted on a log-log scale, and every buffer at the peak that is
    found at all sizes (matched by primitive, source line and rank), grows with exponent above
    ``threshold`` and holds at least ``min_fraction`` of the temp memory at the largest size is
    listed, largest exponent first.

    ``sizes``: at least two distinct positive whole numbers, in any order (they are sorted). A
    foldax fold's memory grows with the problem until one step of it is full (steps are sized
    from the memory budget: see :func:`foldax.memory_budget`), and stays flat beyond; take sizes
    where the folds take several steps. When they ran in one step at all sizes but at most one,
    the report's ``note`` says so.

    Raises:
      TypeError: when ``sizes`` is not a sequence of whole numbers.
      ValueError: when there are fewer than two sizes, or one is not positive or is repeated.

    Example:
      >>> import jax, jax.numpy as jnp, foldax
      >>> make = lambda n: (lambda x: jnp.sort(jnp.outer(x, x), 0).sum(),
      ...                   (jax.ShapeDtypeStruct((n,), jnp.float32),))
      >>> s = foldax.memory.scaling(make, [64, 128, 256])
      >>> round(s.exponent), s.growing[0].shapes[-1]
      (2, (256, 256))
    """
    sizes = check_sizes(sizes)
    report, _ = _scaling(make, sizes, name, top, threshold, min_fraction)
    return report


def _scaling(make, sizes, name, top, threshold, min_fraction):
    """:func:`scaling` of checked ``sizes``, and the audit at each size."""
    audits = _audits(make, sizes, top)
    temps = tuple(a.totals.temp_bytes for a in audits)
    keyed = []
    for a in audits:
        d: dict[tuple, Buffer] = {}
        for b in a.buffers:
            if b.kind != "temp":
                continue
            key = (b.primitive, b.source, len(b.shape))
            if key not in d or d[key].nbytes < b.nbytes:
                d[key] = b
        keyed.append(d)
    growing = []
    for key in set.intersection(*(set(d) for d in keyed)):
        bs = [d[key] for d in keyed]
        nb = tuple(b.nbytes for b in bs)
        e = _fit(sizes, nb)
        if e > threshold and nb[-1] >= min_fraction * temps[-1]:
            growing.append(Growth(key[0], key[1], tuple(b.shape for b in bs), nb, e))
    growing.sort(key=lambda g: (-round(g.exponent, 1), -g.nbytes[-1], g.primitive, g.source))
    exponent = _fit(sizes, temps)
    steps = tuple(a.fold_steps for a in audits)
    report = ScalingReport(
        name=name,
        sizes=sizes,
        temp_bytes=temps,
        exponent=exponent,
        growing=tuple(growing),
        fold_steps=steps,
        note=_step_note(name, sizes, steps) if exponent > threshold else "",
    )
    return report, audits


def _audits(make, sizes, top):
    # ``audit`` as the package names it, looked up at each call: the one name to patch.
    from . import audit

    out = []
    for s in sizes:
        fn, args = make(s)
        out.append(audit(fn, *args, top=top))
    return out


def _step_note(name, sizes, steps) -> str:
    """Say so when the sizes are too small to tell whether foldax keeps memory flat: every fold
    held the whole problem in one step at all sizes but at most one."""
    if not steps or None in steps or sum(s > 1 for s in steps) >= 2:
        return ""
    one = ", ".join(str(n) for n, s in zip(sizes, steps, strict=True) if s == 1)
    return (
        f"at {name}={one} foldax's folds ran in one step (steps per size: "
        f"{', '.join(map(str, steps))}): a step held the whole problem, and a fold's memory "
        f"grows with the problem until a step is full. These sizes are too small to tell "
        f"whether temp memory stays flat; audit larger sizes, where the folds take several steps."
    )


#: Sizes in the error messages' examples.
EXAMPLE_SIZES = (2**18, 2**19, 2**20)


def check_sizes(
    sizes: Any,
    *,
    name: str = "foldax.memory.scaling: sizes",
    example: str = f"sizes={list(EXAMPLE_SIZES)}",
    got: str | None = None,
) -> tuple[int, ...]:
    """The sizes of a scaling fit, sorted: at least two distinct positive whole numbers (ints or
    NumPy integers). ``name`` and ``example`` word the errors (the command line passes its
    ``--sizes``), ``got`` shows what was given.

    Raises:
      TypeError: when ``sizes`` is not a sequence of whole numbers.
      ValueError: when there are fewer than two sizes, or one is not positive or is repeated.
    """
    if isinstance(sizes, str | bytes) or not hasattr(sizes, "__iter__"):
        raise TypeError(
            f"{name} must be a sequence of whole numbers, e.g. {example}; got {sizes!r}"
        )
    values = list(sizes)
    got = repr(values) if got is None else got
    out = []
    for v in values:
        try:
            if isinstance(v, bool | np.bool_):
                raise TypeError
            out.append(operator.index(v))
        except TypeError:
            raise TypeError(
                f"{name} must be whole numbers (int), e.g. {example}; got {v!r} in {got}"
            ) from None
    if len(out) < 2:
        raise ValueError(
            f"{name} needs at least two sizes to fit how memory grows, e.g. {example}; got {got}"
        )
    bad = [v for v in out if v <= 0]
    if bad:
        raise ValueError(
            f"{name} must be distinct positive numbers: {bad[0]} is not positive; e.g. "
            f"{example}; got {got}"
        )
    repeated = sorted({v for v in out if out.count(v) > 1})
    if repeated:
        raise ValueError(
            f"{name} must be distinct positive numbers: {repeated[0]} is repeated; give each "
            f"size once, at least two distinct sizes, e.g. {example}; got {got}"
        )
    return tuple(sorted(out))
