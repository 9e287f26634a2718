r"""Collectives launched from continuations, in the same order on every rank."""

from __future__ import annotations

import logging
import threading

import torch

logger = logging.getLogger(__name__)


class Sequencer:
    """Issues collectives from continuations in ticket order, the same on every rank.

    With agreed scales the SUM of a bucket is launched when its MAX completes, from
    whichever thread completes it; buckets can finish their MAX out of order, and two
    ranks launching SUMs in different orders would pair unrelated collectives. Tickets
    are drawn in hook order (identical on every rank); a launch waits, without blocking
    anything, until every earlier ticket has launched or been skipped.

    Every ticket drawn must be launched or skipped exactly once, also when the code
    between drawing and launching it raises (skip it in ``finally``/``except``): a
    ticket left pending holds back every later one for good.

    Callbacks run outside the lock, one thread at a time: the thread whose
    :meth:`launch` makes tickets ready runs them in order, including those that other
    threads (or the callbacks themselves) launch meanwhile. So a callback may draw and
    launch tickets of the same sequencer, directly or through a transport that runs
    ``then`` callbacks inline (NCCL does), without deadlocking.

    A callback may run on another thread than the one that launched it, whose current
    CUDA stream is another continuation's; a collective orders its work after the
    *current* stream, so :meth:`launch` takes the stream that produced what the callback
    sends (:func:`stream_of`) and runs the callback under it.

    Callbacks should not raise (the transports hand their errors to their futures).
    One that does is logged, since the thread running it may be a transport's, which
    drops exceptions; the later ready tickets still run, and then :meth:`launch`
    re-raises the first such exception to its caller.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._next_ticket = 0
        self._next_launch = 0
        self._ready: dict = {}
        self._running = False  # a thread is running the ready callbacks

    def ticket(self) -> int:
        with self._lock:
            self._next_ticket += 1
            return self._next_ticket - 1

    def launch(self, ticket: int, fn, stream: torch.cuda.Stream | None = None) -> None:
        """Run ``fn`` (None: skip the ticket) once all earlier tickets have run, under
        ``stream`` (a CUDA stream) if given."""
        if fn is not None and stream is not None:
            fn = _under(stream, fn)
        with self._lock:
            if not self._next_launch <= ticket < self._next_ticket or ticket in self._ready:
                raise ValueError(f"hhook: sequencer ticket {ticket} was never drawn or was already launched")
            self._ready[ticket] = fn
            if self._running:
                return  # the running thread gets to it in turn
            self._running = True
        first_error = None
        while True:
            with self._lock:
                if self._next_launch not in self._ready:
                    self._running = False
                    break
                current = self._next_launch
                fn = self._ready.pop(current)
                self._next_launch += 1
            if fn is None:
                continue
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - later tickets must still launch
                logger.error("hhook: the launch callback of sequencer ticket %d raised", current, exc_info=True)
                if first_error is None:
                    first_error = exc
        if first_error is not None:
            raise first_error


def stream_of(tensor: torch.Tensor) -> torch.cuda.Stream | None:
    """The current CUDA stream of ``tensor``'s device (None for a CPU tensor): the one
    whose queued work produced it, to hand to :meth:`Sequencer.launch`."""
    return torch.cuda.current_stream(tensor.device) if tensor.is_cuda else None


def _under(stream: torch.cuda.Stream, fn):
    def run() -> None:
        with torch.cuda.stream(stream):
            fn()

    return run
