r"""Blockwise round-to-nearest quantization of parameter shards (ZeRO++ qwZ style), for
FSDP2's compressed parameter all-gather (:mod:`hhook.fsdp_all_gather`).

Blocks of ``B`` float32 values, optionally rotated first by the codec's randomized
Hadamard transform (:mod:`hhook.rotation`, the seed shared by every rank). Each block
keeps one float32 scale ``M`` (its max ``|y|``) and ``bits``-bit codes on the symmetric
grid ``y ~ (c - q) M / q`` with ``q = 2**(bits-1) - 1`` (``2q + 1`` levels: zero is a
level, so zero padding and zero weights decode to exactly zero).

Round-to-nearest, not stochastic rounding: nothing is summed, so unbiasedness buys
nothing and stochastic rounding doubles the error's variance; and the result is a pure
function of the shard, so every rank decodes every shard to the same bits (the ranks
compute with one unsharded parameter, as in plain FSDP2). The error per value is at
most ``M / (2q)`` in the quantized domain; the rotation is orthogonal, so a block's
error norm is at most ``sqrt(B) M / (2q)`` after it is undone (:meth:`WeightCodec.bound`).

The payload of ``n`` blocks is ``4 n`` bytes of scales, then ``n B bits / 8`` bytes of
codes: ``bits`` bits per value, eight codes packed into ``bits`` bytes.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from . import rng
from .rotation import check_block_size, rotate, unrotate

#: Widths the all-gather takes: 8 by default; 6 and 4 measured (docs/fsdp.md).
WIDTHS = (2, 3, 4, 5, 6, 7, 8)
_SALT = 0x57514147  # "WQAG": the weight codec's fingerprint


@dataclasses.dataclass(frozen=True)
class WeightCodec:
    """``bits``-bit codes per value, one float32 scale per block of ``block_size``."""

    bits: int = 8
    block_size: int = 256
    rotate: bool = True
    seed: int = 0

    def __post_init__(self):
        if isinstance(self.bits, bool) or self.bits not in WIDTHS:
            raise ValueError(f"all-gather bits must be one of {WIDTHS}, got {self.bits!r}")
        check_block_size(self.block_size)
        if self.block_size < 8:
            raise ValueError(f"all-gather block_size must be at least 8 (codes pack by eights), got {self.block_size}")
        if not isinstance(self.rotate, bool):
            raise ValueError(f"rotate must be True or False, got {self.rotate!r}")

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
        for value in (self.bits, self.block_size, int(self.rotate), self.seed):
            h = rng.mix32(h ^ (value & rng.MASK32))
        return h

    def bound(self, scales: torch.Tensor) -> torch.Tensor:
        """Per block, the largest possible L2 norm of ``decode - x``."""
        return scales * (math.sqrt(self.block_size) / (2 * self.q))

    def encode(self, blocks: torch.Tensor, out: torch.Tensor) -> None:
        """Quantize float32 ``(n, B)`` ``blocks`` (overwritten: rotated in place) into the
        uint8 payload ``out`` of :meth:`nbytes` bytes."""
        n = blocks.shape[0]
        if self.rotate:
            rotate(blocks, self.seed, out=blocks)
        scales = blocks.abs().amax(dim=1)
        out[: 4 * n].view(torch.float32).copy_(scales)
        inv = torch.full_like(scales, float(self.q)).div_(scales)
        inv.masked_fill_(~torch.isfinite(inv), 0.0)  # M == 0: every code q (zero)
        codes = blocks.mul_(inv[:, None]).round_().clamp_(-self.q, self.q).add_(self.q).to(torch.uint8)
        pack(codes.view(-1), self.bits, out[4 * n:])

    def scales(self, payload: torch.Tensor, n_blocks: int) -> torch.Tensor:
        return payload[: 4 * n_blocks].view(torch.float32)

    def decode(self, payload: torch.Tensor, n_blocks: int) -> torch.Tensor:
        """The float32 ``(n_blocks, B)`` values of a payload."""
        scales = self.scales(payload, n_blocks)
        codes = unpack(payload[4 * n_blocks:], self.bits, n_blocks * self.block_size)
        step = scales / float(self.q)
        y = codes.to(torch.float32).sub_(self.q).view(n_blocks, self.block_size).mul_(step[:, None])
        return unrotate(y, self.seed, out=y) if self.rotate else y


def pack(codes: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """Eight ``bits``-bit uint8 ``codes`` into ``bits`` bytes of ``out`` (little-endian)."""
    if bits == 8:
        out.copy_(codes)
        return
    groups = codes.view(-1, 8)
    if bits == 4:
        pairs = codes.view(-1, 2)
        torch.bitwise_or(pairs[:, 0], pairs[:, 1] << 4, out=out)
        return
    shifts = torch.arange(0, 8 * bits, bits, dtype=torch.int64, device=codes.device)
    word = (groups.to(torch.int64) << shifts).sum(dim=1)  # disjoint bits: the sum is the OR
    byte_shifts = torch.arange(0, 8 * bits, 8, dtype=torch.int64, device=codes.device)
    out.view(-1, bits).copy_((word[:, None] >> byte_shifts) & 0xFF)


def unpack(data: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``count`` uint8 codes."""
    if bits == 8:
        return data[:count]
    if bits == 4:
        return torch.stack((data & 0xF, data >> 4), dim=1).view(-1)[:count]
    byte_shifts = torch.arange(0, 8 * bits, 8, dtype=torch.int64, device=data.device)
    word = (data.view(-1, bits).to(torch.int64) << byte_shifts).sum(dim=1)
    shifts = torch.arange(0, 8 * bits, bits, dtype=torch.int64, device=data.device)
    return ((word[:, None] >> shifts) & ((1 << bits) - 1)).to(torch.uint8).view(-1)[:count]
