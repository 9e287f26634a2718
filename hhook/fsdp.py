r"""THC compression for FSDP2 (``torch.distributed.fsdp.fully_shard``) and custom HSDP.

:func:`register` puts a :class:`THCReduceScatter` on every ``FSDPModule`` of a model.
FSDP's reduce-scatter input is a flat buffer of ``world_size`` per-rank chunks (dim 0
padded). Each chunk is encoded on its own (its rotation blocks never straddle chunks),
the scale vectors of all chunks are MAX-allreduced together (agreed scales: every rank
knows the scales of every chunk it encodes), the integer words of all chunks go through
the stock ``reduce_scatter_tensor`` with SUM (lanes add without carries), and each rank
decodes only its own chunk: the mean over ranks, written into FSDP's output.

FSDP's reduction is made a plain SUM (``set_force_sum_reduction_for_comms(True)``). Without
a user divide factor, FSDP's division is switched off (``set_gradient_divide_factor(1.0)``)
and the decode's mean is the result; with a factor the user set before :func:`register`,
the comm returns the sum (mean times world size) and FSDP divides by that factor, as plain
FSDP2 would.

Custom HSDP (:func:`register_hsdp`): 1-D FSDP over the ranks of one node plus
``set_all_reduce_hook`` running :func:`hhook.thc_allreduce` over the replica group
(every rank with the same local rank), which averages over replicas and returns the
same bits on every replica.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import rng
from .codec import THCCodec
from .layout import SUPPORTED_DTYPES
from .state import THCState

try:  # torch >= 2.6
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # pragma: no cover
    FSDPModule = None
    ReduceScatter = object

__all__ = ["register", "register_hsdp", "THCReduceScatter"]

_KIND = "reduce_scatter"


def _param_group(module):
    groups = module._get_fsdp_state()._fsdp_param_groups
    return groups[0] if groups else None


class THCReduceScatter(ReduceScatter):
    """FSDP2's ``ReduceScatter`` comm, compressed with THC (agreed scales)."""

    def __init__(self, state: THCState, name: str, factor: float | None):
        self.state = state
        self.name = name
        self.factor = factor  # the user's gradient divide factor (None: world size)
        self._codecs: dict[int, THCCodec] = {}
        self._verified: set = set()

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def _codec(self, world: int) -> THCCodec:
        codec = self._codecs.get(world)
        if codec is None:
            s = self.state
            codec = self._codecs[world] = THCCodec(s.bits, s.block_size, s.seed, world)
        return codec

    def _handshake(self, codec: THCCodec, group, device: torch.device) -> None:
        key = (id(group), device.type)
        if key not in self._verified:
            self.state.check_options(group, device)  # raises ConfigMismatchError on every rank
            self._verified.add(key)

    def __call__(self, output_tensor, input_tensor, group, op=None, async_op=False):
        world = group.size()
        rank = group.rank()
        n = output_tensor.numel()
        # No user factor: FSDP divides by 1.0 and we return the mean. A user factor f: FSDP
        # keeps dividing by f (also at world size 1, where it never calls us), so return the sum.
        scale = 1.0 if self.factor is None else float(world)
        state = self.state
        if input_tensor.dtype not in SUPPORTED_DTYPES:  # exact fallback, counted
            dist.reduce_scatter_tensor(output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=group)
            output_tensor.div_(world / scale)
            state.count("dense_calls", 4 * input_tensor.numel(), input_tensor.nbytes)
            return None
        codec = self._codec(world)
        self._handshake(codec, group, input_tensor.device)
        chunks = input_tensor.view(world, n)
        S = codec.scales_numel(n)
        # Pass 1: the scales of every chunk, holding one chunk's rotated blocks at a time.
        scales = torch.empty(world * S, dtype=torch.float32, device=input_tensor.device)
        for j in range(world):
            scales[j * S:(j + 1) * S] = codec.prepare(chunks[j]).scales
        dist.all_reduce(scales, dist.ReduceOp.MAX, group=group)
        # One rank's inf/NaN anywhere in the buffer turns every chunk NaN on every rank
        # (GradScaler and clip_grad_norm_ see it whichever shard they read).
        flags = scales[0::S]
        flags.fill_(flags.max())
        # Pass 2: the words of every chunk (rotation recomputed: no full-size float copy).
        m = codec.words_numel(n)
        words = torch.empty(world * m, dtype=codec.layout.word_dtype, device=input_tensor.device)
        mine = None
        for j in range(world):
            prepared = codec.prepare(chunks[j])
            key = rng.stream_key(state.seed, rank, state.next_call())
            codec.quantize(prepared, scales[j * S:(j + 1) * S], key, out=words[j * m:(j + 1) * m])
            if j == rank:
                mine = prepared
        summed = torch.empty(m, dtype=words.dtype, device=words.device)
        dist.reduce_scatter_tensor(summed, words, op=dist.ReduceOp.SUM, group=group)
        agreed = scales[rank * S:(rank + 1) * S]
        codec.decode(mine, agreed, summed, output_tensor)
        if scale != 1.0:
            output_tensor.mul_(scale)
        state.count("compressed_calls", 4 * input_tensor.numel(), scales.nbytes + words.nbytes)
        if bool(agreed[0] > 0):
            state.count("nonfinite_calls", 0, 0)
        codec.verify(agreed, n)
        return None


