"""hhook.torchft: THC as the outer exchange of torchft's fault-tolerant DiLoCo, on a real
Lighthouse (in this process), Gloo, CPU, three replica groups of one rank each
(tests/support/torchft_replica.py, one process each, killed and restarted by the test).

Two worlds, each run once for the tests that read it: a drill that kills a replica between
syncs and restarts it (its steps before the kill are the fault-free run), and one that
kills a replica inside a THC exchange (after the exchange's MAX, before its SUM)."""

from __future__ import annotations

import contextlib
import inspect
import time

import pytest

torchft = pytest.importorskip("torchft", reason="torchft is not installed (pip install 'hhook[torchft]')")

from tests.support.torchft_world import JOIN_S, REPLICAS, World, digests  # noqa: E402


PAUSE = 12


@pytest.fixture(scope="module")
def drill(tmp_path_factory):
    """3 replicas; replica 2 SIGKILLed once it committed three steps with every replica
    (between syncs: its next sync is SYNC inner steps away), restarted 0.5 s later; every replica runs to step 24 (the restarted one joins
    a few steps after its start: its imports take seconds; the survivors wait at step PAUSE until its manager is
    built, or on a loaded host they could end before it asks for a quorum, and it would wait for one alone)."""
    tmp = tmp_path_factory.mktemp("torchft_drill")
    rejoin = tmp / "rejoin"  # the survivors wait at step PAUSE until the restarted replica is ready
    world = World(tmp, steps=24)
    try:
        for replica in range(REPLICAS):
            world.start(replica, *(("--pause-at", str(PAUSE), "--pause-file", str(rejoin)) if replica < 2 else ()))
        # three commits of the full quorum first: on a loaded host a replica that starts late
        # makes the first quorums of two, and the fault-free run needs two commits of three
        full = lambda: [r for r in world.commits(2) if r["participants"] == REPLICAS]  # noqa: E731
        world.wait_for(lambda: len(full()) >= 3, 90, "replica 2's third commit with every replica")
        first_pid = world.records(2)[0]["pid"]
        killed = world.kill(2)
        time.sleep(0.5)
        world.start(2)
        world.wait_for(lambda: any(r["event"] == "ready" and r["pid"] != first_pid for r in world.records(2)), 90,
                       "the restarted replica's manager")
        rejoin.touch()
        world.wait_for(lambda: all(world.done(r) for r in range(REPLICAS)), 120, "every replica's last step")
        yield world, killed, first_pid
    finally:
        world.close()


def test_fault_free_steps_train_identically_at_fewer_bytes(drill):
    world, killed, first_pid = drill
    before = [r for r in world.commits(0) if r["t"] < killed and r["participants"] == REPLICAS]
    assert len(before) >= 2, world.commits(0)
    by_step = digests(world)
    for r in before:  # every replica holds the same parameters after each sync
        assert len(set(by_step[r["step"]].values())) == 1 and len(by_step[r["step"]]) == REPLICAS, by_step[r["step"]]
    # bytes of one outer exchange of the three: THC's payload against fp32's (torchft's own: 4 bytes an element)
    a, b = before[-2], before[-1]
    dense, wire = b["dense"] - a["dense"], b["wire"] - a["wire"]
    assert dense == 4 * b["numel"]
    ratio = dense / wire
    # 4 bits over 3 replicas, the default's gathered scales: the all-gather's output is counted,
    # 3 messages of 4-bit lanes (12.1 bits a coordinate), so at most 32 / 12.1 = 2.65x; a ring sends 2
    # of them, 8.06 bits against fp32's allreduce's 2 x 2/3 x 32: 5.3x fewer on the wire
    assert ratio > 2.55, ratio
    losses = [r["loss"] for r in world.commits(0)]
    assert sum(losses[-3:]) < 0.6 * sum(losses[:3]), losses  # it trains


def test_survivors_commit_again_within_the_join_timeout(drill):
    world, killed, _ = drill
    for replica in (0, 1):
        after = [r for r in world.commits(replica) if r["t"] > killed]
        assert after, world.commits(replica)
        assert after[0]["t"] - killed < JOIN_S + 1.0, (after[0]["t"] - killed, after[0])


