r"""The THC codec: homomorphic compression that a stock SUM allreduce can add.

The codec does no communication. A transport (:mod:`hhook.schedule.allreduce` for
torch.distributed, the profiler for MPI, :mod:`hhook.horovod`) drives it in three stages
around two collectives:

1. :meth:`THCCodec.prepare` rotates the tensor and returns a small float32 vector: a
   header (:data:`HEADER`: non-finite flag, configuration fingerprint, digest of the
   tensor's bits) followed by this rank's max ``|y|`` per block of the rotated tensor.
2. The transport MAX-allreduces that vector. Every rank now holds the same scales; the
   flag says whether any rank saw inf/NaN, and ``max(v) == -max(-v)`` says whether every
   rank sent the same fingerprint (configuration and length) and the same digest
   (identical tensors, whose mean is exact without any rounding).
3. :meth:`THCCodec.quantize` rounds stochastically onto the agreed scales (plus the
   error-feedback residual) and packs the codes into lanes of integer words
   (:mod:`hhook.codec.lanes`).
4. The transport SUM-allreduces the words: every lane adds up without carries.
5. :meth:`THCCodec.decode` unpacks the lane sums, dequantizes to the mean, rotates back
   and writes the averaged result into the output in its own dtype.

No stage reads a device value on the host: the header's verdicts are applied by tensor
operations (or inside the kernels), so on a GPU nothing stalls the stream. A transport
that wants an exception for a configuration mismatch calls :meth:`THCCodec.verify` where
a synchronisation is free or happens anyway; :meth:`~THCCodec.decode` writes NaN in any case.

This pure-torch codec is the specification: every accelerated backend (a module with
``prepare``, ``quantize`` and ``decode`` of the same signatures) is tested against it.
"""

from __future__ import annotations

import functools

import torch

from . import lanes, quantization, rng, rotation
from .kernels import cpu as cpu_kernels
from .kernels import cuda as cuda_kernels
from .layout import (HEADER, SUPPORTED_DTYPES, Prepared, agreed_status, constant, overflow_limit, prefix_verdict,
                     write_prefix)
from ..errors import ConfigMismatchError

#: Bumped whenever any decoded bit changes (the bits on the wire change meaning, or the
#: same summed words decode to other values): part of the fingerprint and of the options
#: handshake, which names both versions. 3: the rounding mode (correlated by default)
#: joined the fingerprint. 4: the rotation's specification (one butterfly order, one
#: multiply by float32(1/sqrt B): docs/codec.md), whose change decoded the same words to
#: other bits under version 3.
CODEC_VERSION = 4
#: How ranks draw their rounding thresholds (:class:`hhook.codec.rng.Stream`): spread over the
#: unit interval across ranks (about half the error of the mean, docs/codec.md), or each
#: rank on its own. Part of the fingerprint.
ROUNDINGS = ("correlated", "independent")
_FINGERPRINT_BITS = 24  # integers below 2**24 are exact in float32


def fused_backend(x: torch.Tensor, block: int):
    """The fused module that computes the codec for tensors like ``x``, or None.

    CUDA tensors go to :mod:`hhook.codec.kernels.cuda` when its kernels compiled for that
    device, CPU tensors to :mod:`hhook.codec.kernels.cpu` when a C compiler built it (each
    once; a failure logs one line and falls back here); ``HHOOK_FORCE_REFERENCE=1``
    forces this reference everywhere.
    """
    if x.is_cuda and cuda_kernels.usable(x.device, block):
        return cuda_kernels
    if x.device.type == "cpu" and cpu_kernels.supports(block) and cpu_kernels.available():
        return cpu_kernels
    return None


def warm_up(device: torch.device) -> None:
    """Build (or load) the fused backend for ``device`` now: its first compile takes
    seconds, and a failure should fall back with its log line before training, not
    inside the first backward pass."""
    device = torch.device(device)
    if device.type == "cuda":
        cuda_kernels.warm_up(device)
    elif device.type == "cpu":
        cpu_kernels.available()


@functools.lru_cache(maxsize=4096)
def _fingerprint(bits: int, block_size: int, seed: int, world_size: int, rounding: str, numel: int | None) -> int:
    h = rng.mix32(CODEC_VERSION)
    for value in (bits, block_size, seed, world_size, ROUNDINGS.index(rounding)):
        h = rng.mix32(h ^ value)
    if numel is not None:
        h = rng.mix32(h ^ (numel & rng.MASK32))
        h = rng.mix32(h ^ (numel >> 32))
    return h >> (32 - _FINGERPRINT_BITS)


