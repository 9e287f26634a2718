"""init_distributed reads the rank and world of every supported launcher."""

import os
import shutil
import subprocess
import sys

import pytest

from hhook.launch import DEFAULT_PORT, PORT_RANGE, detect_env, first_slurm_host, job_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
