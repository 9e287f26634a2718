r"""The one dense fallback: what DDP does without a hook, exact, for what THC does not
compress (float64 and sparse tensors, DDP's iterations before ``start_iter``), and the
dense exchanges ``bits="auto"`` measures (fp32, bf16; FSDP2's plain reduce-scatter,
:class:`hhook.fsdp.THCReduceScatter`), all counted one way (:func:`count`); DDP's plain
iterations tally in theirs how many ranks loaded a checkpoint (:func:`tallied_allreduce`,
:mod:`hhook.schedule.load_check`)."""

from __future__ import annotations

import logging
import math
import threading

import torch
import torch.distributed as dist

from ..codec.layout import SUPPORTED_DTYPES
from . import membership
from .futures import completed, then

logger = logging.getLogger(__name__)

#: Tensors averaged exactly, never compressed (as DDP without a hook); any other dtype
#: outside the codec's (:data:`~hhook.codec.SUPPORTED_DTYPES`) has no mean in its own
#: dtype and raises (:func:`check_dtype`).
EXACT_DTYPES = (torch.float64,)
_told: set = set()
_lock = threading.Lock()


def uncompressed(tensor: torch.Tensor) -> bool:
    """Whether THC leaves ``tensor`` uncompressed: anything but a dense float32, float16
    or bfloat16 tensor takes the dense fallback, said once per dtype in the log."""
    if not tensor.is_sparse and tensor.dtype in SUPPORTED_DTYPES:
        return False
    kind = "sparse" if tensor.is_sparse else str(tensor.dtype).replace("torch.", "")
    with _lock:
        new = kind not in _told
        _told.add(kind)
    if new:
        logger.warning("hhook: %s tensors are exchanged exactly, uncompressed (as without hhook); hhook compresses "
                       "dense float32, float16 and bfloat16 tensors", kind)
    return True


def check_dtype(tensor: torch.Tensor) -> None:
    """Refuse a tensor hhook cannot average: one of neither the codec's dtypes nor
    :data:`EXACT_DTYPES` (integers, bool, complex)."""
    if tensor.dtype not in SUPPORTED_DTYPES and tensor.dtype not in EXACT_DTYPES:
        raise TypeError(
            f"hhook averages floating-point tensors: float32, float16 and bfloat16 are compressed, float64 is "
            f"averaged exactly; got {tensor.dtype}, which has no mean in its own dtype. Reduce it with "
            "torch.distributed.all_reduce (an exact integer sum), or pass a floating-point copy"
        )


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor._values().nbytes + tensor._indices().nbytes if tensor.is_sparse else tensor.nbytes


def count(counters, tensor: torch.Tensor, sent: torch.Tensor | None = None, wire_to=None) -> None:
    """Count one dense exchange of ``tensor`` in ``counters`` (:class:`hhook.stats.Counters`):
    a ``dense_calls``, the bytes compression is measured against (its float32 size where
    the codec would take it, else its own size: sparse, its values and indices) and the
    bytes handed to the collective (``sent``, default ``tensor``), those in ``wire_to``
    where given (two-level: the bytes that cross nodes are the inter-node state's)."""
    dense = 4 * tensor.numel() if not tensor.is_sparse and tensor.dtype in SUPPORTED_DTYPES else _nbytes(tensor)
    wire = _nbytes(tensor if sent is None else sent)
    if wire_to is None:
        counters.add("dense_calls", dense, wire)
    else:
        counters.add("dense_calls", dense, 0)
        wire_to.add(None, 0, wire)


def plain_allreduce(tensor: torch.Tensor, group, world_size: int) -> torch.futures.Future:
    """What DDP does without a hook, exact: divide by ``world_size``, SUM-allreduce over
    ``group``; the future holds ``tensor``."""
    tensor.div_(world_size)
    fut = membership.of(group).all_reduce(tensor, dist.ReduceOp.SUM).get_future()
    return then(fut, lambda value: value[0], tensor, f"the plain allreduce of {tensor.numel()} elements", group)


