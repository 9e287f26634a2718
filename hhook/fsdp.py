r"""THC compression for FSDP2 (``torch.distributed.fsdp.fully_shard``) and custom HSDP.

:func:`register` puts a :class:`THCReduceScatter` on every ``FSDPModule`` of a model.
FSDP's reduce-scatter input is a flat buffer of ``world_size`` per-rank chunks (dim 0
padded). Each chunk is one THC message of the shared format (:mod:`hhook.scales.message`: the
prefix with count, status and fingerprints, then the codes), encoded by the agreed scale
policy (:class:`hhook.scales.ScalePolicy`) under the key ``(module name, chunk index)``,
with its rotation blocks inside the chunk. The scale vectors of all chunks are
MAX-allreduced together (every rank knows the scales of every chunk it encodes), the
messages of all chunks go through the stock ``reduce_scatter_tensor`` with SUM (lanes
add without carries), and each rank decodes only its own chunk's summed message: the
mean over the shard group, written into FSDP's output.

FSDP's reduction is made a plain SUM (``set_force_sum_reduction_for_comms(True)``).

* 1-D FSDP without a user divide factor: FSDP's division is switched off
  (``set_gradient_divide_factor(1.0)``) and the decode's mean is the result.
* 1-D FSDP with a factor the user set before :func:`register`: the comm returns the sum
  (mean times world size) and FSDP divides by that factor, as plain FSDP2 would.
* Native 2-D HSDP (``fully_shard(mesh=2-D mesh)``): the comm returns the sum over the
  shard group; FSDP then runs its own (dense, uncompressed) SUM all-reduce over the
  replicate group and divides by its factor (the whole data-parallel size unless the
  user set one). Only the reduce-scatter is compressed; to compress the replica
  all-reduce too, use :func:`register_hsdp` on a 1-D shard mesh.
* FSDP2's ``replicate`` (a mesh with a replicate dimension only) has no reduce-scatter:
  :func:`register` refuses it.

Predicted scales are refused: a key's predicted scales come from the summed thermometer
counts of its message, but after a reduce-scatter only rank ``j`` holds the sums of chunk
``j``, while every rank encodes chunk ``j`` at the next step; sharing them would cost the
extra round predicted scales exist to save.

Custom HSDP (:func:`register_hsdp`): 1-D FSDP over the ranks of one node plus
``set_all_reduce_hook`` running :func:`hhook.thc_allreduce` over the replica group
(every rank with the same shard rank), which averages over replicas and returns the
same bits on every replica. The layout is checked at registration.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from . import fsdp_all_gather, fsdp_auto
from .codec.layout import SUPPORTED_DTYPES, constant
from .fsdp_all_gather import AllGatherOptions, AllGatherState
from .scales.message import RANK_FAILED
from .state import THCState

try:  # torch >= 2.6
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # pragma: no cover
    FSDPModule = None
    ReduceScatter = object

__all__ = ["register", "register_hsdp", "compress_all_gather", "all_gather_stats", "AllGatherOptions",
           "THCReduceScatter"]

logger = logging.getLogger(__name__)

PREDICTED_REFUSED = (
    "hhook.fsdp supports scales='agreed' only: predicted scales cannot work for a reduce-scatter "
    "without an extra round. A chunk's next scales come from the summed thermometer counts of its "
    "message, but after the reduce-scatter only rank j holds chunk j's sums, while every rank encodes "
    "chunk j at the next step (broadcasting them would be the round predicted scales exist to save). "
    "Use scales='agreed' (the default)."
)


def _param_group(module):
    """The module's FSDP param group, or None: torch 2.13 keeps a list of them
    (``_fsdp_param_groups``), torch 2.11 one (``_fsdp_param_group``)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        return getattr(state, "_fsdp_param_group", None)
    return groups[0] if groups else None


