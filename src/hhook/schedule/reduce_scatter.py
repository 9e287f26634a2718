r"""The reduce-scatter schedule: THC of a buffer of ``world_size`` equal chunks over one
process group, each rank receiving the mean of its own chunk (FSDP2's gradient
reduce-scatter, :class:`hhook.fsdp.THCReduceScatter`), with the flat schedule's stages
(:class:`~hhook.scales.ScalePolicy`'s ``begin`` -> ``finish`` -> ``decode``, agreed scales).

It blocks: FSDP2 calls its comm on its reduce-scatter stream and reads the output when
the call returns, so the collectives run in order on the caller's thread.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..codec.layout import constant
from ..scales import message
from .context import CallContext
from .groups import reduce_scatter_flat


def reduce_scatter(ctx: CallContext, output: torch.Tensor, buffer: torch.Tensor, name,
                   changed: message.CallChanged | None = None) -> bool:
    r"""Write into ``output`` the mean over ``ctx.group`` of this rank's chunk of ``buffer``
    (``ctx.world_size`` chunks of ``output.numel()``); returns whether it came back
    non-finite (NaN over the whole shard on every rank). ``ctx``: the
    :class:`~hhook.schedule.context.CallContext` of the shard group, whose policy is agreed
    and sized for it; chunk ``j`` travels under the key ``(name, j)``. One call, on every
    rank of the group:

    1. ``policy.begin`` on each chunk (rotation blocks inside the chunk) gives its scale
       vector; only this rank's chunk keeps its rotated blocks.
    2. One MAX all-reduce of all chunks' scale vectors (agreed scales).
    3. ``policy.finish`` of each chunk (rotated again: at most two chunks' rotated float32
       blocks are alive at once) into one buffer of ``world_size`` messages. A rank whose
       buffer holds inf/NaN anywhere, or that failed to encode any chunk, says so in the
       status word of *every* chunk's message (:func:`hhook.scales.message.share_status`).
    4. A SUM reduce-scatter of the messages: this rank receives the summed message of its
       chunk.
    5. ``policy.decode``: raises :class:`~hhook.errors.ConfigMismatchError`,
       :class:`~hhook.errors.RankFailedError` (the failed rank: its own exception) or
       :class:`~hhook.errors.OpMismatchError` on every rank; writes NaN over the whole
       shard on every rank if any rank's buffer was non-finite; the input itself if every
       rank's chunk had the same bits.

    ``changed``: this rank loaded a checkpoint since the group's options handshake
    (:mod:`hhook.schedule.load_check`): it sends filler of ``ctx``'s sizes (every rank
    verified them) marked :data:`~hhook.scales.message.CHANGED` in every chunk's message,
    and raises ``changed``, its ``count`` the ranks that marked theirs; every other rank
    raises a :class:`~hhook.scales.message.CallChanged` counting them.
    """
    group, world, rank, n, device = ctx.group, ctx.world_size, ctx.rank, output.numel(), buffer.device
    policy = ctx.policy
    chunks = buffer.view(world, n)
    # 1. Scale vectors of every chunk; only this rank's chunk keeps its rotated blocks.
    plans = []
    for j in range(world):
        plan = policy.begin(chunks[j], (name, j), rank, world, ctx.counters.next_call(), ctx.config, error=changed)
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
                plan.prepared = codec.prepare(chunks[j].detach(), policy.residual(plan.state, codec, device))
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
    message.share_status(words, [p.header[0] for p in plans if p.header is not None], failure is not None, ok)
    if changed is not None:
        words[:, 0] += message.CHANGED
    # 4. Each rank receives the lane sums of its own chunk's message.
    summed = torch.empty(L, dtype=words.dtype, device=device)
    reduce_scatter_flat(summed, words.view(-1), group=group)
    ctx.counters.add("compressed_calls", 4 * buffer.numel(), scales.nbytes + words.nbytes)
    if changed is not None:  # how many ranks marked theirs
        changed.count = int(summed[0]) // message.CHANGED
    if failure is not None:
        raise failure  # this rank's own exception; the others raise RankFailedError
    # 5. Decode this rank's chunk: the mean over the shard group.
    _, nonfinite = policy.decode(summed, plans[rank], output)
    nonfinite = bool(nonfinite)
    if nonfinite:
        ctx.counters.add("nonfinite_calls", 0, 0)
    return nonfinite
