"""FSDP2's gradient reduce-scatter, compressed: :class:`THCReduceScatter`, a
``ReduceScatter`` comm for ``FSDPModule.set_custom_reduce_scatter`` (the package's
docstring, :mod:`hhook.fsdp`, says how it sums and divides)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..codec.layout import SUPPORTED_DTYPES, constant
from ..scales.message import RANK_FAILED
from ..schedule.context import check_options
from ..state import THCState

try:  # torch >= 2.6
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # pragma: no cover
    ReduceScatter = object

PREDICTED_REFUSED = (
    "hhook.fsdp supports scales='agreed' only: predicted scales cannot work for a reduce-scatter "
    "without an extra round. A chunk's next scales come from the summed thermometer counts of its "
    "message, but after the reduce-scatter only rank j holds chunk j's sums, while every rank encodes "
    "chunk j at the next step (broadcasting them would be the round predicted scales exist to save). "
    "Use scales='agreed' (the default)."
)


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
        self.switch = switch  # bits="auto" (hhook.fsdp.auto.Switch): dense while it says so
        self._verified: set = set()

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def _handshake(self, group, device: torch.device) -> None:
        key = (id(group), device.type)
        if key not in self._verified:
            check_options(self.state.context(), group, device)  # raises ConfigMismatchError on every rank
            self._verified.add(key)

    def __call__(self, output_tensor, input_tensor, group, op=None, async_op=False):
        world = group.size()
        rank = group.rank()
        n = output_tensor.numel()
        state = self.state
        if self.switch is not None:
            self.switch.reduced = True  # the next training forward starts a step
        if input_tensor.dtype not in SUPPORTED_DTYPES or (self.switch is not None and self.switch.reduce_scatter_dense):
            return self._dense(output_tensor, input_tensor, group)  # exact, counted
        device = input_tensor.device
        self._handshake(group, device)
        policy = state.policy("agreed", world)  # bits="auto": sized for this group, not the state's
        config = state.options.config_id(state.decision)
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