def _fsdp_modules(module):
    if FSDPModule is None:
        raise RuntimeError("hhook.fsdp needs torch.distributed.fsdp.fully_shard (torch >= 2.6)")
    found = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not found:
        raise ValueError(
            "hhook.fsdp.register: the module contains no FSDPModule; apply "
            "torch.distributed.fsdp.fully_shard first"
        )
    return found


def _check_params(module) -> None:
    for name, p in module.named_parameters():
        if p.requires_grad and (p.dtype.is_complex or p.dtype == torch.float64):
            raise TypeError(
                f"hhook.fsdp.register: parameter {name!r} is {p.dtype}; THC compresses float32, "
                "float16 and bfloat16 gradients (keep such parameters in a module without hhook)"
            )


def register(module, state: THCState | None = None, **options) -> THCState:
    """Compress FSDP2's gradient reduce-scatter of every ``FSDPModule`` in ``module``.

    ``options`` are :class:`hhook.THCState`'s (``bits``, ``block_size``, ``seed``...);
    pass ``state`` to share one. Returns the state (``state.stats()`` counts bytes).
    Raises ``ValueError`` for a module without ``FSDPModule`` or one whose reduce-scatter
    is already customised, ``TypeError`` for float64/complex parameters.
    """
    if state is None:
        state = THCState(**options)
    elif options:
        raise TypeError("hhook.fsdp.register: pass either state or options, not both")
    if state.scales != "agreed":
        raise ValueError("hhook.fsdp.register supports scales='agreed' only (for now)")
    if state.error_feedback:
        raise ValueError("hhook.fsdp.register does not support error_feedback (for now)")
    fsdp_modules = _fsdp_modules(module)
    _check_params(module)
    plan = []
    for m in fsdp_modules:
        group = _param_group(m)
        if group is None:
            continue
        comm = getattr(group, "_reduce_scatter_comm", None)
        if comm is not None and type(comm).__name__ != "DefaultReduceScatter":
            raise ValueError(
                f"hhook.fsdp.register: {type(m).__name__} already has a custom reduce-scatter "
                f"({type(comm).__name__}); hhook cannot combine with it"
            )
        plan.append((m, group))
    for index, (m, group) in enumerate(plan):
        factor = group.gradient_divide_factor
        m.set_custom_reduce_scatter(THCReduceScatter(state, f"group{index}", factor))
        if getattr(group.mesh_info, "shard_mesh_size", 2) == 1:
            continue  # FSDP never calls the comm in a world of one: leave its division alone
        m.set_force_sum_reduction_for_comms(True)
        if factor is None:
            m.set_gradient_divide_factor(1.0)
    return state


def register_hsdp(module, replica_group: dist.ProcessGroup, state: THCState | None = None,
                  replica_state: THCState | None = None, **options) -> tuple[THCState, THCState]:
    """Custom HSDP: THC reduce-scatter inside the shard group (``fully_shard``'s 1-D mesh)
    and a THC allreduce over ``replica_group`` in FSDP's all-reduce hook, which averages
    over replicas. Returns ``(shard_state, replica_state)``."""
    from .allreduce import thc_allreduce

    state = register(module, state, **options)
    if replica_state is None:
        replica_state = THCState(process_group=replica_group, bits=state.bits, block_size=state.block_size,
                                 seed=state.seed, start_iter=0)
    counter = {}
    for index, m in enumerate(_fsdp_modules(module)):
        if _param_group(m) is None:
            continue
        key = f"hsdp{index}"

        def hook(output: torch.Tensor, key=key) -> None:
            counter[key] = counter.get(key, 0) + 1
            if dist.get_world_size(replica_group) > 1:
                thc_allreduce(output, replica_state, key=key)

        m.set_all_reduce_hook(hook)
    return state, replica_state
