r"""Two-level THC: dense inside each node, homomorphic between nodes (DESIGN.md sec. 8).

For a tensor of ``d`` coordinates on ``N`` nodes of ``k`` ranks (:class:`~hhook.schedule.topology.Topology`):

1. **Inside the node, dense.** The flat tensor, padded to ``k s`` (``s = ceil(d / k)``),
   goes through one ``all_to_all`` on the node's group: local rank ``j`` receives shard
   ``j`` of every rank of its node, in the tensor's own dtype, and averages them in
   float32 (in a fixed order; where every rank of the node holds the same value, that
   value itself, so identical inputs stay exact). This is a reduce-scatter with the
   same traffic as a ring's, ``(k - 1) / k`` of the tensor per rank.
2. **Between nodes, THC.** Local rank ``j`` averages its node-mean shard with local rank
   ``j`` of every other node through the flat schedule (:mod:`hhook.schedule.flat`) on the
   context's ``inter``, whose group is this rank's inter-node group: lanes are sized
   for ``N`` nodes, not ``N k`` ranks, each rank encodes ``1 / k`` of the tensor, and the
   ``k`` rings of a node run at once.
3. **Inside the node, dense.** An ``all_gather`` on the node's second group (its own
   communicator) writes every shard of the global mean into the tensor, in its dtype.

Nothing waits. The ``all_to_all`` is launched by the caller, in call order. Stage 2 is
launched from its continuation and stage 3 from stage 2's: continuations run in
completion order, which differs between ranks, so both go through a
:class:`~hhook.schedule.futures.Sequencer` per group (tickets drawn in call order, launches in
ticket order): every rank pairs the same collectives. The all-gather has its own group
because new tensors keep entering the first one from the caller's thread.

Guarantees (as the flat path's): the result is the mean over every rank of the parent
group, the same bits on every rank; inf or NaN on any rank makes the whole tensor NaN on
every rank (no exception); identical tensors on every rank come back exactly; a
configuration mismatch between nodes raises on every rank through the future (and the
node's other ranks still complete their all-gather, so nobody hangs); a rank that fails
(its node mean, its encoding, or its node's own collective, where a rank of the node died
or stalled) raises its own exception, and still takes its turn between nodes with filler
marked failed: its ring peers raise :class:`~hhook.errors.RankFailedError` from the flat
schedule at once, rather than waiting for its process to end, and every rank of their
nodes does too (each shard travels in the all-gather with its owner's status). A key
whose tensor changes shape or dtype starts its shard's state afresh, as the flat path's. float64 and sparse
tensors take one exact allreduce over the parent group.

Bytes: ``inter``'s counters count what crosses nodes (the shard's codes and scales,
:meth:`THCState.stats`); the context's ``intra_counters`` count, per tensor, one
``compressed_calls``, the tensor's float32 size as ``dense_bytes`` and the bytes handed
to the two intra-node collectives as ``wire_bytes``. Each continuation is attached to
the group whose collective it follows (:func:`hhook.schedule.futures.attach`), so
ending one of the sub-groups waits for its own work only.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from ..errors import PeerTimeoutError, RankFailedError
from ..scales import message
from .context import CallContext, check_deferred
from ..codec.layout import SUPPORTED_DTYPES
from .dense import count, plain_allreduce, uncompressed
from .flat import flat_allreduce_async, second_group
from .futures import attach, completed, new_future, stream_of, value_of
from .groups import explain, failure_cause, timeout_of
from .membership import all_gather_flat
from .handshake import agree


def shard_numel(numel: int, ranks_per_node: int) -> int:
    """Coordinates of the shard each local rank owns (the tensor is padded to ``k`` of them)."""
    return -(-numel // ranks_per_node)


def ensure_ring(inter: CallContext, device: torch.device, sequencer) -> None:
    """The ring between nodes made ready for ``device``, once, on the caller's thread (a
    continuation must not block): the options handshake over the ring (every rank of
    the parent group agreed already; a width of ``bits="auto"`` agrees on its own), then
    the second communicator for ``device``. Ordered after every collective that earlier
    calls launch on the ring: it takes a ticket of the ring's ``sequencer`` and waits
    (here, not in a continuation) until the earlier tickets have launched, so every rank
    issues it at the same place among the ring's collectives."""
    if inter.runtime.agreed and device.type in inter.runtime.second:
        return
    turn = threading.Event()
    sequencer.launch(sequencer.ticket(), turn.set)
    # Earlier tickets launch from continuations, which never wait for this thread; they
    # run once collectives complete or fail, so within the group's timeout.
    timeout = timeout_of(inter.group).total_seconds()
    if not turn.wait(timeout + 5.0):
        raise PeerTimeoutError(
            f"hhook: the two-level handshake waited {timeout + 5:g} s for the earlier collectives between nodes "
            "(the group's timeout and 5 s): a peer stalled")
    if not inter.runtime.agreed:
        agree(inter.group, inter.fields, inter.counters, "hhook's options handshake between nodes")
        inter.runtime.agreed = True
    second_group(inter, device)


