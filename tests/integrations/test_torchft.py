"""hhook.torchft: THC as the outer exchange of torchft's fault-tolerant DiLoCo, on a real
Lighthouse (in this process), Gloo, CPU, three replica groups of one rank each
(tests/support/torchft_replica.py, one process each, killed and restarted by the test).

Two worlds, each run once for the tests that read it: a drill that kills a replica between
syncs and restarts it (its steps before the kill are the fault-free run), and one that
kills a replica inside a THC exchange (after the exchange's MAX, before its SUM)."""

from __future__ import annotations

import inspect
import json
import signal
import subprocess
import sys
import time

import pytest

torchft = pytest.importorskip("torchft", reason="torchft is not installed (pip install 'hhook[torchft]')")

from tests.support.distributed import ROOT, subprocess_env  # noqa: E402

#: The Lighthouse's join timeout: a quorum forms this long after its first request without
#: a replica that stopped asking (a dead one).
JOIN_S = 1.0
#: Outer syncs every SYNC inner steps of INNER_SLEEP_S each (the time between syncs).
SYNC, INNER_SLEEP_S = 10, 0.02
REPLICAS = 3


class World:
    """A Lighthouse and the replica processes of one drill; records read from their files."""

    def __init__(self, tmp_path, steps: int):
        from torchft.coordination import LighthouseServer

        self.lighthouse = LighthouseServer(bind="[::]:0", min_replicas=2, join_timeout_ms=int(JOIN_S * 1000))
        self.tmp, self.steps, self.procs = tmp_path, steps, {}

    def start(self, replica: int, *extra: str) -> None:
        out = self.tmp / f"r{replica}.jsonl"
        log = open(self.tmp / f"r{replica}.log", "a")
        self.procs[replica] = subprocess.Popen(
            [sys.executable, "-m", "tests.support.torchft_replica", "--replica", str(replica), "--lighthouse",
             self.lighthouse.address(), "--out", str(out), "--steps", str(self.steps), "--sync-every", str(SYNC),
             "--inner-sleep", str(INNER_SLEEP_S), *extra],
            cwd=ROOT, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT)

    def records(self, replica: int) -> list[dict]:
        path = self.tmp / f"r{replica}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]

    def wait_for(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            for replica, proc in self.procs.items():
                if proc.poll() not in (None, 0, -signal.SIGKILL):
                    raise AssertionError(f"replica {replica} exited {proc.returncode}:\n{self.log(replica)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}:\n" + "\n".join(
                    f"--- replica {r}\n{self.log(r)}" for r in self.procs))
            time.sleep(0.05)

    def log(self, replica: int, tail: int = 3000) -> str:
        return (self.tmp / f"r{replica}.log").read_text()[-tail:]

    def commits(self, replica: int, pid: int | None = None) -> list[dict]:
        return [r for r in self.records(replica) if r["event"] == "commit" and pid in (None, r["pid"])]

    def done(self, replica: int) -> bool:
        return any(r["event"] == "done" for r in self.records(replica))

    def kill(self, replica: int) -> float:
        self.procs[replica].send_signal(signal.SIGKILL)
        killed = time.time()
        self.procs[replica].wait()
        return killed

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self.lighthouse.shutdown()


def _digests(world: World) -> dict:
    """step -> {replica: digest} over every commit record (every pid)."""
    by_step: dict = {}
    for replica in range(REPLICAS):
        for r in world.commits(replica):
            by_step.setdefault(r["step"], {})[replica] = r["digest"]
    return by_step


@pytest.fixture(scope="module")
def drill(tmp_path_factory):
    """3 replicas; replica 2 SIGKILLed once it committed step 3 (between syncs: its next
    sync is SYNC inner steps away), restarted 0.5 s later; every replica runs to step 12."""
    world = World(tmp_path_factory.mktemp("torchft_drill"), steps=12)
    try:
        for replica in range(REPLICAS):
            world.start(replica)
        world.wait_for(lambda: any(r["step"] >= 3 for r in world.commits(2)), 90, "replica 2's step 3")
        first_pid = world.records(2)[0]["pid"]
        killed = world.kill(2)
        time.sleep(0.5)
        world.start(2)
        world.wait_for(lambda: all(world.done(r) for r in range(REPLICAS)), 120, "every replica's last step")
        yield world, killed, first_pid
    finally:
        world.close()


def test_fault_free_steps_train_identically_at_5x_fewer_bytes(drill):
    world, killed, first_pid = drill
    before = [r for r in world.commits(0) if r["t"] < killed and r["participants"] == REPLICAS]
    assert len(before) >= 2, world.commits(0)
    digests = _digests(world)
    for r in before:  # every replica holds the same parameters after each sync
        assert len(set(digests[r["step"]].values())) == 1 and len(digests[r["step"]]) == REPLICAS, digests[r["step"]]
    # bytes of one outer exchange of the three: THC's payload against fp32's (torchft's own: 4 bytes an element)
    a, b = before[-2], before[-1]
    dense, wire = b["dense"] - a["dense"], b["wire"] - a["wire"]
    assert dense == 4 * b["numel"]
    ratio = dense / wire
    # 4 bits over 3 replicas: 6-bit lanes, 5 to a 32-bit word (hhook.codec.lanes), so at most 32 / 6.4 = 5x
    assert ratio > 4.8, ratio
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
    digests = _digests(world)
    for r in restarted:
        assert digests[r["step"]].get(0) == digests[r["step"]].get(1) == r["digest"], (r["step"], digests[r["step"]])
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
        after = [r for r in commits if r["t"] > killed]
        assert after and after[0]["participants"] == 2, after
        # the step in flight was discarded (no commit at 4 before the kill), the next quorum committed it
        assert after[0]["step"] == 4
        assert after[0]["t"] - killed < JOIN_S + 1.0 + 1.0, after[0]["t"] - killed
        # hhook's error reached torchft's error path (Manager.wrap_future: reported, the step skipped)
        log = world.log(replica, tail=10**7)
        assert "got exception in future -- skipping remaining: " in log and "PeerLostError: hhook" in log
    digests = _digests(world)
    for step in range(4, world.steps + 1):
        assert digests[step][0] == digests[step][1], digests[step]


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
