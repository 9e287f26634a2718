"""What hhook reads of FSDP2's modules, one place for both torch layouts (2.11 and
2.13): the FSDP modules of a model, their param groups, shard groups and mesh sizes."""

from __future__ import annotations

import torch
import torch.distributed as dist

try:  # torch >= 2.6
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # pragma: no cover
    FSDPModule = None


def group_key(pg) -> tuple[int, ...]:
    """A shard group's identity: its global ranks. torch 2.11 gives every ``fully_shard``
    call without a mesh a process group object of its own over the same ranks, so ``id``
    would tell one group per module."""
    return tuple(dist.get_process_group_ranks(pg))


def param_groups(module) -> list:
    """The FSDP param groups of an ``FSDPModule``: torch 2.13 keeps a list of them
    (``_fsdp_param_groups``), torch 2.11 at most one (``_fsdp_param_group``)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        return [] if group is None else [group]
    return list(groups)


def param_group(module):
    """The module's (first) FSDP param group, or None (:func:`param_groups`)."""
    groups = param_groups(module)
    return groups[0] if groups else None


def mesh_sizes(group) -> tuple[int | None, int | None]:
    """``(shard size, replicate size)`` of an FSDP param group's mesh; None where the
    mesh has no such dimension (FSDPMeshInfo / HSDPMeshInfo / DDPMeshInfo)."""
    info = group.mesh_info
    return getattr(info, "shard_mesh_size", None), getattr(info, "replicate_mesh_size", None)


def fsdp_modules(module, caller: str = "register") -> list[tuple[str, object]]:
    """``[(name, FSDPModule), ...]`` in ``module`` (``named_modules`` order)."""
    if FSDPModule is None:
        raise RuntimeError("hhook.fsdp needs torch.distributed.fsdp.fully_shard (torch >= 2.6)")
    found = [(name or "<root>", m) for name, m in module.named_modules() if isinstance(m, FSDPModule)]
    if not found:
        raise ValueError(
            f"hhook.fsdp.{caller}: the module contains no FSDPModule; apply "
            "torch.distributed.fsdp.fully_shard first"
        )
    return found


def check_params(module, caller: str = "register") -> None:
    for name, p in module.named_parameters():
        if p.requires_grad and (p.dtype.is_complex or p.dtype == torch.float64):
            raise TypeError(
                f"hhook.fsdp.{caller}: parameter {name!r} is {p.dtype}; THC compresses float32, "
                "float16 and bfloat16 gradients (keep such parameters in a module without hhook)"
            )
