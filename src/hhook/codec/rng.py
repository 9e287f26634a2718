r"""Counter-based random numbers for stochastic rounding.

Every uniform is a pure function of ``(key, index)``: a 32-bit integer hash of
``(index + key) mod 2**32``. There is no generator state, so

* a GPU kernel computing the same hash in ``uint32`` arithmetic produces the same
  numbers as this torch reference, bit for bit;
* a bucket can be processed in any order or in chunks;
* ranks draw independent streams simply by deriving different keys
  (:func:`stream_key` mixes the rank in), which keeps the 1/n variance reduction of
  averaging n independently rounded gradients;
* correlated rounding (:class:`Stream`, :func:`thresholds`) adds a second hash that every
  rank computes alike (:func:`shared_key`: the seed and a counter, never the rank), which
  spreads the ranks' thresholds for one coordinate over the unit interval.

The mixer is Chris Wellons' ``lowbias32`` shape (multipliers 0x21f0aaad, 0x735a2d97;
shifts 16, 15, 15). Tensors compute it in ``int32`` holding the ``uint32`` bit pattern:
right shifts are masked to be logical, and multiplication relies on two's-complement
wraparound, which torch's CPU and CUDA kernels implement (tests check every path
against the exact Python hash). Half the bytes of an ``int64`` version: measured 30%
faster on CPU.
"""

from __future__ import annotations

import dataclasses

import torch

MASK32 = 0xFFFFFFFF
_MUL1 = 0x21F0AAAD
_MUL2 = 0x735A2D97
_STREAM_SALT = 0x68686F6B  # "hhok": separates rounding streams from the sign stream
_SIGN_SALT = 0x5369676E  # "Sign"
_DIGEST_SALT = 0x44696773  # "Digs"
_DIGEST_MUL = 0x9E3779B9  # golden ratio: spreads the index before it meets the bits
_SHARED_SALT = 0x53686172  # "Shar": the stream every rank of a group draws alike


def mix32(x: int) -> int:
    """The 32-bit hash on one Python integer (host side: keys, fingerprints)."""
    x &= MASK32
    x ^= x >> 16
    x = (x * _MUL1) & MASK32
    x ^= x >> 15
    x = (x * _MUL2) & MASK32
    x ^= x >> 15
    return x


def _to_int32(value: int) -> int:
    """The signed int32 with the bit pattern of ``value mod 2**32``."""
    value &= MASK32
    return value - (1 << 32) if value >> 31 else value


def mix32_(h: torch.Tensor) -> torch.Tensor:
    """The same hash, in place, on an ``int32`` tensor of uint32 bit patterns."""
    h.bitwise_xor_((h >> 16).bitwise_and_(0xFFFF))
    h.mul_(_MUL1)
    h.bitwise_xor_((h >> 15).bitwise_and_(0x1FFFF))
    h.mul_(_MUL2)
    h.bitwise_xor_((h >> 15).bitwise_and_(0x1FFFF))
    return h


def stream_key(seed: int, rank: int, counter: int) -> int:
    """Key of the rounding stream of one rank for one codec call.

    ``counter`` must differ between calls of the same rank (hhook counts calls per
    state); ``rank`` makes streams independent across ranks.
    """
    key = mix32(seed ^ _STREAM_SALT)
    key = mix32(key ^ rank)
    key = mix32(key ^ (counter & MASK32))
    return mix32(key ^ (counter >> 32))


def shared_key(seed: int, counter: int) -> int:
    """Key of the stream every rank of a group draws alike for one codec call: the seed
    and a counter that advances identically on every rank, never the rank."""
    key = mix32(seed ^ _SHARED_SALT)
    key = mix32(key ^ (counter & MASK32))
    return mix32(key ^ (counter >> 32))


#: Correlated rounding uses at most this many strata (2**16); more ranks share strata.
MAX_STRATA_BITS = 16
_ROW_SALT = 0x526F7773  # "Rows": the per-block half of the shared shift