def _flag_residual(prepared: Prepared, residual: torch.Tensor | None, block: int) -> Prepared:
    """Set ``prepared``'s non-finite flag (and zero its maxima) when ``residual`` holds
    inf/NaN or a value at the overflow limit: tensor operations, no host read (the CPU
    kernel does this inside its own pass)."""
    if residual is None or residual.numel() == 0:
        return prepared
    expected = -(-prepared.numel // block) * block
    if residual.numel() != expected:
        raise ValueError(f"hhook: the residual must have {expected} elements, got {tuple(residual.shape)}")
    bad = ~(residual.abs().amax() < overflow_limit(block))
    flag = torch.maximum(prepared.scales[0], bad.to(torch.float32))
    prepared.scales[0] = flag
    prepared.scales[HEADER:].masked_fill_(bad, 0.0)
    if prepared.header is not None:
        prepared.header[0] = flag
    return prepared


class THCCodec:
    """Rotation, common scales, stochastic rounding and lane packing for ``world_size`` ranks."""

    def __init__(self, bits: int = 4, block_size: int = 1024, seed: int = 0, world_size: int = 1,
                 rounding: str = "correlated"):
        if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
            raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")
        rotation.check_block_size(block_size)
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
            raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding!r}")
        self.bits = bits
        self.rounding = rounding
        self.levels = 1 << bits
        self.block_size = block_size
        self.seed = seed
        self.world_size = world_size
        self.layout = lanes.choose_layout(world_size, self.levels)

    def __repr__(self) -> str:
        lay = self.layout
        return (
            f"THCCodec(bits={self.bits}, block_size={self.block_size}, seed={self.seed}, "
            f"world_size={self.world_size}, rounding={self.rounding}: {lay.lanes} lanes of {lay.width} bits per "
            f"int{lay.word_bits})"
        )

    def describe(self) -> str:
        return (f"bits={self.bits} block_size={self.block_size} seed={self.seed} rounding={self.rounding} "
                f"version={CODEC_VERSION}")

    # -- sizes --------------------------------------------------------------
    def block_for(self, numel: int) -> int:
        """Block size used for a tensor: ``block_size``, or less for tiny tensors.

        A tensor of 10 elements is padded to 16, not to 1024.
        """
        return min(self.block_size, 1 << max(numel - 1, 0).bit_length())

    def n_blocks(self, numel: int) -> int:
        return -(-numel // self.block_for(numel))

    def scales_numel(self, numel: int) -> int:
        return HEADER + self.n_blocks(numel)

    def words_numel(self, numel: int) -> int:
        return self.layout.n_words(self.n_blocks(numel) * self.block_for(numel))

    def wire_bytes(self, numel: int) -> int:
        """Bytes one rank hands to the two collectives for a tensor of ``numel``."""
        word_bytes = self.layout.word_bits // 8
        return 4 * self.scales_numel(numel) + word_bytes * self.words_numel(numel)

    # -- rounding -----------------------------------------------------------
    def stream(self, rank: int, call: int, shared: int | None = None) -> rng.Stream:
        """The rounding stream of ``rank`` (its index among the ``world_size`` ranks that
        sum) for one call: ``call`` must differ between this rank's calls; ``shared``
        (default ``call``) must be the same on every rank for this call, since correlated
        rounding derives the ranks' common strata from it."""
        key = rng.stream_key(self.seed, rank, call)
        if self.rounding == "independent" or self.world_size == 1:
            return rng.Stream(key)
        return rng.Stream(key, rng.shared_key(self.seed, call if shared is None else shared), rank, self.world_size)

    # -- fingerprints -------------------------------------------------------
    def fingerprint(self, numel: int | None = None) -> int:
        """24-bit hash of everything that must match across ranks (and the length); kept
        per configuration and length (every bucket of a step asks again)."""
        return _fingerprint(self.bits, self.block_size, self.seed, self.world_size, self.rounding, numel)

    def verify(self, agreed: torch.Tensor, numel: int) -> None:
        """Raise :class:`ConfigMismatchError` if the ranks' fingerprints differ.

        Reads the agreed header on the host: a transport calls it where a
        synchronisation costs nothing (CPU tensors) or happens anyway. Without it,
        :meth:`decode` still turns a mismatch into NaN, never into a wrong mean.
        """
        if bool(agreed_status(agreed)[1]):
            raise ConfigMismatchError(
                "hhook: ranks disagree on the codec configuration or on the tensor length "
                f"(this rank: {self.describe()}, numel={numel})"
            )

    # -- stage 1 ------------------------------------------------------------
    def header(self, numel: int, nonfinite=0.0, digest=None, device=None) -> torch.Tensor:
        """The scale vector's header (see :data:`HEADER`).

        ``nonfinite`` and ``digest`` may be tensors (0-d float and int64), so building it
        never synchronises. ``digest=None`` means "unknown": the header then never
        reads as identical, which is what a vector of predicted scales needs.
        """
        f = float(self.fingerprint(numel))
        head = constant([0.0, f, -f, 0.0, 1.0, 0.0, 1.0], torch.float32, device)
        head[0] = nonfinite
        if digest is not None:
            digest = torch.as_tensor(digest, dtype=torch.int64, device=head.device)
            halves = torch.stack((digest & 0xFFFFFF, (digest >> 24) & 0xFFFFFF)).to(torch.float32)
            head[3::2] = halves
            head[4::2] = -halves
        return head

    def prepare(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Prepared:
        """Stage 1: the scale vector of ``x`` (any shape, fp32/fp16/bf16).

        The header carries the non-finite flag (block maxima are zeroed when it is set),
        the fingerprint of the configuration and length, and the digest of ``x``'s bits;
        the rest is this rank's max ``|y|`` per block of the rotated tensor. ``residual``:
        the error feedback that :meth:`quantize` will add (float32 ``(n_blocks, B)``); the
        flag covers it, so whatever this rank encodes (``y + residual``) holding inf/NaN
        flags the exchange on every rank rather than rounding to a finite wrong code (a
        NaN rounds to code 0). Both below :func:`~hhook.codec.layout.overflow_limit`,
        their sum is finite. Nothing here reads a device value on the host.
        """
        if x.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"hhook compresses float32, float16 and bfloat16 tensors, not {x.dtype}")
        numel = x.numel()
        block = self.block_for(numel)
        source = x.reshape(-1)
        backend = fused_backend(x, block)
        if backend is cpu_kernels:
            return backend.prepare(self, source, residual)
        if backend is not None:
            return _flag_residual(backend.prepare(self, source), residual, block)
        n_blocks = self.n_blocks(numel)
        flat = source.to(torch.float32)
        bits = flat.view(torch.int32)
        if n_blocks * block != numel:
            padded = torch.zeros(n_blocks * block, dtype=torch.float32, device=x.device)
            padded[:numel] = flat
            flat = padded
        rows_in = flat.view(n_blocks, block)
        blocks = torch.empty(n_blocks, block, dtype=torch.float32, device=x.device)
        scales = torch.empty(HEADER + n_blocks, dtype=torch.float32, device=x.device)
        maxima = scales[HEADER:]
        # Chunks of rows keep each rotated chunk in cache for its max: 2x faster on CPU.
        rows = max(1, quantization.CHUNK // block)
        for first in range(0, n_blocks, rows):
            y = rotation.rotate(rows_in[first : first + rows], self.seed, out=blocks[first : first + rows])
            torch.amax(y.abs(), dim=1, out=maxima[first : first + rows])
        nonfinite = ~(maxima < overflow_limit(block)).all()  # inf, NaN, or too large to sum (layout.overflow_limit)
        maxima.masked_fill_(nonfinite, 0.0)
        scales[:HEADER] = self.header(numel, nonfinite, rng.digest(bits), device=x.device)
        prepared = Prepared(numel, source, scales, blocks, header=scales[:HEADER].clone())
        return _flag_residual(prepared, residual, block)

    # -- stage 3 ------------------------------------------------------------
    def quantize(
        self,
        prepared: Prepared,
        agreed: torch.Tensor,
        key: int,
        residual: torch.Tensor | None = None,
        residual_out: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        prefix: tuple | None = None,
    ) -> torch.Tensor:
        """Stage 3: the packed words for the SUM allreduce (written into ``out`` if given:
        a contiguous tensor of :meth:`words_numel` words, e.g. the tail of a message).
        ``prefix``: ``(words, fingerprints)``: also write this rank's message prefix
        (:func:`hhook.codec.layout.write_prefix`) into those words (CUDA: the same launch).

        ``agreed`` is the MAX-reduced scale vector (or, with predicted scales, a header
        and the predicted scales); ``key`` is this rank's rounding stream
        (:meth:`stream`; a bare integer key rounds independently). With error feedback, ``residual`` (float32,
        ``(n_blocks, B)``) is added to the rotated blocks before rounding, and the new
        rounding error is written to ``residual_out`` (default: ``residual``, in place),
        unless the header says some rank was non-finite or every rank's tensor is the
        same: then the words are zeros (decode ignores them) and ``residual_out``
        receives the old residual. No host reads: the header checks are tensor operations.
        """
        if residual_out is None:
            residual_out = residual
        if out is not None and (
            out.dtype != self.layout.word_dtype or out.numel() != self.words_numel(prepared.numel)
            or not out.is_contiguous() or out.device != prepared.source.device
        ):
            raise ValueError(
                f"hhook: quantize's out must be a contiguous {self.layout.word_dtype} tensor of "
                f"{self.words_numel(prepared.numel)} words on {prepared.source.device}, got "
                f"{tuple(out.shape)} {out.dtype} on {out.device}"
            )
        if prepared.backend is cuda_kernels:
            return cuda_kernels.quantize(self, prepared, agreed, key, residual, residual_out, out, prefix)
        if prefix is not None:
            write_prefix(prefix[0], prefix[1], prepared.header)
        if prepared.backend is not None:
            return prepared.backend.quantize(self, prepared, agreed, key, residual, residual_out, out)
        nonfinite, _, identical = agreed_status(agreed)
        blocks = prepared.blocks
        codes = lanes.code_buffer(blocks.numel(), self.layout, blocks.device)
        if residual is None:
            quantization.quantize_into(codes, blocks, agreed[HEADER:], self.levels, key)
        else:
            fresh = torch.empty_like(blocks)
            quantization.quantize_into(codes, blocks + residual, agreed[HEADER:], self.levels, key, fresh)
            residual_out.copy_(torch.where(nonfinite | identical, residual, fresh))
        codes.masked_fill_(nonfinite | identical, 0)  # the words carry nothing then: zeros, as the kernels send
        words = lanes.pack(codes, self.layout)
        return words if out is None else out.copy_(words)

    # -- stage 5 ------------------------------------------------------------
    def decode(self, prepared: Prepared, agreed: torch.Tensor, words: torch.Tensor, out: torch.Tensor,
               check: tuple | None = None) -> torch.Tensor:
        """Stage 5: write the mean over ranks into ``out`` (shaped like the input).

        NaN everywhere if any rank was non-finite or the fingerprints differ (see
        :meth:`verify` for the error); the input itself, exactly, if every rank's input
        had the same bits. ``check``: ``(summed prefix, world size, fingerprints, flags)``:
        NaN too unless the summed message prefix is right
        (:func:`hhook.codec.layout.prefix_verdict`), and its verdict into the int32
        ``flags`` (``[bad, nonfinite]``, or None); no host read (the CUDA kernel checks it
        in the same launch).
        """
        if prepared.backend is cuda_kernels:
            return cuda_kernels.decode(self, prepared, agreed, words, out, check)
        if check is not None:
            bad, nonfinite = prefix_verdict(*check[:3])
            self.decode(prepared, agreed, words, out)
            out.masked_fill_(bad, float("nan"))
            if check[3] is not None:
                check[3].copy_(torch.stack((bad, nonfinite)))
            return out
        if prepared.backend is not None:
            return prepared.backend.decode(self, prepared, agreed, words, out)
        n_blocks = self.n_blocks(prepared.numel)
        block = self.block_for(prepared.numel)
        nonfinite, mismatch, identical = agreed_status(agreed)
        sums = lanes.unpack(words, self.layout, n_blocks * block).view(n_blocks, block)
        rows = max(1, quantization.CHUNK // block)
        for first in range(0, n_blocks, rows):
            part = slice(first, first + rows)
            mean = quantization.dequantize(sums[part], agreed[HEADER:][part], self.levels, self.world_size)
            rotation.unrotate(mean, self.seed, out=sums[part])
        mean = sums.view(-1)[: prepared.numel]
        result = torch.where(identical, prepared.source.to(torch.float32), mean)
        result.masked_fill_(nonfinite | mismatch, float("nan"))
        out.view(-1).copy_(result) if out.is_contiguous() else out.copy_(result.view(out.shape))
        return out
