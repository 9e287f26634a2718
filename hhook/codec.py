r"""The THC codec: homomorphic compression that a stock SUM allreduce can add.

The codec does no communication. A transport (:mod:`hhook.allreduce` for
torch.distributed, the profiler for MPI, :mod:`hhook.horovod`) drives it in three stages
around two collectives:

1. :meth:`THCCodec.prepare` rotates the tensor, adds its error-feedback residual, and
   returns a small float32 vector: a header ``[non-finite flag, fingerprint,
   -fingerprint]`` followed by this rank's max ``|y|`` per block of the rotated tensor
   (without the residual).
2. The transport MAX-allreduces that vector. Every rank now holds the same scales;
   the flag says whether any rank saw inf/NaN, and ``max(f) == -max(-f)`` holds only
   if every rank has the same fingerprint (configuration and tensor length).
3. :meth:`THCCodec.quantize` rounds stochastically onto the agreed scales and packs
   the codes into lanes of integer words (see :mod:`hhook.lanes`).
4. The transport SUM-allreduces the words: every lane adds up without carries.
5. :meth:`THCCodec.decode` unpacks the lane sums, dequantizes to the mean, rotates
   back and writes the averaged result into the output in its own dtype.

This pure-torch codec is the specification: every accelerated path keeps these
signatures and is tested against it.
"""

from __future__ import annotations

import dataclasses

import torch

from . import cuda_kernels, lanes, quantization, rng, rotation

#: Bumped whenever the bits on the wire change meaning; part of the fingerprint.
CODEC_VERSION = 1
HEADER = 3  # non-finite flag, fingerprint, -fingerprint
_FINGERPRINT_BITS = 24  # integers below 2**24 are exact in float32
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class ConfigMismatchError(RuntimeError):
    """Ranks disagree on the codec configuration or on the tensor they reduce."""


@dataclasses.dataclass
class Prepared:
    """What stage 1 leaves for stages 3 and 5 of one tensor."""

    numel: int
    blocks: torch.Tensor  # rotated float32 (n_blocks, B), residual included
    scales: torch.Tensor  # header + local block maxima; the transport MAX-reduces it
    nonfinite: bool = False  # set by quantize() once the agreed header is known


