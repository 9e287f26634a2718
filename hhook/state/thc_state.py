r"""THCState: what users construct, hand to the DDP hook or :func:`hhook.thc_allreduce`,
and checkpoint: the options (:mod:`~hhook.state.options`), the per-key state
(:mod:`~hhook.state.keys`), the byte counters (:mod:`hhook.stats`), the checkpoint format
and node layout (:mod:`~hhook.state.checkpoint`) and the reports
(:mod:`~hhook.state.report`). A schedule never sees it: it gets the narrow
:class:`~hhook.schedule.context.CallContext` that :meth:`THCState.context` builds, and the
:class:`~hhook.schedule.context.GroupRuntime` the state keeps for it."""

from __future__ import annotations

import torch.distributed as dist

from ..schedule.context import CallContext, GroupRuntime
from ..stats import Counters
from . import checkpoint, report
from .keys import KeyStore
from .options import Options


def _check_group(process_group) -> None:
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed ProcessGroup or None, got {process_group!r}")


def _deferred_sources(state) -> list:
    """The (runtime, counters) pairs whose device flags ``state``'s checks read: its
    inter-node state's, each width's (theirs first, recursively), then its own."""
    sources = []
    for held in (state.inter, *state.variants.values()):
        if held is not None:
            sources += _deferred_sources(held)
    return sources + [(state.runtime, state.counters)]


class THCState:
    r"""Options, error-feedback residuals and byte counters of THC compression.

    Args:
        process_group: the group to reduce over; ``None`` means the default group.
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
        scales: ``"agreed"`` (default): a MAX allreduce of this step's block maxima, then
            the SUM; never clips. ``"predicted"``: one SUM once a key has history, with
            scales from the previous step's maxima (:mod:`hhook.scales`); clips blocks that grew.
        chunk_mb: split a tensor above this many MB of float32 into pieces, each reduced
            on its own, so one is on the wire while the next is encoded. ``"auto"``
            (default): 12 MB for CPU tensors, whole tensors on GPUs; ``0``: never split.
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

    # options: immutable, replaced by load_state_dict; keys: residuals and predicted scales (KeyStore);
    # runtime: the schedule's GroupRuntime, never saved; restored: the (layout, origin) a loaded checkpoint
    # was saved with, until the layout is found; counters (two-level: over the whole group) and
    # intra_counters (inside the node); iter: DDP iterations; calls: the counter of rounding streams;
    # inter: two-level, the state of this rank's shard between nodes; bits="auto" (hhook.decision): the
    # decision (plain data until the hook restores it), its clock (prober, never saved), the widths'
    # states (variants, sharing counters and runtime; calls_from: the state whose calls they draw);
    # registration: what hhook.register learnt of the DDP model (hhook.ddp_hook).
    __slots__ = ("process_group", "options", "keys", "runtime", "restored", "counters", "intra_counters", "iter",
                 "calls", "inter", "decision", "prober", "variants", "calls_from", "registration", "__weakref__")

    def __init__(self, process_group: dist.ProcessGroup | None = None, bits: int = 4, block_size: int = 1024,
                 seed: int = 0, error_feedback: bool = False, start_iter: int = 2, scales: str = "agreed",
                 chunk_mb: float | str = "auto", topology: str | int = "flat", rounding: str = "correlated"):
        self.options = Options(bits, block_size, seed, error_feedback, start_iter, scales, chunk_mb, topology, rounding)
        _check_group(process_group)
        self.process_group = process_group
        self.keys, self.variants = KeyStore(), {}
        self.counters, self.intra_counters = Counters(), Counters()
        self.iter = self.calls = 0
        self.inter = self.decision = self.registration = None
        self.reset_runtime()
        report.LIVE.add(self)

    bits = property(lambda self: self.options.bits)
    block_size = property(lambda self: self.options.block_size)
    seed = property(lambda self: self.options.seed)
    error_feedback = property(lambda self: self.options.error_feedback)
    start_iter = property(lambda self: self.options.start_iter)
    scales = property(lambda self: self.options.scales)
    chunk_mb = property(lambda self: self.options.chunk_mb)
    topology = property(lambda self: self.options.topology)
    rounding = property(lambda self: self.options.rounding)

    @classmethod
    def validate(cls, process_group=None, **options) -> None:
        """Raise what the constructor raises for ``options``; builds no state to keep."""
        Options(**options)
        _check_group(process_group)

    def reset_runtime(self) -> None:
        """Forget the transport pieces (a new group, or a loaded checkpoint): they are
        built again on first use."""
        self.runtime = GroupRuntime()
        self.restored = (None, None)
        self.prober = None  # hhook.decision.Prober: the clock and the reductions in flight
        self.calls_from = None

    # -- checkpoints, node layout and statistics: one implementation each, in checkpoint and report
    state_dict = checkpoint.state_dict
    load_state_dict = checkpoint.load_state_dict
    __getstate__ = checkpoint.state_dict  # as PowerSGDState: the process group is not pickled
    __setstate__ = checkpoint.load_pickled
    stats = report.stats
    warn_if_idle = report.warn_if_idle
    check_deferred = report.check_deferred
    node_layout = checkpoint.node_layout

    def reset_stats(self) -> None:
        self.counters.reset()
        self.intra_counters.reset()
        if self.inter is not None:
            self.inter.reset_stats()

    # -- what the schedules are given -------------------------------------------------
    rank = property(lambda self: dist.get_rank(self.process_group))
    world_size = property(lambda self: dist.get_world_size(self.process_group))

    def codec_bits(self, world_size: int | None = None) -> int:
        """The bits the codec uses over ``world_size`` ranks (default: this group's; a
        two-level state's shards use the inter-node state's, sized for the node count)."""
        if world_size is None and self.bits == "auto":
            world_size = self.world_size
        return self.options.codec_bits(world_size)

    def policy(self, mode: str, world_size: int | None = None):
        """The scale policy of ``mode`` ("agreed" or "predicted"), with its per-key state,
        for messages summed over ``world_size`` ranks (default: this state's group; FSDP's
        reduce-scatter passes its own group's, which ``bits="auto"`` sizes for)."""
        return self.keys.policy(self.options, mode, self.codec_bits(world_size), self.codec_bits())

    def next_call(self) -> int:
        """A number no earlier call of this rank had (it selects the rounding stream); a
        ``bits="auto"`` width takes it from its parent's counter (:mod:`hhook.decision.widths`)."""
        owner = self if self.calls_from is None else self.calls_from
        owner.calls += 1
        return owner.calls - 1

    def context(self, mode: str | None = None, world_size: int | None = None) -> CallContext:
        """What a schedule may use of this state for one call (a :class:`CallContext`): its
        group and runtime, counters, the policy of ``mode`` (default: ``scales``) sized for
        ``world_size`` ranks (default: the group's), call counter, options hash and
        fingerprint, deferred checks, node layout and its ``inter`` state's context."""
        options = self.options

        def fingerprint(world: int):
            f, codec = options.fingerprint(world, self.decision)
            return f, f"{options.describe()} (codec {codec.describe()})"

        return CallContext(
            self.process_group, self.runtime, self.counters, self.intra_counters,
            lambda: self.policy(options.scales if mode is None else mode, world_size), options.chunks,
            self.next_call, lambda: options.config_id(self.decision), fingerprint, _deferred_sources(self),
            self.node_layout, lambda: self.inter.context())
