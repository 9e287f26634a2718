r"""The flat schedule: THC allreduce over one process group, every rank a peer.

:mod:`hhook.schedule.allreduce` dispatches here (or to :mod:`hhook.schedule.two_level`, which runs this
schedule between nodes).

Nothing here waits. :func:`flat_allreduce_async` launches the first collective and
returns a future at once; each later stage runs as the continuation of the previous
collective and the last one completes the returned future. So in DDP the backward pass
goes on computing (and launching) the next buckets while this one is on the wire. A
large tensor travels in pieces (``THCState(chunk_mb=)``): while one piece is on the wire
the next is encoded and the previous decoded, so part of the codec's time hides behind
the wire's.

The scale policy (:mod:`hhook.scales`) decides the rounds of each tensor:

* predicted scales (a key with history): encode, one SUM allreduce, decode in its
  continuation. The decode reads the summed prefix on the host.
* agreed scales (``scales="agreed"``, and a predicted key's first call): MAX-allreduce the
  scale vector; its continuation quantizes onto the agreed scales and launches the SUM of
  the words; that one's continuation decodes. Continuations run on the process group's
  threads in completion order, so the SUMs go on a second communicator over the same
  ranks (:mod:`hhook.schedule.groups`), launched in hook order by a
  :class:`~hhook.schedule.sequencer.Sequencer`: every rank pairs the same collectives.
  Continuations never wait (a wait there can deadlock Gloo's few worker threads).

Errors surface through the returned future (in DDP: from ``loss.backward()``) on every
rank alike: a configuration mismatch raises :class:`~hhook.errors.ConfigMismatchError`
when the mismatched tensor's future completes (on GPUs with agreed scales, which read
nothing on the host, at the next call, ``stats()`` or ``thc_allreduce``'s return); a rank
that fails while encoding sends filler and every other rank raises
:class:`~hhook.errors.RankFailedError`. Non-finite inputs on any rank make every
rank's result NaN (no exception), so ``GradScaler`` skips the step everywhere.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..codec.layout import SUPPORTED_DTYPES
from .context import CallContext, context_of, handshake
from .futures import completed, new_future, settle, then, value_of
from .groups import explain
from .sequencer import stream_of
from .teardown import attach


def _all(futures: list, value: torch.Tensor, starts: list[int]) -> torch.futures.Future:
    """A future holding ``value`` once the futures of all its pieces (starting at
    ``starts`` of the flat tensor) have completed: with the first exception among them, as
    it is, if one failed; all NaN if one piece is (a rank's non-finite piece makes that
    piece NaN on every rank; the whole tensor must be, as without pieces)."""

    def check(done: list) -> torch.Tensor:
        for f in done:
            f.value()  # raises a piece's exception
        flat = value.view(-1)
        nan_piece = flat[starts].isnan().any()  # decode writes NaN over whole pieces only
        if flat.is_cuda:
            flat.masked_fill_(nan_piece, float("nan"))
        elif nan_piece:
            flat.fill_(float("nan"))
        return value

    return then(torch.futures.collect_all(futures), check, value)


def payload_bytes(tensor: torch.Tensor) -> int:
    """Bytes a plain allreduce of ``tensor`` hands to the wire (a sparse one: values and indices)."""
    if tensor.is_sparse:
        return tensor._values().nbytes + tensor._indices().nbytes
    return tensor.nbytes


def plain_allreduce(tensor: torch.Tensor, group, world_size: int) -> torch.futures.Future:
    """What DDP does without a hook, exact: divide by ``world_size``, SUM-allreduce over
    ``group``; the future holds ``tensor``."""
    tensor.div_(world_size)
    fut = dist.all_reduce(tensor, group=group, async_op=True).get_future()
    return then(fut, lambda value: value[0], tensor, f"the plain allreduce of {tensor.numel()} elements", group)


def check_tensor(tensor: torch.Tensor) -> None:
    """Refuse, with a plain message, tensors hhook cannot reduce in place."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"hhook reduces torch tensors, not {type(tensor).__name__}")
    if tensor.is_meta:
        raise ValueError("hhook cannot reduce a meta tensor: it has no data (materialize it first)")
    if tensor.requires_grad:
        raise ValueError(
            "hhook averages the tensor in place, which autograd forbids for a tensor that requires "
            "grad: pass tensor.detach() (it shares the data) or call it under torch.no_grad()"
        )


def dense_allreduce(caller, tensor: torch.Tensor) -> torch.futures.Future:
    """What DDP does without a hook: divide by the world size, then SUM-allreduce.

    Exact; used before ``start_iter`` and for tensors the codec does not take
    (float64, sparse gradients). ``caller``: a :class:`~hhook.schedule.context.CallContext`
    or what gives one (a :class:`~hhook.state.THCState`); its counters count the call.
    """
    ctx = context_of(caller)
    world_size = ctx.world_size
    if world_size == 1:
        ctx.counters.add("local_calls", 0, 0)
        return completed(tensor)
    size = payload_bytes(tensor)
    ctx.counters.add("dense_calls", size if tensor.is_sparse or tensor.dtype == torch.float64 else 4 * tensor.numel(), size)
    return plain_allreduce(tensor, ctx.group, world_size)


