r"""A progress bar on stderr for sweeps that take more than a few seconds.

Only rank 0 draws it. Nothing appears until ``delay`` seconds have passed, so short
runs print nothing; redraws are limited to a few per second and the bar is erased at
the end, leaving stderr clean for whatever follows.
"""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: float, enabled: bool = True, stream=None, delay: float = 2.0, width: int = 28):
        self.total = max(float(total), 1.0)
        self.done = 0.0
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.delay = delay
        self.width = width
        self.start = time.monotonic()
        self.last_draw = 0.0
        self.drawn = 0

    def advance(self, units: float, label: str = "") -> None:
        self.done = min(self.total, self.done + units)
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self.start < self.delay or now - self.last_draw < 0.2:
            return
        self.last_draw = now
        frac = self.done / self.total
        elapsed = now - self.start
        eta = elapsed * (1 - frac) / frac if frac > 0 else float("inf")
        filled = int(round(frac * self.width))
        bar = "#" * filled + "." * (self.width - filled)
        eta_text = f"{eta:4.0f}s" if eta != float("inf") else "   ?s"
        line = f"[{bar}] {100 * frac:3.0f}%  {elapsed:4.0f}s elapsed, ETA {eta_text}  {label}"
        pad = max(0, self.drawn - len(line))
        self.stream.write("\r" + line + " " * pad)
        self.stream.flush()
        self.drawn = len(line)

    def close(self) -> None:
        if self.enabled and self.drawn:
            self.stream.write("\r" + " " * self.drawn + "\r")
            self.stream.flush()
            self.drawn = 0
