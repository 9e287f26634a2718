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


class Stages:
    r"""Progress of one long task watched through its heartbeat (``train``'s child:
    ``"starting"``, ``"model"``, ``"step 40"``): on a terminal a :class:`Progress` bar over
    its ``steps``; in a log (stderr a file or a pipe) one line per stage and per quarter of
    the steps, so a person reading the log sees the ~20 s of a method's training advance.

    Example::
        >>> stages = Stages("thc:4", steps=100, enabled=False)
        >>> stages.beat("step 50"); stages.close()
    """

    def __init__(self, name: str, steps: int, enabled: bool = True, stream=None):
        self.name, self.steps = name, max(1, int(steps))
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = bool(enabled)
        self.bar = Progress(self.steps, enabled=self.enabled, stream=self.stream, delay=0.5) if self.enabled else None
        self.step, self.said = 0, set()

    def beat(self, text: str | None) -> None:
        """What the heartbeat says now (None: nothing yet); repeated beats are ignored."""
        if not self.enabled or not text:
            return
        parts = text.split()
        step = int(parts[1]) if len(parts) == 2 and parts[0] == "step" and parts[1].isdigit() else None
        if self.bar is not None and self.bar.enabled:
            if step is not None and step > self.step:
                self.bar.advance(step - self.step, f"{self.name}: step {step}/{self.steps}")
                self.step = step
            elif step is None:
                self.bar.advance(0, f"{self.name}: {text}")
            return
        if step is None:
            key = text
        else:
            quarter = 4 * step // self.steps
            if step and not quarter:
                return
            key = f"quarter {quarter}" if step else "step 0"
            text = f"step {step}/{self.steps}" if step else "training (step 0)"
        if key not in self.said:
            self.said.add(key)
            print(f"# {self.name}: {text}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