def test_the_restarted_replica_holds_the_survivors_parameters_from_its_first_commit(drill):
    world, killed, first_pid = drill
    restarted = [r for r in world.commits(2) if r["pid"] != first_pid]
    assert restarted and restarted[-1]["step"] == world.steps
    by_step = digests(world)
    for r in restarted:
        assert by_step[r["step"]].get(0) == by_step[r["step"]].get(1) == r["digest"], (r["step"], by_step[r["step"]])
    # every quorum's rebuild of hhook's state (handshake and second communicator of the new
    # quorum, the wait for its members included)
    rebuilds = [s for replica in range(REPLICAS) for s in world.commits(replica)[-1]["rebuilds"]]
    assert rebuilds and max(rebuilds) < 2.0, rebuilds


@pytest.fixture(scope="module")
def in_flight(tmp_path_factory):
    """3 replicas; replica 2 stops inside its THC exchange at step 3 (after the MAX, before
    the SUM), then is SIGKILLed; the survivors run to step 7."""
    world = World(tmp_path_factory.mktemp("torchft_in_flight"), steps=7)
    try:
        world.start(0)
        world.start(1)
        world.start(2, "--hold-at", "3")
        world.wait_for(lambda: any(r["event"] == "holding" for r in world.records(2)), 90, "replica 2 to hold")
        time.sleep(0.5)  # the survivors wait in their SUM
        killed = world.kill(2)
        world.wait_for(lambda: world.done(0) and world.done(1), 90, "the survivors' last step")
        yield world, killed
    finally:
        world.close()


def test_a_replica_killed_inside_a_thc_exchange_fails_that_step_only(in_flight):
    world, killed = in_flight
    for replica in (0, 1):
        commits = world.commits(replica)
        steps = [r["step"] for r in commits]
        assert steps == sorted(set(steps)) and steps[-1] == world.steps, steps
        # the step in flight was discarded (no commit of it before the kill), the next quorum committed it
        # (by step, not by the record's time: under load a survivor may record its commit of the step
        # before later than the kill)
        held = next(r["step"] for r in world.records(2) if r["event"] == "holding")
        after = [r for r in commits if r["step"] > held]
        assert after and after[0]["participants"] == 2 and after[0]["step"] == held + 1, (held, after)
        assert after[0]["t"] - killed < JOIN_S + 1.0 + 1.0, after[0]["t"] - killed
        # hhook's error reached torchft's error path (Manager.wrap_future: reported, the step skipped)
        log = world.log(replica, tail=10**7)
        assert "got exception in future -- skipping remaining: " in log and "PeerLostError: hhook" in log
        said = next(line for line in log.splitlines() if "PeerLostError: hhook" in line)
        assert "torchft's Manager reports it" in said and "torchrun" not in said, said  # torchft's recovery, not a restart
    by_step = digests(world)
    for step in range(4, world.steps + 1):
        assert by_step[step][0] == by_step[step][1], by_step[step]


def test_the_private_torchft_pieces_hhook_leans_on():
    """hhook.torchft reads Manager._pg and Manager._timeout and wraps ProcessGroup.configure
    with the arguments Manager passes: a torchft that changes them fails here first."""
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroup

    import hhook.torchft

    init = inspect.getsource(Manager.__init__)
    for name in hhook.torchft.PRIVATE:
        assert f"self.{name}" in init, name
    assert list(inspect.signature(ProcessGroup.configure).parameters) == [
        "self", "store_addr", "replica_id", "rank", "world_size", "quorum_id", "group_rank", "group_world_size",
        "global_ranks"]
    assert list(inspect.signature(Manager.allreduce).parameters) == ["self", "tensor", "should_quantize", "reduce_op"]
    quorum = inspect.getsource(Manager._async_quorum)
    assert "self._pg.configure(" in quorum and "replica_world_size," in quorum


