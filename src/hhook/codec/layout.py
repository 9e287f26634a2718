r"""The codec's data layout, shared by the torch reference and the fused backends.

Only formats live here (the scale vector's header, what stage 1 hands to stages 3 and 5,
the dtypes the codec takes, and the prefix that messages carry in front of the words,
which :mod:`hhook.scales.message` describes), so :mod:`hhook.codec` can dispatch to the
backends and the backends can read these formats without importing the codec: each layer
looks down. The fused CUDA kernels write and check the prefix themselves
(``csrc/thc_kernels.cu``: ``hh_write_prefix``, ``hh_decode``); the functions here are the
specification they are tested against.
"""

from __future__ import annotations

import dataclasses

import torch

#: The scale vector's header: ``[non-finite flag, f, -f, d_lo, -d_lo, d_hi, -d_hi]``.
#: ``f`` is the configuration fingerprint, ``d_lo``/``d_hi`` the two 24-bit halves of a
#: 48-bit digest of the tensor's bits. After the MAX allreduce, ``max(v) == -max(-v)``
#: holds exactly when every rank sent the same ``v``.
HEADER = 7
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def overflow_limit(block: int) -> float:
    """The smallest block maximum ``M`` (of ``|y|``, rotated) that counts as non-finite.

    Below it nothing overflows on the way: ``2 M`` (the rounding step), the dequantized
    mean (at most ``M`` in magnitude) and the inverse rotation's unnormalised sums (at most
    ``B M``) all stay under ``2**127``. At or above it (``2**(126 - log2 B)``: 8.5e37 at
    ``B = 1``, 8.3e34 at 1024) a finite input would decode to inf or NaN, so every backend
    flags the block as it flags inf and NaN: the bucket comes back NaN on every rank."""
    return 2.0 ** (126 - (block.bit_length() - 1))


def constant(values, dtype: torch.dtype, device=None) -> torch.Tensor:
    """A small tensor of Python ``values`` on ``device`` without a host synchronisation.

    ``torch.tensor(values, device="cuda")`` copies from pageable memory and waits for the
    copy: a host sync in the middle of the hook's path. Here the values go through pinned
    memory and the copy is queued on the current stream like any kernel."""
    host = torch.tensor(values, dtype=dtype)
    device = torch.device(device) if device is not None else host.device
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclasses.dataclass
class Prepared:
    """What stage 1 leaves for stages 3 and 5 of one tensor.

    ``source`` is the input flattened (a view when it was contiguous): quantize and
    decode read it again, so it must not change until :meth:`THCCodec.decode` returns.
    ``blocks`` holds the rotated blocks where a backend keeps them (the reference and the
    CPU kernels do; the CUDA kernels recompute the rotation in quantize instead, which
    moves fewer bytes through GPU memory). ``header`` is this rank's own header, apart from
    ``scales``, which a transport may MAX-reduce in place: the message prefix encodes it.
    """

    numel: int
    source: torch.Tensor
    scales: torch.Tensor  # header + local block maxima; the transport MAX-reduces it
    blocks: torch.Tensor | None = None
    backend: object = None  # the fused module that prepared it; None: this reference
    header: torch.Tensor | None = None  # this rank's header (HEADER floats), kept from the reduction


