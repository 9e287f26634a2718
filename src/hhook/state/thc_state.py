r"""THCState: what users construct, hand to the DDP hook or :func:`hhook.thc_allreduce`,
and checkpoint: the options (:mod:`~hhook.state.options`), the per-key state
(:mod:`~hhook.state.keys`), the byte counters (:mod:`hhook.stats`), the checkpoint format
and node layout (:mod:`~hhook.state.checkpoint`) and the reports
(:mod:`~hhook.state.report`). A schedule never sees it: it gets the narrow
:class:`~hhook.schedule.context.CallContext` that :meth:`THCState.context` builds, and the
:class:`~hhook.schedule.context.GroupRuntime` the state keeps for it."""

from __future__ import annotations

import torch.distributed as dist

from ..schedule import handshake, load_check, membership
from ..schedule.context import CallContext, GroupRuntime
from ..schedule.flat import flat_allreduce_async
from ..schedule.two_level import two_level_allreduce_async
from ..stats import Counters
from . import report
from .checkpoint import Checkpointed
from .keys import KeyStore
from .options import Options


def _check_group(process_group) -> None:
    if process_group is not None and not isinstance(process_group, (dist.ProcessGroup, membership.Membership)):
        raise TypeError("process_group must be a torch.distributed ProcessGroup, None, or a "
                        f"hhook.schedule.membership.Membership, got {process_group!r}")


