"""Faults outside hhook, with the hook in place (docs/reliability.md): a stalled rank, a
killed rank (with and without torchrun's restarts), an elastic restart with fewer ranks.
Every run is ``examples/resilient_train.py`` on loopback, as a user would launch it; each
test bounds how long every process may take, so a hang fails it."""

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.distributed import free_port, run_world, subprocess_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "examples" / "resilient_train.py")
ERROR = re.compile(r"rank (\d+): step (\d+): t=([\d.]+): (\w+): (.*)")
STOPPED = re.compile(r"fault: rank stopped at t=([\d.]+)")


def launch(world: int, *args: str) -> list:
    """``world`` ranks of the script, started as any launcher would (RANK, WORLD_SIZE, ...)."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = subprocess_env(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                             LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, SCRIPT, *args], env=env, cwd=ROOT, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True))
    return procs


def finish(procs: list, limit: float) -> list:
    """``[(returncode, stdout, stderr)]``; a process still running after ``limit`` seconds
    is a hang: it is killed (with its session: the SIGCONT helper) and the test fails."""
    deadline = time.monotonic() + limit
    out, hung = [], []
    for rank, p in enumerate(procs):
        try:
            stdout, stderr = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            hung.append(rank)
            os.killpg(p.pid, signal.SIGKILL)
            stdout, stderr = p.communicate()
        out.append((p.returncode, stdout, stderr))
    assert not hung, f"ranks {hung} hung past {limit} s:\n" + "\n".join(e[-3000:] for _, _, e in out)
    return out


def torchrun(*args: str, nproc: int = 2, restarts: int = 0, limit: float = 240.0):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--max-restarts",
           str(restarts), "--master-port", str(free_port()), SCRIPT, *args]
    proc = subprocess.run(cmd, env=subprocess_env(), cwd=ROOT, text=True, capture_output=True, timeout=limit)
    return proc


@pytest.mark.parametrize("scales,topology", [("agreed", "flat"), ("predicted", "flat"), ("agreed", "2")])
def test_a_stalled_rank_stops_every_rank_with_a_clear_error_within_the_timeout(scales, topology):
    """Rank 1 stops (SIGSTOP) past the 6 s collective timeout: every other rank names the
    stalled collective and the timeout, within timeout + 10 s, and exits; rank 1, continued
    only once they all have ended (no wait beyond that), finds its peers gone and says so;
    nobody hangs. At 4 ranks as 2 nodes x 2 the node's shared-memory barriers are in the
    path too, and none of the job's files is left in /dev/shm while rank 1, the last
    process of its node, is still stopped: it never runs an exit handler before that (a
    launcher would tear it down with SIGKILL; before, the node's lock file stayed until the
    next job's sweep)."""
    timeout = 6
    world = 4 if topology == "2" else 3
    procs = launch(world, "--steps", "40", "--bits", "4", "--scales", scales, "--topology", topology,
                   "--timeout", str(timeout), "--stall-at", "12", "--stall-s", "300")  # continued below
    others = finish(procs[:1] + procs[2:], limit=150)
    left = {m.group(1): glob.glob(m.group(1) + "*") for _, out, _ in others
            for m in re.finditer(r"shared memory: (\S+)\*", out)}  # at once: another job's start sweeps them
    _end_helper(procs[1])  # the script's own SIGCONT, 300 s on
    os.kill(procs[1].pid, signal.SIGCONT)
    results = others[:1] + finish(procs[1:2], limit=60) + others[1:]
    stopped = float(STOPPED.search(results[1][2]).group(1))
    for rank, (code, _, stderr) in enumerate(results):
        found = ERROR.search(stderr)
        assert code != 0 and found, f"rank {rank} (exit {code}) said no error:\n{stderr[-3000:]}"
        message, seen = found.group(5), float(found.group(3))
        if rank == 1:
            assert "closed its connection" in message or "did not complete within" in message, message
            continue
        assert seen - stopped < timeout + 10, f"rank {rank} raised {seen - stopped:.1f} s after the stall"
        # the stalled rank is named, even where this rank waited for it through another
        # (two-level: rank 2 waits for rank 0 between nodes, rank 0 for rank 1 in its node)
        assert "a peer (rank 1) stalled" in message, message
        if "RankFailedError" in message:  # two-level: rank 0 gave up first and took its turn between nodes with filler
            assert topology == "2" and "rank 0 waited the timeout for it" in message, message
            continue
        # the rank's own peers stalled (the timeout) or a peer that gave up first closed its connection
        assert re.search(r"hhook: .* (did not complete within the timeout \(6 s|closed its connection)", message), message
        assert_names_hhook_s_error(message)
        assert "PeerTimeoutError" in message, message
    if topology == "2":
        assert all(code == 1 for code, _, _ in others), [e[-2000:] for _, _, e in others]
        assert len(left) == 2 and not any(left.values()), left
    else:
        assert not left  # flat: no node-shared memory


def test_a_killed_rank_without_restarts_stops_every_other_rank_clearly():
    """SIGKILL inside the hook's collectives, no launcher to restart (mpirun's case): every
    surviving rank raises hhook's PeerLostError (or the timeout) and exits; nobody hangs."""
    procs = launch(3, "--steps", "40", "--bits", "4", "--timeout", "30", "--kill-at", "10", "--kill-in", "hook")
    results = finish(procs, limit=120)
    assert results[1][0] == -signal.SIGKILL
    for rank in (0, 2):
        code, _, stderr = results[rank]
        found = ERROR.search(stderr)
        assert code != 0 and found, f"rank {rank} (exit {code}):\n{stderr[-3000:]}"
        assert re.search(r"hhook: .*(closed its connection|did not complete within)", found.group(5)), found.group(5)
        assert_names_hhook_s_error(found.group(5))


def test_a_killed_rank_of_two_nodes_is_named_by_every_survivor():
    """Issue 52: 4 ranks as 2 nodes x 2, rank 2 killed inside the hook's collectives: every
    survivor raises within seconds and names rank 2, never rank 3 (which exits only after
    losing rank 2: it reports so, and a survivor whose own peer it is follows the report)."""
    procs = launch(4, "--steps", "40", "--bits", "4", "--topology", "2", "--timeout", "30", "--kill-at", "10",
                   "--kill-in", "hook", "--fault-rank", "2")
    results = finish(procs, limit=150)
    assert results[2][0] == -signal.SIGKILL
    killed = float(re.search(r"fault: rank killed at t=([\d.]+)", results[2][2]).group(1))
    for rank in (0, 1, 3):
        code, _, stderr = results[rank]
        found = ERROR.search(stderr)
        assert code == 1 and found, f"rank {rank} (exit {code}):\n{stderr[-3000:]}"
        message = found.group(5)
        everyone = "\n".join(f"rank {r} (exit {c}): {ERROR.search(e).group(0) if ERROR.search(e) else e[-1500:]}"
                             for r, (c, _, e) in enumerate(results))
        assert "Unable to cast" not in message, everyone
        # its own peer lost (PeerLostError), or a rank of its node or its ring that failed on it
        # (RankFailedError: rank 3 takes its turn between nodes with filler, rather than leave
        # rank 1 waiting for its process to end)
        assert re.search(r"PeerLostError: hhook: .*a peer \(rank 2(, at [^)]*)?\) closed its connection|"
                         r"RankFailedError: hhook: .*failed.*by the job's reports, rank 2 died", message), everyone
        assert float(found.group(3)) - killed < 20, (rank, float(found.group(3)) - killed, everyone)


def assert_names_hhook_s_error(message: str) -> None:
    """DDP raises the hook's failure as a RuntimeError; what it says must name hhook's
    error class, not read as a cast (DDP's reducer casting an exception to a Tensor)."""
    assert "Unable to cast" not in message, message
    assert re.search(r"Peer(Lost|Timeout)Error: hhook: ", message), message


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The fault-free runs the restarted ones must end as, per scale mode."""
    runs = {}
    for scales in ("agreed", "predicted"):
        out = tmp_path_factory.mktemp(scales) / "result.json"
        proc = torchrun("--steps", "60", "--every", "20", "--bits", "4", "--scales", scales,
                        "--ckpt", str(out.parent / "ckpt"), "--json", str(out))
        assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
        runs[scales] = json.loads(out.read_text())
    return runs


@pytest.mark.parametrize("scales,where", [("agreed", "step"), ("predicted", "hook")])
def test_torchrun_restarts_a_killed_rank_from_the_checkpoint_bit_for_bit(uninterrupted, tmp_path, scales, where):
    """Rank 1 is killed at step 30 (between forward and backward, or inside the hook's
    collectives); torchrun --max-restarts 2 restarts both ranks, which resume from the
    checkpoint of step 20 (model, optimizer, hook state) and end with the very weights of
    the uninterrupted run: at most one checkpoint interval of steps is redone, nothing is lost."""
    out = tmp_path / "result.json"
    proc = torchrun("--steps", "60", "--every", "20", "--bits", "4", "--scales", scales, "--ckpt",
                    str(tmp_path / "ckpt"), "--json", str(out), "--kill-at", "30", "--kill-in", where, restarts=2)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["attempt"] == 1 and result["resumed_from"] == 20, result
    assert result["weights_sha1"] == uninterrupted[scales]["weights_sha1"]
    assert result["accuracy"] == uninterrupted[scales]["accuracy"]


def test_a_truncated_checkpoint_resumes_from_the_older_intact_one(uninterrupted, tmp_path):
    """Rank 1's newest checkpoint (step 40) loses its second half, then rank 1 is killed:
    under torchrun --max-restarts 2 the ranks agree on the newest step every rank can read
    (20), resume from it at the first restart and end with the very weights of the
    uninterrupted run. Before, rank 1 failed torch.load at every restart, its peer read
    Gloo's raw 'Connection closed by peer' from hhook.register, and the job failed."""
    out = tmp_path / "result.json"
    proc = torchrun("--steps", "60", "--every", "20", "--bits", "4", "--ckpt", str(tmp_path / "ckpt"), "--json",
                    str(out), "--truncate-at", "40", restarts=2)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["attempt"] == 1 and result["resumed_from"] == 20, result
    assert "checkpoint of step 40 cannot be read" in proc.stderr and "resuming from step 20" in proc.stdout
    assert result["weights_sha1"] == uninterrupted["agreed"]["weights_sha1"]


def test_an_elastic_restart_with_fewer_ranks_resumes_and_starts_the_hook_state_afresh(tmp_path):
    """3 ranks train to step 30 and stop; 2 ranks resume from their checkpoint
    (``bits="auto"``, hhook.register's default): the hook state of another world size
    starts afresh with one log line per rank (no shape error, no hang) and training goes on
    to the accuracy of an uninterrupted 2-rank run."""
    ckpt = str(tmp_path / "ckpt")
    first = finish(launch(3, "--steps", "30", "--every", "15", "--ckpt", ckpt), limit=180)
    assert all(code == 0 for code, _, _ in first), [e[-2000:] for _, _, e in first]
    out = tmp_path / "resumed.json"
    proc = torchrun("--steps", "150", "--every", "15", "--ckpt", ckpt, "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    afresh = [line for line in proc.stderr.splitlines() if "starts afresh" in line]
    assert len(afresh) == 2 and all("saved with 3 ranks" in line for line in afresh), proc.stderr[-3000:]
    resumed = json.loads(out.read_text())
    assert resumed["resumed_from"] == 30 and resumed["ranks"] == 2
    ref_out = tmp_path / "reference.json"
    ref = torchrun("--steps", "150", "--json", str(ref_out))
    assert ref.returncode == 0, ref.stderr[-3000:]
    reference = json.loads(ref_out.read_text())
    assert abs(resumed["accuracy"] - reference["accuracy"]) < 0.03, (resumed, reference)


def _usage(prefix: str | None) -> tuple:
    """(resident bytes, open file descriptors, this job's files in /dev/shm) of this process."""
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    shm = len(glob.glob(f"/dev/shm/{prefix}*")) if prefix else 0
    return rss, len(os.listdir("/proc/self/fd")), shm


def _long_run_worker(rank, world, topology, steps, marks):
    import torch

    import hhook

    state = hhook.THCState(bits=4, topology=topology)
    layout = state.node_layout()
    prefix = layout.node_memory.prefix if layout.two_level and layout.node_memory is not None else None
    g = torch.Generator().manual_seed(rank)
    usage = {}
    for step in range(steps):
        scale = 10.0 if rank == 1 else 0.0 if rank == world - 1 else 1.0  # heterogeneous ranks
        hhook.thc_allreduce(torch.randn(20000, generator=g) * scale, state, key="w")
        hhook.thc_allreduce(torch.randn(3000, generator=g), state)  # keyless: a fresh region each call
        if step + 1 in marks:
            usage[step + 1] = _usage(prefix)
    return usage, prefix is not None


@pytest.mark.parametrize("world,topology", [(2, "flat"), (4, 2)])
def test_a_long_run_keeps_memory_descriptors_and_shared_memory_flat(world, topology):
    """1,000 steps (the drill runs 2,000): resident memory grows under 2% from step 250
    on, open files and this job's /dev/shm files not at all (two-level: 2 nodes x 2)."""
    marks = (250, 1000)
    usages = run_world(_long_run_worker, world, topology, 1000, marks, timeout=400, fresh=True)  # a user's process
    for rank, (usage, shared) in enumerate(usages):
        (rss0, fds0, shm0), (rss1, fds1, shm1) = usage[250], usage[1000]
        assert rss1 < 1.02 * rss0, f"rank {rank}: resident {rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB"
        assert fds1 == fds0 and shm1 == shm0, (rank, usage)
        assert shared == (topology != "flat")


def test_no_shared_memory_is_left_behind_when_a_rank_is_killed():
    """Two-level (2 nodes x 2, node-shared memory): rank 3 is killed mid-run; once the job
    has ended, none of its files is left in /dev/shm."""
    procs = launch(4, "--steps", "40", "--bits", "4", "--topology", "2", "--timeout", "30", "--kill-at", "10",
                   "--fault-rank", "3")
    results = finish(procs, limit=150)
    prefixes = {m.group(1) for _, out, _ in results for m in re.finditer(r"shared memory: (\S+)\*", out)}
    assert len(prefixes) == 2, [out for _, out, _ in results]
    assert results[3][0] == -signal.SIGKILL
    for prefix in prefixes:
        assert glob.glob(prefix + "*") == [], prefix


def _end_helper(proc) -> None:
    """End the helper that would continue ``proc`` (the example's stall: ``sh -c "sleep S;
    kill -CONT PID"`` in a session of its own, holding ``proc``'s pipes): its whole process
    group, so that ``proc``'s pipes close when ``proc`` ends."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv[:2] == [b"sh", b"-c"] and argv[2].endswith(f"kill -CONT {proc.pid}".encode()):
            os.killpg(int(pid), signal.SIGKILL)


def _subgroup_timeout_worker(rank, world, scales, raised):
    import datetime

    import torch
    import torch.distributed as dist

    import hhook
    from hhook.schedule.groups import timeout_of

    both = hhook.THCState(bits=4, scales=scales)  # WORLD (torch's default timeout) beside a subgroup
    hhook.thc_allreduce(torch.randn(4000) * (10.0 if rank == 1 else 1.0), both)
    sub = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=3))
    if rank == 2:
        return None
    state = hhook.THCState(sub, bits=4, scales=scales)
    hhook.thc_allreduce(torch.randn(4000) * (0.0 if rank == 1 else 1.0), state)  # builds the second communicator
    second = state.runtime.second["cpu"]
    out = {"second_timeout": second.timeout.total_seconds(), "world_second": timeout_of(both.runtime.second[
        "cpu"]).total_seconds()}
    tic = time.monotonic()
    if rank == 1:  # stalls: never joins the SUM below; leaves once rank 0 has raised (at most 60 s)
        while not os.path.exists(raised) and time.monotonic() - tic < 60:
            time.sleep(0.1)
        return out
    try:
        t = torch.ones(10)
        hhook.schedule.futures.then(second.all_reduce(t).get_future(), lambda v: v[0], t, "a test SUM", second).wait()
        out["error"] = None
    except hhook.PeerTimeoutError as e:
        out["error"] = str(e)
    out["waited"] = time.monotonic() - tic
    open(raised, "w").close()
    return out


@pytest.mark.parametrize("scales", ["agreed", "predicted"])
def test_the_second_communicator_of_a_subgroup_waits_the_subgroup_s_timeout(scales, tmp_path):
    """A subgroup beside WORLD with a 3 s timeout: its second communicator takes those 3 s
    (not torch's 30 minutes, nor WORLD's), and a SUM whose peer stalls (until rank 0 is
    done) raises PeerTimeoutError naming the peer and the timeout within them."""
    res = run_world(_subgroup_timeout_worker, 3, scales, str(tmp_path / "raised"), timeout=120)
    assert res[2] is None
    for r in res[:2]:
        assert r["second_timeout"] == 3.0 and r["world_second"] == 1800.0, r
    assert res[0]["error"] and "a peer (rank 1) stalled" in res[0]["error"] and "3 s" in res[0]["error"], res[0]
    assert res[0]["waited"] < 3.0 + 5, res[0]["waited"]


def _register_without_a_peer(rank, world, topology):
    import torch

    import hhook

    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2))
    if rank == 1:
        return None  # leaves: its process ends, its connections close
    time.sleep(2)
    try:
        hhook.register(ddp, bits=4, topology=topology)
    except Exception as exc:  # noqa: BLE001 - what the user would read
        return f"{type(exc).__name__}: {exc}"
    return "registered"


@pytest.mark.parametrize("topology", ["flat", "auto"])
def test_a_peer_lost_during_register_reads_as_peer_lost_error(topology):
    """A peer that dies before hhook.register (a truncated checkpoint failed its
    torch.load): the rank waiting at register's options handshake raises hhook's
    PeerLostError naming the peer at once (it said goodbye on its liveness connection), not
    after the group's timeout (torch's default: 30 minutes) nor Gloo's raw error."""
    tic = time.monotonic()
    said = run_world(_register_without_a_peer, 2, topology, timeout=120)[0]
    assert said.startswith("PeerLostError: hhook: rank 1 left the job normally") and "options handshake" in said, said
    assert time.monotonic() - tic < 60