def _mesh_sizes(group) -> tuple[int | None, int | None]:
    """``(shard size, replicate size)`` of an FSDP param group's mesh; None where the
    mesh has no such dimension (FSDPMeshInfo / HSDPMeshInfo / DDPMeshInfo)."""
    info = group.mesh_info
    return getattr(info, "shard_mesh_size", None), getattr(info, "replicate_mesh_size", None)


class THCReduceScatter(ReduceScatter):
    r"""FSDP2's ``ReduceScatter`` comm, compressed with THC (agreed scales).

    Args:
        state: the :class:`hhook.THCState` (options, per-key state, counters).
        name: this param group's name (its module's name in the model): the first half
            of every chunk's key, ``(name, chunk index)``, stable across steps.
        factor: the user's gradient divide factor (None: FSDP's division is off and the
            comm returns the mean).
        returns_sum: return the sum over the shard group instead of the mean (a user
            factor, or native HSDP, where FSDP divides after its replica all-reduce).

    One call, on every rank of the shard group:

    1. ``policy.begin`` on each destination chunk (rotation blocks inside the chunk) gives
       its scale vector; only this rank's chunk keeps its rotated blocks.
    2. One MAX all-reduce of all chunks' scale vectors (agreed scales).
    3. ``policy.finish`` of each chunk (rotated again: at most two chunks' rotated float32
       blocks are alive at once) into one buffer of ``world_size`` messages. A rank whose
       buffer holds inf/NaN anywhere, or that failed to encode any chunk, says so in the
       status word of *every* chunk's message.
    4. ``reduce_scatter_tensor`` (SUM) of the messages: this rank receives the summed
       message of its chunk.
    5. ``policy.decode``: raises :class:`~hhook.errors.ConfigMismatchError`,
       :class:`~hhook.errors.RankFailedError` (the failed rank: its own exception) or
       :class:`~hhook.errors.OpMismatchError` on every rank; writes NaN over the whole
       shard on every rank if any rank's buffer was non-finite; the input itself if every
       rank's chunk had the same bits.
    """

    def __init__(self, state: THCState, name: str, factor: float | None, returns_sum: bool | None = None,
                 switch=None):
        if state.scales != "agreed":
            raise ValueError(PREDICTED_REFUSED)
        self.state = state
        self.name = name
        self.factor = factor
        self.returns_sum = factor is not None if returns_sum is None else bool(returns_sum)
        self.switch = switch  # bits="auto" (hhook.fsdp_auto.Switch): dense while it says so
        self._verified: set = set()

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def _handshake(self, group, device: torch.device) -> None:
        key = (id(group), device.type)
        if key not in self._verified:
            self.state.check_options(group, device)  # raises ConfigMismatchError on every rank
            self._verified.add(key)

    def __call__(self, output_tensor, input_tensor, group, op=None, async_op=False):
        world = group.size()
        rank = group.rank()
        n = output_tensor.numel()
        state = self.state
        if input_tensor.dtype not in SUPPORTED_DTYPES or (self.switch is not None and self.switch.reduce_scatter_dense):
            return self._dense(output_tensor, input_tensor, group)  # exact, counted
        device = input_tensor.device
        self._handshake(group, device)
        policy = state.policy("agreed", world)  # bits="auto": sized for this group, not the state's
        config = state.config_id()
        chunks = input_tensor.view(world, n)
        # 1. Scale vectors of every chunk; only this rank's chunk keeps its rotated blocks.
        plans = []
        for j in range(world):
            plan = policy.begin(chunks[j], (self.name, j), rank, world, state.next_call(), config)
            if j != rank:
                plan.prepared = None  # recomputed in step 3: no full-size float copy
            plans.append(plan)
        S = plans[0].max_vector.numel()
        scales = torch.cat([p.max_vector for p in plans])
        # 2. Agreed scales.
        dist.all_reduce(scales, dist.ReduceOp.MAX, group=group)
        # 3. One message per chunk.
        codec = plans[0].codec
        L = policy.message_numel(codec, n, predicted=False)
        words = torch.empty(world, L, dtype=codec.layout.word_dtype, device=device)
        for j, plan in enumerate(plans):
            if plan.prepared is None and plan.error is None:
                try:
                    plan.prepared = codec.prepare(chunks[j].detach())
                except Exception as exc:  # noqa: BLE001 - sent as filler, raised on every rank
                    plan.error = exc
            words[j] = policy.finish(plan, scales[j * S:(j + 1) * S])
            if j != rank:
                plan.prepared = None
        failure = next((p.error for p in plans if p.error is not None), None)
        ok = constant([p.error is None for p in plans], torch.bool, device)
        # The status word of every chunk's message tells about this rank's whole buffer:
        # one rank's inf/NaN anywhere turns every shard NaN on every rank (GradScaler and
        # clip_grad_norm_ see it whichever shard they read), and one failed chunk makes
        # every rank raise rather than only the chunk's owner.
        headers = [p.header[0] for p in plans if p.header is not None]
        flag = torch.stack(headers).gt(0).any().to(words.dtype) if headers else words.new_zeros(())
        status = flag + (RANK_FAILED if failure is not None else 0)
        words[:, 1] = torch.where(ok, status, words[:, 1])
        # 4. Each rank receives the lane sums of its own chunk's message.
        summed = torch.empty(L, dtype=words.dtype, device=device)
        dist.reduce_scatter_tensor(summed, words.view(-1), op=dist.ReduceOp.SUM, group=group)
        state.counters.add("compressed_calls", 4 * input_tensor.numel(), scales.nbytes + words.nbytes)
        if failure is not None:
            raise failure  # this rank's own exception; the others raise RankFailedError
        # 5. Decode this rank's chunk: the mean over the shard group.
        _, nonfinite = policy.decode(summed, plans[rank], output_tensor)
        if nonfinite:
            state.counters.add("nonfinite_calls", 0, 0)
        elif self.returns_sum:
            output_tensor.mul_(world)
        return None


    def _dense(self, output_tensor, input_tensor, group) -> None:
        """Plain FSDP2's reduce-scatter of the same buffer (FSDP's division is off: the mean here)."""
        dist.reduce_scatter_tensor(output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=group)
        if not self.returns_sum:
            output_tensor.div_(group.size())
        self.state.counters.add("dense_calls", 4 * input_tensor.numel(), input_tensor.nbytes)
        return None