def test_replica_groups_of_two_ranks_exchange_rank_by_rank():
    """2 replica groups of 2 ranks each, DDP inside a group (torchtitan's HSDP): each group
    rank has its own ring across the groups (its own quorum name and store), and every rank
    of every group holds the same parameters after each sync; the replica group's default
    process group (and hhook's liveness mesh on it) is not confused with the quorum."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        world = World(Path(tmp), steps=4, group_size=2)
        try:
            world.start(0)
            world.start(1)
            world.wait_for(lambda: world.done(0) and world.done(1), 120, "every rank's last step")
            by_rank = [digests(world, replicas=2, rank=rank) for rank in (0, 1)]
            full = [r["step"] for r in world.commits(0) if r["participants"] == 2]
            assert full, world.commits(0)
            for step in full:
                assert len({*by_rank[0][step].values(), *by_rank[1][step].values()}) == 1, (step, by_rank)
            a, b = world.commits(1, rank=1)[-2:]
            ratio = (b["dense"] - a["dense"]) / (b["wire"] - a["wire"])
            # 2 replicas at 4 bits, gathered scales: two messages of 4-bit lanes counted (8.06 bits), at most 3.97x
            assert ratio > 3.8, ratio
        finally:
            world.close()


def test_streaming_diloco_fragments_with_overlap(tmp_path):
    """Streaming DiLoCo: the model in 2 fragments synced in turn, each exchange launched 2
    inner steps before it is waited for (fragment_sync_delay): after every sync every replica
    holds the same parameters of the fragment it synced (the other one holds each replica's
    own inner steps since its last sync), and it trains. Every quorum needs all three
    replicas: with two, a replica that starts late (under load) heals into a step whose
    fragment differs from its peers', with torchft's own fp32 exchange as with THC (measured:
    a replica joining at step 17 of 40, both exchanges), matching them from its next commit."""
    extra = ("--fragments", "2", "--sync-delay", "2", "--min-replicas", str(REPLICAS))
    with contextlib.closing(World(tmp_path, steps=8, extra=extra, min_replicas=REPLICAS)) as world:
        for replica in range(REPLICAS):
            world.start(replica)
        world.wait_for(lambda: all(world.done(r) for r in range(REPLICAS)), 120, "every replica's last step")
        synced = {}  # step -> {replica: digest of the fragment that step synced: (step - 1) % 2}
        for replica in range(REPLICAS):
            for r in world.commits(replica):
                synced.setdefault(r["step"], {})[replica] = r["fragments"][(r["step"] - 1) % 2]
        full = [r["step"] for r in world.commits(0) if r["participants"] == REPLICAS]
        assert len(full) >= 4, world.commits(0)
        for step in full:
            assert len(set(synced[step].values())) == 1 and len(synced[step]) == REPLICAS, (step, synced[step])
        # the fragment not synced at a step holds local progress: it differs between replicas
        assert len({r["fragments"][full[-1] % 2] for r in (world.commits(x)[-1] for x in range(REPLICAS))}) > 1
        losses = [r["loss"] for r in world.commits(0)]
        assert sum(losses[-2:]) < 0.8 * sum(losses[:2]), losses


def test_a_stopped_replica_is_left_out_and_heals_when_it_resumes():
    """SIGSTOP replica 2 between syncs (after its step 3), SIGCONT it 3 s later: the
    survivors commit without it within the join timeout + 1 s; once resumed it heals from
    them and holds their parameters bit for bit from its next commit."""
    import signal
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        world = World(Path(tmp), steps=24)
        try:
            for replica in range(REPLICAS):
                world.start(replica)
            world.wait_for(lambda: any(r["step"] >= 3 for r in world.commits(2)), 90, "replica 2's step 3")
            stopped = world.signal(2, signal.SIGSTOP)
            time.sleep(3.0)
            resumed = world.signal(2, signal.SIGCONT)
            world.wait_for(lambda: all(world.done(r) for r in range(REPLICAS)), 120, "every replica's last step")
            for replica in (0, 1):
                after = [r for r in world.commits(replica) if r["t"] > stopped]
                assert after and after[0]["participants"] == 2, after
                assert after[0]["t"] - stopped < JOIN_S + 1.0, after[0]["t"] - stopped
            by_step = digests(world)
            back = [r for r in world.commits(2) if r["t"] > resumed]
            assert back and back[-1]["step"] == world.steps, back
            for r in back:
                assert by_step[r["step"]].get(0) == by_step[r["step"]].get(1) == r["digest"], (r["step"], by_step)
        finally:
            world.close()


def test_an_error_inside_one_replicas_exchange_discards_the_step_and_the_next_quorum_commits():
    """Replica 2's THC exchange raises at step 3 after its MAX (it sends no SUM; no process
    dies): replica 2 reports it to torchft, the others' SUM fails at the manager's timeout
    (5 s), the step is discarded, torchft forms a new quorum (a member reports a commit
    failure) and every replica commits again, identical, with hhook's state rebuilt."""
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        world = World(Path(tmp), steps=8, extra=("--timeout", "5"))
        try:
            world.start(0)
            world.start(1)
            world.start(2, "--fail-at", "3")
            world.wait_for(lambda: all(world.done(r) for r in range(REPLICAS)), 120, "every replica's last step")
            failed = next(r["t"] for r in world.records(2) if r["event"] == "failing")
            log = world.log(2, tail=10**7)
            assert "got exception in future -- skipping remaining: " in log and "injected" in log
            by_step = digests(world)
            for replica in range(REPLICAS):
                after = [r for r in world.commits(replica) if r["t"] > failed]
                assert after and after[-1]["step"] == world.steps, after
                assert after[0]["t"] - failed < 5.0 + JOIN_S + 2.0, after[0]["t"] - failed
            last = [r["step"] for r in world.commits(0) if r["participants"] == REPLICAS][-1]
            assert len(set(by_step[last].values())) == 1 and len(by_step[last]) == REPLICAS, by_step[last]
        finally:
            world.close()


