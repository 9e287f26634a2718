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

Reports are keyed by the launcher's attempt (torchrun's run id and restart count), never
judged by a wall clock (hosts' clocks differ): torchrun's agents keep their store across
restarts, and an earlier attempt's report there is not read. Every store operation here
is bounded (a store whose host stalled answers nothing): where the store cannot tell, the
message names the group's peers, as before. The bound is the store's own timeout, set to
:data:`STORE_TIMEOUT_S` meanwhile: another thread's store operation in that moment is
bounded by it too (a client of its own would need connecting, which a stalled store host
does not bound: it would have to be made beforehand, at the handshake).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time

import torch.distributed as dist

from ..errors import Blame

#: Longest wait (s) for the reports of the ranks a timed-out rank waited for (at most half
#: the group's timeout).
REPORT_WAIT_S = 3.0
#: Bound (s) of each store operation here.
STORE_TIMEOUT_S = 2.0
_PREFIX = "hhook/blame/"
_lock = threading.Lock()
_cache: dict = {}
_reported: list = []


def blame(kind: str, peers: list[int], timeout_s: float) -> Blame | None:
    """Who is at fault where this rank's collective with ``peers`` (global ranks) failed:
    ``kind`` "timeout" (this rank reports that it waited for them, then waits up to
    :data:`REPORT_WAIT_S` for their reports) or "lost" (a peer closed its connection: the
    reports as they are). One answer per kind and peers for the life of the process; None
    where the store cannot tell."""
    if not peers:
        return None
    try:
        store, me = dist.distributed_c10d._get_default_store(), dist.get_rank()
    except Exception:  # noqa: BLE001 - no default group (destroyed, not initialized)
        return None
    key = (kind, tuple(sorted(peers)))
    with _lock:
        if key not in _cache:
            try:
                with _bounded(store):
                    _cache[key] = _resolve(store, me, sorted(peers), kind, timeout_s)
            except Exception:  # noqa: BLE001 - a store that does not answer: the group's peers
                _cache[key] = None
        return _cache[key]


def _resolve(store, me: int, peers: list[int], kind: str, timeout_s: float) -> Blame:
    if kind == "timeout":
        _report(store, me, peers)
    # Peers that wait too time out at about the same time: their reports are awaited (in a
    # world of two as well: there the peer may wait for this rank).
    wait = min(REPORT_WAIT_S, max(1.0, timeout_s / 2)) if kind == "timeout" else 0.0
    deadline = time.monotonic() + wait
    while True:
        found = _walk(store, me, peers)
        if not found.culprits or time.monotonic() >= deadline:
            break
        time.sleep(0.25)
    if kind == "lost" and found.waiting:  # a peer gave up: this rank waits for the same ranks
        _report(store, me, list(found.culprits))
    return found


def _walk(store, me: int, peers: list[int]) -> Blame:
    """From ``peers`` through every rank that reported waiting: the ranks reached without
    a report (culprits), the peers that reported (waiting), whether a report names ``me``."""
    seen, todo, culprits, waiting, mine = {me}, list(peers), [], [], False
    while todo:
        rank = todo.pop(0)
        if rank in seen:
            continue
        seen.add(rank)
        on = _read(store, rank)
        if on is None:
            culprits.append(rank)
            continue
        if rank in peers:
            waiting.append(rank)
        mine = mine or me in on
        todo.extend(on)
    return Blame(tuple(sorted(culprits)), tuple(sorted(waiting)), mine)


def _key(rank: int) -> str:
    """Where ``rank`` reports in this attempt: torchrun's agents keep their store across
    restarts, and every rank of an attempt holds the same run id and restart count."""
    attempt = f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return f"{_PREFIX}{attempt}/{rank}"


def _report(store, me: int, on: list[int]) -> None:
    """Say, once per process, which ranks this one waited for when it gave up."""
    if not _reported:
        store.set(_key(me), ",".join(str(r) for r in on))
        _reported.append(on)


def _read(store, rank: int) -> list[int] | None:
    """The ranks ``rank`` reported waiting for in this attempt, or None."""
    key = _key(rank)
    if not store.check([key]):
        return None
    return [int(r) for r in store.get(key).decode().split(",") if r]


@contextlib.contextmanager
def _bounded(store):
    """The store's operations time out after :data:`STORE_TIMEOUT_S` meanwhile (every
    thread's: the store is the process's)."""
    old = store.timeout
    store.set_timeout(datetime.timedelta(seconds=STORE_TIMEOUT_S))
    try:
        yield
    finally:
        store.set_timeout(old)