def _fsdp_modules(module, caller: str = "register") -> list[tuple[str, object]]:
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


def _check_params(module, caller: str = "register") -> None:
    for name, p in module.named_parameters():
        if p.requires_grad and (p.dtype.is_complex or p.dtype == torch.float64):
            raise TypeError(
                f"hhook.fsdp.{caller}: parameter {name!r} is {p.dtype}; THC compresses float32, "
                "float16 and bfloat16 gradients (keep such parameters in a module without hhook)"
            )


def _all_gather_options(all_gather, seed: int) -> AllGatherOptions | bool | None:
    """``register``'s ``all_gather`` as :class:`AllGatherOptions` (a width), or as given."""
    if isinstance(all_gather, int) and not isinstance(all_gather, bool):
        return AllGatherOptions(bits=all_gather, seed=seed)
    if all_gather not in (None, False) and not isinstance(all_gather, AllGatherOptions):
        raise TypeError("hhook.fsdp.register: all_gather must be None, False, a width or AllGatherOptions, got "
                        f"{all_gather!r}")
    return all_gather


def _plan(module) -> list[tuple]:
    """``[(name, FSDPModule, param group, shard size, replicate size)]`` of the modules
    ``register`` compresses; raises before anything changes."""
    fsdp_modules = _fsdp_modules(module)
    _check_params(module)
    plan = []
    for name, m in fsdp_modules:
        group = _param_group(m)
        if group is None:
            continue
        comm = getattr(group, "_reduce_scatter_comm", None)
        if comm is not None and type(comm).__name__ != "DefaultReduceScatter":
            raise ValueError(f"hhook.fsdp.register: {name} ({type(m).__name__}) already has a custom reduce-scatter "
                             f"({type(comm).__name__}); hhook cannot combine with it")
        shard, replicate = _mesh_sizes(group)
        if shard is None:
            raise ValueError(f"hhook.fsdp.register: {name} is replicated without sharding (a mesh with only a "
                             "replicate dimension, FSDP2's replicate): it has no reduce-scatter to compress. Use "
                             "hhook.register on DDP, or shard it (fully_shard on a 1-D mesh, or register_hsdp for "
                             "shard + replicate)")
        plan.append((name, m, group, shard, replicate))
    return plan