class THCCodec:
    """Rotation, common scales, stochastic rounding and lane packing for ``world_size`` ranks."""

    def __init__(self, bits: int = 4, block_size: int = 1024, seed: int = 0, world_size: int = 1):
        if not isinstance(bits, int) or not 1 <= bits <= 8:
            raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")
        rotation.check_block_size(block_size)
        if not isinstance(seed, int) or not 0 <= seed < 2**32:
            raise ValueError(f"seed must be an integer in [0, 2**32), got {seed!r}")
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        self.bits = bits
        self.levels = 1 << bits
        self.block_size = block_size
        self.seed = seed
        self.world_size = world_size
        self.layout = lanes.choose_layout(world_size, self.levels)

    def __repr__(self) -> str:
        lay = self.layout
        return (
            f"THCCodec(bits={self.bits}, block_size={self.block_size}, seed={self.seed}, "
            f"world_size={self.world_size}: {lay.lanes} lanes of {lay.width} bits per "
            f"int{lay.word_bits})"
        )

    def describe(self) -> str:
        return f"bits={self.bits} block_size={self.block_size} seed={self.seed} version={CODEC_VERSION}"

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

    # -- fingerprints -------------------------------------------------------
    def fingerprint(self, numel: int | None = None) -> int:
        """24-bit hash of everything that must match across ranks (and the length)."""
        h = rng.mix32(CODEC_VERSION)
        for value in (self.bits, self.block_size, self.seed, self.world_size):
            h = rng.mix32(h ^ value)
        if numel is not None:
            h = rng.mix32(h ^ (numel & rng.MASK32))
            h = rng.mix32(h ^ (numel >> 32))
        return h >> (32 - _FINGERPRINT_BITS)

    def handshake_vector(self, device=None) -> torch.Tensor:
        """``[f, -f]`` of the configuration alone: MAX-reduce it once before the first call.

        The per-call header cannot catch a differing ``block_size`` by itself, because
        that changes the length of the scale vector the ranks reduce together.
        """
        f = float(self.fingerprint())
        return torch.tensor([f, -f], dtype=torch.float32, device=device)

    def check_handshake(self, agreed: torch.Tensor) -> None:
        if agreed[0].item() != -agreed[1].item():
            raise ConfigMismatchError(
                "hhook: ranks use different codec configurations; this rank has "
                f"{self.describe()}. Every rank must build THCState with the same options."
            )

    # -- stage 1 ------------------------------------------------------------
    def prepare(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Prepared:
        """Rotate ``x`` (any shape, fp32/fp16/bf16) and measure its local block maxima."""
        if x.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"hhook compresses float32, float16 and bfloat16 tensors, not {x.dtype}")
        numel = x.numel()
        block = self.block_for(numel)
        # On GPUs, fused kernels compute the same stage (hhook.cuda_kernels).
        if x.is_cuda and cuda_kernels.available() and cuda_kernels.supports(block):
            return cuda_kernels.prepare(self, x, residual)
        n_blocks = self.n_blocks(numel)
        flat = x.reshape(-1).to(torch.float32)
        if n_blocks * block != numel:
            padded = torch.zeros(n_blocks * block, dtype=torch.float32, device=x.device)
            padded[:numel] = flat
            flat = padded
        source = flat.view(n_blocks, block)
        blocks = torch.empty(n_blocks, block, dtype=torch.float32, device=x.device)
        scales = torch.empty(HEADER + n_blocks, dtype=torch.float32, device=x.device)
        maxima = scales[HEADER:]
        # Chunks of rows keep each rotated chunk in cache for its max: 2x faster on CPU.
        rows = max(1, quantization.CHUNK // block)
        for first in range(0, n_blocks, rows):
            y = rotation.rotate(source[first : first + rows], self.seed, out=blocks[first : first + rows])
            torch.amax(y.abs(), dim=1, out=maxima[first : first + rows])
            if residual is not None:
                # The scales cover the gradient, not the residual: a residual can be as
                # large as one step, and letting it raise the scale made it grow
                # geometrically at 1 bit. What exceeds the scale is clamped and stays in
                # the residual.
                y.add_(residual[first : first + rows])
        finite = bool(torch.isfinite(maxima).all())
        if not finite:
            maxima.zero_()
        scales[:HEADER] = self.header(numel, nonfinite=not finite)
        return Prepared(numel, blocks, scales)

    def header(self, numel: int, nonfinite: bool = False, device=None) -> torch.Tensor:
        """The scale vector's header: ``[non-finite flag, fingerprint, -fingerprint]``."""
        f = float(self.fingerprint(numel))
        return torch.tensor([1.0 if nonfinite else 0.0, f, -f], dtype=torch.float32, device=device)

    # -- stage 3 ------------------------------------------------------------
    def quantize(
        self, prepared: Prepared, agreed: torch.Tensor, key: int, residual: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Packed words for the SUM allreduce, or ``None`` when some rank is non-finite.

        ``agreed`` is the MAX-reduced scale vector; ``key`` selects this rank's rounding
        stream (:func:`hhook.rng.stream_key`). ``residual``, shaped like
        ``prepared.blocks``, receives this rank's rounding error for error feedback.
        Raises :class:`ConfigMismatchError` if the ranks' fingerprints differ.
        """
        if agreed[1].item() != -agreed[2].item():
            raise ConfigMismatchError(
                "hhook: ranks disagree on the codec configuration or on the tensor length "
                f"(this rank: {self.describe()}, numel={prepared.numel})"
            )
        if agreed[0].item() > 0:
            prepared.nonfinite = True
            return None
        # On GPUs, fused kernels compute the same stage (hhook.cuda_kernels).
        if prepared.blocks.is_cuda and cuda_kernels.available():
            return cuda_kernels.quantize(self, prepared, agreed, key, residual)
        blocks = prepared.blocks
        codes = lanes.code_buffer(blocks.numel(), self.layout, blocks.device)
        quantization.quantize_into(codes, blocks, agreed[HEADER:], self.levels, key, residual)
        return lanes.pack(codes, self.layout)

    # -- stage 5 ------------------------------------------------------------
    def decode(self, prepared: Prepared, agreed: torch.Tensor, words: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
        """Write the mean over ranks into ``out`` (NaN everywhere if any rank was non-finite)."""
        if prepared.nonfinite or words is None:
            return out.fill_(float("nan"))
        n_blocks, block = prepared.blocks.shape
        # On GPUs, fused kernels compute the same stage (hhook.cuda_kernels).
        if words.is_cuda and cuda_kernels.available() and cuda_kernels.supports(block):
            return cuda_kernels.decode(self, prepared, agreed, words, out)
        sums = lanes.unpack(words, self.layout, n_blocks * block).view(n_blocks, block)
        direct = out.dtype == torch.float32 and out.is_contiguous() and out.numel() == sums.numel()
        dest = out.view(n_blocks, block) if direct else sums
        rows = max(1, quantization.CHUNK // block)
        for first in range(0, n_blocks, rows):
            part = slice(first, first + rows)
            mean = quantization.dequantize(sums[part], agreed[HEADER:][part], self.levels, self.world_size)
            rotation.unrotate(mean, self.seed, out=dest[part])
        if not direct:
            out.view(-1).copy_(sums.view(-1)[: prepared.numel])
        return out
