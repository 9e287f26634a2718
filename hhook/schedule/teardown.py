r"""The end of a job: no thread of a process group may still need the interpreter once it
finalizes.

hhook's continuations run on the worker threads of the process groups (Gloo's, and its
own second communicators'). Even after its future is complete, such a thread still takes
the GIL a few times: to return from ``set_result`` (the waiter is already awake), to run
callbacks the program chained on the future, to release the callback. A thread that asks
for the GIL once the interpreter finalizes is ended by Python in the middle of C++ code,
and the process aborts ("terminate called without an active exception", exit -6) after
the job has finished. So, before ``torch.distributed.destroy_process_group`` and at exit
(before the interpreter finalizes), from a thread of the program:

1. :func:`quiesce`: wait, without the GIL, until torch has released every continuation
   hhook attached (each is counted from attachment until its last reference goes, on the
   thread that ran it), then a short grace for what torch does right after. Destroying a
   sub-group waits only for the continuations of collectives on that group (and on its
   second communicators) and those attached without a group, not for another group's;
2. :func:`hhook.schedule.groups.end_second_groups`: end hhook's own communicators (their threads
   are joined: nothing of them outlives this).

A collective still in flight is waited for at most the groups' timeout.
"""

from __future__ import annotations

import atexit
import functools
import threading
import time

import torch
import torch.distributed as dist

from . import groups

#: Seconds to wait after the last continuation was released: torch destroys the
#: callback's wrapper right after (a GIL acquisition), with no Python to observe it.
GRACE_S = 0.05
#: The wait's bound where no group says how long a collective may take.
DEFAULT_LIMIT_S = 30.0

_quiet = threading.Condition()
#: A continuation's group where its caller did not say (futures of several collectives):
#: every quiesce waits for it.
UNSAID = object()
_WORLD = "default group"
_in_flight: dict = {}  # group key (:func:`_key_of`) -> continuations attached and not yet released
_released = 0  # continuations released since the last quiesce: only then is a grace due


def _key_of(group):
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
        self.fn, self.counted, self.thread, self.key = fn, True, None, _key_of(group)
        with _quiet:
            _in_flight[self.key] = _in_flight.get(self.key, 0) + 1

    def __call__(self, fut):
        fn, self.fn, self.thread = self.fn, None, threading.get_ident()
        # Not in this frame any more: an exception raised in ``fn`` and kept (a future's
        # error) keeps this frame alive through its traceback's callers.
        del self
        return fn(fut)

    def release(self) -> None:
        """No longer in flight (once): at its last reference, or where no worker thread
        holds it any more."""
        global _released
        if not self.counted:
            return
        self.counted = False
        with _quiet:
            _in_flight[self.key] -= 1
            if not _in_flight[self.key]:
                del _in_flight[self.key]
            _released += 1
            _quiet.notify_all()

    __del__ = release


def attach(fut: torch.futures.Future, fn, group=UNSAID) -> None:
    """Run ``fn(fut)`` when ``fut`` completes, on the thread that completes it (now, if it
    has); ``fn`` must not raise (it settles a future of its own). No child future is made:
    its value would be one more object for that thread to release with the GIL.
    ``group``: the process group whose collective ``fut`` completes (None: the default
    group; a second communicator's: its parent), for :func:`quiesce`."""
    continuation = Continuation(fn, group)
    try:
        fut.add_done_callback(continuation)
    finally:
        if continuation.thread == threading.get_ident():
            # It ran here, on this thread (the future was complete): no worker thread holds
            # it, and an exception kept from its run (a future's error, its traceback's
            # callers: this frame, torch's) may keep it alive past the job's exit.
            continuation.release()


def in_flight(group=None) -> int:
    """Continuations attached and not yet released that ending ``group`` waits for: every
    one for None (and the default group, whose end ends every group), else ``group``'s
    and those attached without a group."""
    with _quiet:
        return _waited_for(group)


def _waited_for(group) -> int:
    if group is None or _key_of(group) == _WORLD:
        return sum(_in_flight.values())
    return _in_flight.get(_key_of(group), 0) + _in_flight.get(UNSAID, 0)


def quiesce(limit_s: float | None = None, group=None) -> bool:
    """Wait, without the GIL, until every continuation that ending ``group`` waits for
    (:func:`in_flight`) is released (at most ``limit_s``; default: the longest timeout of
    hhook's groups), then :data:`GRACE_S` if any was released since the last call.
    False where some are still in flight (a collective that has not completed). Does not
    wait on a thread that is not the program's (a worker thread: it would wait for
    itself)."""
    if isinstance(threading.current_thread(), threading._DummyThread):
        return in_flight(group) == 0
    if limit_s is None:
        limit_s = (groups.longest_timeout() or DEFAULT_LIMIT_S) + 5.0
    global _released
    deadline = time.monotonic() + limit_s
    with _quiet:
        while _waited_for(group) and deadline - time.monotonic() > 0:
            _quiet.wait(deadline - time.monotonic())
        quiet, released, _released = _waited_for(group) == 0, _released, 0
    if released:
        time.sleep(GRACE_S)
    return quiet


def end(group=None) -> None:
    """:func:`quiesce` for ``group``, then end hhook's communicators over it (None: all)."""
    quiesce(group=group)
    groups.end_second_groups(group)


def _observe_destroy() -> None:
    """``torch.distributed.destroy_process_group`` calls :func:`end` first (once per process)."""
    original = dist.destroy_process_group
    if getattr(original, "_hhook", False):
        return

    @functools.wraps(original)
    def destroy_process_group(group=None):
        end(group)
        return original(group)

    destroy_process_group._hhook = True
    dist.destroy_process_group = destroy_process_group
    dist.distributed_c10d.destroy_process_group = destroy_process_group


_observe_destroy()
atexit.register(end)