def register(module, state: THCState | None = None, *, all_gather: int | AllGatherOptions | bool | None = None,
             **options) -> THCState:
    """Compress FSDP2's gradient reduce-scatter of every ``FSDPModule`` in ``module``, and
    with ``all_gather`` (8, 6, 4 or :class:`AllGatherOptions`) its parameter all-gather
    (:mod:`hhook.fsdp_all_gather`; :func:`all_gather_stats`). ``options`` are
    :class:`hhook.THCState`'s, or pass ``state``; returns the state. 1-D meshes and native
    2-D HSDP meshes (whose replica all-reduce stays dense; :func:`register_hsdp`).

    ``bits="auto"`` (the default) measures the step with THC's reduce-scatter plus the
    compressed all-gather (``all_gather``'s width, 8 by default; ``False`` leaves it out),
    THC's reduce-scatter alone and plain FSDP2 in turns, and keeps the fastest
    (:mod:`hhook.fsdp_auto`; on 2-D meshes it compresses without measuring). An integer
    ``bits`` always compresses the reduce-scatter.

    Raises ``ValueError`` for a module without ``FSDPModule``, a reduce-scatter or
    all-gather already customised, a replicate-only mesh, ``scales="predicted"``,
    ``error_feedback=True`` or a bad width; ``TypeError`` for float64/complex parameters;
    ``ConfigMismatchError`` on every rank when ranks differ in the all-gather's options,
    the parameters they would quantize or ``bits="auto"`` (a blocking handshake per shard
    group); ``RuntimeError`` for a torch without ``set_custom_all_gather``. Modules the
    compressed all-gather cannot serve keep FSDP's, named in one log line (docs/fsdp.md).
    Nothing is changed on the model when it raises.
    """
    if state is None:
        state = THCState(**{"bits": "auto", **options})
    elif options:
        raise TypeError("hhook.fsdp.register: pass either state or options, not both")
    if state.scales != "agreed":
        raise ValueError(PREDICTED_REFUSED)
    if state.error_feedback:
        raise ValueError("hhook.fsdp.register does not support error_feedback (agreed scales are unbiased "
                         "without it)")
    all_gather = _all_gather_options(all_gather, state.seed)
    plan = _plan(module)
    decider = fsdp_auto.decider(state, plan, all_gather is not False) if state.bits == "auto" else None
    if decider is not None and all_gather is None:
        all_gather = AllGatherOptions(seed=state.seed)  # the candidate's: 8 bits
    entries, extra = [(name, m, group) for name, m, group, *_ in plan], decider.digest() if decider else 0
    if all_gather in (None, False):  # the ranks agree on that too (one blocking all-reduce per shard group)
        gathers = fsdp_all_gather.agree_without(entries, extra)
    else:
        gathers = fsdp_all_gather.plan(entries, AllGatherState(all_gather), extra)
    switch = decider.switch if decider is not None else None
    for name, m, group, shard, replicate in plan:
        factor = group.gradient_divide_factor
        hsdp = replicate is not None
        m.set_custom_reduce_scatter(THCReduceScatter(state, name, factor, returns_sum=hsdp or factor is not None,
                                                     switch=switch))
        if shard == 1:
            continue  # FSDP never calls the comm in a shard group of one: leave its division alone
        m.set_force_sum_reduction_for_comms(True)
        if factor is None and not hsdp:
            m.set_gradient_divide_factor(1.0)
    if any(replicate is not None and replicate > 1 for *_, replicate in plan):
        logger.info("hhook.fsdp.register: native HSDP mesh: the reduce-scatter inside the shard group is "
                    "compressed, FSDP's replica all-reduce stays dense (register_hsdp compresses both)")
    if gathers is not None:
        fsdp_all_gather.apply(gathers, switch)
    if decider is not None:
        decider.attach(module)
    return state


