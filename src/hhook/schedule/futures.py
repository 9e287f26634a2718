r"""How the schedules (:mod:`hhook.schedule.flat`, :mod:`hhook.schedule.two_level`) and the
hook run on futures: futures CUDA-aware where the value lives on a GPU, exceptions handed
to the waiter as they are (torch wraps an exception raised in a ``then`` callback in a
RuntimeError; a :class:`~hhook.errors.ConfigMismatchError` should stay one); every
continuation counted from its attachment until torch releases it, per process group, so
that the end of a job (:mod:`hhook.schedule.teardown`) can wait for them; and the
:class:`Sequencer`, which launches collectives from continuations in the same order on
every rank."""

from __future__ import annotations

import logging
import threading

import torch
import torch.distributed as dist

from .groups import explain

logger = logging.getLogger(__name__)

#: A continuation's group where its caller did not say (futures of several collectives):
#: the end of any group waits for it.
UNSAID = object()
_WORLD = "default group"
quiet = threading.Condition()  # held while counting; notified at each release
in_flight: dict = {}  # group key (:func:`key_of`) -> continuations attached and not yet released
released = [0]  # continuations released since the end of a job last looked


def key_of(group):
    """Continuations are counted per group: None and WORLD are the default group."""
    if group is UNSAID:
        return UNSAID
    if group is None or group == dist.GroupMember.WORLD:
        return _WORLD
    return getattr(group, "group_name", None) or id(group)


class Continuation:
    """``fn`` as a callback of a torch future of a collective on ``group``, counted as in
    flight from here until torch releases it (after it ran, on the thread that ran it)."""

    __slots__ = ("fn", "counted", "thread", "key")

    def __init__(self, fn, group=UNSAID):
        self.fn, self.counted, self.thread, self.key = fn, True, None, key_of(group)
        with quiet:
            in_flight[self.key] = in_flight.get(self.key, 0) + 1

    def __call__(self, fut):
        fn, self.fn, self.thread = self.fn, None, threading.get_ident()
        # Not in this frame any more: an exception raised in ``fn`` and kept (a future's
        # error) keeps this frame alive through its traceback's callers.
        del self
        return fn(fut)

    def release(self) -> None:
        """No longer in flight (once): at its last reference, or where no worker thread
        holds it any more."""
        if not self.counted:
            return
        self.counted = False
        with quiet:
            in_flight[self.key] -= 1
            if not in_flight[self.key]:
                del in_flight[self.key]
            released[0] += 1
            quiet.notify_all()

    __del__ = release


def attach(fut: torch.futures.Future, fn, group=UNSAID) -> None:
    """Run ``fn(fut)`` when ``fut`` completes, on the thread that completes it (now, if it
    has); ``fn`` must not raise (it settles a future of its own). No child future is made:
    its value would be one more object for that thread to release with the GIL.
    ``group``: the process group whose collective ``fut`` completes (None: the default
    group; a second communicator's: its parent), for the end of that group."""
    continuation = Continuation(fn, group)
    try:
        fut.add_done_callback(continuation)
    finally:
        if continuation.thread == threading.get_ident():
            # It ran here, on this thread (the future was complete): no worker thread holds
            # it, and an exception kept from its run (a future's error, its traceback's
            # callers: this frame, torch's) may keep it alive past the job's exit.
            continuation.release()


def new_future(like: torch.Tensor) -> torch.futures.Future:
    """A future that may hold ``like``'s device (a CUDA result needs a CUDA-aware future)."""
    return torch.futures.Future(devices=[like.device]) if like.is_cuda else torch.futures.Future()


def completed(value: torch.Tensor) -> torch.futures.Future:
    """A future already holding ``value``."""
    fut = new_future(value)
    fut.set_result(value)
    return fut


def settle(result: torch.futures.Future, fn, *args) -> None:
    """Complete ``result`` with ``fn(*args)``, or with the exception it raises, as it is."""
    try:
        value = fn(*args)
    except BaseException as exc:  # noqa: BLE001 - handed to the waiter
        result.set_exception(exc)
        return
    result.set_result(value)


def value_of(fut: torch.futures.Future, what: str | None = None, group=None):
    """``fut.value()``; where ``what`` names the collective that ``fut`` completes, a
    stalled or lost peer of ``group`` raises as :class:`~hhook.errors.PeerTimeoutError` or
    :class:`~hhook.errors.PeerLostError` saying so (:func:`hhook.schedule.groups.explain`)."""
    try:
        return fut.value()
    except BaseException as exc:  # noqa: BLE001 - re-raised, explained where it can be
        if what is None:
            raise
        explained = explain(exc, what, group)
        if explained is exc:
            raise
        raise explained from exc


def then(fut: torch.futures.Future, fn, like: torch.Tensor, what: str | None = None,
         group=UNSAID) -> torch.futures.Future:
    """``fut.then(fn)`` where ``fn`` takes ``fut``'s value and its exception (or ``fut``'s)
    reaches the waiter unwrapped; ``what`` and ``group`` (None: the default group) as
    :func:`value_of`. Counted until released (:func:`attach`), under ``group`` where it is
    said."""
    result = new_future(like)
    named = None if group is UNSAID else group
    attach(fut, lambda f: settle(result, lambda: fn(value_of(f, what, named))), group)
    return result


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
        self._held = False  # a callback holds the later tickets back (:meth:`hold`)

    def ticket(self) -> int:
        with self._lock:
            self._next_ticket += 1
            return self._next_ticket - 1

    def hold(self) -> None:
        """From inside a callback: later tickets wait until :meth:`resume`, so that the
        callback's own collectives, launched later from continuations of its first,
        keep their place in the order (a checked call's check, then its exchange)."""
        with self._lock:
            self._held = True

    def resume(self) -> None:
        """End a :meth:`hold` (from any thread): the ready tickets run on."""
        with self._lock:
            self._held = False
            if self._running:
                return  # the running thread gets to them
            self._running = True
        self._drain()

    def launch(self, ticket: int, fn, stream: torch.cuda.Stream | None = None) -> None:
        """Run ``fn`` (None: skip the ticket) once all earlier tickets have run, under
        ``stream`` (a CUDA stream) if given."""
        if fn is not None and stream is not None:
            fn = _under(stream, fn)
        with self._lock:
            if not self._next_launch <= ticket < self._next_ticket or ticket in self._ready:
                raise ValueError(f"hhook: sequencer ticket {ticket} was never drawn or was already launched")
            self._ready[ticket] = fn
            if self._running or self._held:
                return  # the running thread, or the end of the hold, gets to it in turn
            self._running = True
        self._drain()

    def _drain(self) -> None:
        first_error = None
        while True:
            with self._lock:
                if self._held or self._next_launch not in self._ready:
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
