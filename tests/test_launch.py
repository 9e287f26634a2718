"""init_distributed reads the rank and world of every supported launcher."""

import pytest

from hhook.launch import detect_env, first_slurm_host


@pytest.mark.parametrize(
    "environ,expected",
    [
        ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "1234"}, ("torchrun", 3, 4, 1, "n1", 1234)),
        ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}, ("openmpi", 2, 8, 0, "127.0.0.1", 29500)),
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