def _dense_world(ctx: CallContext, tensor: torch.Tensor) -> torch.futures.Future:
    """float64 and sparse tensors: one exact allreduce over the parent group (its bytes
    cross nodes: counted as the inter state's wire bytes, the call in ``intra_counters``)."""
    count(ctx.intra_counters, tensor, wire_to=ctx.inter.counters)
    return plain_allreduce(tensor, ctx.topo.group, ctx.topo.world_size)


def _node_mean(rows: torch.Tensor, k: int, in_place: bool = True) -> torch.Tensor:
    """Mean of the ``k`` rows in float32; a value every row holds comes back exactly.

    For ``k`` a power of two, a pairwise tree of sums (``2a + 2a = 4a``: exact for equal
    values) times ``1 / k``, in place on the rows when they are float32 already and
    ``in_place`` (shared rows are not): ``k`` passes. Otherwise the sum, and the first
    row where all rows agree.
    """
    if rows.dtype != torch.float32:
        rows = rows.to(torch.float32)
    elif not in_place and k > 1 and k & (k - 1) == 0:
        half = k // 2
        rows = rows[:half] + rows[half:]  # the tree's first level, out of place
        k_left = half
        while k_left > 1:
            k_left //= 2
            rows[:k_left].add_(rows[k_left:2 * k_left])
        return rows[0].mul_(1.0 / k)
    if k & (k - 1) == 0:
        width = k
        while width > 1:
            width //= 2
            rows[:width].add_(rows[width:2 * width])
        return rows[0].mul_(1.0 / k)
    total = rows[0].clone()
    same = torch.ones_like(total, dtype=torch.bool)
    for i in range(1, k):
        total.add_(rows[i])
        same &= rows[i] == rows[0]
    return torch.where(same, rows[0], total.div_(k))


def _nonfinite(x: torch.Tensor) -> torch.Tensor:
    """Whether ``x`` holds inf or NaN, as a 0-d bool tensor: min and max propagate NaN and
    show an inf. One pass: 0.5 ms for 2.6M floats here, against 8 ms for
    ``isfinite(x).all()`` (which builds a bool tensor)."""
    low, high = torch.aminmax(x)
    return ~(torch.isfinite(low) & torch.isfinite(high))


def _all_gather(out: torch.Tensor, piece: torch.Tensor, group, k: int):
    """All-gather of ``piece`` into ``out`` (async Work). Gloo's all_gather moved 8 MB
    4-5x slower than its all_to_all moved 16 MB on one host (measured here), so on
    CPUs the shard is sent to every peer through all_to_all; NCCL gathers itself."""
    if piece.is_cuda:
        return all_gather_flat(out, piece, group=group, async_op=True)
    return dist.all_to_all_single(out, piece.repeat(k), group=group, async_op=True)


def two_level_allreduce_async(ctx: CallContext, tensor: torch.Tensor, key=None, layout=None,
                              changed: message.CallChanged | None = None) -> torch.futures.Future:
    r"""Start averaging ``tensor`` in place over ``ctx``'s group, two-level (``ctx.topo``
    found several nodes; ``ctx.inter`` is the context of this rank's ring between nodes,
    whose codec, scales, error feedback and counters apply to this rank's shard).

    Returns at once a future holding ``tensor`` once it holds the mean over every rank;
    ``key`` names the tensor across steps as for :func:`hhook.thc_allreduce_async` (the
    shard travels under the same key, and ``layout`` says what the key holds, as there).
    Call it in the same order on every rank, and wait for a key's future before reducing
    that key again. The first call readies the ring on the caller's thread
    (:func:`ensure_ring`). ``changed`` (a :class:`~hhook.scales.message.CallChanged`):
    this rank's shard goes between nodes as filler marked with it
    (:mod:`hhook.schedule.load_check`: a rank that loaded a checkpoint since the
    handshake); its ``count`` is then set to the number of ranks of the group that sent
    such filler, and the future raises, as every rank's does where one did.
    """
    inter = ctx.inter
    if any(runtime.pending for runtime, _ in ctx.deferred):
        check_deferred(ctx.deferred)
    if tensor.numel() == 0:
        return completed(tensor)
    if tensor.is_sparse or tensor.dtype not in SUPPORTED_DTYPES:
        uncompressed(tensor)
        return _dense_world(ctx, tensor)
    ensure_ring(inter, tensor.device, ctx.topo.sequencer("inter"))
    if layout is None:  # what the key holds is the whole tensor, not the shard (whose length may not change)
        layout = (tuple(tensor.shape), str(tensor.dtype))
    call = _TwoLevelCall(ctx, tensor, key, layout, changed)
    call.scatter()
    return call.result


