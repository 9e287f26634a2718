r"""Blockwise round-to-nearest quantization of parameter shards (ZeRO++ qwZ style), for
FSDP2's compressed parameter all-gather (:mod:`hhook.fsdp.all_gather`).

Blocks of ``B`` float32 values. Each block keeps one float32 scale ``M`` (its max
``|y|``) and ``bits``-bit codes on the symmetric grid ``y ~ (c - q) M / q`` with
``q = 2**(bits-1) - 1`` (``2q + 1`` levels: zero is a level, so zero padding and zero
weights decode to exactly zero).

The codec's randomized Hadamard rotation (:mod:`hhook.codec.rotation`, the seed shared by every
rank) spreads a block's outliers, but on light-tailed weights (uniform, as layers are
initialised) it raises the max: measured (docs/fsdp.md) int8 without it 1.8x better on
uniform weights, with it 2.5-3.7x better on heavy-tailed ones. So ``rotate="auto"`` (the
default) rotates each block or not, whichever has the smaller max (round-to-nearest's
error is proportional to it in either domain), and says which in the sign bit of the
block's scale: no extra bytes, and the decoder undoes the rotation of those blocks only.
``rotate=True`` rotates every block, ``False`` none. "auto" tries only blocks whose max
exceeds twice their RMS (a block of 256 rotated values is about Gaussian, its max near
three RMS), so light-tailed layers cost no rotation at all.

Round-to-nearest, not stochastic rounding: nothing is summed, so unbiasedness buys
nothing and stochastic rounding doubles the error's variance; and the result is a pure
function of the shard, so every rank decodes every shard to the same bits (the ranks
compute with one unsharded parameter, as in plain FSDP2). The error per value is at
most ``M / (2q)`` in the domain it was quantized in; the rotation is orthogonal, so a
block's error norm is at most ``sqrt(B) M / (2q)`` either way (:meth:`WeightCodec.bound`).

The payload of ``n`` blocks is ``4 n`` bytes of scales, then ``n B bits / 8`` bytes of
codes: ``bits`` bits per value, eight codes packed into ``bits`` bytes.

Every float operation is specified, as the THC codec's (docs/guarantees.md), so that the
torch path and the CUDA kernels (:mod:`hhook.codec.kernels.cuda`: ``hh_wq_encode`` and
``hh_wq_decode``, one pass each way, used for CUDA tensors with blocks up to 1024) give the
same bits: the rotation's butterflies, the candidates' RMS (:func:`_rms`), true divisions.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from . import rng
from .kernels import cuda as cuda_kernels
from .rotation import check_block_size, norm, rotate, unrotate

#: Widths the all-gather takes: 8 by default; 6 and 4 measured (docs/fsdp.md).
WIDTHS = (2, 3, 4, 5, 6, 7, 8)
ROTATE_MODES = (False, True, "auto")
_SALT = 0x57514147  # "WQAG": the weight codec's fingerprint


@dataclasses.dataclass(frozen=True)
class WeightCodec:
    """``bits``-bit codes per value, one float32 scale per block of ``block_size``."""

    bits: int = 8
    block_size: int = 256
    rotate: bool | str = "auto"
    seed: int = 0

    def __post_init__(self):
        if isinstance(self.bits, bool) or self.bits not in WIDTHS:
            raise ValueError(f"all-gather bits must be one of {WIDTHS}, got {self.bits!r}")
        check_block_size(self.block_size)
        if self.block_size < 8:
            raise ValueError(f"all-gather block_size must be at least 8 (codes pack by eights), got {self.block_size}")
        if not any(self.rotate is mode or self.rotate == mode and isinstance(mode, str) for mode in ROTATE_MODES):
            raise ValueError(f"rotate must be True, False or 'auto', got {self.rotate!r}")

    @property
    def q(self) -> int:
        """The largest code magnitude: codes are ``-q..q``, stored as ``0..2q``."""
        return (1 << (self.bits - 1)) - 1

    def n_blocks(self, numel: int) -> int:
        return -(-numel // self.block_size)

    def nbytes(self, n_blocks: int) -> int:
        """Payload bytes of ``n_blocks`` blocks: scales, then packed codes."""
        return 4 * n_blocks + n_blocks * self.block_size * self.bits // 8

    def fingerprint(self) -> int:
        h = rng.mix32(_SALT)
        for value in (self.bits, self.block_size, ROTATE_MODES.index(self.rotate), self.seed):
            h = rng.mix32(h ^ (value & rng.MASK32))
        return h

    def bound(self, scales: torch.Tensor) -> torch.Tensor:
        """Per block, the largest possible L2 norm of ``decode - x`` (``scales`` as stored)."""
        return scales.abs() * (math.sqrt(self.block_size) / (2 * self.q))

    def _rotate(self, blocks: torch.Tensor, inverse: bool) -> torch.Tensor:
        """:func:`hhook.codec.rotation.rotate` (or ``unrotate``) of contiguous ``blocks``, in
        place: the specification's butterflies, so every rank decodes a shard to the same
        bits on any CPU."""
        return (unrotate if inverse else rotate)(blocks, self.seed, out=blocks)

    def _choose(self, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``blocks`` (in place) as they will be quantized, and their signed scales (the
        sign bit set where the block is rotated)."""
        if self.rotate is False:
            return blocks, _maxabs(blocks)
        if self.rotate is True:
            return self._rotate(blocks, False), _maxabs(blocks).neg_()
        plain = _maxabs(blocks)
        # Candidates: a block whose max is under twice its RMS stays as it is (uniform: 1.7);
        # rotated, its max would not be lower (about Gaussian: near 3 RMS at B = 256).
        rows = (plain > 2 * _rms(blocks)).nonzero().view(-1)
        if rows.numel() == 0:
            return blocks, plain
        rotated = blocks[rows]
        self._rotate(rotated, False)
        turned = _maxabs(rotated)
        use = turned < plain[rows]
        rows, turned = rows[use], turned[use]
        blocks.index_copy_(0, rows, rotated[use])
        return blocks, plain.index_copy_(0, rows, turned.neg_())

    def encode(self, blocks: torch.Tensor, out: torch.Tensor) -> bool:
        """Quantize float32 ``(n, B)`` ``blocks`` (overwritten, except by the CUDA kernel)
        into the uint8 payload ``out`` of :meth:`nbytes` bytes. Returns whether every value
        was finite (an inf or NaN makes its block's scale inf or NaN: ``amax`` propagates
        NaN); a host read.

        Codes are ``floor(y q / M + q + 1/2)``, clamped to ``0..2q``: round to nearest,
        ties up, in three passes and the conversion (``to(uint8)`` truncates). On a GPU one
        kernel (``hh_wq_encode``) computes the same bits in one pass."""
        if cuda_kernels.weights_usable(self, blocks, out):
            return cuda_kernels.weight_encode(self, blocks, out)
        n = blocks.shape[0]
        blocks, scales = self._choose(blocks)
        out[: 4 * n].view(torch.float32).copy_(scales)
        inv = torch.full_like(scales, float(self.q)).div_(scales.abs())
        inv.masked_fill_(~torch.isfinite(inv), 0.0)  # M == 0: every code q (zero)
        codes = blocks.mul_(inv[:, None]).add_(self.q + 0.5).clamp_(0.0, 2 * self.q + 0.5).to(torch.uint8)
        pack(codes.view(-1), self.bits, out[4 * n:])
        return bool(torch.isfinite(scales).all())

    def scales(self, payload: torch.Tensor, n_blocks: int) -> torch.Tensor:
        """The signed scales of a payload: ``|s|`` the block's max, ``signbit(s)`` rotated."""
        return payload[: 4 * n_blocks].view(torch.float32)

    def decode(self, payload: torch.Tensor, n_blocks: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 ``(n_blocks, B)`` values of a payload (into ``out`` if given): ``(c -
        q) (|M| / q)`` (a true division), then the inverse rotation of the rotated blocks,
        in place. On a GPU one kernel (``hh_wq_decode``), the same bits."""
        y = torch.empty(n_blocks, self.block_size, dtype=torch.float32, device=payload.device) if out is None else out
        if cuda_kernels.weights_usable(self, y, payload):
            return cuda_kernels.weight_decode(self, payload, n_blocks, y)
        scales = self.scales(payload, n_blocks)
        codes = unpack(payload[4 * n_blocks:], self.bits, n_blocks * self.block_size)
        y.view(-1).copy_(codes)
        y.sub_(self.q).mul_(scales.abs().div_(torch.full_like(scales, float(self.q)))[:, None])
        turned = torch.signbit(scales).nonzero().view(-1) if self.rotate == "auto" else None
        if self.rotate is True or turned is not None and turned.numel() == n_blocks:
            return self._rotate(y, True)
        if turned is not None and turned.numel():  # only the rotated blocks
            rows = y.index_select(0, turned)
            y.index_copy_(0, turned, self._rotate(rows, True))
        return y


def _maxabs(blocks: torch.Tensor) -> torch.Tensor:
    """max ``|y|`` per row without a ``|y|`` temporary (NaN propagates; +0, never -0)."""
    return torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_()).abs_()


def _rms(blocks: torch.Tensor) -> torch.Tensor:
    """The root mean square of each row, in a specified order (the kernel's): the squares,
    summed by adjacent pairs (``s[i] = s[2i] + s[2i + 1]``) down to one, its square root,
    times ``float32(1/sqrt(B))``."""
    s = blocks * blocks
    while s.shape[1] > 1:
        s = s[:, 0::2] + s[:, 1::2]
    return s.view(-1).sqrt_().mul_(norm(blocks.shape[1]))


def pack(codes: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """Eight ``bits``-bit uint8 ``codes`` into ``bits`` bytes of ``out``. Widths 2, 4 and 6
    are planar (codes ``i``, ``i + n/k``, ... share a byte: whole-vector shifts, 3-15x
    faster on one core than interleaving them); the others little-endian, 8 codes per
    ``bits`` bytes."""
    if bits == 8:
        out.copy_(codes)
    elif bits in (2, 4):
        planes = codes.view(8 // bits, -1)
        out.copy_(planes[0])
        for i in range(1, 8 // bits):
            out.bitwise_or_(planes[i] << (bits * i))
    elif bits == 6:  # 4 codes in 3 bytes: c0 | c1 << 6, c1 >> 2 | c2 << 4, c2 >> 4 | c3 << 2
        c0, c1, c2, c3 = codes.view(4, -1)
        o0, o1, o2 = out.view(3, -1)
        torch.bitwise_left_shift(c1, 6, out=o0).bitwise_or_(c0)
        torch.bitwise_left_shift(c2, 4, out=o1).bitwise_or_(c1 >> 2)
        torch.bitwise_left_shift(c3, 2, out=o2).bitwise_or_(c2 >> 4)
    else:
        shifts = torch.arange(0, 8 * bits, bits, dtype=torch.int64, device=codes.device)
        word = (codes.view(-1, 8).to(torch.int64) << shifts).sum(dim=1)  # disjoint bits: the sum is the OR
        byte_shifts = torch.arange(0, 8 * bits, 8, dtype=torch.int64, device=codes.device)
        out.view(-1, bits).copy_((word[:, None] >> byte_shifts) & 0xFF)


def unpack(data: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``count`` uint8 codes."""
    if bits == 8:
        return data[:count]
    if bits in (2, 4):
        k, mask = 8 // bits, (1 << bits) - 1
        out = torch.empty(k, data.numel(), dtype=torch.uint8, device=data.device)
        for i in range(k):
            torch.bitwise_right_shift(data, bits * i, out=out[i]).bitwise_and_(mask)
        return out.view(-1)[:count]
    if bits == 6:
        b0, b1, b2 = data.view(3, -1)
        out = torch.empty(4, b0.numel(), dtype=torch.uint8, device=data.device)
        torch.bitwise_and(b0, 63, out=out[0])
        torch.bitwise_and(b1, 15, out=out[1]).bitwise_left_shift_(2).bitwise_or_(b0 >> 6)
        torch.bitwise_and(b2, 3, out=out[2]).bitwise_left_shift_(4).bitwise_or_(b1 >> 4)
        torch.bitwise_right_shift(b2, 2, out=out[3])
        return out.view(-1)[:count]
    byte_shifts = torch.arange(0, 8 * bits, 8, dtype=torch.int64, device=data.device)
    word = (data.view(-1, bits).to(torch.int64) << byte_shifts).sum(dim=1)
    shifts = torch.arange(0, 8 * bits, bits, dtype=torch.int64, device=data.device)
    return ((word[:, None] >> shifts) & ((1 << bits) - 1)).to(torch.uint8).view(-1)[:count]
