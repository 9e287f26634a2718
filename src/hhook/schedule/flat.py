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
  :class:`~hhook.schedule.futures.Sequencer`: every rank pairs the same collectives.
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

from ..codec import warm_up
from ..errors import RankFailedError
from ..codec.layout import SUPPORTED_DTYPES
from ..scales import message
from ..scales.policy import GATHERED
from . import link, membership
from .context import CallContext, check_deferred
from .dense import dense_allreduce
from .futures import attach, completed, new_future, settle, stream_of, then, value_of
from .groups import SecondGroup, explain, told_failure_cause


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


def pieces(numel: int, device: torch.device, piece_limit: tuple[int, int], block: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]``: the pieces of a flat tensor of ``numel`` on ``device`` that
    travel separately: equal pieces of whole codec blocks of ``block`` elements (the last
    one takes the remainder), at most ``piece_limit`` elements each (a
    :attr:`~hhook.schedule.context.CallContext.piece_limit`: on the CPU, elsewhere) but at
    least a block; one piece when the tensor is smaller or splitting is off."""
    limit = piece_limit[0 if device.type == "cpu" else 1]
    if limit <= 0 or numel <= limit:
        return [(0, numel)]
    blocks = -(-numel // block)
    count = -(-blocks // max(1, limit // block))
    step = -(-blocks // count) * block
    return [(start, min(start + step, numel)) for start in range(0, numel, step)]


def pieces_of(ctx: CallContext, tensor: torch.Tensor) -> list[tuple[int, int]]:
    """:func:`pieces` of ``tensor`` in an exchange over ``ctx``, under its piece limit as
    its group's link says now (:func:`hhook.schedule.link.limit`): the one split of the
    exchange and of the call numbers drawn for it (:mod:`hhook.schedule.call_check`)."""
    return pieces(tensor.numel(), tensor.device, link.limit(ctx), ctx.block_size)


def second_group(ctx: CallContext, device: torch.device) -> SecondGroup:
    """The second communicator of ``ctx``'s group for ``device``'s type, built at its first
    use (blocking, on every rank at the same call: a tensor's first agreed round on that
    device), with the fused backend for ``device`` (its first compile belongs here, not in
    a later stage)."""
    runtime = ctx.runtime
    second = runtime.second.get(device.type)
    if second is None:
        warm_up(device)
        second = runtime.second[device.type] = SecondGroup(ctx.group, device.type)
        ctx.counters.add(None, 0, second.handshake_bytes)
    return second


def flat_allreduce_async(ctx: CallContext, tensor: torch.Tensor, key=None, layout=None,
                         failed: BaseException | None = None, lane=None) -> torch.futures.Future:
    r""":func:`hhook.thc_allreduce_async` over ``ctx.group``, every rank a peer (its contract,
    documented there). Pieces of a tensor above ``ctx.piece_limit`` travel under the keys
    ``(key, 0)``, ``(key, 1)``, ... ``failed``: this rank failed before the tensor could be
    encoded; it takes part with filler, every other rank's future raises
    :class:`~hhook.errors.RankFailedError` and this rank's raises ``failed`` (a
    :class:`~hhook.scales.message.CallChanged`: every rank raises one, counting the ranks
    that sent it). ``lane``: ``(communicator, sequencer, call numbers)``: every collective
    of the call goes on that second communicator in that sequencer's order, its pieces
    encoded under those numbers, drawn at the call (a checked call's exchange, launched
    from a continuation while the group's sequencer holds: :mod:`hhook.schedule.call_check`);
    None: the first collective on ``ctx.group`` from this thread.
    """
    if any(runtime.pending for runtime, _ in ctx.deferred):
        check_deferred(ctx.deferred)
    if tensor.numel() == 0:
        return completed(tensor)
    if ctx.world_size == 1 or tensor.is_sparse or tensor.dtype not in SUPPORTED_DTYPES:
        return dense_allreduce(ctx, tensor)  # exact (float64, sparse: one log line says so)
    if layout is None:
        layout = (tuple(tensor.shape), str(tensor.dtype))
    target = tensor if tensor.is_contiguous() else tensor.contiguous()
    parts = pieces_of(ctx, target)
    if len(parts) == 1:
        fut = _reduce(ctx, target, key, layout, failed, lane)
    else:
        flat = target.view(-1)
        futures = [_reduce(ctx, flat[start:stop], None if key is None else (key, i), layout, failed, lane)
                   for i, (start, stop) in enumerate(parts)]
        fut = _all(futures, target, [start for start, _ in parts])
    if target is tensor:
        return fut
    return then(fut, tensor.copy_, tensor)


def _on(group):
    """``all_reduce(tensor, op)`` on ``group`` (:func:`hhook.schedule.membership.of`) from this thread: its future."""
    members = membership.of(group)
    return lambda tensor, op: members.all_reduce(tensor, op).get_future()


def _gather_on(group):
    """``all_gather(output, input)`` on ``group`` from this thread: its future."""
    members = membership.of(group)
    return lambda output, input: members.all_gather(output, input).get_future()


def _in_turn(comm, sequencer, gather: bool = False):
    """``all_reduce(tensor, op)`` (``gather``: ``all_gather(output, input)``) on ``comm``
    (a second communicator) in a ticket's turn of ``sequencer``, drawn now: a future of it
    (a lane's collectives share one order)."""

    def launch(tensor: torch.Tensor, op) -> torch.futures.Future:
        ticket, fut = sequencer.ticket(), new_future(tensor)
        collective = comm.all_gather if gather else comm.all_reduce

        def run() -> None:
            try:
                attach(collective(tensor, op).get_future(), lambda g: settle(fut, g.value), comm.parent)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                fut.set_exception(exc)

        sequencer.launch(ticket, run, stream_of(tensor))
        return fut

    return launch


def _marked(words: torch.Tensor, changed) -> torch.Tensor:
    """A changed call's filler says so in word 0 (:data:`hhook.scales.message.CHANGED`)."""
    if changed is not None:
        words[0] += message.CHANGED
    return words


def _reduce(ctx: CallContext, target: torch.Tensor, key, layout, failed=None, lane=None) -> torch.futures.Future:
    """One tensor (or piece) through the policy: one SUM round when its scales are
    predicted, else a MAX round whose continuation launches the SUM on the second
    communicator, in hook order. Nothing waits; the returned future completes in the
    SUM's continuation."""
    runtime, group, policy = ctx.runtime, ctx.group, ctx.policy
    first, sequencer = (_in_turn(*lane[:2]), lane[1]) if lane else (_on(group), runtime.sequencer)
    gather = _in_turn(*lane[:2], gather=True) if lane else _gather_on(group)
    changed = failed if isinstance(failed, message.CallChanged) else None
    call = next(lane[2]) if lane else ctx.counters.next_call()  # drawn in call order, the same on every rank
    plan = policy.begin(target, key, ctx.rank, ctx.world_size, call, ctx.config, layout, failed)
    defer = runtime.defer if target.is_cuda or runtime.defer_on_cpu else None
    what = f"the THC allreduce of {target.numel()} elements (key {key!r})"

    def decode(sums: torch.Tensor) -> torch.Tensor:
        if changed is not None:  # filler of the verified size: how many ranks sent one
            count = sums.view(ctx.world_size, -1)[:, 0].sum() if plan.kind == GATHERED else sums[0]
            changed.count = int(count) // message.CHANGED
        try:
            _, nonfinite = policy.decode(sums, plan, target, defer)
        except RankFailedError as exc:  # a peer that lost or waited for a rank of its node: the reports say which
            raise RankFailedError(f"{exc}{told_failure_cause(group)}") from None
        if nonfinite is True:
            ctx.counters.add("nonfinite_calls", 0, 0)
        return target

    if plan.kind == GATHERED:  # each rank's own scales: one all-gather of every message
        words = _marked(policy.finish(plan), changed)
        gathered = words.new_empty(ctx.world_size * words.numel())
        # An all-gather counts its output, as the profiler and FSDP's all-gather count it
        # (n messages; a ring sends n - 1 of them, an allreduce's 2(n - 1)/n of its input:
        # at 2 ranks this count is 1.5x agreed scales' while the wire carries 0.75x).
        ctx.counters.add("compressed_calls", 4 * target.numel(), gathered.nbytes)
        fut = gather(gathered, words)
        return then(fut, lambda value: decode(gathered), target, f"the all-gather of the codes of {what}", group)

    if plan.max_vector is None:  # predicted scales: one round
        words = _marked(policy.finish(plan), changed)
        ctx.counters.add("compressed_calls", 4 * target.numel(), words.nbytes)
        fut = first(words, dist.ReduceOp.SUM)
        return then(fut, lambda value: decode(value[0]), target, f"the SUM of the codes of {what}", group)

    second = lane[0] if lane else second_group(ctx, target.device)
    length = policy.message_numel(plan.codec, target.numel(), predicted=False)
    ctx.counters.add("compressed_calls", 4 * target.numel(), plan.max_vector.nbytes + length * plan.codec.layout.word_bits // 8)
    result = new_future(target)

    def finish_and_sum(f: torch.futures.Future) -> None:
        try:
            agreed = f.value()[0]
        except BaseException as exc:  # the MAX itself failed: no rank can go on with this ticket
            sequencer.launch(ticket, None)
            result.set_exception(explain(exc, f"the MAX of the block scales of {what}", group))
            return
        try:
            words = _marked(policy.finish(plan, agreed), changed)  # by contract never raises: filler
        except BaseException as exc:  # noqa: BLE001 - a bug: the waiter must learn of it, not hang
            sequencer.launch(ticket, None)
            result.set_exception(exc)
            return

        def launch() -> None:
            try:
                attach(second.all_reduce(words).get_future(),
                       lambda g: settle(result, lambda: decode(value_of(g, f"the SUM of the codes of {what}", second)[0])),
                       group)
            except BaseException as exc:
                result.set_exception(exc)

        sequencer.launch(ticket, launch, stream_of(words))

    fut = first(plan.max_vector, dist.ReduceOp.MAX)
    ticket = sequencer.ticket()  # after the MAX: in a lane, the MAX's own ticket comes first
    attach(fut, finish_and_sum, group)
    return result

