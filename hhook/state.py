r"""Per-process-group state shared by the DDP hook and :func:`hhook.thc_allreduce`:
options, per-key state (through the scale policies), counters, and the transport pieces
built on first use (the node layout, the second communicator, the sequencer, deferred
device checks)."""

from __future__ import annotations

import atexit
import logging
import math
import weakref

import torch
import torch.distributed as dist

from .codec import rng
from .codec import CODEC_VERSION, THCCodec
from .schedule.groups import SecondGroup, explain
from .errors import ConfigMismatchError
from .scales import ScalePolicy
from .schedule.sequencer import Sequencer
from .stats import Counters, two_level_stats
from .codec.error_model import auto_bits
from .schedule.topology import Topology, TopologyError, detect_topology

#: The scale policies (:mod:`hhook.scales`): agree on each step's maxima (two
#: collectives; never clips; the default), or predict them from the previous step (one
#: collective once a key has history; clips blocks that grew). "auto", the default of
#: earlier versions (predicted on CPUs), is accepted and now means "agreed".
SCALE_MODES = ("agreed", "predicted")
#: Piece size of ``chunk_mb="auto"`` on CPUs: a 21 MB bucket goes in 2 pieces, DDP's
#: default 25 MB bucket in 3 (docs/train.md: 4 MB pieces cost more than they hide).
DEFAULT_CHUNK_MB = 12
#: ``topology=``: every rank a peer (the default), nodes from the launcher or hostnames,
#: or an integer number of ranks per node (:mod:`hhook.schedule.topology`).
TOPOLOGIES = ("flat", "auto")

#: Version of :meth:`THCState.state_dict`'s layout (pickles of older hhooks have none).
STATE_FORMAT = 1
#: The constructor's options a checkpoint keeps (not the process group).
_OPTIONS = ("bits", "block_size", "seed", "error_feedback", "start_iter", "scales", "chunk_mb", "topology",
            "rounding")

logger = logging.getLogger(__name__)

#: The states a program built, weakly held: at exit each one that no tensor went through
#: says so (:meth:`THCState.warn_if_idle`), e.g. a state handed to a framework that never
#: registered its hook. States hhook builds for itself leave the set.
_LIVE: "weakref.WeakSet[THCState]" = weakref.WeakSet()


