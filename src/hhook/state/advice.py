r"""What hhook's warnings advise when nothing would be, or was, compressed: advice that fits
how the program was started and which framework it runs, not a command the user may
already have typed."""

from __future__ import annotations

import os
import sys

import torch.distributed as dist


def one_process() -> str:
    """Why a launch may have started one process, and what to check."""
    env = os.environ
    if any(name.startswith("ACCELERATE_") for name in env):
        return ("Accelerate started this process alone: `accelerate launch --cpu` starts one process whatever "
                "--num_processes says (several CPU processes need --mpirun_hostfile, or torchrun --nproc-per-node N "
                "with Accelerator(cpu=True)); on GPUs, check that `accelerate env` shows distributed_type MULTI_GPU "
                "and the num_processes you meant, and that no single-process config file overrides them.")
    if "WORLD_SIZE" in env:
        return (f"the launcher set WORLD_SIZE={env['WORLD_SIZE']}: check the launcher's process count "
                "(torchrun's --nproc-per-node and --nnodes) and that the framework was told to use them all.")
    return ("no launcher variables (WORLD_SIZE, RANK) are set: the script was started as one plain process; "
            "start it through a launcher (torchrun --nproc-per-node N, or your framework's) to train data-parallel.")


def idle_state(registration, where: str) -> str:
    """Why a state that no tensor went through saw none, for the end of ``where``.

    ``registration``: the state's (None: never registered; what :func:`hhook.register`
    learnt of a DDP model; :mod:`hhook.fsdp`'s, which says its own ``advice``)."""
    if dist.is_initialized() and dist.get_world_size() == 1:
        return "This process ran in a world of one: there was nothing to exchange."
    if getattr(registration, "advice", None):
        return registration.advice
    if registration is not None:
        return ("Its hook was registered by hhook.register, but no backward pass went through that DDP model: was "
                "another model trained, or did training end before its first step?")
    if where.startswith("Lightning") or any(name in sys.modules for name in ("lightning", "pytorch_lightning")):
        return ("Was its hook registered on the DDP model that trained? Lightning's DDPStrategy registers "
                "ddp_comm_hook on CUDA devices only: use hhook.lightning.THCCallback.")
    return ("Was its hook registered on the DDP model that trained? Register it with hhook.register(ddp_model, "
            "state=state) (or ddp_model.register_comm_hook(state, hhook.thc_hook)) after the model is wrapped in DDP.")
