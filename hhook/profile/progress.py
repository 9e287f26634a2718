r"""A progress bar on stderr for sweeps that take more than a few seconds (tqdm).

Only rank 0 draws it, and only on a terminal: redirected to a file or a pipe, stderr
stays clean. Under ``mpirun`` a rank's stderr is always a pipe to the launcher, so there
the launcher's own stderr decides (:func:`on_terminal`). Nothing appears for the first
``delay`` seconds, so short runs print nothing.

The work is counted in bytes moved per iteration, and the ETA is elapsed time times
remaining over done (tqdm with ``smoothing=0``). A background thread redraws twice a
second, so the elapsed time and the ETA keep moving during one long iteration (a 25 MB
zlib allgather takes seconds) instead of freezing until it ends.
"""

from __future__ import annotations

import os
import sys
import threading
import time


def _launcher_stderr_is_a_terminal() -> bool:
    """Whether ``mpirun`` (our parent) writes to a terminal: Linux ``/proc`` only."""
    try:
        target = os.readlink(f"/proc/{os.getppid()}/fd/2")
    except OSError:
        return False
    return target.startswith(("/dev/pts/", "/dev/tty"))


def on_terminal(stream) -> bool:
    """True when what is written to ``stream`` ends up on a person's terminal."""
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        return True
    if stream is not sys.stderr:
        return False
    from ..launch import detect_env

    try:
        launcher = detect_env().launcher
    except ValueError:
        return False
    # Open MPI and PMI launchers forward a rank's stderr through a pipe even when they
    # print to a terminal; ask the launcher's stderr instead.
    return launcher in ("openmpi", "pmi") and _launcher_stderr_is_a_terminal()


class Progress:
    r"""``advance(units, label)`` after each piece of work; ``write(text)`` prints a line
    to stdout without tearing the bar; ``close()`` erases it.

    Example::
        >>> bar = Progress(total=100, enabled=False)
        >>> bar.advance(10, "fp32 4096 B"); bar.close()
    """

    def __init__(self, total: float, enabled: bool = True, stream=None, delay: float = 2.0,
                 refresh_s: float = 0.5):
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = bool(enabled) and on_terminal(self.stream)
        self.total = max(float(total), 1.0)
        self.done = 0.0
        self.delay = delay
        self.start = time.monotonic()
        self._bar = None
        self._stop = threading.Event()
        self._thread = None
        if not self.enabled:
            return
        from .deps import require

        tqdm = require("tqdm", "its progress bar").tqdm

        self._bar = tqdm(total=self.total, file=self.stream, delay=delay, smoothing=0, leave=False,
                         dynamic_ncols=True, mininterval=0.2,
                         bar_format="{percentage:3.0f}%|{bar}| {elapsed} elapsed, ETA {remaining}  {desc}")
        self._thread = threading.Thread(target=self._refresh_loop, args=(refresh_s,), daemon=True,
                                        name="hhook-profile-progress")
        self._thread.start()

    def _refresh_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.tick()

    def tick(self) -> None:
        """Redraw with the current elapsed time (the background thread calls this)."""
        if self._bar is not None and time.monotonic() - self.start >= self.delay:
            self._bar.refresh()

    def advance(self, units: float, label: str = "") -> None:
        step = min(self.total - self.done, float(units))
        self.done += step
        if self._bar is not None:
            self._bar.set_description_str(label, refresh=False)
            self._bar.update(step)

    def write(self, text: str) -> None:
        """Print ``text`` on stdout; the bar is cleared first and redrawn by the next tick."""
        if self._bar is not None:
            self._bar.clear()
            self.stream.flush()
        print(text, flush=True)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None