@atexit.register
def _report_idle_states() -> None:
    for state in list(_LIVE):
        try:
            state.warn_if_idle("the program")
        except Exception:  # noqa: BLE001 - at exit, a deferred error has had its chance to raise
            pass


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

    __slots__ = [
        "process_group",
        "bits",
        "block_size",
        "seed",
        "error_feedback",
        "start_iter",
        "scales",
        "chunk_mb",
        "topology",
        "rounding",
        # per-key state (residuals, predicted scales), one store per scale policy in use
        "policies",
        # counters
        "iter",
        "calls",
        "_stats",
        # two-level: the THC state of this rank's shard between nodes, the intra-node
        # counters, and the layout a checkpoint was saved with
        "inter",
        "_intra",
        "_saved_layout",
        "_saved_origin",
        # bits="auto" in the DDP hook (hhook.decision): the decision (plain data) and the
        # THC state of each width it tried (sharing this state's counters and transport)
        "decision",
        "variants",
        # derived, rebuilt on demand and never pickled
        "_codec",
        "_verified",
        "_second",
        "_sequencer",
        "_pending",
        "_defer_on_cpu",
        "_topo",
        "_checked",
        "_param_names",
        "_ddp_iterations",
        "_prober",
        "_calls_from",
        "__weakref__",
    ]

    #: What a checkpoint keeps (:meth:`state_dict`).
    _PICKLED = (*_OPTIONS, "policies", "iter", "calls", "_stats", "inter", "_intra", "decision", "variants")

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
        THCCodec(4 if bits == "auto" else bits, block_size, seed, rounding=rounding)  # validates the options before any training
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
            raise ValueError(f"start_iter must be a non-negative integer, got {start_iter!r}")
        if not isinstance(error_feedback, bool):
            raise ValueError(f"error_feedback must be True or False, got {error_feedback!r}")
        if scales == "auto":
            scales = "agreed"
        if scales not in SCALE_MODES:
            raise ValueError(f"scales must be one of {SCALE_MODES}, got {scales!r}")
        if chunk_mb != "auto" and (
            isinstance(chunk_mb, bool) or not isinstance(chunk_mb, (int, float)) or not 0 <= chunk_mb < math.inf
        ):
            raise ValueError(f"chunk_mb must be 'auto' or a non-negative number of megabytes, got {chunk_mb!r}")
        if topology not in TOPOLOGIES and (isinstance(topology, bool) or not isinstance(topology, int) or topology < 1):
            raise ValueError(f"topology must be 'flat', 'auto' or a positive number of ranks per node, got {topology!r}")
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"process_group must be a torch.distributed ProcessGroup or None, got {process_group!r}")
        if error_feedback and start_iter < 2:
            # As PowerSGD: DDP rebuilds its buckets after the first iteration, and a
            # residual kept for a bucket index would be added to another bucket's gradients.
            raise ValueError(
                f"error_feedback needs start_iter >= 2 (got {start_iter}): DDP rebuilds its buckets "
                "after the first iteration, so per-bucket residuals are stable only from iteration 2"
            )
        self.process_group = process_group
        self.bits = bits
        self.block_size = block_size
        self.seed = seed
        self.error_feedback = bool(error_feedback)
        self.start_iter = start_iter
        self.scales = scales
        self.chunk_mb = chunk_mb
        self.topology = topology
        self.rounding = rounding
        self.policies: dict = {}
        self.iter = 0
        self.calls = 0
        self._stats = Counters()
        self.inter: THCState | None = None
        self._intra = Counters()
        self._saved_layout = None
        self._saved_origin = None
        self.decision = None
        self.variants: dict[int, THCState] = {}
        self._reset_derived()
        _LIVE.add(self)

    @classmethod
    def validate(cls, **options) -> None:
        """Raise what the constructor raises for ``options``; builds no state to keep."""
        _LIVE.discard(cls(**options))

    def _reset_derived(self) -> None:
        self._codec = None
        self._verified = set()
        self._second = {}
        self._sequencer = Sequencer()
        self._pending = []
        self._defer_on_cpu = False  # tests: run the GPU's deferred checks on CPU tensors
        self._topo = None
        self._checked = set()  # device types whose options were checked over the whole group
        self._param_names = None  # id(parameter) -> name, set by hhook.register (DDP)
        self._ddp_iterations = None  # iterations of the DDP registered on, counted by the hook
        self._prober = None  # hhook.decision.Prober: the clock and the reduction in flight
        self._calls_from = None  # a bits="auto" width: the state whose call counter it draws from

    # -- checkpoints: one plain representation for state_dict() and pickling ----------
    def state_dict(self) -> dict:
        """Everything a resumed run needs, as plain data (tensors, numbers, strings, tuples,
        lists, dicts), so ``torch.load(..., weights_only=True)`` loads it: the options,
        counters, every key's residual and predicted scales (per scale policy), the
        two-level ``inter`` state and the node layout. A component held in a
        :attr:`_PICKLED` slot that has its own ``state_dict()`` is saved through it.
        ``torch.save(state)`` pickles this same dict. The process group is not saved.

        Example::
            >>> ckpt = {"model": model.state_dict(), "hhook": state.state_dict()}
            >>> state.load_state_dict(torch.load(path, weights_only=True)["hhook"])
        """
        decision = None  # bits="auto": the decision with the reductions in flight read in (nothing changes here)
        if self._prober is not None and self.decision is not None and not isinstance(self.decision, dict):
            decision = self._prober.checkpoint(self.decision)
        saved = {"format": STATE_FORMAT, "codec_version": CODEC_VERSION,
                 "layout": self._topo.record() if self._topo is not None else self._saved_layout,
                 "origin": self._origin()}
        for name in self._PICKLED:
            value = getattr(self, name)
            if name == "policies":
                value = {mode: policy.state_dict() for mode, policy in value.items()}
            elif name == "variants":
                value = {bits: variant.state_dict() for bits, variant in value.items()}
            elif name == "decision" and decision is not None:
                value = decision
            elif hasattr(value, "state_dict"):
                value = value.state_dict()
            saved[name] = value
        return saved

    def load_state_dict(self, saved: dict) -> None:
        """Continue from :meth:`state_dict` (or an older hhook's pickled state): options,
        counters and per-key state are replaced (one log line names the options that
        change); this state's process group and the model :func:`hhook.register` gave it
        stay. Per-key state that cannot describe this run starts afresh with one log line:
        a checkpoint of another node layout or world size (compared when the layout is
        found, or now if it is known) or of another codec version; another rank's
        residuals. A component that has ``load_state_dict`` (built by ``__init__``) loads
        its part in place."""
        self._load(saved, announce=True)

    def _load(self, saved: dict, announce: bool) -> None:
        if not isinstance(saved, dict) or "bits" not in saved:
            raise ValueError(f"hhook: not a THCState.state_dict(): {type(saved).__name__} "
                             f"with keys {sorted(saved) if isinstance(saved, dict) else '-'}")
        if saved.get("format", STATE_FORMAT) > STATE_FORMAT:
            raise ValueError(f"hhook: this THCState was saved by a newer hhook (format {saved['format']}, "
                             f"this one reads up to {STATE_FORMAT})")
        options = {name: saved.get(name, getattr(self, name)) for name in _OPTIONS}
        THCState.validate(**options)  # before anything changes
        changed = [f"{name} {getattr(self, name)!r} -> {options[name]!r}" for name in _OPTIONS
                   if options[name] != getattr(self, name)]
        if changed and announce:
            logger.warning("hhook: the checkpoint's THC options replace this state's: %s", ", ".join(changed))
        topo, names, iterations = self._topo, self._param_names, self._ddp_iterations
        self._reset_derived()
        self._param_names, self._ddp_iterations = names, iterations
        self._saved_layout = saved.get("layout")
        self._saved_origin = saved.get("origin")
        for name in self._PICKLED:
            if name not in saved:  # saved before this component existed: it starts afresh
                continue
            value, current = saved[name], getattr(self, name)
            if name == "policies":
                value = {mode: p if isinstance(p, ScalePolicy) else ScalePolicy.from_state_dict(p)
                         for mode, p in value.items()}
            elif name == "inter" and isinstance(value, dict):
                value = _loaded(value)
            elif name == "variants":
                value = {bits: v if isinstance(v, THCState) else _loaded(v) for bits, v in value.items()}
            elif name == "decision" and isinstance(value, dict) and current is None:
                pass  # plain data until hhook.decision.build restores the Decision (it imports this module)
            elif hasattr(current, "load_state_dict") and not hasattr(value, "load_state_dict"):
                current.load_state_dict(value)
                continue
            setattr(self, name, value)
        if self.variants:
            from .widths import merge_call_counters

            merge_call_counters(self)  # a checkpoint of one counter per width
        version = saved.get("codec_version", CODEC_VERSION)
        if version != CODEC_VERSION:
            self._start_afresh(f"it was saved by codec version {version}, this hhook's is {CODEC_VERSION}")
        if topo is not None:
            self._adopt_layout(topo)

    def __getstate__(self):
        # Like PowerSGDState: a process group cannot be pickled; the default one is used after loading.
        return self.state_dict()

    def __setstate__(self, saved):
        THCState.__init__(self)  # every slot at its default; saved values replace them
        if "format" not in saved:  # pickled by an hhook before state_dict()
            if saved.get("scales", "auto") == "auto":  # saved before there was a choice, or with "auto"
                saved["scales"] = "agreed"
            saved.setdefault("chunk_mb", 0)  # saved before tensors were split
            saved.setdefault("rounding", "independent")  # saved before there was a choice: what it ran
            if "residuals" in saved or "predicted" in saved:
                saved.pop("residuals", None)
                saved.pop("predicted", None)
                logger.warning("hhook: a THCState saved by an older hhook: its residuals and predicted scales "
                               "start afresh")
        self._load(saved, announce=False)

    def policy(self, mode: str, world_size: int | None = None) -> ScalePolicy:
        """The scale policy of ``mode`` ("agreed" or "predicted"), with its per-key state,
        for messages summed over ``world_size`` ranks (default: this state's group; FSDP's
        reduce-scatter passes its own group's, which ``bits="auto"`` sizes for)."""
        bits = self.codec_bits(world_size)
        name = mode if bits == self.codec_bits() else f"{mode}@{bits}bits"
        policy = self.policies.get(name)
        if policy is not None and getattr(policy, "rounding", "independent") != self.rounding:
            logger.warning(
                "hhook: per-key state saved under rounding=%r, this state rounds %r: its residuals and "
                "scales start afresh", getattr(policy, "rounding", "independent"), self.rounding,
            )
            policy = None
        if policy is None:
            policy = self.policies[name] = ScalePolicy(
                bits, self.block_size, self.seed, self.error_feedback, predict=mode == "predicted",
                rounding=self.rounding,
            )
        return policy

    def config_id(self) -> int:
        """A hash of every option that changes which collectives run, in what order or
        with what lengths: part of the handshake and of every message's fingerprint."""
        h = rng.mix32(0x53434844)
        chunk = -1 if self.chunk_mb == "auto" else int(round(self.chunk_mb * 1024))
        topology = {"flat": 0, "auto": 1}.get(self.topology, 2 + (self.topology if isinstance(self.topology, int) else 0))
        # bits="auto" decides between exchanges in the DDP hook: its options are in the handshake
        auto = 0 if self.bits != "auto" else 1 + (self.decision.options_digest() if hasattr(self.decision, "options_digest") else 0)
        for value in (SCALE_MODES.index(self.scales), chunk & rng.MASK32, self.start_iter, int(self.error_feedback),
                      topology & rng.MASK32, auto & rng.MASK32):
            h = rng.mix32(h ^ value)
        return h

    def describe(self) -> str:
        return (f"bits={self.bits} block_size={self.block_size} seed={self.seed} scales={self.scales} "
                f"chunk_mb={self.chunk_mb} start_iter={self.start_iter} error_feedback={self.error_feedback} "
                f"topology={self.topology} rounding={self.rounding}")

    def codec_bits(self, world_size: int | None = None) -> int:
        """The bits the codec uses: ``bits``, or for ``"auto"`` the rule of
        :func:`~hhook.codec.error_model.auto_bits` at ``world_size`` ranks (default: this group's;
        a two-level state's shards use the inter-node state's, sized for the number of
        nodes)."""
        if self.bits != "auto":
            return self.bits
        return auto_bits(self.world_size if world_size is None else world_size, rounding=self.rounding)

    def auto_width(self) -> int:
        """The auto rule's bits for this layout: :func:`~hhook.codec.error_model.auto_bits` of the
        node count (two-level) or of the world size (flat)."""
        topo = self.node_layout()
        if topo.two_level:
            return auto_bits(topo.n_nodes, topo.ranks_per_node, rounding=self.rounding)
        return auto_bits(self.world_size, rounding=self.rounding)

    def variant(self, bits: int) -> THCState:
        """THC at ``bits`` over this state's group: ``bits="auto"``'s widths (:func:`hhook.widths.variant`)."""
        from .widths import variant

        return variant(self, bits)

    def release_other_widths(self, key, tensor: torch.Tensor, keep: int | None) -> None:
        """Flush every other width's residual of ``key`` into ``tensor`` (:func:`hhook.widths.release_other_widths`)."""
        from .widths import release_other_widths

        release_other_widths(self, key, tensor, keep)

    def node_layout(self) -> Topology:
        """The node layout of ``process_group`` under the ``topology`` option, found once.

        The first call (on every rank, at the same point of the program: it may create
        process groups) runs :func:`~hhook.schedule.topology.detect_topology` (one small
        all-gather, also for ``"flat"``, so ranks that disagree fail together), checks it
        against the layout a checkpoint was saved with, and for two-level builds :attr:`inter`, the THC state
        of this rank's shard between nodes (same options; ``bits="auto"`` sized for the
        node count). Raises :class:`~hhook.schedule.topology.TopologyError` on every rank alike.
        """
        if self._topo is None:
            if not dist.is_initialized():
                raise RuntimeError("hhook: torch.distributed is not initialized (see hhook.init_distributed)")
            # One small all-gather even for "flat": ranks that disagree on the layout then
            # raise TopologyError together instead of one rank waiting in a collective
            # the others never start.
            self._adopt_layout(detect_topology(self.process_group, ranks_per_node=self.topology))
        return self._topo

    def _origin(self) -> dict | None:
        """Which rank of how many this state belongs to (None before torch.distributed)."""
        if not dist.is_initialized():
            return None
        return {"rank": self.rank, "world_size": self.world_size}

    def _start_afresh(self, why: str) -> None:
        """Drop what a checkpoint carried per key (residuals, predicted scales, the
        two-level shards' state, ``bits="auto"``'s widths and measurements), with one log
        line: options and counters stay. Nothing carried is then used on a tensor it does
        not describe."""
        logger.warning("hhook: the THC state from the checkpoint starts afresh (residuals, predicted scales, "
                       "bits='auto' measurements): %s", why)
        self.policies, self.inter, self.variants, self.decision = {}, None, {}, None

    def _drop_residuals(self) -> int:
        """Forget every error-feedback residual (this rank's own), returns how many."""
        dropped = 0
        for state in (self, self.inter, *self.variants.values()):
            if state is None:
                continue
            for policy in state.policies.values():
                for key_state in policy.keys.values():
                    if key_state.residual is not None:
                        key_state.residual = None
                        dropped += 1
        return dropped

    def _adopt_layout(self, topo: Topology) -> None:
        """Use ``topo``: compare it with a checkpoint's layout and rank, build or reattach
        :attr:`inter`.

        A checkpoint of another layout (another world size: an elastic restart with fewer
        or more ranks; other nodes) starts its per-key state afresh with one log line; one
        saved by another rank of the same layout keeps its scales (the same on every rank)
        but not its residuals (that rank's own rounding errors)."""
        try:
            topo.check_record(self._saved_layout)
        except TopologyError as exc:
            self._start_afresh(str(exc).split(". Per-shard", 1)[0].replace("hhook: the checkpoint", "the checkpoint"))
        else:
            origin = self._saved_origin
            if origin is not None and origin.get("rank") != topo.rank and self._drop_residuals():
                logger.warning("hhook: this rank (%d) loaded the THC state of rank %s: its error-feedback residuals "
                               "start afresh (save every rank's state to keep them)", topo.rank, origin.get("rank"))
        self._saved_layout, self._saved_origin = None, None
        if topo.two_level:
            if self.inter is None:
                bits = (auto_bits(topo.n_nodes, topo.ranks_per_node, rounding=self.rounding) if self.bits == "auto"
                        else self.bits)
                self.inter = THCState(
                    topo.inter_group, bits, self.block_size, self.seed, self.error_feedback, self.start_iter,
                    self.scales, self.chunk_mb, rounding=self.rounding,
                )
                _LIVE.discard(self.inter)  # reported through this state
            else:  # restored from a checkpoint of the same layout
                self.inter.process_group = topo.inter_group
        elif self.inter is not None:
            raise TopologyError("hhook: this THCState holds two-level state but the layout found is flat")
        self._topo = topo

    def mode(self, device: torch.device) -> str:
        """The scale policy for tensors on ``device`` (the same on every device)."""
        return self.scales

    def next_call(self) -> int:
        """A number no earlier call of this rank had (it selects the rounding stream); a
        ``bits="auto"`` width takes it from its parent's counter (:mod:`hhook.widths`)."""
        owner = self if self._calls_from is None else self._calls_from
        owner.calls += 1
        return owner.calls - 1

    def chunks(self, numel: int, device: torch.device) -> list[tuple[int, int]]:
        """``[(start, stop), ...]``: the pieces of a flat tensor that travel separately.

        Equal pieces of whole codec blocks (the last one takes the remainder), at most
        ``chunk_mb`` each (but at least a block); one piece when the tensor is smaller or
        splitting is off.
        """
        chunk_mb = self.chunk_mb
        if chunk_mb == "auto":
            chunk_mb = DEFAULT_CHUNK_MB if device.type == "cpu" else 0
        limit = int(chunk_mb * 2**20) // 4
        if limit <= 0 or numel <= limit:
            return [(0, numel)]
        blocks = -(-numel // self.block_size)
        pieces = -(-blocks // max(1, limit // self.block_size))
        step = -(-blocks // pieces) * self.block_size
        return [(start, min(start + step, numel)) for start in range(0, numel, step)]

    @property
    def rank(self) -> int:
        return dist.get_rank(self.process_group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    def codec(self) -> THCCodec:
        """The codec for this group's world size (built on first use)."""
        if self._codec is None:
            if not dist.is_initialized():
                raise RuntimeError("hhook: torch.distributed is not initialized (see hhook.init_distributed)")
            self._codec = THCCodec(self.codec_bits(), self.block_size, self.seed, self.world_size, self.rounding)
        return self._codec

    # -- transport pieces built on first use ---------------------------------------
    def handshake(self, device: torch.device) -> None:
        """Once per state and device type, blocking, in the same place on every rank:
        :meth:`check_options`, then build the second communicator that agreed rounds use
        (predicted keys take one at their first call, too)."""
        self.check_options(self.process_group, device)
        if device.type not in self._second:
            second = self._second[device.type] = SecondGroup(self.process_group, device.type)
            self.count(None, 0, second.handshake_bytes)
        self._verified.add(device.type)

    def check_options(self, group, device: torch.device) -> None:
        """A blocking MAX allreduce over ``group`` of this state's options fingerprint
        (codec and schedule): differing options raise :class:`ConfigMismatchError` on
        every rank before the first message. Also builds the fused backend for
        ``device`` (a first compile belongs here, not in a later stage)."""
        from .codec import warm_up

        world = dist.get_world_size(group)
        codec = THCCodec(self.codec_bits(world), self.block_size, self.seed, world, self.rounding)
        warm_up(device)
        f = float(rng.mix32(codec.fingerprint() ^ self.config_id()) >> 8)  # 24 bits: exact in float32
        vector = torch.tensor([f, -f], dtype=torch.float32, device=device)
        try:
            dist.all_reduce(vector, dist.ReduceOp.MAX, group=group)
        except BaseException as exc:  # noqa: BLE001 - a stalled or lost peer, said plainly
            raise explain(exc, "hhook's options handshake", group) from exc
        self.count(None, 0, vector.nbytes)
        if vector[0].item() != -vector[1].item():
            raise ConfigMismatchError(
                "hhook: ranks use different THC options (configuration); this rank has "
                f"{self.describe()} (codec {codec.describe()}). Every rank must build THCState "
                "with the same options."
            )

    def ensure_checked(self, device: torch.device) -> None:
        """Once per device type, blocking, on every rank, before the first collective of
        the DDP hook or :func:`hhook.thc_allreduce`: the node layout, then the options
        handshake over the whole group. Two-level states check the parent group too (the
        inter-node rings alone miss a rank whose options differ from its node's, or a
        difference mirrored on every node), and DDP's plain iterations before
        ``start_iter`` depend on the options as much as the compressed ones."""
        if device.type in self._checked:
            return
        if self.world_size > 1:  # in a world of one nothing is sent, nothing can mismatch
            if self.node_layout().two_level:
                self.check_options(self.process_group, device)
            else:
                self.handshake(device)
        self._checked.add(device.type)

    def second_group(self, device: torch.device) -> SecondGroup:
        return self._second[device.type]

    def defer(self, bad: torch.Tensor, nonfinite: torch.Tensor, what: str) -> None:
        """Keep device flags of a decode to read later without a synchronisation: a
        non-blocking copy to pinned host memory and an event; :meth:`check_deferred`
        reads the copies whose event has completed."""
        flags = torch.stack((bad, nonfinite)).to(torch.int32)
        if flags.is_cuda:
            host = torch.empty(2, dtype=torch.int32, pin_memory=True)
            host.copy_(flags, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = flags, None
        self._pending.append((event, host, what))

    def check_deferred(self, wait: bool = False) -> None:
        """Count and raise what earlier decodes flagged on the device, for every copy that
        has arrived (all of them with ``wait``): a bad prefix (different options, a wrong
        reduction, a failed rank) raises :class:`ConfigMismatchError` here, on every rank,
        at the next hook call, ``stats()`` or ``thc_allreduce``'s return."""
        if self.inter is not None:
            self.inter.check_deferred(wait)
        for v in self.variants.values():
            v.check_deferred(wait)
        still, first = [], None
        for event, host, what in self._pending:
            if event is not None and not wait and not event.query():
                still.append((event, host, what))
                continue
            if event is not None:
                event.synchronize()
            bad, nonfinite = host.tolist()
            if nonfinite:
                self._stats.add("nonfinite_calls")
            if bad and first is None:
                first = what
        self._pending = still
        if first is not None:
            raise ConfigMismatchError(
                "hhook: an earlier tensor came back NaN because the ranks disagreed on the THC options, "
                f"the tensor length or the reduction, or a rank failed while encoding (this rank: {first})"
            )

    def maybe_increase_iter(self, bucket: dist.GradBucket) -> None:
        """Count DDP iterations: one per backward pass, on its last bucket."""
        if bucket.is_last():
            self.iter += 1

    def count(self, kind: str | None, dense_bytes: int, wire_bytes: int) -> None:
        """Add one call of ``kind`` (None: wire traffic that is not a call)."""
        self._stats.add(kind, dense_bytes, wire_bytes)

    def stats(self) -> dict:
        """Bytes since creation (or :meth:`reset_stats`) on this rank.

        ``dense_bytes``: what the same calls would have sent as float32.
        ``wire_bytes``: what was handed to collectives: codes, scales and the one-time
        configuration handshake, or the dense tensors of plain-allreduce iterations.
        ``local_calls``: calls in a world of one rank, which send and count nothing.
        ``nonfinite_calls``: tensors that came back NaN because some rank's held inf/NaN
        (GradScaler skips those steps); on GPUs counted once the flag's copy has arrived.

        Two-level (:meth:`node_layout`): ``wire_bytes`` = ``inter_wire_bytes``, what was
        handed to collectives that cross nodes (the shards' codes and scales, handshakes,
        exact allreduces), ``intra_wire_bytes`` what stayed inside the node, ``ratio``
        dense over inter-node bytes, ``inter_calls`` the shards' THC calls
        (:func:`hhook.stats.two_level_stats`).
        """
        self.check_deferred()
        if self.inter is not None:
            s = two_level_stats(self.inter.stats(), self._intra, self._stats.snapshot())
        else:
            s = self._stats.snapshot()
        s["iter"] = self.iter
        if hasattr(self.decision, "summary"):  # not while it is still the plain data of a checkpoint
            s["decision"] = self.decision.summary()
        return s

    def reported_through_parent(self) -> None:
        """A state another one holds (a width, the inter-node state) is not reported idle
        at exit on its own: its parent's report covers it."""
        _LIVE.discard(self)

    def warn_if_idle(self, where: str) -> bool:
        """Log a warning when no tensor went through this state by the end of ``where``
        (a training run, the program): its hook was never called, so that run trained
        uncompressed, or not data-parallel. Returns True when it warned; either way the
        state is not checked again at exit."""
        _LIVE.discard(self)
        s = self.stats()
        if s["compressed_calls"] + s["dense_calls"] + s["local_calls"]:
            return False
        from .advice import idle_state

        logger.warning("hhook: %s ended but no tensor went through this THCState (%s): nothing was compressed. %s",
                       where, self.describe(), idle_state(self._ddp_iterations is not None, where))
        return True

    def reset_stats(self) -> None:
        self._stats.reset()
        self._intra.reset()
        if self.inter is not None:
            self.inter.reset_stats()


def _loaded(saved: dict) -> THCState:
    """A state built from a :meth:`THCState.state_dict` (a component: not reported idle)."""
    state = THCState()
    _LIVE.discard(state)
    state._load(saved, announce=False)
    return state
