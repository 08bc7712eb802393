"""How the documentation writes a measured time: the one rule, used by ``measure.py`` and by
``tests/test_timings.py``.

Under 90 s (once rounded) a time is written in seconds: whole seconds below 10 s, else to the
nearest 5 s ("about 6 s", "about 25 s", "about 70 s"). From there on it is written in minutes, to
the nearest half minute ("about 2 min", "about 4.5 min"). The text may spell the unit out
("about 20 seconds", "about 4.5 minutes"): only the number and the unit are compared.
"""

from __future__ import annotations

import math
import re

#: A time quote in running text: "about 20 s", "about 4.5 minutes", "~6 s".
QUOTE = re.compile(r"(?:\babout |~ ?)(\d+(?:\.\d+)?) ?(s|seconds?|min|minutes?)\b")
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


def canonical(quote: str) -> str:
    """A quote as ``format_time`` writes it: "about 4.5 minutes" -> "about 4.5 min"."""
    m = QUOTE.fullmatch(quote.strip())
    if m is None:
        raise ValueError(f"not a time quote: {quote!r}")
    number, unit = m.groups()
    return f"about {float(number):g} {'s' if unit.startswith('s') else 'min'}"
