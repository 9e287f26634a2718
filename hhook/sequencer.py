r"""Collectives launched from continuations, in the same order on every rank."""

from __future__ import annotations

import threading


class Sequencer:
    """Issues collectives from continuations in ticket order, the same on every rank.

    With agreed scales the SUM of a bucket is launched when its MAX completes, from
    whichever thread completes it; buckets can finish their MAX out of order, and two
    ranks launching SUMs in different orders would pair unrelated collectives. Tickets
    are drawn in hook order (identical on every rank); a launch waits, without blocking
    anything, until every earlier ticket has launched or been skipped.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._next_ticket = 0
        self._next_launch = 0
        self._ready: dict = {}

    def ticket(self) -> int:
        with self._lock:
            self._next_ticket += 1
            return self._next_ticket - 1

    def launch(self, ticket: int, fn) -> None:
        """Run ``fn`` (None: skip the ticket) once all earlier tickets have run."""
        with self._lock:
            self._ready[ticket] = fn
            while self._next_launch in self._ready:
                fn = self._ready.pop(self._next_launch)
                self._next_launch += 1
                if fn is not None:
                    fn()
