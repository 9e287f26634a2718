r"""Per-process-group state shared by the DDP hook and :func:`hhook.thc_allreduce`:
options, per-key state (through the scale policies), counters, and the transport pieces
built on first use (the node layout, the second communicator, the sequencer, deferred
device checks)."""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist

from . import rng
from .codec import THCCodec
from .groups import SecondGroup
from .errors import ConfigMismatchError
from .scales import ScalePolicy
from .sequencer import Sequencer
from .stats import Counters, two_level_stats
from .topology import Topology, TopologyError, auto_bits, detect_topology

#: The scale policies (:mod:`hhook.scales`): agree on each step's maxima (two
#: collectives; never clips; the default), or predict them from the previous step (one
#: collective once a key has history; clips blocks that grew). "auto", the default of
#: earlier versions (predicted on CPUs), is accepted and now means "agreed".
SCALE_MODES = ("agreed", "predicted")
#: Piece size of ``chunk_mb="auto"`` on CPUs: a 21 MB bucket goes in 2 pieces, DDP's
#: default 25 MB bucket in 3 (docs/train.md: 4 MB pieces cost more than they hide).
DEFAULT_CHUNK_MB = 12
#: ``topology=``: every rank a peer (the default), nodes from the launcher or hostnames,
#: or an integer number of ranks per node (:mod:`hhook.topology`).
TOPOLOGIES = ("flat", "auto")

logger = logging.getLogger(__name__)