@dataclasses.dataclass(frozen=True)
class Stream:
    r"""Where one rank draws its rounding thresholds for one codec call.

    The threshold of coordinate ``j`` (in block ``b = j // B`` at ``i = j % B``, ``B``
    the tensor's rotation block) is ``U_j / 2**24`` with the 24-bit integer

        U_j = (p_j << (24 - L)) | (mix32(j + key) >> (8 + L)),
        p_j = ((mix32(i + shared) >> (32 - L)) + (mix32(b + row) >> (32 - L)) + floor(k 2**L / n)) mod 2**L

    ``ranks == 1`` (``L = 0``): independent rounding, ``U_j`` the top 24 bits of this
    rank's own hash. ``ranks == n > 1``: correlated rounding (Suresh et al., ICML 2022)
    over ``2**L >= n`` strata (``L = ceil(log2 n)``, at most :data:`MAX_STRATA_BITS`):
    rank ``k`` takes stratum ``p_j``; the shift (the top bits of two hashes) is the same
    on every rank, so the ``n`` ranks' thresholds for one coordinate fall
    in distinct, evenly spread ``2**-L`` slices of [0, 1) and their rounding errors
    largely cancel in the sum; over the shift each rank's threshold is still uniform on
    the same 2**24 points as independent rounding's (unbiased). Integer operations only,
    so every kernel reproduces it exactly.

    Why this shift: it must look random along ``j`` within a block. A shift that walks
    with ``j`` (``j + s``) has the same mean error but makes the conditional errors
    periodic in ``j``, which the inverse rotation gathers onto a few coordinates (peak
    errors 3-5x independent rounding's, measured). A hash per coordinate (the paper's
    form) costs a second hash per coordinate (+40% on the fused CPU rounding pass);
    a table of ``B`` hashes per call plus one hash per block gives the same errors,
    peaks included, for a load, an add and a mask per coordinate.
    """

    key: int  # this rank's private stream (:func:`stream_key`)
    shared: int = 0  # the group's shared stream (:func:`shared_key`)
    rank: int = 0  # index within the group that sums
    ranks: int = 1  # 1: independent rounding

    def __post_init__(self):
        if not 0 <= self.rank < self.ranks:
            raise ValueError(f"rank {self.rank} is not in [0, {self.ranks})")

    @property
    def strata_bits(self) -> int:
        """``L``: ``2**L`` strata, the fewest that give every rank its own (capped)."""
        return min((self.ranks - 1).bit_length(), MAX_STRATA_BITS)

    @property
    def offset(self) -> int:
        """``floor(k 2**L / n)``: this rank's place among the strata. Ranks sit evenly
        (5 ranks on 8 strata: 0, 1, 3, 4, 6); a run of adjacent strata would bunch their
        thresholds (measured: 0.9x the error of independent rounding at 5 ranks, against
        0.6x spread)."""
        return (self.rank << self.strata_bits) // self.ranks

    @property
    def row(self) -> int:
        """Key of the per-block half of the shift."""
        return mix32(self.shared ^ _ROW_SALT)

    def table(self, block: int, device=None) -> torch.Tensor:
        """``mix32(i + shared) >> (32 - L)`` for ``i`` in ``[0, block)`` (int32)."""
        bits = self.strata_bits
        return (hash_range(self.shared, 0, block, device) >> (32 - bits)).bitwise_and_((1 << bits) - 1)


def as_stream(key) -> Stream:
    """A :class:`Stream` from a stream or a bare private key (independent rounding)."""
    return key if isinstance(key, Stream) else Stream(int(key) & MASK32)


def sign_key(seed: int) -> int:
    """Key of the shared +-1 diagonal of the rotation: the seed only, never the rank."""
    return mix32(seed ^ _SIGN_SALT)


def hash_range(key: int, start: int, count: int, device=None) -> torch.Tensor:
    """``mix32((start + i + key) mod 2**32)`` for ``i`` in ``[0, count)``, as int32 bit patterns."""
    h = torch.arange(count, dtype=torch.int32, device=device)
    h.add_(_to_int32(start + key))
    return mix32_(h)


def uniform(key: int, start: int, count: int, device=None) -> torch.Tensor:
    """Uniform floats in [0, 1): the top 24 bits of the hash, exact in float32."""
    h = hash_range(key, start, count, device)
    return (h >> 8).bitwise_and_(0xFFFFFF).to(torch.float32).mul_(2.0**-24)


def thresholds(stream: Stream, start: int, count: int, block: int, device=None) -> torch.Tensor:
    """Rounding thresholds of coordinates ``[start, start + count)`` of a tensor rotated
    in blocks of ``block`` (see :class:`Stream`): exact 24-bit fractions, as the kernels
    compute them."""
    bits = stream.strata_bits
    h = (hash_range(stream.key, start, count, device) >> (8 + bits)).bitwise_and_(0xFFFFFF >> bits)
    if bits:
        j = torch.arange(start, start + count, dtype=torch.int64, device=h.device)
        mask = (1 << bits) - 1
        rows = (mix32_(_wrap32((j // block).add_(stream.row).bitwise_and_(MASK32))) >> (32 - bits)).bitwise_and_(mask)
        strata = stream.table(block, h.device)[j % block].add_(rows).add_(stream.offset).bitwise_and_(mask)
        h.bitwise_or_(strata.bitwise_left_shift_(24 - bits))
    return h.to(torch.float32).mul_(2.0**-24)


def _wrap32(values: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) as int32 tensors of the same bit patterns."""
    return values.sub_(values.ge(1 << 31).to(torch.int64) << 32).to(torch.int32)


def digest(bits: torch.Tensor, chunk: int = 1 << 18) -> torch.Tensor:
    """48-bit digest of a vector of uint32 bit patterns (an ``int32`` tensor), as a 0-d int64.

    ``sum_i mix32(bits_i + i * 0x9E3779B9 + salt) mod 2**48``. A sum of per-element
    hashes is independent of the summation order, so chunked, threaded and GPU versions
    agree exactly; ``mix32`` is a bijection, so two vectors that differ in one element
    always differ in the digest. Tensor operations only: no host synchronisation.
    """
    total = torch.zeros((), dtype=torch.int64, device=bits.device)
    for first in range(0, bits.numel(), chunk):
        part = bits[first : first + chunk]
        h = torch.arange(first, first + part.numel(), dtype=torch.int32, device=bits.device)
        h.mul_(_to_int32(_DIGEST_MUL)).add_(_to_int32(_DIGEST_SALT)).add_(part)
        total += mix32_(h).to(torch.int64).bitwise_and_(MASK32).sum()
    return total.bitwise_and_((1 << 48) - 1)
