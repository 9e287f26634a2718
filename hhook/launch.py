r"""Start torch.distributed from whatever launched this process.

The same training script runs under ``torchrun``, ``mpirun`` (Open MPI, MPICH and
other PMI launchers) and ``srun``: each sets a rank, a world size and a local rank
under its own names, and :func:`init_distributed` reads them.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import socket
import zlib

import torch
import torch.distributed as dist

# (rank, world size, local rank) variables of each launcher, most specific first.
_LAUNCHERS = (
    ("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("pmi", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
)


# Variables naming the job (the same on every rank of one job, different between jobs), most
# specific first: Open MPI 4/5 (PMIx namespace, ess job id), Open MPI 3, SLURM, PBS, LSF.
_JOB_ID_VARS = (
    "OMPI_MCA_ess_base_jobid",
    "PMIX_NAMESPACE",
    "OMPI_MCA_orte_ess_jobid",
    "SLURM_JOB_ID",
    "PBS_JOBID",
    "LSB_JOBID",
)
DEFAULT_PORT = 29500
PORT_RANGE = 3000  # job ports: 29500..32499, below Linux's ephemeral range (32768+)


def job_port(environ) -> int:
    r"""Rendezvous port of this job when ``MASTER_PORT`` is not set.

    Every job used to meet at port 29500, so a second ``mpirun`` on the same host failed
    with EADDRINUSE. Instead the launcher's job id (the same on every rank of a job) is
    hashed into ``29500 + crc32(id) % 3000``; two concurrent jobs still collide with
    probability 1/3000, so set ``MASTER_PORT`` where that matters. SLURM steps of one job
    get their own ports (the step id is part of the id). Without a job id: 29500.

    Example::
        >>> job_port({"OMPI_MCA_ess_base_jobid": "2037448705"})
        29869
    """
    for var in _JOB_ID_VARS:
        if environ.get(var):
            job = f"{var}={environ[var]}"
            if var == "SLURM_JOB_ID":
                job += f".{environ.get('SLURM_STEP_ID', '')}"
            return DEFAULT_PORT + zlib.crc32(job.encode()) % PORT_RANGE
    return DEFAULT_PORT


@dataclasses.dataclass(frozen=True)
class DistributedEnv:
    launcher: str
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def free_port(host: str = "") -> int:
    """A TCP port the OS says is free now on ``host`` (all interfaces by default), for a
    rendezvous the caller starts right away."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list such as ``gpu[03-07,12],cpu1`` -> ``gpu03``."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ValueError(f"cannot parse SLURM node list {nodelist!r}")
    prefix, ranges = m.groups()
    if not ranges:
        return prefix
    return prefix + re.split(r"[-,]", ranges)[0]


def detect_env(environ=None) -> DistributedEnv:
    """Rank, world size, local rank and rendezvous address from the launcher's variables.

    Outside any launcher this is a world of one. ``MASTER_ADDR``/``MASTER_PORT`` win when
    set (torchrun always sets them). Otherwise MPI jobs meet at ``127.0.0.1`` (a single
    host; set ``MASTER_ADDR`` for several) and SLURM jobs at the first node of the
    allocation, on a port derived from the job id (:func:`job_port`) so that concurrent
    jobs on one host do not fight over one port.
    """
    env = os.environ if environ is None else environ
    for name, rank_var, size_var, local_var in _LAUNCHERS:
        if rank_var in env and size_var in env:
            rank, world = int(env[rank_var]), int(env[size_var])
            local = int(env.get(local_var, rank))
            break
    else:
        name, rank, world, local = "none", 0, 1, 0
    if not 0 <= rank < world:
        raise ValueError(f"launcher {name} gave rank {rank} outside a world of {world}")
    default_addr = "127.0.0.1"
    if name == "slurm" and "SLURM_JOB_NODELIST" in env:
        default_addr = first_slurm_host(env["SLURM_JOB_NODELIST"])
    port = env.get("MASTER_PORT")
    try:
        master_port = int(port) if port else job_port(env)
    except ValueError:
        raise ValueError(f"MASTER_PORT={port!r} is not a port number") from None
    if not 0 < master_port < 65536:
        raise ValueError(f"MASTER_PORT={master_port} is outside 1..65535")
    return DistributedEnv(
        launcher=name,
        rank=rank,
        world_size=world,
        local_rank=local,
        master_addr=env.get("MASTER_ADDR", default_addr),
        master_port=master_port,
    )


def init_distributed(backend: str | None = None, timeout_s: float = 300.0) -> DistributedEnv:
    r"""Initialise the default process group from the launcher's environment.

    Picks NCCL and the local GPU (``cuda:local_rank``) when CUDA is available, Gloo
    otherwise, unless ``backend`` says which. Does nothing if already initialised.

    Example::
        >>> env = hhook.init_distributed()
        >>> model = DDP(model.to(device))
    """
    info = detect_env()
    if dist.is_initialized():
        return info
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{info.master_addr}:{info.master_port}",
        rank=info.rank,
        world_size=info.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return info