class THCState:
    r"""Options, error-feedback residuals and byte counters of THC compression.

    Args:
        process_group: the group to reduce over; ``None`` means the default group.
        bits: bits per coordinate before headroom; ``2**bits`` quantization levels (1..8).
            ``"auto"``: the fewest bits whose predicted error of the mean, at this
            world size (or node count, two-level), is no worse than 4 bits at 4 ranks
            rounding independently (:func:`hhook.topology.auto_bits`; correlated
            rounding: 5 at 2 ranks, 4 at 3-8, 3 at 16, 2 at 64-128, 1 at 1024; 3 for
            8 nodes of 8): large jobs average rounding noise away and get narrower lanes.
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
            (:mod:`hhook.two_level`) when the group spans several nodes of equal size:
            dense inside each node, THC between nodes with lanes sized for the number
            of nodes, each rank encoding ``1 / ranks_per_node`` of the tensor. Nodes
            come from the launcher's variables or the hostnames (:mod:`hhook.topology`);
            one node, one rank per node or uneven nodes fall back to flat with one log
            line. The layout is found once, blocking, on every rank (it creates process
            groups): at :func:`hhook.register`, else at the first call; a request that
            cannot hold raises :class:`~hhook.topology.TopologyError` on every rank.
        rounding: ``"correlated"`` (default): the ranks' rounding thresholds for each
            coordinate are spread over the unit interval (:class:`hhook.rng.Stream`),
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
        # derived, rebuilt on demand and never pickled
        "_codec",
        "_verified",
        "_second",
        "_sequencer",
        "_pending",
        "_defer_on_cpu",
        "_topo",
        "_hook_checked",
    ]

    _PICKLED = (
        "bits", "block_size", "seed", "error_feedback", "start_iter", "scales", "chunk_mb", "topology", "policies",
        "iter", "calls", "_stats", "inter", "_intra", "rounding",
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
        self._reset_derived()

    def _reset_derived(self) -> None:
        self._codec = None
        self._verified = set()
        self._second = {}
        self._sequencer = Sequencer()
        self._pending = []
        self._defer_on_cpu = False  # tests: run the GPU's deferred checks on CPU tensors
        self._topo = None
        self._hook_checked = False

    def __getstate__(self):
        # Like PowerSGDState: a process group cannot be pickled; the default one is used after loading.
        saved = {name: getattr(self, name) for name in self._PICKLED}
        saved["layout"] = self._topo.record() if self._topo is not None else self._saved_layout
        return saved

    def __setstate__(self, saved):
        self.process_group = None
        self._reset_derived()
        if saved.get("scales", "auto") == "auto":  # saved before there was a choice, or with "auto"
            saved["scales"] = "agreed"
        saved.setdefault("chunk_mb", 0)  # saved before tensors were split
        if "residuals" in saved or "predicted" in saved:
            saved.pop("residuals", None)
            saved.pop("predicted", None)
            logger.warning("hhook: a THCState saved by an older hhook: its residuals and predicted scales start afresh")
        saved.setdefault("policies", {})
        saved.setdefault("topology", "flat")  # saved before there were nodes
        saved.setdefault("rounding", "independent")  # saved before there was a choice: what it ran
        saved.setdefault("inter", None)
        self._saved_layout = saved.pop("layout", None)
        intra = saved.pop("_intra", {})
        self._intra = intra if isinstance(intra, Counters) else Counters(intra)
        stats = saved.pop("_stats", {})
        self._stats = stats if isinstance(stats, Counters) else Counters(stats)  # a dict before Counters
        for name, value in saved.items():
            setattr(self, name, value)

    def policy(self, mode: str) -> ScalePolicy:
        """The scale policy of ``mode`` ("agreed" or "predicted"), with its per-key state."""
        policy = self.policies.get(mode)
        if policy is not None and getattr(policy, "rounding", "independent") != self.rounding:
            logger.warning(
                "hhook: per-key state saved under rounding=%r, this state rounds %r: its residuals and "
                "scales start afresh", getattr(policy, "rounding", "independent"), self.rounding,
            )
            policy = None
        if policy is None:
            policy = self.policies[mode] = ScalePolicy(
                self.codec_bits(), self.block_size, self.seed, self.error_feedback, predict=mode == "predicted",
                rounding=self.rounding,
            )
        return policy

    def config_id(self) -> int:
        """A hash of every option that changes which collectives run, in what order or
        with what lengths: part of the handshake and of every message's fingerprint."""
        h = rng.mix32(0x53434844)
        chunk = -1 if self.chunk_mb == "auto" else int(round(self.chunk_mb * 1024))
        topology = {"flat": 0, "auto": 1}.get(self.topology, 2 + (self.topology if isinstance(self.topology, int) else 0))
        for value in (SCALE_MODES.index(self.scales), chunk & rng.MASK32, self.start_iter, int(self.error_feedback),
                      topology & rng.MASK32):
            h = rng.mix32(h ^ value)
        return h

    def describe(self) -> str:
        return (f"bits={self.bits} block_size={self.block_size} seed={self.seed} scales={self.scales} "
                f"chunk_mb={self.chunk_mb} start_iter={self.start_iter} error_feedback={self.error_feedback} "
                f"topology={self.topology} rounding={self.rounding}")

    def codec_bits(self) -> int:
        """The bits the codec uses: ``bits``, or for ``"auto"`` the rule of
        :func:`~hhook.topology.auto_bits` at this group's world size (a two-level state's
        shards use the inter-node state's, sized for the number of nodes)."""
        return auto_bits(self.world_size, rounding=self.rounding) if self.bits == "auto" else self.bits

    def node_layout(self) -> Topology:
        """The node layout of ``process_group`` under the ``topology`` option, found once.

        The first call (on every rank, at the same point of the program: it may create
        process groups) runs :func:`~hhook.topology.detect_topology` (one small
        all-gather, also for ``"flat"``, so ranks that disagree fail together), checks it
        against the layout a checkpoint was saved with, and for two-level builds :attr:`inter`, the THC state
        of this rank's shard between nodes (same options; ``bits="auto"`` sized for the
        node count). Raises :class:`~hhook.topology.TopologyError` on every rank alike.
        """
        if self._topo is None:
            if not dist.is_initialized():
                raise RuntimeError("hhook: torch.distributed is not initialized (see hhook.init_distributed)")
            # One small all-gather even for "flat": ranks that disagree on the layout then
            # raise TopologyError together instead of one rank waiting in a collective
            # the others never start.
            topo = detect_topology(self.process_group, ranks_per_node=self.topology)
            topo.check_record(self._saved_layout)
            if topo.two_level:
                if self.inter is None:
                    bits = (auto_bits(topo.n_nodes, topo.ranks_per_node, rounding=self.rounding) if self.bits == "auto"
                            else self.bits)
                    self.inter = THCState(
                        topo.inter_group, bits, self.block_size, self.seed, self.error_feedback, self.start_iter,
                        self.scales, self.chunk_mb, rounding=self.rounding,
                    )
                else:  # restored from a checkpoint of the same layout
                    self.inter.process_group = topo.inter_group
            elif self.inter is not None:
                raise TopologyError("hhook: this THCState holds two-level state but the layout found is flat")
            self._topo = topo
        return self._topo

    def mode(self, device: torch.device) -> str:
        """The scale policy for tensors on ``device`` (the same on every device)."""
        return self.scales

    def next_call(self) -> int:
        """A number no earlier call of this rank had (it selects the rounding stream)."""
        self.calls += 1
        return self.calls - 1

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
            self._second[device.type] = SecondGroup(self.process_group, device.type)
        self._verified.add(device.type)

    def check_options(self, group, device: torch.device) -> None:
        """A blocking MAX allreduce over ``group`` of this state's options fingerprint
        (codec and schedule): differing options raise :class:`ConfigMismatchError` on
        every rank before the first message. Also builds the fused backend for
        ``device`` (a first compile belongs here, not in a later stage)."""
        from .codec import warm_up

        codec = THCCodec(self.codec_bits(), self.block_size, self.seed, dist.get_world_size(group), self.rounding)
        warm_up(device)
        f = float(rng.mix32(codec.fingerprint() ^ self.config_id()) >> 8)  # 24 bits: exact in float32
        vector = torch.tensor([f, -f], dtype=torch.float32, device=device)
        dist.all_reduce(vector, dist.ReduceOp.MAX, group=group)
        self.count(None, 0, vector.nbytes)
        if vector[0].item() != -vector[1].item():
            raise ConfigMismatchError(
                "hhook: ranks use different THC options (configuration); this rank has "
                f"{self.describe()} (codec {codec.describe()}). Every rank must build THCState "
                "with the same options."
            )

    def check_hook_options(self, device: torch.device) -> None:
        """The DDP hook's first call, on every rank, before its first collective: the node
        layout, then the options handshake over the whole group (its plain iterations
        before ``start_iter`` depend on the options as much as the compressed ones)."""
        if self.world_size > 1:  # in a world of one nothing is sent, nothing can mismatch
            if self.node_layout().two_level:
                self.check_options(self.process_group, device)
            else:
                self.handshake(device)
        self._hook_checked = True

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
        return s

    def reset_stats(self) -> None:
        self._stats.reset()
        self._intra.reset()
        if self.inter is not None:
            self.inter.reset_stats()
