"""A rank that ends is named within seconds on every other rank (issue 58): one that died
(killed, out of memory, preempted) as :class:`hhook.PeerLostError` without it saying so,
one that stopped as :class:`hhook.PeerTimeoutError` at the group's timeout, one that
finished normally as having left; and what ranks say in the store belongs to one
process-group instance. Mechanism: :mod:`hhook.schedule.liveness`."""

import os
import re
import signal
import time

import pytest

from tests.support.distributed import free_port, run_outcomes, run_world


def _register_while_a_peer_ends(rank, world, victim, how):
    import torch
    import torch.distributed as dist

    import hhook

    store = dist.distributed_c10d._get_default_store()
    if rank == victim:
        store.set("victim", str(os.getpid()))
        time.sleep(0.3)  # after init_process_group, before the options handshake
        os.kill(os.getpid(), signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    tic = time.monotonic()
    try:
        hhook.thc_allreduce(torch.ones(1000), hhook.THCState(bits=4))
        said = "finished"
    except Exception as exc:  # noqa: BLE001 - what the user reads
        said = f"{type(exc).__name__}: {exc}"
    took = time.monotonic() - tic
    if how == "stop":
        os.kill(int(store.get("victim")), signal.SIGKILL)  # the test's own cleanup: the harness waits less
    return said, took


@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_killed_before_the_handshake_is_named_as_dead_within_seconds(victim):
    """Before: the survivor waited the whole group timeout in the handshake's arrival, then
    raised ConfigMismatchError ("rank 1 runs no hhook here"). Now PeerLostError naming the
    dead rank within a few seconds (measured about 0.5 s), also where it hosted the store."""
    out = run_outcomes(_register_while_a_peer_ends, 2, victim, "kill", pg_timeout_s=20, timeout=30)
    survivor = out[1 - victim]
    assert survivor["error"] is None and out[victim]["exitcode"] == -signal.SIGKILL, out
    said, took = survivor["value"]
    assert said.startswith("PeerLostError: hhook: ") and f"rank {victim} died" in said, said
    assert took < 10, (took, said)


def test_a_stopped_rank_reads_as_stalled_at_the_timeout_without_log_spam(capfd):
    """A SIGSTOPped rank is alive (its connections stay open) but silent: PeerTimeoutError
    at the group's timeout (5 s), not ConfigMismatchError; and the wait logs nothing
    (before: two C++ socket warnings a second, from 1 s store waits that timed out)."""
    out = run_outcomes(_register_while_a_peer_ends, 2, 1, "stop", pg_timeout_s=5, timeout=30)
    said, took = out[0]["value"]
    assert said.startswith("PeerTimeoutError: hhook: rank 1 of this group did not reach"), said
    assert "stalled" in said and 4.5 < took < 9, (took, said)
    printed = capfd.readouterr().err
    assert len(re.findall(r"^\[rank\d\]:\[W", printed, re.M)) <= 1, printed[-3000:]


def _two_groups_in_one_process(rank, world, port):
    """Two init/destroy cycles in the same processes on one store (a pytest fixture's, a
    notebook's); rank 1 is 2.5 s late in the second."""
    import datetime

    import torch
    import torch.distributed as dist

    import hhook

    dist.destroy_process_group()
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=30))
    results = []
    for cycle in range(2):
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=10))
        if cycle == 1 and rank == 1:
            time.sleep(2.5)
        results.append(hhook.thc_allreduce(torch.full((1000,), float(rank)), hhook.THCState(bits=4)).mean().item())
        dist.destroy_process_group()
        # torch's own Gloo addresses stay in a shared store too (the second group would read the
        # first's): the fixture removes them, once every rank has ended the first group.
        _barrier(store, f"ended{cycle}", world)
        if rank == 0:
            for peer in range(world):
                store.delete_key(f"0//cpu//0/{peer}")
        _barrier(store, f"cleaned{cycle}", world)
    dist.init_process_group("gloo", store=dist.PrefixStore("end", store), rank=rank, world_size=world)
    return results


def _barrier(store, name, world):
    store.add(name, 1)
    while store.add(name, 0) < world:
        time.sleep(0.05)


def test_a_second_process_group_in_the_same_processes_starts_clean():
    """Before: the first group's "left" records stayed in the store, and the rank waiting
    for the late one raised PeerLostError ("rank 1 left the job") after 1 s, on one rank
    only. Now every record is keyed by the process-group instance: the job completes."""
    for results in run_world(_two_groups_in_one_process, 2, free_port(), timeout=90):
        assert results == pytest.approx([0.5, 0.5], abs=0.05)


def _one_rank_ends_early(rank, world, end):
    import torch
    import torch.distributed as dist

    import hhook

    state = hhook.THCState(bits=4)
    hhook.thc_allreduce(torch.ones(1000), state)
    if rank == 1:  # out of data: it ends, normally, while rank 0 reduces once more
        if end == "world":
            dist.destroy_process_group(dist.group.WORLD)
        return "ended"
    time.sleep(1.0)
    try:
        hhook.thc_allreduce(torch.ones(1000), state)
        return "finished"
    except Exception as exc:  # noqa: BLE001 - what the user reads
        return f"{type(exc).__name__}: {exc}"


@pytest.mark.parametrize("end", ["exit", "world"])
def test_a_rank_that_finished_early_reads_as_left_not_as_dead(end):
    """Uneven inputs: rank 1 ends normally (its program returns, or it destroys the group
    passing ``dist.group.WORLD``) while rank 0 still reduces. Before: "closed its
    connection, so that rank died (killed, out of memory, preempted)"; now it left the job
    normally."""
    out = run_outcomes(_one_rank_ends_early, 2, end, pg_timeout_s=20, timeout=60)
    said = out[0]["value"]
    assert said.startswith("PeerLostError") and "rank 1 left the job normally" in said, out


def _register_after_the_store_host_left(rank, world):
    import torch

    import hhook

    if rank == 0:
        time.sleep(0.5)
        return "left"  # the store's host ends normally
    time.sleep(1.5)
    try:
        hhook.thc_allreduce(torch.ones(1000), hhook.THCState(bits=4))
        return "finished"
    except Exception as exc:  # noqa: BLE001 - what the user reads
        return f"{type(exc).__name__}: {exc}"


def test_the_store_host_gone_is_hhook_s_error_naming_the_rank():
    """Before: a raw DistNetworkError (Broken pipe) from the handshake's store call."""
    said = run_outcomes(_register_after_the_store_host_left, 2, pg_timeout_s=20, timeout=60)[1]["value"]
    assert said.startswith("PeerLostError: hhook: rank 0 left the job normally"), said


def _bad_shm_cap_on_one_rank(rank, world):
    import torch

    import hhook

    if rank == 1:
        os.environ["HHOOK_SHM_MB"] = "lots"
    try:
        hhook.thc_allreduce(torch.ones(4000), hhook.THCState(bits=4, topology=2))
        return "finished"
    except ValueError as exc:
        return str(exc)


def test_a_garbage_hhook_shm_mb_on_one_rank_raises_on_every_rank():
    """Before: a bare ValueError (could not convert string to float) on that rank, while
    the others waited in a collective."""
    said = run_world(_bad_shm_cap_on_one_rank, 4, timeout=90)
    assert all("HHOOK_SHM_MB" in s for s in said), said
    assert "'lots'" in said[1], said