class _TwoLevelCall:
    """One tensor's two-level reduction, in its stages: :meth:`scatter` inside the node
    (stage 1), :meth:`reduce_between_nodes` (stage 2, THC on this rank's shard),
    :meth:`gather` inside the node (stage 3) and :meth:`finish`. Each stage is launched
    from the previous one's continuation; a failure anywhere raises on every rank of the
    node (``failure``: this rank's first exception, set on the result once the gather is
    done; ``loaded``: how many ranks of this rank's ring sent filler marked CHANGED,
    :meth:`finish` sums it over the node's shards)."""

    def __init__(self, ctx: CallContext, tensor: torch.Tensor, key, layout, changed=None):
        topo = ctx.topo
        self.tensor, self.topo, self.inter, self.key, self.intra_counters, self.layout = \
            tensor, topo, ctx.inter, key, ctx.intra_counters, layout
        self.k, self.d = topo.ranks_per_node, tensor.numel()
        self.s = shard_numel(self.d, self.k)
        self.dtype, self.j = tensor.dtype, topo.local_rank
        self.flat = tensor.view(-1) if tensor.is_contiguous() else None
        # Shared memory where the node has it and the region fits its budget, else collectives
        # (every rank of the node asks for the same regions in the same order: the same answer).
        self.region = topo.node_memory.region(key, self.k * self.s, self.dtype) \
            if topo.node_memory is not None and tensor.device.type == "cpu" else None
        self.shm = self.region is not None
        self.inter_seq, self.gather_seq = topo.sequencer("inter"), topo.sequencer("gather")
        self.result = new_future(tensor)
        self.failure: list = []
        self.changed, self.loaded = changed, 0
        self.new_file = None

    def _buffers(self):
        """Stage 1's buffers. Shared memory: this rank's row of the node's [k, k s] region
        (the tensor copied in once), the node's result row. Collectives: the tensor itself
        (when it needs no padding) and a receive buffer. Returns (send, recv)."""
        tensor, k, s, d = self.tensor, self.k, self.s, self.d
        if self.shm:
            self.rows, self.shared_result, self.new_file = self.region
            self.rows[self.j, :d].copy_(self.flat if self.flat is not None else tensor.reshape(-1))
            self.rows[self.j, d:].zero_()  # the padding: a reused region holds the previous call's tail
            return None, None
        if self.flat is not None and d == k * s:  # the tensor itself can be sent
            send = self.flat
        else:
            send = torch.zeros(k * s, dtype=self.dtype, device=tensor.device)
            send[:d].copy_(tensor.reshape(-1))
        return send, torch.empty(k * s, dtype=self.dtype, device=tensor.device)

    def _mapped(self) -> None:
        if self.shm and self.new_file is not None:
            self.topo.node_memory.done(self.new_file)  # the memory lives on (or nobody will map it now)

    def _skip_turns(self) -> None:
        self.inter_seq.launch(self.inter_ticket, None)  # later tensors must not wait for this one's turn
        self.gather_seq.launch(self.gather_ticket, None)

    def scatter(self) -> None:
        """Stage 1: each rank of the node receives every rank's copy of its shard (or, in
        shared memory, a barrier once every rank has written its row)."""
        send, self.recv = self._buffers()
        self.intra_counters.add("compressed_calls", 4 * self.d, (self.k * self.s + self.s) * self.tensor.element_size())
        self.inter_ticket, self.gather_ticket = self.inter_seq.ticket(), self.gather_seq.ticket()
        try:
            if self.shm:  # a barrier: every rank of the node has written its row
                work = dist.all_reduce(torch.zeros(1, dtype=torch.float32), group=self.topo.intra_group, async_op=True)
            else:
                work = dist.all_to_all_single(self.recv, send, group=self.topo.intra_group, async_op=True)
        except BaseException:
            self._mapped()
            self._skip_turns()
            raise
        attach(work.get_future(), self.after_scatter, self.topo.intra_group)

    def after_scatter(self, f: torch.futures.Future) -> None:
        """The node's mean of this rank's shard, then stage 2 in its turn."""
        k, s, j = self.k, self.s, self.j
        try:
            f.value()
        except BaseException as exc:  # noqa: BLE001 - the node's collective failed on every member
            self._mapped()  # not every rank may have mapped it: nobody will now
            self._tell_ring(explain(
                exc, f"the node's reduce-scatter of a two-level tensor of {self.d} elements", self.topo.intra_group))
            return
        self._mapped()  # every rank of the node has mapped it
        try:
            if self.shm:
                shard = _node_mean(self.rows[:, j * s:(j + 1) * s], k, in_place=False)
            else:
                shard = _node_mean(self.recv.view(k, s), k)
        except BaseException as exc:  # noqa: BLE001 - a local failure: raised on every rank (filler between nodes)
            self.failure.append(exc)
            shard = torch.zeros(s, dtype=torch.float32, device=self.tensor.device)
        self.inter_seq.launch(self.inter_ticket, lambda: self.reduce_between_nodes(shard), stream_of(shard))

    def _tell_ring(self, err: BaseException) -> None:
        """The node's own collective failed (a rank of it lost or stalled): no gather, but
        this rank still takes its turn between nodes, with filler marked failed, so its
        ring peers raise :class:`~hhook.errors.RankFailedError` at once (and their nodes
        through the gather) instead of waiting for this process to end; then ``err``."""
        self.failure.append(err)
        self.gather_seq.launch(self.gather_ticket, None)
        shard = torch.zeros(self.s, dtype=torch.float32, device=self.tensor.device)

        def launch() -> None:
            try:
                attach(flat_allreduce_async(self.inter, shard, self.key, self.layout, err), lambda g: None,
                       self.inter.group)
            except BaseException:  # noqa: BLE001 - the ring then learns of it from this rank's end; err is raised
                pass
            self.result.set_exception(err)

        self.inter_seq.launch(self.inter_ticket, launch, stream_of(shard))

    def reduce_between_nodes(self, shard: torch.Tensor) -> None:
        """Stage 2: THC of this rank's shard over the nodes' ring, then the gather."""
        try:
            failed = self.failure[0] if self.failure else self.changed
            fut = flat_allreduce_async(self.inter, shard, self.key, self.layout, failed)
        except BaseException as exc:  # noqa: BLE001
            self.failure.append(exc)
            shard.fill_(float("nan"))
            self.gather(shard)
            return
        attach(fut, lambda g: self.after_inter(g, shard), self.inter.group)

    def after_inter(self, g: torch.futures.Future, shard: torch.Tensor) -> None:
        try:
            g.value()
        except message.CallChanged as exc:  # ranks of the ring sent marked filler: the gather tells the node
            self.loaded = exc.count
            shard.fill_(float("nan"))
        except BaseException as exc:  # noqa: BLE001 - e.g. a mismatch between nodes: raised after the gather
            self.failure.append(exc)
            shard.fill_(float("nan"))
        self.gather(shard)

    def gather(self, mean_shard: torch.Tensor) -> None:
        """Stage 3, in ticket order: every local rank launches it whatever happened before,
        with its status word (:func:`hhook.scales.message.status_word`: whether it failed)
        and its ring's count of marked filler (``loaded``), so that a failure anywhere in
        the node raises on every rank of it, and every rank learns how many ranks of the
        group sent marked filler (the sum over the node's rings)."""
        k, s, j, dtype, device = self.k, self.s, self.j, self.dtype, self.tensor.device
        piece = mean_shard.to(dtype)
        bad = _nonfinite(piece)  # THC writes NaN over whole pieces; make sure of whole shards
        if piece.is_cuda:
            piece.masked_fill_(bad, float("nan"))
        elif bad:
            piece.fill_(float("nan"))
        failed = message.status_word(False, bool(self.failure))
        if self.shm:
            self.shared_result[j * s:(j + 1) * s].copy_(piece)
            out, send = self.shared_result, torch.tensor([failed, self.loaded], dtype=torch.int64)
        else:  # (a count up to 256 is exact in every float dtype of a shard)
            send = torch.empty(s + 2, dtype=dtype, device=device)
            send[:s].copy_(piece)
            send[s], send[s + 1] = failed, self.loaded
            out = torch.empty(k * (s + 2), dtype=dtype, device=device)

        def launch() -> None:
            try:
                if self.shm:  # a barrier (every rank of the node has written its shard) and the statuses
                    work = dist.all_reduce(send, group=self.topo.gather_group, async_op=True)
                    attach(work.get_future(), lambda h: self.finish(h, out, send), self.topo.gather_group)
                else:
                    work = _all_gather(out, send, self.topo.gather_group, k)
                    attach(work.get_future(), lambda h: self.finish(h, out, None), self.topo.gather_group)
            except BaseException as exc:  # noqa: BLE001
                self.failure.append(exc)
                self.finish(None, out, None)

        self.gather_seq.launch(self.gather_ticket, launch, stream_of(send))

    def finish(self, h: torch.futures.Future | None, out: torch.Tensor, status: torch.Tensor | None) -> None:
        """``out``: the gathered shards (``k s``, or ``k`` rows of ``s + 2`` whose last
        entries are the shard owner's status word and its ring's count of marked filler);
        ``status``: the node's summed status word and count (shared memory). Where it says
        a rank of the node failed, every rank of it raises (that rank its own exception);
        where ranks sent marked filler, every rank raises
        :class:`~hhook.scales.message.CallChanged` with their number (read on the host,
        on GPUs too where this rank sent one: ``changed.count``)."""
        tensor, s, d = self.tensor, self.s, self.d
        try:
            if h is not None:
                value_of(h, f"the node's all-gather of a two-level tensor of {d} elements", self.topo.gather_group)
            if self.failure:
                raise self.failure[0]
            if status is None:  # statuses travelled with the shards
                rows = out.view(self.k, s + 2)
                status, out = rows[:, s:].to(torch.float64).sum(dim=0), rows[:, :s]
            failed_peer, loaded = message.any_failed(status[0]), status[1]
            if self.changed is not None or not out.is_cuda:
                self._tell_loaded(int(loaded))
            # A non-finite shard travels as all NaN (see gather), so its first element
            # tells: k reads, the same on every rank of every node.
            bad = out[:, 0].isnan().any() if out.dim() == 2 else out[::s].isnan().any()
            if out.is_cuda:  # no host read: NaN now, the error at the next check (as flat's)
                out.masked_fill_(bad | failed_peer, float("nan"))
                self.inter.runtime.defer(failed_peer, bad, f"two-level tensor of {d} elements")
            elif failed_peer:
                raise RankFailedError(
                    "hhook: another rank of this node failed while reducing this tensor (two-level THC); "
                    "that rank raises its own exception" + failure_cause(self.topo.intra_group)
                )
            elif bad:
                tensor.fill_(float("nan"))
                self.intra_counters.add("nonfinite_calls")
                self.result.set_result(tensor)
                return
            self._write_back(out)
            self.result.set_result(tensor)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            self.result.set_exception(exc)

    def _tell_loaded(self, loaded: int) -> None:
        """Raise where ``loaded`` ranks of the group sent marked filler (this rank's
        ``changed`` learns their number)."""
        if self.changed is not None:
            self.changed.count = loaded
        if loaded:
            raise message.CallChanged(f"hhook: {loaded} rank(s) exchanged filler of what the group verified (a "
                                      "checkpoint loaded since the options handshake)", loaded)

    def _write_back(self, out: torch.Tensor) -> None:
        """The gathered mean into the tensor: row by row (one pass), or the node's shared
        result row."""
        tensor, k, s, d = self.tensor, self.k, self.s, self.d
        if out.dim() != 2:
            tensor.copy_(out[:d].view(tensor.shape))
            return
        flat_out = self.flat if self.flat is not None else torch.empty(d, dtype=self.dtype, device=out.device)
        for i in range(k):
            stop = min((i + 1) * s, d)
            if stop > i * s:
                flat_out[i * s:stop].copy_(out[i, :stop - i * s])
        if self.flat is None:
            tensor.copy_(flat_out.view(tensor.shape))