class _FakePG:
    """torchft's reconfigurable process group as hhook.torchft sees it, over this world's
    default group (the quorum id and store address as torchft's Manager passes them)."""

    def __init__(self):
        self.configured = []

    def configure(self, store_addr, replica_id, rank, world_size, quorum_id=None, group_rank=None,
                  group_world_size=None, global_ranks=None):
        self.configured.append(quorum_id)

    def getBackendName(self):
        return "torchft-gloo"

    def allreduce(self, tensors, opts):
        import torch.distributed as dist

        return dist.all_reduce(tensors[0], opts.reduceOp, async_op=True)

    def allgather(self, outputs, inputs, opts):
        import torch.distributed as dist

        return dist.all_gather(outputs[0], inputs[0], async_op=True)


class _FakeManager:
    """What hhook.torchft calls of torchft's Manager, with torchft's semantics for
    ``wrap_future`` (an error is reported, the default returned)."""

    def __init__(self, participants: int, participating: bool):
        import datetime

        self._pg, self._timeout = _FakePG(), datetime.timedelta(seconds=20)
        self.participants, self.participating, self.errors, self.own = participants, participating, [], 0

    def allreduce(self, tensor, should_quantize=False, reduce_op=None):
        self.own += 1
        return "torchft's own exchange"

    def errored(self):
        return self.errors[-1] if self.errors else None

    def wait_quorum(self):
        pass

    def num_participants(self):
        return self.participants

    def is_participating(self):
        return self.participating

    def report_error(self, exc):
        self.errors.append(exc)

    def wrap_future(self, fut, default):
        def reported(f):
            try:
                return f.value()
            except Exception as exc:  # noqa: BLE001 - as torchft's Manager.wrap_future
                self.report_error(exc)
                return default

        return fut.then(reported)


