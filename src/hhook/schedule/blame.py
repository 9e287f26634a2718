r"""Which rank stalled: a collective that timed out names the rank that stopped, not the
peer that was waiting for it.

A rank waits for the other ranks of its collective's group, and a peer may itself be
waiting, for a rank of another group: two-level, 2 nodes x 2 ranks, rank 1 stopped, rank 2
waits for rank 0 between nodes while rank 0 waits for rank 1 inside its node. So a rank
whose collective times out leaves a report in the job's store (the default group's, whose
keys belong to this attempt) naming the ranks it waited for, then reads its peers'
reports: a peer that reported waits too, and the search goes on through the ranks that
peer waits for; the ranks it reaches that report nothing (within a few seconds: every
waiting rank times out at about the same time) are the ones that stalled. A peer that
closed its connection after reporting gave up waiting (it stalled nobody); one that closed
it without a report died. In a world of two the same wait applies: a peer that waits for
this rank too (each waits for the other) reports within it, and is not named as stalled.

Reports are keyed by the process-group instance (:func:`hhook.schedule.liveness.instance`:
torchrun's run id and restart count, and how many default groups the process made), never
judged by a wall clock (hosts' clocks differ): torchrun's agents keep their store across
restarts, and a program may destroy and re-make its group; an earlier instance's report is
not read. A silent peer that said goodbye on its liveness connection
(:mod:`hhook.schedule.liveness`) left normally and is named so, not as dead. Every store operation here
is bounded (a store whose host stalled answers nothing): where the store cannot tell, the
message names the group's peers, as before. The bound is the store's own timeout, set to
:data:`STORE_TIMEOUT_S` meanwhile: another thread's store operation in that moment is
bounded by it too (a client of its own would need connecting, which a stalled store host
does not bound: it would have to be made beforehand, at the handshake).

A report also says which collective the rank waited in (its description and group), so
two ranks that each wait for the other in *different* collectives (a world of two whose
program launched them in another order on each rank) are told apart from a stall: each
names both collectives. A rank that lost a peer (its connection closed) reports that too
before it exits, naming the rank it lost: so a survivor whose own peer exited only
because another rank died first follows that report and names the rank that died, not the
peer that left after it.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import time

import torch.distributed as dist

from ..errors import Blame
from . import liveness

#: Longest wait (s) for the reports of the ranks a timed-out rank waited for (at most half
#: the group's timeout).
REPORT_WAIT_S = 3.0
#: Longest wait (s), where a peer closed its connection, for the reports that tell which
#: of several silent ranks died (the others report losing it within this).
LOST_WAIT_S = 1.0
#: Longest wait (s) for the ranks that wait for this one to have read its report.
ACK_WAIT_S = 1.0
#: Bound (s) of each store operation here.
STORE_TIMEOUT_S = 2.0
_PREFIX = "hhook/blame/"
#: What a report says the rank did: waited for the ranks it names, or lost one of them.
WAITED, LOST = "waited", "lost"
_lock = threading.Lock()
_cache: dict = {}
_reported: list = []


def blame(kind: str, peers: list[int], timeout_s: float, what: str = "") -> Blame | None:
    """Who is at fault where this rank's collective ``what`` with ``peers`` (global ranks)
    failed: ``kind`` "timeout" (this rank reports that it waited for them, then waits up
    to :data:`REPORT_WAIT_S` for their reports) or "lost" (a peer closed its connection:
    the reports as they are, after at most :data:`LOST_WAIT_S`; this rank then reports
    what it lost). One answer per kind and peers for the life of the process; None where
    the store cannot tell."""
    if not peers:
        return None
    try:
        store, me = dist.distributed_c10d._get_default_store(), dist.get_rank()
    except Exception:  # noqa: BLE001 - no default group (destroyed, not initialized)
        return None
    key = (liveness.instance(), kind, tuple(sorted(peers)))
    with _lock:
        if key not in _cache:
            try:
                with bounded(store):
                    _cache[key] = _resolve(store, me, sorted(peers), kind, timeout_s, what)
            except Exception:  # noqa: BLE001 - a store that does not answer: the group's peers
                _cache[key] = None
        return _cache[key]


def reported(ranks) -> bool:
    """Whether any of ``ranks`` (global) reported giving up in this process-group instance
    (False where the store cannot tell)."""
    try:
        store = dist.distributed_c10d._get_default_store()
        with _lock, bounded(store):
            return any(store.check([_key(rank)]) for rank in ranks)
    except Exception:  # noqa: BLE001 - no default group, or a store that does not answer
        return False


def _resolve(store, me: int, peers: list[int], kind: str, timeout_s: float, what: str) -> Blame:
    # Read before reporting: a peer that waits for this rank's report may end its process
    # as soon as it reads it, and with it the store where that rank hosts it.
    found = _walk(store, me, peers, what)
    if kind == "timeout":
        _report(store, me, WAITED, peers, what)
    # Peers that wait too time out at about the same time: their reports are awaited (in a
    # world of two as well: there the peer may wait for this rank). Where a peer closed its
    # connection, the silent ranks but one may still be about to report losing it.
    wait = min(REPORT_WAIT_S, max(1.0, timeout_s / 2)) if kind == "timeout" else LOST_WAIT_S
    deadline = time.monotonic() + wait
    while (found.culprits if kind == "timeout" else found.culprits[1:]) and time.monotonic() < deadline:
        time.sleep(0.25)
        found = _walk(store, me, peers, what)
    if kind == "lost":  # before this rank exits, so that its own peers follow it to the cause
        _report(store, me, WAITED if found.waiting else LOST, list(found.culprits) or peers, what)
    # The ranks that wait for this one have read its report once they say so: until then
    # (at most ACK_WAIT_S) this rank does not return, so it does not end the process that
    # may host the store while they read.
    store.set(_key(me) + "/read", "1")
    deadline = time.monotonic() + ACK_WAIT_S
    readers = [_key(rank) + "/read" for rank, _ in found.elsewhere]
    while readers and not store.check(readers) and time.monotonic() < deadline:
        time.sleep(0.05)
    return found


def _walk(store, me: int, peers: list[int], what: str) -> Blame:
    """From ``peers`` through every rank that reported: the ranks reached without a report
    (culprits), the peers that reported waiting (waiting) or losing a rank (lost), whether
    a report waits for ``me``, and the collectives of the reports that do."""
    seen, todo, culprits, waiting, lost, elsewhere, mine = {me}, list(peers), [], [], [], [], False
    while todo:
        rank = todo.pop(0)
        if rank in seen:
            continue
        seen.add(rank)
        report = _read(store, rank)
        if report is None:
            culprits.append(rank)
            continue
        kind, on, where = report
        if rank in peers:
            (waiting if kind == WAITED else lost).append(rank)
        if me in on and kind == WAITED:
            mine = True
            elsewhere.append((rank, where))
        todo.extend(on)
    left = tuple(sorted(r for r, how in liveness.ended(culprits).items() if how == liveness.LEFT))
    return Blame(tuple(sorted(culprits)), tuple(sorted(waiting)), mine, tuple(sorted(lost)), tuple(elsewhere), what,
                 left)


def _key(rank) -> str:
    """Where ``rank`` reports in this process-group instance."""
    return f"{_PREFIX}{liveness.instance()}/{rank}"


def _report(store, me: int, kind: str, on: list[int], what: str) -> None:
    """Say, once per process, which ranks this one waited for (or lost) when it gave up,
    and in which collective."""
    if liveness.instance() not in _reported:
        store.set(_key(me), f"{kind}|{','.join(str(r) for r in on)}|{what}")
        _reported.append(liveness.instance())


def _read(store, rank: int) -> tuple[str, list[int], str] | None:
    """What ``rank`` reported in this attempt (``(kind, ranks, collective)``), or None."""
    key = _key(rank)
    if not store.check([key]):
        return None
    kind, ranks, what = store.get(key).decode().split("|", 2)
    return kind, [int(r) for r in ranks.split(",") if r], what


@contextlib.contextmanager
def bounded(store, seconds: float = STORE_TIMEOUT_S):
    """The store's operations time out after ``seconds`` meanwhile (every thread's: the
    store is the process's); for error paths, where the store's host may be gone."""
    old = store.timeout
    store.set_timeout(datetime.timedelta(seconds=seconds))
    try:
        yield
    finally:
        store.set_timeout(old)
