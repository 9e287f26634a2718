"""hhook.schedule.futures.Sequencer: launches in ticket order, from any thread, without deadlocks.

A deadlock would hang the suite, so every scenario that could deadlock runs in a daemon
thread and fails after a timeout instead.
"""

import logging
import random
import threading

import pytest

from hhook.schedule.futures import Sequencer

TIMEOUT = 10.0


def _within(fn, timeout=TIMEOUT):
    """``fn()`` on a daemon thread; fails the test if it is not done within ``timeout``."""
    outcome = {}

    def run():
        try:
            outcome["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"deadlock: still running after {timeout} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome.get("value")


def test_a_later_ticket_waits_for_the_hole_before_it():
    seq, ran = Sequencer(), []
    t0, t1, t2 = seq.ticket(), seq.ticket(), seq.ticket()
    seq.launch(t1, lambda: ran.append(1))
    seq.launch(t2, lambda: ran.append(2))
    assert ran == []  # ticket 0 is a hole
    seq.launch(t0, lambda: ran.append(0))
    assert ran == [0, 1, 2]


def test_a_skipped_ticket_releases_the_later_ones():
    seq, ran = Sequencer(), []
    t0, t1 = seq.ticket(), seq.ticket()
    seq.launch(t1, lambda: ran.append(1))
    seq.launch(t0, None)
    assert ran == [1]


def test_a_hold_keeps_later_tickets_back_until_resumed_from_another_thread():
    """A checked call's turn (issue 57): its callback holds the later tickets while its
    collectives launch from continuations; resume() from any thread lets them run."""
    seq, ran = Sequencer(), []
    t0, t1, t2 = seq.ticket(), seq.ticket(), seq.ticket()

    def held():
        ran.append(0)
        seq.hold()

    seq.launch(t1, lambda: ran.append(1))
    seq.launch(t0, held)
    seq.launch(t2, lambda: ran.append(2))
    assert ran == [0]  # 1 and 2 wait for the hold
    thread = threading.Thread(target=seq.resume)
    thread.start()
    thread.join(5)
    assert ran == [0, 1, 2]
    t3 = seq.ticket()
    seq.launch(t3, lambda: (seq.hold(), seq.resume(), ran.append(3)))  # resumed inside its own callback
    seq.launch(seq.ticket(), lambda: ran.append(4))
    assert ran == [0, 1, 2, 3, 4]


def test_out_of_order_completion_launches_in_ticket_order():
    rnd = random.Random(0)
    for _ in range(50):
        seq, ran = Sequencer(), []
        tickets = [seq.ticket() for _ in range(20)]
        skipped = {t for t in tickets if rnd.random() < 0.2}
        launched = set()
        for t in rnd.sample(tickets, len(tickets)):
            seq.launch(t, None if t in skipped else (lambda t=t: ran.append(t)))
            launched.add(t)
            prefix = min(set(range(len(tickets) + 1)) - launched)
            assert ran == [i for i in range(prefix) if i not in skipped]  # the launched prefix, in order


def test_launching_a_ticket_twice_or_one_never_drawn_is_refused():
    seq = Sequencer()
    t0, t1 = seq.ticket(), seq.ticket()
    seq.launch(t1, None)
    with pytest.raises(ValueError):
        seq.launch(t1, None)  # pending
    seq.launch(t0, None)
    with pytest.raises(ValueError):
        seq.launch(t0, None)  # already run
    with pytest.raises(ValueError):
        seq.launch(5, None)  # never drawn


def test_a_callback_may_draw_and_launch_tickets_of_the_same_sequencer():
    """As when NCCL runs a ``then`` callback inline and it re-enters hhook on the same state."""
    seq, ran = Sequencer(), []
    t0 = seq.ticket()

    def first():
        ran.append(0)
        inner = seq.ticket()
        seq.launch(inner, lambda: ran.append("inner"))

    _within(lambda: seq.launch(t0, first))
    assert ran == [0, "inner"]


def test_a_callback_may_launch_the_pending_next_ticket():
    """A collective launched by ticket 0 completes inline and launches ticket 1."""
    seq, ran = Sequencer(), []
    t0, t1, t2 = seq.ticket(), seq.ticket(), seq.ticket()
    seq.launch(t2, lambda: ran.append(2))
    _within(lambda: seq.launch(t0, lambda: (ran.append(0), seq.launch(t1, lambda: ran.append(1)))))
    assert ran == [0, 1, 2]


def test_a_raising_callback_does_not_stall_later_tickets_and_is_raised_and_logged(caplog):
    seq, ran = Sequencer(), []
    t0, t1, t2, t3 = (seq.ticket() for _ in range(4))
    seq.launch(t1, lambda: ran.append(1))

    def broken():
        raise RuntimeError("boom")

    seq.launch(t2, broken)
    seq.launch(t3, lambda: ran.append(3))
    with caplog.at_level(logging.ERROR, logger="hhook.schedule.futures"):
        with pytest.raises(RuntimeError, match="boom"):
            _within(lambda: seq.launch(t0, lambda: ran.append(0)))
    assert ran == [0, 1, 3]  # ticket 3 ran although ticket 2 raised
    assert any("ticket 2" in r.getMessage() and r.exc_info for r in caplog.records)
    t4 = seq.ticket()
    _within(lambda: seq.launch(t4, lambda: ran.append(4)))  # nothing is left stuck
    assert ran == [0, 1, 3, 4]


def test_a_raising_callback_run_by_another_thread_does_not_stall_the_waiter():
    """ensure_handshake's pattern: launch an Event.set and wait for it on this thread."""
    seq = Sequencer()
    t0, t1 = seq.ticket(), seq.ticket()
    turn = threading.Event()
    seq.launch(t1, turn.set)

    def broken():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        _within(lambda: seq.launch(t0, broken))
    assert turn.wait(TIMEOUT)


def test_threads_launching_out_of_order_with_reentry_and_skips():
    """Tickets drawn in one order, launched from 8 threads in shuffled order; a third of
    the callbacks draw and launch a further ticket from inside (re-entry)."""
    seq = Sequencer()
    ran, ran_lock = [], threading.Lock()
    n = 2000
    tickets = [seq.ticket() for _ in range(n)]
    rnd = random.Random(1)
    order = rnd.sample(tickets, n)
    kinds = {t: rnd.choice(("plain", "skip", "reenter")) for t in tickets}

    def record(t):
        with ran_lock:
            ran.append(t)

    def callback(t):
        record(t)
        if kinds[t] == "reenter":
            inner = seq.ticket()
            seq.launch(inner, lambda: record(("inner", t)))

    def worker(part):
        for t in part:
            seq.launch(t, None if kinds[t] == "skip" else (lambda t=t: callback(t)))

    threads = [threading.Thread(target=worker, args=(order[i::8],), daemon=True) for i in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(TIMEOUT)
    assert not any(th.is_alive() for th in threads), "deadlock"
    outer = [t for t in ran if not isinstance(t, tuple)]
    assert outer == [t for t in tickets if kinds[t] != "skip"]
    assert sum(isinstance(t, tuple) for t in ran) == sum(k == "reenter" for k in kinds.values())
    assert seq._ready == {} and seq._next_launch == seq._next_ticket
