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
   hhook attached (:mod:`hhook.schedule.futures` counts each from attachment until its
   last reference goes, on the thread that ran it), then a short grace for what torch does right after. Destroying a
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

import torch.distributed as dist

from . import futures, groups, liveness

#: Seconds to wait after the last continuation was released: torch destroys the
#: callback's wrapper right after (a GIL acquisition), with no Python to observe it.
GRACE_S = 0.05
#: The wait's bound where no group says how long a collective may take.
DEFAULT_LIMIT_S = 30.0


def in_flight(group=None) -> int:
    """Continuations attached and not yet released that ending ``group`` waits for: every
    one for None (and the default group, whose end ends every group), else ``group``'s
    and those attached without a group."""
    with futures.quiet:
        return _waited_for(group)


def _waited_for(group) -> int:
    counts, key = futures.in_flight, futures.key_of(group)
    if group is None or key == futures.key_of(None):
        return sum(counts.values())
    return counts.get(key, 0) + counts.get(futures.UNSAID, 0)


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
    deadline = time.monotonic() + limit_s
    with futures.quiet:
        while _waited_for(group) and deadline - time.monotonic() > 0:
            futures.quiet.wait(deadline - time.monotonic())
        quiet, released = _waited_for(group) == 0, futures.released[0]
        futures.released[0] = 0
    if released:
        time.sleep(GRACE_S)
    return quiet


def end(group=None) -> None:
    """:func:`quiesce` for ``group``, then end hhook's communicators over it (None or the
    default group, passed as ``dist.group.WORLD`` too: all, and this process says goodbye
    on its liveness connections, :func:`liveness.stop`: its peers read that it left
    normally, not that it died)."""
    quiesce(group=group)
    if group is None or (dist.is_initialized() and group == dist.GroupMember.WORLD):
        liveness.stop()  # first: a peer whose collective fails when these communicators end reads the goodbye
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
