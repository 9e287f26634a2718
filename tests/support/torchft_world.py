"""A torchft world for tests and measurements: a Lighthouse in this process and replica
processes of tests/support/torchft_replica.py (one rank each), started, killed and
restarted at will; their records read back from their files."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

from tests.support.distributed import ROOT, subprocess_env

#: The Lighthouse's join timeout: a quorum forms this long after its first request without
#: a replica that stopped asking (a dead one).
JOIN_S = 1.0
#: Outer syncs every SYNC inner steps of INNER_SLEEP_S each (the time between syncs).
SYNC, INNER_SLEEP_S = 10, 0.02
REPLICAS = 3


class World:
    """A Lighthouse and the replica processes of one drill; records read from their files."""

    def __init__(self, tmp_path, steps: int, extra: tuple = (), group_size: int = 1, min_replicas: int = 2):
        from torchft.coordination import LighthouseServer

        self.lighthouse = LighthouseServer(bind="[::]:0", min_replicas=min_replicas,
                                           join_timeout_ms=int(JOIN_S * 1000))
        self.tmp, self.steps, self.procs, self.extra = tmp_path, steps, {}, tuple(extra)
        self.group_size = group_size

    def start(self, replica: int, *extra: str) -> None:
        """Every rank of replica group ``replica`` (a store of its own on a free port)."""
        from tests.support.distributed import free_port

        port = free_port() if self.group_size > 1 else 0
        for rank in range(self.group_size):
            log = open(self.tmp / f"r{replica}_{rank}.log", "a")
            self.procs[replica, rank] = subprocess.Popen(
                [sys.executable, "-m", "tests.support.torchft_replica", "--replica", str(replica), "--lighthouse",
                 self.lighthouse.address(), "--out", str(self.tmp / f"r{replica}_{rank}.jsonl"), "--steps",
                 str(self.steps), "--sync-every", str(SYNC), "--inner-sleep", str(INNER_SLEEP_S), "--group-size",
                 str(self.group_size), "--group-rank", str(rank), "--store-port", str(port), *self.extra, *extra],
                cwd=ROOT, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT)

    def records(self, replica: int, rank: int = 0) -> list[dict]:
        path = self.tmp / f"r{replica}_{rank}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]

    def wait_for(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            for (replica, rank), proc in self.procs.items():
                if proc.poll() not in (None, 0, -signal.SIGKILL):
                    raise AssertionError(f"replica {replica} rank {rank} exited {proc.returncode}:\n"
                                         f"{self.log(replica, rank)}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}:\n" + "\n".join(
                    f"--- replica {r} rank {k}\n{self.log(r, k)}" for r, k in self.procs))
            time.sleep(0.05)

    def log(self, replica: int, rank: int = 0, tail: int = 3000) -> str:
        return (self.tmp / f"r{replica}_{rank}.log").read_text()[-tail:]

    def commits(self, replica: int, pid: int | None = None, rank: int = 0) -> list[dict]:
        return [r for r in self.records(replica, rank) if r["event"] == "commit" and pid in (None, r["pid"])]

    def done(self, replica: int) -> bool:
        return all(any(r["event"] == "done" for r in self.records(replica, k)) for k in range(self.group_size))

    def kill(self, replica: int) -> float:
        """SIGKILL every rank of replica group ``replica``; the time of the first kill."""
        killed = time.time()
        for (r, _), proc in self.procs.items():
            if r == replica:
                proc.send_signal(signal.SIGKILL)
        for (r, _), proc in self.procs.items():
            if r == replica:
                proc.wait()
        return killed

    def signal(self, replica: int, sig) -> float:
        """Send ``sig`` to every rank of replica group ``replica``; the time it was sent."""
        sent = time.time()
        for (r, _), proc in self.procs.items():
            if r == replica:
                proc.send_signal(sig)
        return sent

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait()
        self.lighthouse.shutdown()


def digests(world: World, replicas: int = REPLICAS, rank: int = 0) -> dict:
    """step -> {replica: digest} over every commit record of group rank ``rank`` (every pid)."""
    by_step: dict = {}
    for replica in range(replicas):
        for r in world.commits(replica, rank=rank):
            by_step.setdefault(r["step"], {})[replica] = r["digest"]
    return by_step