class THCState(Checkpointed, report.Reporting):
    r"""Options, error-feedback residuals and byte counters of THC compression.

    Args:
        process_group: the group to reduce over; ``None`` means the default group; a
            :class:`~hhook.schedule.membership.Membership` is one ``torch.distributed``
            does not know (:mod:`hhook.torchft`'s quorums; ``topology="flat"`` only).
        bits: bits per coordinate before headroom; ``2**bits`` quantization levels (1..8).
            ``"auto"``: the fewest bits whose predicted error of the mean at this world
            size (or node count, two-level) is no worse than 4 bits at 4 ranks rounding
            independently (:func:`hhook.codec.error_model.auto_bits`). In the DDP hook
            ``"auto"`` (:func:`hhook.register`'s default) also measures narrower widths,
            bf16 and fp32 and keeps the fastest (:mod:`hhook.decision`).
        block_size: rotation and scale block, a power of two (at most 65536).
        seed: shared seed of the rotation's random signs; must match on every rank.
        error_feedback: carry each rank's rounding error into its next call (one float32
            copy of every compressed tensor); needs ``start_iter >= 2``.
        start_iter: the DDP hook runs a plain allreduce for the iterations before this
            one (DDP rebuilds its buckets after the first).
        scales: ``"agreed"``: a MAX allreduce of this step's block maxima, then the SUM;
            never clips. ``"predicted"``: one SUM once a key has history, with scales from
            the previous step's maxima (:mod:`hhook.scales`); clips blocks that grew.
            ``"gathered"``: one all-gather of every rank's codes on its own maxima; never
            clips; bytes grow with the ranks. ``"auto"`` (default): gathered for CPU
            tensors over a flat group of 2 to 4 ranks, agreed elsewhere
            (:meth:`hhook.state.Options.scale_mode`).
        chunk_mb: split a tensor above this many MB of float32 into pieces, each reduced
            on its own, so one is on the wire while the next is encoded. ``"auto"``
            (default): 12 MB for CPU tensors, whole tensors on GPUs and, where the group's
            round takes 5 ms or more, for agreed scales (:mod:`hhook.schedule.link`);
            ``0``: never split.
        topology: ``"flat"`` (default): every rank a peer. ``"auto"`` or a number of ranks
            per node: two-level THC (:mod:`hhook.schedule.two_level`) where the group spans
            several equal nodes, else flat with one log line; found once, blocking, on every
            rank (:meth:`node_layout`).
        rounding: ``"correlated"`` (default): the ranks' rounding thresholds for each
            coordinate are spread over the unit interval (:class:`hhook.codec.rng.Stream`):
            unbiased, and the errors largely cancel in the sum (docs/codec.md).
            ``"independent"``: each rank rounds on its own.

    Options are part of the handshake's fingerprint: ranks that disagree raise
    :class:`~hhook.errors.ConfigMismatchError`.

    Example::
        >>> state = THCState(process_group=None, bits=4)
        >>> ddp_model.register_comm_hook(state, thc_hook)
    """

    # Pickles name this class hhook.state.THCState, as every hhook wrote them.
    __module__ = "hhook.state"

    # options: immutable, replaced by load_state_dict; keys: residuals and predicted scales (KeyStore); runtime:
    # the schedule's GroupRuntime of process_group, runtimes: of other groups (FSDP's shard groups); contexts:
    # (group, mode) -> its CallContext ((None, None): its own group and scales mode; never saved); restored: the
    # (layout, origin) of a loaded checkpoint until the layout is found; counters (two-level: the whole group's,
    # with the next call's number), intra_counters (inside the node); iter: DDP iterations; inter: two-level, the
    # state of this rank's shard between nodes; bits="auto" (hhook.decision): the decision, its clock (prober,
    # never saved), the widths' states (variants); registration: what hhook.register learnt of the DDP model;
    # pending_load: the context every rank verified, kept by load_state_dict until the hook's next exchange
    # finds whether every rank loaded (hhook.schedule.load_check).
    __slots__ = ("process_group", "options", "keys", "runtime", "runtimes", "contexts", "restored", "counters",
                 "intra_counters", "iter", "inter", "decision", "prober", "variants", "registration", "pending_load",
                 "__weakref__")

    def __init__(self, process_group: dist.ProcessGroup | None = None, bits: int | str = 4, block_size: int = 1024,
                 seed: int = 0, error_feedback: bool = False, start_iter: int = 2, scales: str = "auto",
                 chunk_mb: float | str = "auto", topology: str | int = "flat", rounding: str = "correlated"):
        self.options = Options(bits, block_size, seed, error_feedback, start_iter, scales, chunk_mb, topology, rounding)
        _check_group(process_group)
        self.process_group = process_group
        self.keys, self.variants = KeyStore(), {}
        self.counters, self.intra_counters = Counters(), Counters()
        self.iter = 0
        self.inter = self.decision = self.registration = self.pending_load = None
        self.reset_runtime()
        report.LIVE.add(self)

    @classmethod
    def validate(cls, process_group=None, **options) -> None:
        """Raise what the constructor raises for ``options``; builds no state to keep."""
        Options(**options)
        _check_group(process_group)

    def reset_runtime(self) -> None:
        """Forget the transport pieces and the contexts made of them (a new group, or a
        loaded checkpoint): they are built again, and the handshake runs again, at the
        next exchange."""
        self.runtime, self.runtimes, self.contexts = GroupRuntime(), {}, {}
        self.restored = (None, None)
        self.prober = None  # hhook.decision.Prober: the clock and the reductions in flight

    def reset_stats(self) -> None:
        self.counters.reset()
        self.intra_counters.reset()
        if self.inter is not None:
            self.inter.reset_stats()

    def codec_bits(self, world_size: int | None = None) -> int:
        """The bits the codec uses over ``world_size`` ranks (default: this group's; a
        two-level state's shards use the inter-node state's, sized for the node count)."""
        if world_size is None and self.options.bits == "auto":
            world_size = membership.of(self.process_group).size
        return self.options.codec_bits(world_size)

    def policy(self, mode: str, world_size: int | None = None):
        """The scale policy of ``mode`` (one of :data:`~hhook.state.SCALE_MODES`), with its per-key state,
        for messages summed over ``world_size`` ranks (default: this state's group; FSDP's
        reduce-scatter passes its own group's, which ``bits="auto"`` sizes for)."""
        return self.keys.policy(self.options, mode, self.codec_bits(world_size), self.codec_bits())

    def agree(self, group=None, runs: str | None = None, extra: tuple = ()) -> None:
        """The options handshake of this state on ``group`` (default: its own), once per
        group, and again after :meth:`load_state_dict` (:func:`hhook.schedule.handshake.agree`:
        every option, the codec's version, ``runs``, what runs, and ``extra`` fields);
        blocking, on every rank. Raises :class:`~hhook.errors.ConfigMismatchError` on every
        rank where they differ, or where a rank never reaches it."""
        runtime = self.runtime if group is None else self.runtimes.setdefault(group, GroupRuntime())
        if runtime.agreed:
            return
        if not dist.is_initialized() and membership.registered(self.process_group):
            raise RuntimeError("hhook: torch.distributed is not initialized (see hhook.init_distributed)")
        fields = self.options.fields() + ((("runs", runs),) if runs else ()) + tuple(extra)
        handshake.agree(self.process_group if group is None else group, fields, self.counters)
        runtime.agreed = True
        if group is None:
            self.pending_load = None  # every rank handshook: what they verified before is past
        elif self.pending_load is not None:
            load_check.handshook(self, group)

    def context(self, group=None, mode: str | None = None, device=None) -> CallContext:
        """What a schedule may use of this state for its calls on ``group`` (default: its
        own, with its node layout) in scale ``mode`` (default: ``scales``, resolved for
        the group and ``device``, the exchanged tensors': :meth:`Options.scale_mode`): a
        :class:`~hhook.schedule.context.CallContext` of plain data, made once per group,
        mode and configuration (after the options handshake and the node layout, on every
        rank, at the first exchange) and kept in :attr:`contexts` until a checkpoint is
        loaded (:meth:`reset_runtime`)."""
        ctx = self.contexts.get((group, mode))
        if ctx is None:
            self.agree(group)
            if group is None:
                self.node_layout()
            ctx = self.contexts[(group, mode)] = _made(self, group, mode, device)
        return ctx


def _made(state: THCState, group, mode: str | None, device=None) -> CallContext:
    """:meth:`THCState.context`'s new context (a two-level one holds its shards' inter-node one)."""
    pg = state.process_group if group is None else group
    members, options = membership.of(pg), state.options
    world = members.size
    topo = state.runtime.topo if group is None else None
    two_level = topo is not None and topo.two_level
    inter = state.inter
    if two_level:
        inter = _made(inter, None, inter.options.scale_mode(topo.n_nodes, device, two_level=True), device)
    policy = None if two_level else state.policy(mode or options.scale_mode(world, device), None if group is None else world)
    return CallContext(
        pg, members.rank, world, state.runtime if group is None else state.runtimes[group], state.counters,
        policy, options.piece_limit(), options.block_size, options.config_id(), options.fields(),
        report.deferred_sources(state), two_level_allreduce_async if two_level else flat_allreduce_async,
        state.intra_counters, topo, inter if two_level else None)
