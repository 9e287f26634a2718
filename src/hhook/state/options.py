r"""THCState's options: validated once, immutable, and the fingerprint every rank compares.

Every option is a field of the options handshake (:meth:`Options.fields`,
:mod:`hhook.schedule.handshake`): ranks built with different options raise
:class:`~hhook.errors.ConfigMismatchError` together, naming each option that differs
with each rank's value. Those that change which collectives run, in what order or with
what lengths are also folded into every message's fingerprint (:meth:`Options.config_id`).
"""

from __future__ import annotations

import dataclasses
import math

from ..codec import CODEC_VERSION, THCCodec, rng
from ..codec.error_model import auto_bits
from ..scales import gathered

#: The scale policies (:mod:`hhook.scales`): agree on each step's maxima (two
#: collectives; never clips), predict them from the previous step (one collective once a
#: key has history; clips blocks that grew), or let each rank keep its own and gather
#: every rank's codes (one all-gather; never clips; bytes grow with the ranks).
SCALE_MODES = ("agreed", "predicted", "gathered")
#: ``scales=``: a mode, or ``"auto"`` (the default, :meth:`Options.scale_mode`).
SCALES = SCALE_MODES + ("auto",)
#: Piece size of ``chunk_mb="auto"`` on CPUs: a 21 MB bucket goes in 2 pieces, DDP's
#: default 25 MB bucket in 3 (docs/train.md: 4 MB pieces cost more than they hide).
DEFAULT_CHUNK_MB = 12
#: ``topology=``: every rank a peer (the default), nodes from the launcher or hostnames,
#: or an integer number of ranks per node (:mod:`hhook.schedule.topology`).
TOPOLOGIES = ("flat", "auto")
#: The options, in the order of :class:`hhook.THCState`'s arguments after the group.
NAMES = ("bits", "block_size", "seed", "error_feedback", "start_iter", "scales", "chunk_mb", "topology", "rounding")


@dataclasses.dataclass(frozen=True)
class Options:
    """The options of :class:`hhook.THCState` (documented there), checked on construction."""

    bits: int | str = 4
    block_size: int = 1024
    seed: int = 0
    error_feedback: bool = False
    start_iter: int = 2
    scales: str = "auto"
    chunk_mb: float | str = "auto"
    topology: str | int = "flat"
    rounding: str = "correlated"

    def __post_init__(self):
        bits, start_iter, chunk_mb, topology = self.bits, self.start_iter, self.chunk_mb, self.topology
        THCCodec(4 if bits == "auto" else bits, self.block_size, self.seed, rounding=self.rounding)
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
            raise ValueError(f"start_iter must be a non-negative integer, got {start_iter!r}")
        if not isinstance(self.error_feedback, bool):
            raise ValueError(f"error_feedback must be True or False, got {self.error_feedback!r}")
        if self.scales not in SCALES:
            raise ValueError(f"scales must be one of {SCALES}, got {self.scales!r}")
        if chunk_mb != "auto" and (
            isinstance(chunk_mb, bool) or not isinstance(chunk_mb, (int, float)) or not 0 <= chunk_mb < math.inf
        ):
            raise ValueError(f"chunk_mb must be 'auto' or a non-negative number of megabytes, got {chunk_mb!r}")
        if topology not in TOPOLOGIES and (isinstance(topology, bool) or not isinstance(topology, int) or topology < 1):
            raise ValueError(f"topology must be 'flat', 'auto' or a positive number of ranks per node, got {topology!r}")
        if self.error_feedback and start_iter < 2:
            # As PowerSGD: DDP rebuilds its buckets after the first iteration, and a
            # residual kept for a bucket index would be added to another bucket's gradients.
            raise ValueError(
                f"error_feedback needs start_iter >= 2 (got {start_iter}): DDP rebuilds its buckets "
                "after the first iteration, so per-bucket residuals are stable only from iteration 2"
            )

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in NAMES}

    def describe(self) -> str:
        return (f"bits={self.bits} block_size={self.block_size} seed={self.seed} scales={self.scales} "
                f"chunk_mb={self.chunk_mb} start_iter={self.start_iter} error_feedback={self.error_feedback} "
                f"topology={self.topology} rounding={self.rounding}")

    def codec_bits(self, world_size: int) -> int:
        """The bits the codec uses over ``world_size`` ranks: ``bits``, or for ``"auto"``
        the rule of :func:`~hhook.codec.error_model.auto_bits`."""
        if self.bits != "auto":
            return self.bits
        return auto_bits(world_size, rounding=self.rounding)

    def scale_mode(self, world_size: int, device, two_level: bool = False) -> str:
        """The scale mode of exchanges over ``world_size`` ranks of tensors on ``device``
        (its type; None: not known): ``scales``, or for ``"auto"`` gathered scales on the
        CPU over a flat layout of 2 to :data:`~hhook.scales.gathered.MAX_RANKS` ranks (one
        round, and at most agreed scales' bytes up to 3 ranks, 1.25x at 4), agreed scales
        elsewhere: on GPUs (whose fused kernels check an agreed message without a host
        read), between the nodes of a two-level layout, over more ranks."""
        if self.scales != "auto":
            return self.scales
        on_cpu = getattr(device, "type", device) == "cpu"
        return "gathered" if on_cpu and not two_level and 1 < world_size <= gathered.MAX_RANKS else "agreed"

    def agreed_unless_gathered(self) -> bool:
        """Whether an exchange that runs no gathered scales (FSDP2's reduce-scatter,
        ``bits="auto"``'s ``thc:A`` beside its own gathered candidate) runs agreed scales
        under these options: ``scales`` is ``"agreed"``, or ``"auto"``."""
        return self.scales in ("agreed", "auto")

    def piece_limit(self) -> tuple[int, int]:
        """The most elements of a piece that travels on its own (a tensor above it goes in
        equal pieces of whole blocks, :func:`hhook.schedule.context.pieces`), on the CPU and
        elsewhere; 0: tensors travel whole. ``chunk_mb="auto"``: :data:`DEFAULT_CHUNK_MB`
        on the CPU, whole tensors on GPUs (and on a slow link for agreed scales, decided
        at each call: :func:`hhook.schedule.link.limit`)."""
        def limit(chunk_mb) -> int:
            return int(chunk_mb * 2**20) // 4

        if self.chunk_mb == "auto":
            return limit(DEFAULT_CHUNK_MB), 0
        return limit(self.chunk_mb), limit(self.chunk_mb)

    def config_id(self) -> int:
        """A hash of every option that changes which collectives run, in what order or
        with what lengths: part of every message's fingerprint. (What ``bits="auto"``'s
        decision measures is compared by the registration's handshake and the decision's
        own checks, :mod:`hhook.decision`.)"""
        h = rng.mix32(0x53434844)
        chunk = -1 if self.chunk_mb == "auto" else int(round(self.chunk_mb * 1024))
        topology = {"flat": 0, "auto": 1}.get(self.topology, 2 + (self.topology if isinstance(self.topology, int) else 0))
        auto = 0 if self.bits != "auto" else 1
        for value in (SCALES.index(self.scales), chunk & rng.MASK32, self.start_iter, int(self.error_feedback),
                      topology & rng.MASK32, auto & rng.MASK32):
            h = rng.mix32(h ^ value)
        return h

    def fields(self) -> tuple:
        """What the options handshake compares (:func:`hhook.schedule.handshake.agree`):
        every option, as given (``bits="auto"`` itself, not the width it gives), and the
        codec's version, which changes with any change of the decoded bits."""
        return tuple((name, getattr(self, name)) for name in NAMES) + (("codec_version", CODEC_VERSION),)
