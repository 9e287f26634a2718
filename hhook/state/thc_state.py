r"""THCState: what users construct, hand to the DDP hook or :func:`hhook.thc_allreduce`,
and checkpoint. It holds its parts, each with one job: the options
(:mod:`~hhook.state.options`), the per-key state (:mod:`~hhook.state.keys`), the group
runtime (:mod:`~hhook.state.runtime`), the byte counters (:mod:`hhook.stats`) and the
checkpoint format (:mod:`~hhook.state.checkpoint`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..stats import Counters
from . import checkpoint, report, runtime
from .keys import KeyStore
from .options import Options
from .runtime import GroupRuntime

def _check_group(process_group) -> None:
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(f"process_group must be a torch.distributed ProcessGroup or None, got {process_group!r}")


class THCState:
    r"""Options, error-feedback residuals and byte counters of THC compression.

    Args:
        process_group: the group to reduce over; ``None`` means the default group.
        bits: bits per coordinate before headroom; ``2**bits`` quantization levels (1..8).
            ``"auto"``: the fewest bits whose predicted error of the mean, at this
            world size (or node count, two-level), is no worse than 4 bits at 4 ranks
            rounding independently (:func:`hhook.codec.error_model.auto_bits`; correlated
            rounding: 5 at 2 ranks, 4 at 3-8, 3 at 16, 2 at 64-128, 1 at 1024; 3 for
            8 nodes of 8): large jobs average rounding noise away and get narrower lanes.
            In the DDP hook ``"auto"`` (:func:`hhook.register`'s default) goes further:
            it measures this job's step with THC at that width and narrower ones, a
            bf16 and the fp32 allreduce, and keeps the fastest (:mod:`hhook.decision`).
        block_size: rotation and scale block, a power of two (at most 65536). 1024 costs
            0.03 bits per coordinate for the scales.
        seed: shared seed of the rotation's random signs; must match on every rank.
        error_feedback: carry each rank's rounding error into its next call (costs one
            float32 copy of every compressed tensor). The rounding is unbiased, so this
            is optional. Needs ``start_iter >= 2`` (refused otherwise, as PowerSGD does).
        start_iter: the DDP hook runs a plain allreduce for the iterations before this
            one. DDP rebuilds its buckets after the first iteration, so per-bucket
            residuals are stable only from iteration 2.
        scales: ``"predicted"``: one SUM allreduce per bucket once the bucket has
            history, with scales bounding the previous step's maximum over ranks of
            the block maxima, which travel in-band as thermometer counts
            (:mod:`hhook.scales`); a bucket's first compressed call takes one agreed
            round. Clips only blocks that grew since the previous step.
            ``"agreed"`` (default): a MAX allreduce of this step's block maxima first,
            then the SUM; two rounds, but scales that never clip (unbiased), about 1.5x
            (2-4 bits) to 6x (8 bits) less error than predicted ones, and no host read
            anywhere. Predicted scales saved about 10% of the step time on the emulated
            1 Gbit/s cluster (README).
        chunk_mb: split a tensor larger than this many MB of float32 into pieces of at
            most this size, each compressed and reduced on its own, so one piece is on
            the wire while the next is encoded and the previous decoded: part of the
            codec's time hides behind the wire's. Each piece costs a collective and the
            codec's fixed overhead, so pieces are large. ``"auto"`` (default): 12 MB for
            CPU tensors, whole tensors on GPUs (whose codec takes about a millisecond
            per bucket); ``0``: never split.
        topology: ``"flat"`` (default): every rank of the group is a peer of one THC
            allreduce. ``"auto"`` or an integer number of ranks per node: two-level THC
            (:mod:`hhook.schedule.two_level`) when the group spans several nodes of equal size:
            dense inside each node, THC between nodes with lanes sized for the number
            of nodes, each rank encoding ``1 / ranks_per_node`` of the tensor. Nodes
            come from the launcher's variables or the hostnames (:mod:`hhook.schedule.topology`);
            one node, one rank per node or uneven nodes fall back to flat with one log
            line. The layout is found once, blocking, on every rank (it creates process
            groups): at :func:`hhook.register`, else at the first call; a request that
            cannot hold raises :class:`~hhook.schedule.topology.TopologyError` on every rank.
        rounding: ``"correlated"`` (default): the ranks' rounding thresholds for each
            coordinate are spread over the unit interval (:class:`hhook.codec.rng.Stream`),
            each still uniform, so the rounding stays unbiased and the codes add exactly
            as before, but the errors largely cancel in the sum: about half the error of
            the mean at 3-8 bits, a quarter or less at 1-2 bits or where ranks' gradients
            are alike (docs/codec.md). ``"independent"``: each rank rounds on its own
            (hhook before version 3 of the codec). The index is the rank in the group
            that sums (the nodes' ring, two-level). Part of the fingerprint: ranks that
            disagree raise :class:`~hhook.errors.ConfigMismatchError`.

    Example::
        >>> state = THCState(process_group=None, bits=4)
        >>> ddp_model.register_comm_hook(state, thc_hook)
    """

    # Pickles name this class hhook.state.THCState, as every hhook wrote them.
    __module__ = "hhook.state"

    __slots__ = (
        "process_group",
        "options",  # Options: immutable, replaced by load_state_dict
        "keys",  # KeyStore: residuals and predicted scales, one policy per mode and width
        "runtime",  # GroupRuntime: built on first use, never saved
        "counters",  # this state's calls and bytes (two-level: the calls over the whole group)
        "intra_counters",  # two-level: what stayed inside the node
        "iter",  # DDP iterations, counted on each backward pass's last bucket
        "calls",  # the call counter that selects rounding streams
        "inter",  # two-level: the THCState of this rank's shard between nodes
        # bits="auto" in the DDP hook (hhook.decision): the decision (plain data until the
        # hook restores it), its clock (never saved), and the THC state of each width it
        # tried, which shares this state's counters and runtime and draws from ``calls``
        "decision",
        "prober",
        "variants",
        "calls_from",  # a width: the state whose call counter it draws from
        "registration",  # what hhook.register learnt of the DDP model (hhook.ddp_hook)
        "__weakref__",
    )

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        bits: int = 4,
        block_size: int = 1024,
        seed: int = 0,
        error_feedback: bool = False,
        start_iter: int = 2,
        scales: str = "agreed",
        chunk_mb: float | str = "auto",
        topology: str | int = "flat",
        rounding: str = "correlated",
    ):
        self.options = Options(bits, block_size, seed, error_feedback, start_iter, scales, chunk_mb, topology, rounding)
        _check_group(process_group)
        self.process_group = process_group
        self.keys = KeyStore()
        self.counters, self.intra_counters = Counters(), Counters()
        self.iter = self.calls = 0
        self.inter: THCState | None = None
        self.decision = None
        self.variants: dict[int, THCState] = {}
        self.registration = None
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
        self.prober = None  # hhook.decision.Prober: the clock and the reductions in flight
        self.calls_from = None

    # -- checkpoints (hhook.state.checkpoint) ------------------------------------------
    def state_dict(self) -> dict:
        """Everything a resumed run needs, as plain data (tensors, numbers, strings, tuples,
        lists, dicts), so ``torch.load(..., weights_only=True)`` loads it: the options,
        counters, every key's residual and predicted scales (per scale policy), the
        two-level ``inter`` state, the node layout and ``bits="auto"``'s decision and
        widths. ``torch.save(state)`` pickles this same dict. The process group is not saved.

        Example::
            >>> ckpt = {"model": model.state_dict(), "hhook": state.state_dict()}
            >>> state.load_state_dict(torch.load(path, weights_only=True)["hhook"])
        """
        return checkpoint.state_dict(self)

    def load_state_dict(self, saved: dict) -> None:
        """Continue from :meth:`state_dict` (or an older hhook's pickled state): options,
        counters and per-key state are replaced (one log line names the options that
        change); this state's process group and the model :func:`hhook.register` gave it
        stay. Per-key state that cannot describe this run starts afresh with one log line:
        a checkpoint of another node layout or world size (compared when the layout is
        found, or now if it is known) or of another codec version; another rank's
        residuals."""
        checkpoint.load(self, saved, announce=True)

    def __getstate__(self):
        # Like PowerSGDState: a process group cannot be pickled; the default one is used after loading.
        return self.state_dict()

    def __setstate__(self, saved):
        THCState.__init__(self)  # every slot at its default; saved values replace them
        checkpoint.load_pickled(self, saved)

    # -- what the schedules ask of a state ---------------------------------------------
    @property
    def rank(self) -> int:
        return dist.get_rank(self.process_group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

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

    def config_id(self) -> int:
        """The schedule's options hash in every message's fingerprint (:meth:`Options.config_id`)."""
        return self.options.config_id(self.decision)

    def describe(self) -> str:
        return self.options.describe()

    def next_call(self) -> int:
        """A number no earlier call of this rank had (it selects the rounding stream); a
        ``bits="auto"`` width takes it from its parent's counter (:mod:`hhook.decision.widths`)."""
        owner = self if self.calls_from is None else self.calls_from
        owner.calls += 1
        return owner.calls - 1

    def node_layout(self):
        """The node layout, found once on every rank (:func:`hhook.state.runtime.node_layout`)."""
        return runtime.node_layout(self)

    def check_options(self, group, device: torch.device) -> None:
        """The blocking options check over ``group`` (:func:`hhook.state.runtime.check_options`)."""
        runtime.check_options(self, group, device)

    def handshake(self, device: torch.device) -> None:
        """The options check and second communicator of ``device`` (:func:`hhook.state.runtime.handshake`)."""
        runtime.handshake(self, device)

    def ensure_checked(self, device: torch.device) -> None:
        """Layout and options checked over the whole group, once per device type
        (:func:`hhook.state.runtime.ensure_checked`)."""
        runtime.ensure_checked(self, device)

    def check_deferred(self, wait: bool = False) -> None:
        """Raise what earlier decodes flagged on the device (:func:`hhook.state.runtime.check_deferred`)."""
        runtime.check_deferred(self, wait)

    # -- statistics (hhook.state.report) -------------------------------------------------
    def stats(self) -> dict:
        """Bytes since creation (or :meth:`reset_stats`) on this rank: the fields of
        :func:`hhook.state.report.stats`."""
        return report.stats(self)

    def reset_stats(self) -> None:
        self.counters.reset()
        self.intra_counters.reset()
        if self.inter is not None:
            self.inter.reset_stats()

    def reported_through_parent(self) -> None:
        """A state another one holds (a width, the inter-node state) is not reported idle
        at exit on its own: its parent's report covers it."""
        report.LIVE.discard(self)

    def warn_if_idle(self, where: str) -> bool:
        """Warn when no tensor went through this state by the end of ``where``
        (:func:`hhook.state.report.warn_if_idle`); True when it warned."""
        return report.warn_if_idle(self, where)
