"""The progress bar a ``foldax bench`` run prints on stderr."""

from __future__ import annotations

import sys
import time


class Progress:
    """A one-line progress bar on stderr: steps done / total, the step, elapsed time."""

    def __init__(self, total: int, stream=None):
        self.total, self.done, self.t0 = max(total, 1), 0, time.perf_counter()
        self.stream = stream or sys.stderr

    def step(self, what: str) -> None:
        self.done += 1  # counted as is: a total announced too low shows as steps past it
        width = 24
        filled = min(width, int(width * self.done / self.total))
        bar = "#" * filled + "." * (width - filled)
        secs = time.perf_counter() - self.t0
        print(
            f"[{bar}] {self.done:3d}/{self.total} {secs:6.0f} s  {what}",
            file=self.stream,
            flush=True,
        )

    def note(self, what: str) -> None:
        print(
            f"{'':>{24 + 2}} {'':>7} {time.perf_counter() - self.t0:6.0f} s  {what}",
            file=self.stream,
            flush=True,
        )
