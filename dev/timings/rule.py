"""How the documentation writes a measured time: the one rule, used by ``measure.py`` and by
``tests/test_timings.py``.

Under 90 s (once rounded) a time is written in seconds: whole seconds below 10 s, else to the
nearest 5 s ("about 6 s", "about 25 s", "about 70 s"). From there on it is written in minutes, to
the nearest half minute ("about 2 min", "about 4.5 min"). The text may spell the unit out
("about 20 seconds", "about 4.5 minutes"): only the number and the unit are compared.

A command whose time depends much on what else the machine runs is written as a range, from its
time on a quiet machine to its time with other jobs on the cores, each end as above without the
"about", the first end's unit dropped where both share it ("30 to 75 s", "65 s to 3.5 min"). Its
entry in docs/timings.json holds both: ``seconds`` (quiet) and ``busy.seconds``.
"""

from __future__ import annotations

import math
import re

#: A time quote in running text: "about 20 s", "about 4.5 minutes", "~6 s".
QUOTE = re.compile(r"(?:\babout |~ ?)(\d+(?:\.\d+)?) ?(s|seconds?|min|minutes?)\b")
_UNIT = r"(?:s|seconds?|min|minutes?)"
#: A range of times: "30 to 75 s", "65 s to 3.5 minutes".
RANGE = re.compile(rf"\b(\d+(?:\.\d+)?)\s?({_UNIT})?\s+to\s+(\d+(?:\.\d+)?)\s?({_UNIT})\b")
#: A time written in words, which says nothing that a measurement can check.
VAGUE = re.compile(r"\ba few (?:seconds|minutes)\b")


def _half_up(x: float) -> int:
    return math.floor(x + 0.5)


def format_time(seconds: float) -> str:
    """The text for a measured wall time: ``format_time(21.4) == "about 20 s"``."""
    if seconds < 9.5:
        return f"about {max(1, _half_up(seconds))} s"
    five = 5 * _half_up(seconds / 5)
    if five < 90:
        return f"about {five} s"
    half_minutes = max(3, _half_up(seconds / 30))  # 90 s and up: 1.5 min at least
    minutes = half_minutes / 2
    return f"about {minutes:g} min"


def format_range(quiet: float, busy: float) -> str:
    """The text for a time measured on a quiet and on a busy machine:
    ``format_range(31.6, 72.5) == "30 to 75 s"``; one time if both round alike."""
    low, high = format_time(quiet), format_time(busy)
    if low == high:
        return low
    low, high = low.removeprefix("about "), high.removeprefix("about ")
    if low.split()[1] == high.split()[1]:
        low = low.split()[0]
    return f"{low} to {high}"


def _unit(unit: str | None) -> str:
    return "s" if unit.startswith("s") else "min"


def canonical(quote: str) -> str:
    """A quote as ``format_time`` or ``format_range`` writes it: "about 4.5 minutes" ->
    "about 4.5 min", "65 seconds to 3.5 minutes" -> "65 s to 3.5 min"."""
    m = QUOTE.fullmatch(quote.strip())
    if m is not None:
        number, unit = m.groups()
        return f"about {float(number):g} {_unit(unit)}"
    m = RANGE.fullmatch(quote.strip())
    if m is None:
        raise ValueError(f"not a time quote: {quote!r}")
    low, low_unit, high, high_unit = m.groups()
    low_unit = _unit(low_unit or high_unit)
    first = f"{float(low):g}" + ("" if low_unit == _unit(high_unit) else f" {low_unit}")
    return f"{first} to {float(high):g} {_unit(high_unit)}"