def cast_allreduce(caller, tensor: torch.Tensor, dtype: torch.dtype) -> torch.futures.Future:
    """A dense allreduce in ``dtype`` (``bits="auto"``'s bf16 candidate, as PyTorch's
    bf16 hook): cast, divide, SUM-allreduce, copy back. Round-to-nearest, not exact;
    inf/NaN on any rank stays non-finite on every rank. Counted as a dense call."""
    ctx = context_of(caller)
    world_size = ctx.world_size
    if world_size == 1:
        return dense_allreduce(ctx, tensor)
    # Cast first, then divide the half-size copy in place (as torch's hook): no float32
    # temporary of the bucket (why: docs/decision.md, "What a Python hook costs").
    low = tensor.to(dtype).div_(world_size)
    ctx.counters.add("dense_calls", 4 * tensor.numel(), low.nbytes)
    fut = dist.all_reduce(low, group=ctx.group, async_op=True).get_future()
    return then(fut, lambda value: tensor.copy_(value[0]), tensor, f"the {dtype} allreduce of {tensor.numel()} elements",
                ctx.group)


def flat_allreduce_async(tensor: torch.Tensor, caller, key=None, layout=None,
                         failed: BaseException | None = None) -> torch.futures.Future:
    r""":func:`hhook.thc_allreduce_async` over one process group, every rank a peer (its
    contract, documented there). ``caller``: a :class:`~hhook.schedule.context.CallContext`
    or what gives one. Pieces of a tensor above the caller's ``chunk_mb`` travel under the
    keys ``(key, 0)``, ``(key, 1)``, ... ``failed``: this rank failed before the
    tensor could be encoded; it takes part with filler, every other rank's future raises
    :class:`~hhook.errors.RankFailedError` and this rank's raises ``failed``.
    """
    check_tensor(tensor)
    ctx = context_of(caller)
    ctx.check_deferred()
    if tensor.numel() == 0:
        return completed(tensor)
    if ctx.world_size == 1 or tensor.is_sparse or tensor.dtype not in SUPPORTED_DTYPES:
        return dense_allreduce(ctx, tensor)
    if tensor.device.type not in ctx.runtime.verified:
        handshake(ctx, tensor.device)
    if layout is None:
        layout = (tuple(tensor.shape), str(tensor.dtype))
    policy = ctx.policy()
    target = tensor if tensor.is_contiguous() else tensor.contiguous()
    pieces = ctx.chunks(target.numel(), target.device)
    if len(pieces) == 1:
        fut = _reduce(ctx, policy, target, key, layout, failed)
    else:
        flat = target.view(-1)
        futures = [
            _reduce(ctx, policy, flat[start:stop], None if key is None else (key, i), layout, failed)
            for i, (start, stop) in enumerate(pieces)
        ]
        fut = _all(futures, target, [start for start, _ in pieces])
    if target is tensor:
        return fut
    return then(fut, tensor.copy_, tensor)


def _reduce(ctx: CallContext, policy, target: torch.Tensor, key, layout, failed=None) -> torch.futures.Future:
    """One tensor (or piece) through the policy: one SUM round when its scales are
    predicted, else a MAX round whose continuation launches the SUM on the second
    communicator, in hook order. Nothing waits; the returned future completes in the
    SUM's continuation."""
    runtime, group = ctx.runtime, ctx.group
    plan = policy.begin(target, key, ctx.rank, ctx.world_size, ctx.next_call(), ctx.config_id(), layout, failed)
    defer = runtime.defer if target.is_cuda or runtime.defer_on_cpu else None
    what = f"the THC allreduce of {target.numel()} elements (key {key!r})"

    def decode(sums: torch.Tensor) -> torch.Tensor:
        _, nonfinite = policy.decode(sums, plan, target, defer)
        if nonfinite is True:
            ctx.counters.add("nonfinite_calls", 0, 0)
        return target

    if plan.max_vector is None:  # predicted scales: one round
        words = policy.finish(plan)
        ctx.counters.add("compressed_calls", 4 * target.numel(), words.nbytes)
        fut = dist.all_reduce(words, dist.ReduceOp.SUM, group=group, async_op=True).get_future()
        return then(fut, lambda value: decode(value[0]), target, f"the SUM of the codes of {what}", group)

    ticket = runtime.sequencer.ticket()
    second = runtime.second_group(target.device)
    length = policy.message_numel(plan.codec, target.numel(), predicted=False)
    ctx.counters.add("compressed_calls", 4 * target.numel(), plan.max_vector.nbytes + length * plan.codec.layout.word_bits // 8)
    result = new_future(target)

    def finish_and_sum(f: torch.futures.Future) -> None:
        try:
            agreed = f.value()[0]
        except BaseException as exc:  # the MAX itself failed: no rank can go on with this ticket
            runtime.sequencer.launch(ticket, None)
            result.set_exception(explain(exc, f"the MAX of the block scales of {what}", group))
            return
        try:
            words = policy.finish(plan, agreed)  # by contract never raises: a local failure sends filler
        except BaseException as exc:  # noqa: BLE001 - a bug: the waiter must learn of it, not hang
            runtime.sequencer.launch(ticket, None)
            result.set_exception(exc)
            return

        def launch() -> None:
            try:
                attach(second.all_reduce(words).get_future(),
                       lambda g: settle(result, lambda: decode(value_of(g, f"the SUM of the codes of {what}", second)[0])),
                       group)
            except BaseException as exc:
                result.set_exception(exc)

        runtime.sequencer.launch(ticket, launch, stream_of(words))

    try:
        fut = dist.all_reduce(plan.max_vector, dist.ReduceOp.MAX, group=group, async_op=True)
    except BaseException:
        runtime.sequencer.launch(ticket, None)  # later tickets must not wait for this one
        raise
    attach(fut.get_future(), finish_and_sum, group)
    return result