@dataclasses.dataclass(frozen=True)
class LaneLayout:
    """How codes sit in the summed words: ``lanes`` lanes of ``width`` bits per
    ``word_dtype`` word (:mod:`hhook.codec.lanes` packs them, and chooses the layout for a
    world size and level count)."""

    width: int  # bits per lane, w
    lanes: int  # lanes per word, k
    word_dtype: torch.dtype  # torch.int32 or torch.int64

    @property
    def word_bits(self) -> int:
        return 32 if self.word_dtype == torch.int32 else 64

    @property
    def mask(self) -> int:
        return (1 << self.width) - 1

    @property
    def bits_per_code(self) -> float:
        return self.word_bits / self.lanes

    def n_words(self, count: int) -> int:
        return -(-count // self.lanes)


def agreed_status(agreed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(nonfinite, mismatch, identical)`` of a MAX-reduced header, as 0-d bool tensors.

    Tensor operations only: no host synchronisation. ``identical``: every rank sent a
    tensor with the same bits, whose mean is that tensor itself.
    """
    h = agreed[:HEADER]
    nonfinite = h[0] > 0
    mismatch = h[1] != -h[2]
    identical = (h[3] == -h[4]) & (h[5] == -h[6])
    return nonfinite, mismatch, identical


# -- the message prefix (hhook.scales.message describes its words) -----------------------
#: Words at the front of every message.
PREFIX = 12
#: Where the status word is in a message (:func:`status_word`).
STATUS = 1
#: Added to the status word by a rank that failed locally (more than any count of
#: non-finite ranks can reach).
RANK_FAILED = 1 << 20


def status_word(nonfinite, failed: bool):
    """The failure protocol, one definition for every exchange (the prefix of a summed
    message, FSDP2's reduce-scatter, which says every chunk's in each message, its
    all-gather's payload header, the shards of two-level's gather, the CUDA kernels' prefix):
    what a rank sends is 1 if its tensor held inf/NaN (a bool or a 0-d tensor), plus
    :data:`RANK_FAILED` if it failed locally and sends filler. Summed over ranks,
    :func:`any_failed`, :func:`failed_ranks` and :func:`any_nonfinite` read it (a count of
    non-finite ranks stays below :data:`RANK_FAILED`)."""
    return nonfinite + (RANK_FAILED if failed else 0)


def any_failed(status):
    """Whether a status word (one rank's, or a sum) says some rank failed (a number or a
    tensor; inf, a sum that overflowed a float16, says so too)."""
    return status >= RANK_FAILED


def failed_ranks(status: int) -> int:
    """How many ranks failed, from a summed status word read on the host."""
    return int(status // RANK_FAILED)


def any_nonfinite(status):
    """Whether a status word says some rank's tensor held inf/NaN."""
    return status % RANK_FAILED > 0


def wrap(value: int, word_bits: int) -> int:
    """``value`` as the two's-complement integer of ``word_bits`` bits that holds it."""
    value &= (1 << word_bits) - 1
    return value - (1 << word_bits) if value >> (word_bits - 1) else value


def digest_chunks(header: torch.Tensor) -> torch.Tensor:
    """The four 12-bit chunks of the 48-bit digest in a prepared header (:data:`HEADER`),
    each followed by its square."""
    halves = header[3:6:2].to(torch.int64)  # a view: indexing with a list would copy the list to the GPU and wait
    chunks = torch.stack((halves & 0xFFF, halves >> 12), dim=1).reshape(-1)
    return torch.stack((chunks, chunks * chunks), dim=1).reshape(-1)


def write_prefix(words: torch.Tensor, fps: tuple[int, int], header: torch.Tensor | None, failed: bool = False) -> None:
    """Fill ``words[:PREFIX]``. ``header`` is the codec's prepared header (flag and
    digest); None (a failed rank) sends no flag and a digest no other rank matches."""
    prefix = words[:PREFIX]
    prefix[:4] = constant([1, status_word(0, failed), fps[0], fps[1]], words.dtype, words.device)
    if header is not None:
        prefix[STATUS] += (header[0] > 0).to(words.dtype)
        prefix[4:] = digest_chunks(header)
    else:
        prefix[4:] = constant([1, 1, 0, 0, 0, 0, 0, 0], words.dtype, words.device)


def expected_prefix(world_size: int, fps: tuple[int, int], word_bits: int) -> tuple[int, int, int]:
    """The count and fingerprint words a right SUM of ``world_size`` ranks' prefixes holds."""
    return world_size, wrap(world_size * fps[0], word_bits), wrap(world_size * fps[1], word_bits)


def prefix_verdict(sums: torch.Tensor, world_size: int, fps: tuple[int, int]):
    """``(bad, nonfinite)`` of a summed prefix as 0-d bool tensors, without a host read:
    ``bad`` covers a wrong op, a failed rank and a mismatch (decode writes NaN; the
    caller raises later, where reading the flag is free)."""
    count, fp_a, fp_b = expected_prefix(world_size, fps, 32 if sums.dtype == torch.int32 else 64)
    p = sums[:PREFIX]
    bad = (p[0] != count) | any_failed(p[STATUS]) | (p[2] != fp_a) | (p[3] != fp_b)
    return bad, any_nonfinite(p[STATUS])
