"""init_distributed reads the rank and world of every supported launcher."""

import os
import shutil
import subprocess
import sys

import pytest

from hhook.launch import (
    DEFAULT_PORT,
    PORT_RANGE,
    detect_env,
    first_slurm_host,
    job_port,
    launcher_layout,
    slurm_tasks_per_node,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize(
    "environ,expected",
    [
        ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "1234"}, ("torchrun", 3, 4, 1, "n1", 1234)),
        ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}, ("openmpi", 2, 8, 0, "127.0.0.1", 29500)),
        ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_MCA_ess_base_jobid": "2037448705"}, ("openmpi", 2, 8, 2, "127.0.0.1", 29869)),
        ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"}, ("pmi", 1, 2, 1, "127.0.0.1", 29500)),
        ({"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[03-07]"}, ("slurm", 5, 6, 1, "gpu03", 29500)),
        ({}, ("none", 0, 1, 0, "127.0.0.1", 29500)),
    ],
)
def test_detect_env(environ, expected):
    e = detect_env(environ)
    assert (e.launcher, e.rank, e.world_size, e.local_rank, e.master_addr, e.master_port) == expected


def test_torchrun_wins_over_the_mpi_that_started_it():
    e = detect_env({"RANK": "0", "WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"})
    assert e.launcher == "torchrun" and e.rank == 0


def test_inconsistent_rank_is_an_error():
    with pytest.raises(ValueError, match="outside"):
        detect_env({"RANK": "4", "WORLD_SIZE": "4"})


@pytest.mark.parametrize("nodes,first", [("a1", "a1"), ("gpu[12,15-16]", "gpu12"), ("x[1-3],y7", "x1"), ("n01,n02", "n01")])
def test_first_slurm_host(nodes, first):
    assert first_slurm_host(nodes) == first


def test_mpi_jobs_get_their_port_from_the_job_id():
    ompi = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}
    ports = {detect_env({**ompi, "OMPI_MCA_ess_base_jobid": str(job)}).master_port for job in range(2037448705, 2037448745)}
    assert len(ports) > 30  # 40 jobs: different jobs, different ports (a few may collide)
    assert all(DEFAULT_PORT <= p < DEFAULT_PORT + PORT_RANGE for p in ports)
    # every rank of one job derives the same port
    one = {**ompi, "OMPI_MCA_ess_base_jobid": "2037448705", "PMIX_NAMESPACE": "2037448705"}
    assert detect_env(one).master_port == detect_env({**one, "OMPI_COMM_WORLD_RANK": "1"}).master_port
    assert detect_env({**ompi, "PMIX_NAMESPACE": "prterun-host-123@1"}).master_port != DEFAULT_PORT


def test_user_master_port_wins_over_the_job_id():
    env = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_MCA_ess_base_jobid": "7", "MASTER_PORT": "4242"}
    assert detect_env(env).master_port == 4242
    with pytest.raises(ValueError, match="MASTER_PORT"):
        detect_env({**env, "MASTER_PORT": "http"})
    with pytest.raises(ValueError, match="MASTER_PORT"):
        detect_env({**env, "MASTER_PORT": "70000"})


def test_slurm_steps_of_one_job_get_different_ports():
    base = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "4711"}
    assert job_port({**base, "SLURM_STEP_ID": "0"}) != job_port({**base, "SLURM_STEP_ID": "1"})


_RENDEZVOUS = (
    "import time, torch.distributed as dist, hhook\n"
    "env = hhook.init_distributed(backend='gloo')\n"
    "dist.barrier(); time.sleep(3); dist.barrier()\n"
    "print('port', env.master_port, flush=True)\n"
)


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI's mpirun")
def test_two_mpirun_jobs_on_one_host_at_once(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR")}
    env.update(PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""), OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable, "-c", _RENDEZVOUS]
    # Two mpiruns starting in the same instant race to mkdir Open MPI's shared session
    # directory (/tmp/ompi.HOST.UID: "File exists"): give each its own. The jobs still
    # share the host and its ports, which is what this test is about.
    jobs = [
        subprocess.Popen(cmd, env={**env, "OMPI_MCA_orte_tmpdir_base": str(tmp_path / f"job{i}")},
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)
    ]
    outs = [job.communicate(timeout=120)[0] for job in jobs]
    for job, out in zip(jobs, outs):
        assert job.returncode == 0, out
    ports = [{line for line in out.splitlines() if line.startswith("port")} for out in outs]
    assert all(len(p) == 1 for p in ports) and ports[0] != ports[1], outs