def _semantics_worker(rank, world):
    import torch
    import torch.distributed as dist

    import hhook.torchft

    store = dist.distributed_c10d._get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    manager = _FakeManager(participants=world, participating=True)
    thc = hhook.torchft.enable(manager, bits=4)

    def quorum(qid):
        manager._pg.configure(f"127.0.0.1:{store.port}/torchft/{qid}/0", "r", rank, world, qid, 0, 1, None)
        manager.errors.clear()

    def x(r):  # heterogeneous replicas: replica 1's pseudo-gradient 10x replica 0's
        return torch.randn(3000, generator=torch.Generator().manual_seed(r)) * (10.0 if r == 1 else 1.0)

    out = {}
    quorum(1)
    t = x(rank)
    thc.allreduce(t, should_quantize=True).wait()
    out["avg"] = t
    t = x(rank)
    thc.allreduce(t, should_quantize=True, reduce_op=dist.ReduceOp.SUM).wait()
    out["sum"] = t
    out["own"] = (thc.allreduce(x(rank)), manager.own)  # should_quantize=False: torchft's own exchange
    # a callback chained on the Work's future has run when wait() returns (the bucketized DiLoCo's copy-back)
    seen = []
    work = thc.allreduce(x(rank), should_quantize=True)
    work.get_future().then(lambda f: (time.sleep(0.2), seen.append(f.value().sum().item())))
    work.wait()
    out["chained"] = len(seen)
    out["calls_q1"] = thc.state.counters.calls
    # a quorum of 3 where replica 2 heals (does not participate): it sends zeros, AVG over 2
    quorum(2)
    manager.participants, manager.participating = 2, rank != 2
    t = x(rank)
    thc.allreduce(t, should_quantize=True).wait()
    out["partial"] = t
    out["name"], out["first_call_q2"] = thc.state.process_group.name, thc.state.counters.calls
    # a replica whose tensor has another length: every replica's step is reported, and the
    # quorum takes no more THC exchanges until the next one
    manager.participants, manager.participating = world, True
    t = torch.ones(100 if rank == 2 else 200)
    thc.allreduce(t, should_quantize=True).wait()
    out["mismatch"] = [type(e).__name__ for e in manager.errors]
    manager.errors.clear()
    thc.allreduce(torch.ones(200), should_quantize=True).wait()  # no collective: reported at once
    out["after"] = [str(e)[:60] for e in manager.errors]
    quorum(3)
    t = x(rank)
    thc.allreduce(t, should_quantize=True).wait()
    out["again"], out["errors_q3"], out["rebuilds"] = t, list(manager.errors), len(thc.rebuilds)
    return out


def test_torchfts_semantics_on_a_fake_manager():
    """hhook.torchft against a Manager that behaves as torchft's, over 3 ranks: AVG is the
    sum over the participants and SUM the sum, the same bits on every replica; a replica
    that does not participate sends zeros; calls without should_quantize go to torchft's
    own exchange; wait() covers callbacks chained on the future; a mismatch is reported on
    every replica and ends THC in that quorum; the next quorum starts afresh, its rounding
    counters from its id."""
    import torch

    from tests.support.distributed import run_world

    world = 3
    outs = run_world(_semantics_worker, world)

    def x(r):
        return torch.randn(3000, generator=torch.Generator().manual_seed(r)) * (10.0 if r == 1 else 1.0)

    total = sum(x(r) for r in range(world))

    def close(a, b):
        return ((a - b).norm() / b.norm()).item() < 0.3

    for out in outs:
        for key in ("avg", "sum", "partial", "again"):
            assert torch.equal(out[key], outs[0][key]), key
        assert close(out["avg"], total / world) and close(out["sum"], total)
        assert close(out["partial"], (x(0) + x(1)) / 2)
        assert out["own"] == ("torchft's own exchange", 1)
        assert out["chained"] == 1
        assert out["calls_q1"] >= 1 << 32 and out["first_call_q2"] >= 2 << 32
        assert out["name"] == "torchft:2:0"
        assert out["mismatch"] == ["ConfigMismatchError"], out["mismatch"]
        assert len(out["after"]) == 1 and "an earlier THC exchange of quorum 2 failed" in out["after"][0]
        assert close(out["again"], total / world) and out["errors_q3"] == [] and out["rebuilds"] == 3