def dense_allreduce(ctx, tensor: torch.Tensor) -> torch.futures.Future:
    """:func:`plain_allreduce` over ``ctx.group`` (a
    :class:`~hhook.schedule.context.CallContext`), counted in ``ctx.counters``; in a
    world of one, the tensor as it is."""
    if ctx.world_size == 1:
        ctx.counters.add("local_calls", 0, 0)
        return completed(tensor)
    uncompressed(tensor)  # said once where it is for its dtype
    count(ctx.counters, tensor)
    return plain_allreduce(tensor, ctx.group, ctx.world_size)


#: What a rank that loaded a checkpoint sends in the last element of a tallied exchange
#: (:func:`tallied_allreduce`), zeros elsewhere: far above any gradient's sum, and k times
#: it is exact in float32, float64 (k below 2**24) and bfloat16 (below 2**8).
MARK = 2.0 ** 100


def marks(value: float) -> int:
    """How many :data:`MARK` a tallied exchange's last element holds: a finite sum at least
    half a mark (no gradient's); a non-finite one (a rank's inf or NaN) holds none."""
    return int(round(value / MARK)) if math.isfinite(value) and abs(value) >= MARK / 2 else 0


def tallied_allreduce(ctx, tensor: torch.Tensor, mark: int, check,
                      dtype: torch.dtype | None = None) -> torch.futures.Future:
    """:func:`plain_allreduce` of ``tensor`` (with ``dtype``, bf16: :func:`cast_allreduce`,
    the same bits) that also counts the ranks whose ``mark`` is 1: each of them sends zeros
    and :data:`MARK` in the last element instead of its tensor (``tensor`` untouched). The
    count (:func:`marks` of the sum's last element) goes to ``check``, which may raise (the
    future then raises); else the mean is ``tensor``'s. The other ranks' exchange is the
    plain one, in place: no copy, no element more. A dtype with no room for the mark
    (float16) carries the count in one element more; sparse tensors and a world of one take
    :func:`dense_allreduce` (no count)."""
    if tensor.is_sparse or ctx.world_size == 1:
        return dense_allreduce(ctx, tensor)
    uncompressed(tensor)  # said once where it is for its dtype (float64)
    wire = dtype or tensor.dtype
    extra = int(torch.finfo(wire).max < 2 ** 8 * MARK)  # no room for the mark in the values
    if mark or extra:
        words = torch.zeros(tensor.numel() + extra, dtype=wire, device=tensor.device)
        if not mark:
            words[:-1].copy_(tensor.reshape(-1)).div_(ctx.world_size)
        words[-1] = mark if extra else mark * MARK
    elif dtype is not None:  # cast, then divide the half-size copy (as cast_allreduce)
        words = tensor.to(dtype).div_(ctx.world_size)
    else:  # in place (as plain_allreduce)
        words = tensor.div_(ctx.world_size)
    count(ctx.counters, tensor, words)
    fut = membership.of(ctx.group).all_reduce(words, dist.ReduceOp.SUM).get_future()

    def done(value) -> torch.Tensor:
        last = float(words.reshape(-1)[-1].item())
        tally = int(round(last)) if extra else marks(last)
        check(tally if tally <= ctx.world_size else 0)  # more marks than ranks: a gradient's sum, not marks
        if words is not tensor:
            tensor.copy_(words.reshape(-1)[:tensor.numel()].view_as(tensor))
        return tensor

    what = f"the {'plain' if dtype is None else dtype} allreduce of {tensor.numel()} elements"
    return then(fut, done, tensor, what, ctx.group)


def cast_allreduce(ctx, tensor: torch.Tensor, dtype: torch.dtype) -> torch.futures.Future:
    """A dense allreduce in ``dtype`` (``bits="auto"``'s bf16 candidate, as PyTorch's
    bf16 hook): cast, divide, SUM-allreduce, copy back. Round-to-nearest, not exact;
    inf/NaN on any rank stays non-finite on every rank. Counted as a dense call."""
    world_size = ctx.world_size
    if world_size == 1:
        return dense_allreduce(ctx, tensor)
    # Cast first, then divide the half-size copy in place (as torch's hook): no float32
    # temporary of the bucket (why: docs/decision.md, "What a Python hook costs").
    low = tensor.to(dtype).div_(world_size)
    count(ctx.counters, tensor, low)
    fut = dist.all_reduce(low, group=ctx.group, async_op=True).get_future()
    return then(fut, lambda value: tensor.copy_(value[0]), tensor, f"the {dtype} allreduce of {tensor.numel()} elements",
                ctx.group)