def compress_all_gather(module, bits: int = 8, **options) -> AllGatherState:
    """Compress only the parameter all-gather of every ``FSDPModule`` in ``module``
    (``options``: :class:`AllGatherOptions`' others); the reduce-scatter stays FSDP2's.
    Raises as :func:`register` does for the all-gather, before changing anything."""
    state = AllGatherState(AllGatherOptions(bits=bits, **options))
    entries = [(name, m, group) for name, m in _fsdp_modules(module, "compress_all_gather")
               if (group := _param_group(m)) is not None]
    fsdp_all_gather.apply(fsdp_all_gather.plan(entries, state))
    return state


def all_gather_stats(module) -> dict | None:
    """Bytes and calls of ``module``'s compressed all-gathers (``AllGatherState.stats``);
    None where its all-gather is not compressed."""
    state = fsdp_all_gather.find_state(module)
    return None if state is None else state.stats()


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
    verdict = torch.tensor([float(local_bad)], device=device)
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
    if group is None and replica_state.calls == 0 and replica_state.runtime.topo is None:
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


def register_hsdp(module, replica_group: dist.ProcessGroup, state: THCState | None = None,
                  replica_state: THCState | None = None, **options) -> tuple[THCState, THCState]:
    """Custom HSDP: THC reduce-scatter inside the shard group (``fully_shard``'s 1-D mesh)
    and a THC allreduce over ``replica_group`` in FSDP's all-reduce hook, which averages
    over replicas. Returns ``(shard_state, replica_state)``.

    Checks the layout first, blocking, on every rank of the shard and replica groups:
    raises ``ValueError`` on every rank if a module was sharded on a 2-D mesh (FSDP would
    run its own replica all-reduce as well) or if the members of ``replica_group`` do not
    all hold the same shard (e.g. ``WORLD`` passed as the replica group). A gradient
    divide factor set before the call is respected (the result is the sum over all ranks
    divided by it, as plain FSDP2's). A ``replica_state`` must reduce over
    ``replica_group`` (``ValueError`` on every rank otherwise); one built without a
    process group takes ``replica_group``.
    """
    from .schedule.allreduce import thc_allreduce

    if not isinstance(replica_group, dist.ProcessGroup):
        raise TypeError(f"hhook.fsdp.register_hsdp: replica_group must be a ProcessGroup, got {replica_group!r}")
    modules = []
    shard_group = None
    for name, m in _fsdp_modules(module, "register_hsdp"):
        group = _param_group(m)
        if group is None:
            continue
        shard, replicate = _mesh_sizes(group)
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
        modules.append((name, m, group.gradient_divide_factor))
    if shard_group is not None:
        _check_replica_layout(shard_group, replica_group, device)
    if replica_state is not None:
        _adopt_replica_group(replica_state, replica_group)
    state = register(module, state, **options)
    if replica_state is None:
        replica_state = THCState(process_group=replica_group, bits=state.bits, block_size=state.block_size,
                                 seed=state.seed, start_iter=0)
        replica_state.reported_through_parent()  # idle in a single replica; reported through the returned pair
    replicas = dist.get_world_size(replica_group)
    for name, m, factor in modules:
        def hook(output: torch.Tensor, key=f"hsdp:{name}", factor=factor) -> None:
            if replicas > 1:
                thc_allreduce(output, replica_state, key=key)  # the mean over replicas
                if factor is not None:  # the comm returned the shard group's sum; FSDP divides by factor
                    output.mul_(replicas)

        m.set_all_reduce_hook(hook)
    return state, replica_state
