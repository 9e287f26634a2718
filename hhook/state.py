r"""Per-process-group state shared by the DDP hook and :func:`hhook.thc_allreduce`."""

from __future__ import annotations

import logging
import math
import torch
import torch.distributed as dist

from .codec import THCCodec
from .predicted import PredictedScales
from .sequencer import Sequencer

#: The scale policies: agree on each step's maxima (two collectives), or predict them
#: from the previous step (one collective; :mod:`hhook.predicted`); "auto" picks per
#: device (see :meth:`THCState.mode`).
SCALE_MODES = ("auto", "agreed", "predicted")
#: Piece size of ``chunk_mb="auto"`` on CPUs: a 21 MB bucket goes in 2 pieces, DDP's
#: default 25 MB bucket in 3 (docs/train.md: 4 MB pieces cost more than they hide).
DEFAULT_CHUNK_MB = 12

logger = logging.getLogger(__name__)


class THCState:
    r"""Options, error-feedback residuals and byte counters of THC compression.

    Args:
        process_group: the group to reduce over; ``None`` means the default group.
        bits: bits per coordinate before headroom; ``2**bits`` quantization levels (1..8).
        block_size: rotation and scale block, a power of two (at most 65536). 1024 costs
            0.03 bits per coordinate for the scales.
        seed: shared seed of the rotation's random signs; must match on every rank.
        error_feedback: carry each rank's rounding error into its next call (costs one
            float32 copy of every compressed tensor). The rounding is unbiased, so this
            is optional.
        start_iter: the DDP hook runs a plain allreduce for the iterations before this
            one. DDP rebuilds its buckets after the first iteration, so per-bucket
            residuals are stable only from iteration 2. With predicted scales the last
            of these iterations also measures the first scales (its maxima travel with it).
        scales: ``"predicted"``: one SUM allreduce per bucket, with scales predicted
            from the previous step's block maxima, which travel in-band
            (:mod:`hhook.predicted`). ``"agreed"``: a MAX allreduce of this step's block
            maxima first, then the SUM; two rounds, but scales that never clip and no
            host read anywhere. ``"auto"`` (default): predicted for CPU tensors, agreed
            for CUDA tensors (the README's measurements say why).
        chunk_mb: split a tensor larger than this many MB of float32 into pieces of at
            most this size, each compressed and reduced on its own, so one piece is on
            the wire while the next is encoded and the previous decoded: part of the
            codec's time hides behind the wire's. Each piece costs a collective and the
            codec's fixed overhead, so pieces are large. ``"auto"`` (default): 12 MB for
            CPU tensors, whole tensors on GPUs (whose codec takes about a millisecond
            per bucket); ``0``: never split.

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
        # per-tensor state: error-feedback residuals keyed by bucket index or name
        "residuals",
        "predicted",
        # counters
        "iter",
        "calls",
        "_stats",
        # derived, rebuilt on demand and never pickled
        "_codec",
        "_verified",
        "_sum_group",
        "_sequencer",
    ]

    _PICKLED = (
        "bits", "block_size", "seed", "error_feedback", "start_iter", "scales", "chunk_mb", "residuals", "predicted",
        "iter", "calls", "_stats",
    )

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        bits: int = 4,
        block_size: int = 1024,
        seed: int = 0,
        error_feedback: bool = False,
        start_iter: int = 2,
        scales: str = "auto",
        chunk_mb: float | str = "auto",
    ):
        THCCodec(bits, block_size, seed)  # validates the options before any training
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
            raise ValueError(f"start_iter must be a non-negative integer, got {start_iter!r}")
        if not isinstance(error_feedback, bool):
            raise ValueError(f"error_feedback must be True or False, got {error_feedback!r}")
        if scales not in SCALE_MODES:
            raise ValueError(f"scales must be one of {SCALE_MODES}, got {scales!r}")
        if chunk_mb != "auto" and (
            isinstance(chunk_mb, bool) or not isinstance(chunk_mb, (int, float)) or not 0 <= chunk_mb < math.inf
        ):
            raise ValueError(f"chunk_mb must be 'auto' or a non-negative number of megabytes, got {chunk_mb!r}")
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"process_group must be a torch.distributed ProcessGroup or None, got {process_group!r}")
        if error_feedback and start_iter < 2:
            logger.warning(
                "hhook: error_feedback with start_iter=%d: DDP rebuilds buckets after the first "
                "iteration, so residuals of iteration 0 may be dropped", start_iter
            )
        self.process_group = process_group
        self.bits = bits
        self.block_size = block_size
        self.seed = seed
        self.error_feedback = bool(error_feedback)
        self.start_iter = start_iter
        self.scales = scales
        self.chunk_mb = chunk_mb
        self.residuals: dict = {}
        self.predicted = PredictedScales(bits, block_size, seed, self.error_feedback) if scales != "agreed" else None
        self.iter = 0
        self.calls = 0
        self._stats = dict.fromkeys(("dense_bytes", "wire_bytes", "compressed_calls", "dense_calls", "local_calls"), 0)
        self._codec = None
        self._verified = False
        self._sum_group = None
        self._sequencer = Sequencer()

    def __getstate__(self):
        # Like PowerSGDState: a process group cannot be pickled; the default one is used after loading.
        return {name: getattr(self, name) for name in self._PICKLED}

    def __setstate__(self, saved):
        self.process_group = None
        self._codec = None
        self._verified = False
        self._sum_group = None
        self._sequencer = Sequencer()
        saved.setdefault("scales", "agreed")  # saved before there was a choice
        saved.setdefault("predicted", None)
        saved.setdefault("chunk_mb", 0)  # saved before tensors were split
        for name, value in saved.items():
            setattr(self, name, value)

    def mode(self, device: torch.device) -> str:
        """The scale policy for tensors on ``device``: ``scales``, with ``"auto"`` resolved.

        Auto picks predicted scales on CPUs (one round per bucket; measured as fast or
        faster) and agreed ones on GPUs, where the predicted path's decode would read
        its summed header on the host once per bucket and stall the stream.
        """
        if self.scales != "auto":
            return self.scales
        return "agreed" if device.type == "cuda" else "predicted"

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
            self._codec = THCCodec(self.bits, self.block_size, self.seed, self.world_size)
        return self._codec

    def residual(self, key, shape: torch.Size, device: torch.device) -> torch.Tensor:
        """The error-feedback residual of ``key``, zeroed when the tensor's shape changed."""
        r = self.residuals.get(key)
        if r is None or r.shape != shape or r.device != device:
            r = self.residuals[key] = torch.zeros(shape, dtype=torch.float32, device=device)
        return r

    def maybe_increase_iter(self, bucket: dist.GradBucket) -> None:
        """Count DDP iterations: one per backward pass, on its last bucket."""
        if bucket.is_last():
            self.iter += 1

    def count(self, kind: str | None, dense_bytes: int, wire_bytes: int) -> None:
        """Add one call of ``kind`` (None: wire traffic that is not a call)."""
        if kind is not None:
            self._stats[kind] += 1
        self._stats["dense_bytes"] += dense_bytes
        self._stats["wire_bytes"] += wire_bytes

    def stats(self) -> dict:
        """Bytes since creation (or :meth:`reset_stats`) on this rank.

        ``dense_bytes``: what the same calls would have sent as float32.
        ``wire_bytes``: what was handed to collectives: codes, scales and the one-time
        configuration handshake, or the dense tensors of plain-allreduce iterations.
        ``local_calls``: calls in a world of one rank, which send and count nothing.
        """
        s = dict(self._stats)
        s["ratio"] = s["dense_bytes"] / s["wire_bytes"] if s["wire_bytes"] else float("nan")
        s["iter"] = self.iter
        return s

    def reset_stats(self) -> None:
        for name in self._stats:
            self._stats[name] = 0
