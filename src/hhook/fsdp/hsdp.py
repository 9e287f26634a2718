"""Custom HSDP (:func:`register_hsdp`): THC's reduce-scatter inside each shard group and
:func:`hhook.thc_allreduce` across replicas in FSDP's all-reduce hook (:mod:`hhook.fsdp`)."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from ..schedule.dense import count
from ..state import THCState, report
from .modules import fsdp_modules, mesh_sizes, param_group
from .auto import BOTH, CANDIDATES, HSDP_CANDIDATES, REPLICA, RS
from .register import Registered, _register, _state_of

logger = logging.getLogger("hhook.fsdp")


def _check_replica_layout(shard_group, replica_group, device) -> None:
    """Every member of ``replica_group`` must hold the same shard (the same rank in a shard
    group of the same size). Blocking, on every rank: an all-gather over the replica group,
    then a MAX of the verdict over the shard group, so that on a (replicate x shard) grid
    every rank raises if any replica group is wrong."""
    r = dist.get_world_size(replica_group)
    mine = torch.tensor([shard_group.rank(), shard_group.size(), dist.get_rank()], dtype=torch.int64, device=device)
    rows = torch.empty(r * 3, dtype=torch.int64, device=device)
    dist.all_gather_into_tensor(rows, mine, group=replica_group)
    shard_ranks, shard_sizes, ranks = rows.view(r, 3).t().tolist()
    local_bad = len(set(shard_ranks)) > 1 or len(set(shard_sizes)) > 1
    verdict = torch.tensor([float(local_bad)], dtype=torch.float32, device=device)
    dist.all_reduce(verdict, dist.ReduceOp.MAX, group=shard_group)
    if verdict.item() > 0:
        found = (f"this rank's replica_group (global ranks {ranks}) holds shard ranks {shard_ranks} of shard "
                 f"groups of sizes {shard_sizes}" if local_bad else
                 "this rank's replica group is fine, but a replica group of another rank of its shard group is not")
        raise ValueError(
            "hhook.fsdp.register_hsdp: replica_group must join the ranks that hold the same shard in each "
            "replica (one rank per shard group, all with the same shard rank), e.g. mesh['replicate'].get_group() "
            "of init_device_mesh(..., (n_replicas, shard_size), mesh_dim_names=('replicate', 'shard')) with "
            f"fully_shard(mesh=mesh['shard']); {found}"
        )


def _adopt_replica_group(replica_state: THCState, replica_group: dist.ProcessGroup) -> None:
    """A ``replica_state`` averages over its own process group: it must be
    ``replica_group`` (averaging over WORLD instead gave relative errors near 1). A state
    built without a group (``THCState(bits=8)``) and not used yet takes ``replica_group``."""
    group = replica_state.process_group
    if group is None and replica_state.counters.calls == 0 and replica_state.runtime.topo is None:
        replica_state.process_group = replica_group
        replica_state.reset_runtime()
        return
    mine = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    if mine != dist.get_process_group_ranks(replica_group):
        raise ValueError(
            f"hhook.fsdp.register_hsdp: replica_state reduces over ranks {mine}, not over replica_group "
            f"(ranks {dist.get_process_group_ranks(replica_group)}): build it with "
            "THCState(process_group=replica_group, ...) or leave its process_group unset"
        )


class ReplicaAllReduce:
    """FSDP's all-reduce hook of one module (``set_all_reduce_hook``): the shard group's
    reduce-scatter output averaged over ``replica_state``'s group (the replicas), by
    :func:`hhook.thc_allreduce`, or, where ``bits="auto"`` runs ``dense``, by FSDP2's own
    HSDP reduction (a SUM all-reduce, then the division by the replicas: the same bits on
    Gloo). ``factor``: the user's divide factor (the shard group's sum comes in; the sum
    over all ranks goes out, FSDP divides).

    On a 1-D shard mesh FSDP calls the hook after every reduce-scatter and ignores
    ``set_requires_all_reduce(False)``: the hook keeps those outputs' sum (their
    gradient is left zero) and adds it to the next one it all-reduces, as FSDP2's own
    HSDP does."""

    def __init__(self, replica_state: THCState, key: str, factor, param_group, switch=None):
        self.state, self.key, self.factor = replica_state, key, factor
        self.param_group, self.switch = param_group, switch
        self.pending: torch.Tensor | None = None  # the sum of the outputs not all-reduced yet

    def __call__(self, output: torch.Tensor) -> None:
        from ..schedule.allreduce import thc_allreduce

        replicas = dist.get_world_size(self.state.process_group)
        if replicas == 1:
            return
        if not getattr(self.param_group, "all_reduce_grads", True):
            if self.pending is None:
                self.pending = output.clone()
            else:
                self.pending += output
            output.zero_()
            return
        if self.pending is not None:
            output += self.pending
            self.pending = None
        if self.switch is not None and self.switch.all_reduce_dense:
            dist.all_reduce(output, group=self.state.process_group)
            count(self.state.counters, output)  # as FSDP2's own HSDP (sum, then its division), counted once
            if self.factor is None:
                output.div_(replicas)
            return
        thc_allreduce(output, self.state, key=self.key)  # the mean over replicas
        if self.factor is not None:
            output.mul_(replicas)


def register_hsdp(module, replica_group: dist.ProcessGroup, state: THCState | None = None,
                  replica_state: THCState | None = None, **options) -> tuple[THCState, THCState]:
    """Custom HSDP: THC reduce-scatter inside the shard group (``fully_shard``'s 1-D mesh)
    and a THC allreduce over ``replica_group`` in FSDP's all-reduce hook, which averages
    over replicas (:class:`ReplicaAllReduce`). Returns ``(shard_state, replica_state)``.

    ``bits="auto"`` (the default) decides between THC on both exchanges with and without
    the compressed all-gather (``rs+ag``, ``rs``), THC across replicas alone (``ar``) and
    FSDP2's own HSDP (``dense``), once for the whole world where the shard groups and
    replicas make it up (else each shard group decides between the three THC ones).

    Checks the layout first, blocking, on every rank of the shard and replica groups:
    raises ``ValueError`` on every rank if a module was sharded on a 2-D mesh (FSDP would
    run its own replica all-reduce as well) or if the members of ``replica_group`` do not
    all hold the same shard (e.g. ``WORLD`` passed as the replica group). A gradient
    divide factor set before the call is respected (the result is the sum over all ranks
    divided by it, as plain FSDP2's). A ``replica_state`` must reduce over
    ``replica_group`` (``ValueError`` on every rank otherwise); one built without a
    process group takes ``replica_group``.
    """
    if not isinstance(replica_group, dist.ProcessGroup):
        raise TypeError(f"hhook.fsdp.register_hsdp: replica_group must be a ProcessGroup, got {replica_group!r}")
    modules = []
    shard_group = None
    for name, m in fsdp_modules(module, "register_hsdp"):
        group = param_group(m)
        if group is None:
            continue
        shard, replicate = mesh_sizes(group)
        if replicate is not None or shard is None:
            raise ValueError(
                f"hhook.fsdp.register_hsdp: {name} was sharded on a mesh with a replicate dimension, so FSDP "
                "runs its own dense all-reduce across replicas before any hook. Shard on the 1-D shard mesh "
                "(fully_shard(..., mesh=mesh['shard'])) and pass mesh['replicate'].get_group() here; or keep "
                "the 2-D mesh and call hhook.fsdp.register (the replica all-reduce then stays dense)"
            )
        pg = group.mesh_info.shard_process_group
        if shard_group is None:
            shard_group, device = pg, group.device
        elif pg.size() != shard_group.size() or pg.rank() != shard_group.rank():
            raise ValueError(f"hhook.fsdp.register_hsdp: {name} is sharded over a different group than the "
                             "other FSDP modules; every module must share one shard mesh")
        modules.append((name, m, group, group.gradient_divide_factor))  # (register sets 1.0 where unset)
    if shard_group is not None:
        _check_replica_layout(shard_group, replica_group, device)
    if replica_state is not None:
        _adopt_replica_group(replica_state, replica_group)
    # bits="auto": one decision over every shard group and replica (their step times are
    # coupled by the replica all-reduce, whose method every replica must share), where they
    # make up the world; else each shard group decides, and the replica all-reduce is THC's.
    replicas = dist.get_world_size(replica_group)
    whole = shard_group is not None and shard_group.size() * replicas == dist.get_world_size()
    state = _state_of(state, options)
    options = state.options
    candidates = CANDIDATES if replicas == 1 else HSDP_CANDIDATES if whole else (BOTH, RS, REPLICA)
    switch = _register(module, state, None, dist.group.WORLD if whole else None, candidates)
    if switch is not None and replicas > 1 and not whole:
        logger.warning("hhook.fsdp.register_hsdp: bits='auto' decides in each replica's shard group on its own, "
                       "between rs+ag, rs and ar (the replica all-reduce always THC's, plain HSDP no candidate): the "
                       "shard groups and replicas do not make up the whole world")
    if replica_state is None:
        replica_state = THCState(process_group=replica_group, bits=options.bits, block_size=options.block_size,
                                 seed=options.seed, start_iter=0)
        report.covered_by_parent(replica_state)  # idle in a single replica; reported through the returned pair
    replica_state.registration = Registered(
        "It was registered by hhook.fsdp.register_hsdp for the replica all-reduce, but FSDP never called its "
        "all-reduce hook with more than one replica: was another model trained, or did training end before its "
        "first synchronised backward?")
    for name, m, group, factor in modules:
        m.set_all_reduce_hook(ReplicaAllReduce(replica_state, f"hsdp:{name}", factor, group, switch))
    return state, replica_state