# -- where the launcher put this process on its node (hhook.schedule.topology reads it) -------
@pytest.mark.parametrize(
    "environ,expected",
    [
        ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "2"}, ("torchrun", 1, 4, 2)),
        ({"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}, ("torchrun", 0, 2, None)),
        ({"OMPI_COMM_WORLD_LOCAL_RANK": "3", "OMPI_COMM_WORLD_LOCAL_SIZE": "8"}, ("openmpi", 3, 8, None)),
        ({"MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}, ("pmi", 1, 2, None)),
        ({"SLURM_LOCALID": "1", "SLURM_NODEID": "2", "SLURM_TASKS_PER_NODE": "2(x3),1"}, ("slurm", 1, 2, 2)),
        ({"SLURM_LOCALID": "0", "SLURM_NTASKS_PER_NODE": "4"}, ("slurm", 0, 4, None)),
    ],
)
def test_launcher_layout(environ, expected):
    lay = launcher_layout(environ)
    assert (lay.launcher, lay.local_rank, lay.local_world_size, lay.node_rank) == expected


def test_launcher_layout_absent_or_wrong():
    assert launcher_layout({}) is None
    assert launcher_layout({"LOCAL_RANK": "0"}) is None  # torchrun always sets both
    # uneven SLURM nodes without a node index: this node's size is unknown
    assert launcher_layout({"SLURM_LOCALID": "0", "SLURM_TASKS_PER_NODE": "2,1"}) is None
    with pytest.raises(ValueError, match="outside a node of 2"):
        launcher_layout({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"})
    with pytest.raises(ValueError, match="not an integer"):
        launcher_layout({"OMPI_COMM_WORLD_LOCAL_RANK": "x", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})
    assert slurm_tasks_per_node("4(x2),3") == [4, 4, 3]
    with pytest.raises(ValueError):
        slurm_tasks_per_node("4(x2")


NETCLUSTER = os.path.join(ROOT, "ci", "netcluster.sh")


def _plan(*args):
    return subprocess.run(["bash", NETCLUSTER, "plan", *args], capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("nodes,k", [(2, 2), (3, 1), (2, 4)])
def test_netcluster_places_k_ranks_per_node_as_torchrun(nodes, k):
    """``netcluster.sh launch N --ranks-per-node K`` sets these variables (``plan``
    prints them; it needs no root and no cluster): hhook.schedule.topology finds the nodes."""
    from hhook.schedule.topology import local_record, plan_layout

    out = _plan(str(nodes), "--ranks-per-node", str(k))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == nodes * k
    envs = []
    for line in lines:
        ns, *assignments = line.split()
        env = dict(a.split("=", 1) for a in assignments)
        assert ns == f"hh{env['GROUP_RANK']}"
        envs.append(env)
    assert [int(e["RANK"]) for e in envs] == list(range(nodes * k))
    for e in envs:
        assert e["WORLD_SIZE"] == str(nodes * k) and e["LOCAL_WORLD_SIZE"] == str(k)
        assert int(e["RANK"]) == int(e["GROUP_RANK"]) * k + int(e["LOCAL_RANK"])
        assert detect_env(e).rank == int(e["RANK"])
    # every rank of a node in one namespace, with one hostname: both detections agree
    records = [local_record(int(e["RANK"]), "auto", e, f"hh{e['GROUP_RANK']}") for e in envs]
    plan = plan_layout(records)
    if k == 1:
        assert plan.nodes is None and "one rank per node" in plan.reason
    else:
        assert plan.nodes == tuple(tuple(range(i * k, (i + 1) * k)) for i in range(nodes))
        assert plan_layout([local_record(r[6], "auto", {}, f"hh{r[6] // k}") for r in records]).nodes == plan.nodes


@pytest.mark.parametrize("args", [["2", "--ranks-per-node", "0"], ["2", "--ranks-per-node", "x"], ["zero"]])
def test_netcluster_refuses_bad_layouts_before_touching_anything(args):
    assert _plan(*args).returncode != 0
    up = subprocess.run(["bash", NETCLUSTER, "up", *args], capture_output=True, text=True, timeout=30)
    assert up.returncode != 0 and ("ranks-per-node" in up.stderr or "usage" in up.stderr)


RTT_PY = r"""
import socket, statistics, sys, time
if sys.argv[1] == "serve":
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("10.77.0.2", 5311)); s.listen(1)
    c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while (d := c.recv(64)):
        c.sendall(d)
else:
    for _ in range(100):
        try:
            c = socket.create_connection(("10.77.0.2", 5311)); break
        except OSError:
            time.sleep(0.05)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1); rtt = []
    for _ in range(30):
        t = time.perf_counter(); c.sendall(b"x"); c.recv(64); rtt.append((time.perf_counter() - t) * 1e3)
    c.close(); print(min(rtt), statistics.median(rtt))
"""


def _round_trip_ms() -> tuple:
    """(min, median) of 30 one-byte TCP round trips hh0 -> hh1 on the emulated cluster."""
    serve = subprocess.Popen(["bash", NETCLUSTER, "exec", "1", sys.executable, "-c", RTT_PY, "serve"])
    try:
        out = subprocess.run(["bash", NETCLUSTER, "exec", "0", sys.executable, "-c", RTT_PY, "ask"],
                             capture_output=True, text=True, timeout=60)
    finally:
        serve.wait(timeout=30)
    assert out.returncode == 0, out.stderr
    return tuple(float(v) for v in out.stdout.split())


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
                    reason="needs root and iproute2 (network namespaces)")
def test_netcluster_delay_holds_every_packet_and_goes_away():
    """``netcluster.sh delay 5 2`` (the fault drill's delayed, reordering link, without
    netem): a round trip takes at least 2 x (5 - 2) ms while it is on, and the cluster's
    plain link is back once it is removed; ``down`` ends the user-space link too."""
    if subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split().count("hh0"):
        pytest.skip("an emulated cluster is up (a drill or a benchmark): not touching it")

    def nc(*args):
        res = subprocess.run(["bash", NETCLUSTER, *args], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        return res

    try:
        nc("up", "2", "none")
        plain = _round_trip_ms()
        nc("delay", "5", "2")
        held = _round_trip_ms()
        assert held[0] >= 6.0 and held[1] >= 8.0, (plain, held)
        nc("delay", "0")
        assert _round_trip_ms()[1] < held[0], (plain, held)
        nc("delay", "5", "2")
    finally:
        subprocess.run(["bash", NETCLUSTER, "down"], capture_output=True, timeout=60)
    assert not os.path.exists("/run/hhook-netcluster/delay.pid")
    assert "delaylink.py" not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout


# One write a rank (under PYTHONUNBUFFERED, print's pieces are written one by one and the two
# ranks' lines interleaved on the shared pipe: a CI run read "joinedjoined 0\n 1").
JOIN_PY = ("import sys, torch.distributed as dist, hhook; hhook.init_distributed(backend='gloo', timeout_s=60); "
           "dist.barrier(); sys.stdout.write(f'joined {dist.get_rank()}\\n'); dist.destroy_process_group()")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
                    reason="needs root and iproute2 (network namespaces)")
def test_ranks_join_on_the_emulated_cluster_without_torch_s_socket_warnings():
    """Two ranks of ``hhook.init_distributed`` on the emulated cluster (a cluster of its
    own, ``HH_PREFIX``, beside any other) print nothing: c10d's store client names the
    IPv4-mapped form of MASTER_ADDR (``::ffff:10.x``) through getnameinfo, and before
    ``up`` wrote that form into the nodes' hosts files each rank logged "The hostname of
    the client socket cannot be retrieved. err=-3" (issue 61, item 8: the demo's two
    warnings)."""
    env = {**os.environ, "HH_PREFIX": "tsw", "HH_SUBNET": "10.79.61", "MASTER_PORT": "29561",
           "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), ROOT])}
    try:
        up = subprocess.run(["bash", NETCLUSTER, "up", "2", "none"], env=env, capture_output=True, text=True,
                            timeout=60)
        assert up.returncode == 0, up.stderr
        job = subprocess.run(["bash", NETCLUSTER, "launch", "2", sys.executable, "-c", JOIN_PY], env=env,
                             capture_output=True, text=True, timeout=120)
    finally:
        subprocess.run(["bash", NETCLUSTER, "down"], env=env, capture_output=True, timeout=60)
    assert job.returncode == 0 and sorted(job.stdout.split("\n"))[-2:] == ["joined 0", "joined 1"], job
    assert job.stderr == "", job.stderr
