"""The job's store host gone (issue 58, item 6): every store or network call on hhook's
paths raises hhook's error (``PeerLostError``, or ``PeerTimeoutError`` where the store
timed out) naming this rank and the cause, with torch's error chained; before, each raised
a raw ``DistNetworkError`` (Broken pipe). The handshake's own store calls:
``tests/reliability/test_lost.py``."""

import datetime
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.support.distributed import free_port, run_world, subprocess_env

#: A store served by a process of its own, which the test kills (the store's host vanishes).
_SERVER = ("import datetime, sys, time; import torch.distributed as d; "
           "s = d.TCPStore('127.0.0.1', 0, None, True, timeout=datetime.timedelta(seconds=60), wait_for_workers=False); "
           "print(s.port, flush=True); time.sleep(600)")


def start_store() -> tuple[subprocess.Popen, int]:
    """A TCPStore server in a process of its own, and its port."""
    proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdout=subprocess.PIPE, text=True,
                            env=subprocess_env())
    return proc, int(proc.stdout.readline())


def kill(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def _paths(rank, world):
    """Each path on a default group of its own, over a store whose server process rank 0
    kills once every rank is connected: what each rank raised there."""
    import torch
    import torch.distributed as dist

    import hhook.diloco
    from hhook.schedule.groups import SecondGroup
    from hhook.schedule.topology import detect_topology

    paths = {
        "second communicator": lambda sites: SecondGroup(None, "cpu"),
        "two-level sub-groups": lambda sites: detect_topology(None, ranks_per_node=2),
        "diloco's groups": lambda sites: hhook.diloco.find_sites(2),
        "diloco's finish": lambda sites: hhook.diloco.sites.say_finished(sites, "t", 3),
    }
    servers = [start_store() if rank == 0 else (None, 0) for _ in paths]
    ports = torch.tensor([port for _, port in servers])
    dist.broadcast(ports, 0)
    dist.destroy_process_group()
    said = {}
    for (name, path), (server, _), port in zip(paths.items(), servers, ports.tolist()):
        store = dist.TCPStore("127.0.0.1", port, world, False, timeout=datetime.timedelta(seconds=20))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=20))
        sites = hhook.diloco.find_sites(1) if name == "diloco's finish" else None
        dist.barrier()
        if rank == 0:
            kill(server)
        dist.barrier()  # Gloo's own connections: the store is not read
        try:
            path(sites)
            said[name] = "no error"
        except Exception as exc:  # noqa: BLE001 - what the user reads
            said[name] = (f"{type(exc).__name__}: {exc}", type(exc.__cause__).__name__)
        dist.barrier()  # every rank has its error before any says goodbye
        dist.destroy_process_group()
    # the harness's teardown needs a default group
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return said


def test_every_store_call_of_hhook_s_set_up_raises_hhook_s_error_when_the_store_host_vanished():
    """The second communicator's set-up, the two-level sub-groups, hhook.diloco's groups and
    its finish: hhook's PeerLostError naming the rank and the store's host as the cause;
    a raw DistNetworkError (Broken pipe) before."""
    for rank, said in enumerate(run_world(_paths, 4, timeout=240)):
        for name, outcome in said.items():
            assert outcome != "no error", (rank, name)
            text, cause = outcome
            assert text.startswith(f"PeerLostError: hhook: rank {rank}: the job's store failed in "), (rank, name, text)
            assert "is gone or does not answer" in text and "Store: " in text, (rank, name, text)
            assert cause.startswith("Dist"), (rank, name, cause)


def _launch_env(port: int) -> dict:
    return {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port), "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_USE_AGENT_STORE": "True"}


def test_init_distributed_under_torchrun_raises_hhook_s_error_when_the_agent_store_vanished(monkeypatch):
    """hhook.init_distributed under torchrun counts this attempt's ranks in the agent's
    store (launch.attempt_prefix's store.add): its host killed after this rank connected
    raised a raw DistNetworkError; nothing listening, torch's DistStoreError after the
    timeout. Now PeerLostError / PeerTimeoutError naming rank 1 and the store's address."""
    import torch.distributed as dist

    import hhook

    server, port = start_store()
    real = dist.TCPStore

    def connected_then_killed(*args, **kwargs):
        store = real(*args, **kwargs)
        kill(server)
        return store

    monkeypatch.setattr(dist, "TCPStore", connected_then_killed)
    for name, value in _launch_env(port).items():
        monkeypatch.setenv(name, value)
    with pytest.raises(hhook.PeerLostError) as lost:
        hhook.init_distributed(backend="gloo", timeout_s=5)
    said = str(lost.value)
    assert said.startswith("hhook: rank 1: the job's store failed in hhook.init_distributed's count"), said
    assert f"torchrun's agent store at 127.0.0.1:{port} is gone" in said, said
    assert isinstance(lost.value.__cause__, dist.DistError) and not dist.is_initialized()

    monkeypatch.setattr(dist, "TCPStore", real)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))  # nothing listens there
    tic = time.monotonic()
    with pytest.raises((hhook.PeerTimeoutError, hhook.PeerLostError)) as silent:
        hhook.init_distributed(backend="gloo", timeout_s=1)
    assert str(silent.value).startswith("hhook: rank 1: the job's store failed"), str(silent.value)
    assert time.monotonic() - tic < 30


def _named_over_a_failing_store(rank, world_size):
    """thc_allreduce's mismatch naming (handshake.named) where the group's store fails."""
    import torch.distributed as dist

    from hhook.schedule import handshake

    class Failing:
        def set(self, *args):
            raise dist.DistNetworkError("Broken pipe")

    real = dist.distributed_c10d._get_process_group_store
    dist.distributed_c10d._get_process_group_store = lambda pg: Failing()
    try:
        err = handshake.named(None, (("numel", 4),), 0, "this thc_allreduce call")
    finally:
        dist.distributed_c10d._get_process_group_store = real
    return type(err).__name__, str(err)


def test_a_mismatch_named_over_a_failing_store_is_hhooks_error_naming_the_rank():
    # Merged code once called a helper that no longer existed here (a NameError).
    kind, message = run_world(_named_over_a_failing_store, 1)[0]
    assert kind in ("PeerLostError", "PeerTimeoutError"), (kind, message)
    assert "rank 0" in message and "this thc_allreduce call" in message and "Broken pipe" in message
