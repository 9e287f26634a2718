r"""Randomized Hadamard rotation, applied per block of ``B`` coordinates.

``rotate`` computes ``y = H_B D x / sqrt(B)`` for every block, ``unrotate`` its inverse
``x = D H_B y / sqrt(B)``. ``D`` is a +-1 diagonal drawn from the shared seed, so all
ranks rotate identically and the rotation commutes with the sum. The rotation is
orthogonal: it keeps norms and spreads outliers, so one scale per block wastes few
quantization levels.

The float32 operations are part of the specification (docs/guarantees.md), because every
rank decodes the summed words on its own and DDP's replicas stay identical only if every
rank, on any CPU or GPU, turns them into the same bits:

1. ``D``: an exact sign flip (a multiply by +-1);
2. ``H_B``: ``log2(B)`` radix-2 butterfly stages on strides ``1, 2, 4, ..., B/2`` in that
   order (ascending), each ``(a, b) -> (a + b, a - b)`` with ``a`` at the lower index, one
   exact-rounded float32 add or subtract per output;
3. ``1/sqrt(B)``: one float32 multiply by :func:`norm` (``float32(1/sqrt(B))``) after the
   butterflies.

Rounding depends only on that order, so any implementation that performs it (these torch
elementwise operations, the fused C kernel at any instruction set) gives the same bits on
every machine. A matrix product through BLAS (the Kronecker form ``H_b1 X H_b2`` this
module used before) sums in an order of the library's choosing, with fused multiply-adds
where the CPU has them: its bits differ between CPU models.
"""

from __future__ import annotations

import functools
import math

import torch

from . import rng


def check_block_size(block_size: int) -> None:
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 1, got {block_size!r}")
    if block_size > 1 << 16:
        raise ValueError(f"block_size must be at most 65536, got {block_size}")


@functools.lru_cache(maxsize=None)
def _hadamard_cpu(n: int) -> torch.Tensor:
    """The ``n x n`` Walsh-Hadamard matrix (Sylvester order), float32: for tests."""
    h = torch.ones(1, 1, dtype=torch.float32)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


@functools.lru_cache(maxsize=64)
def norm(block_size: int) -> float:
    """``1/sqrt(B)`` rounded to float32 (returned as the Python float of that value)."""
    return torch.tensor(1.0 / math.sqrt(block_size), dtype=torch.float32).item()


@functools.lru_cache(maxsize=64)
def _norm_on(block_size: int, device: torch.device) -> torch.Tensor:
    return torch.tensor(norm(block_size), dtype=torch.float32, device=device)


@functools.lru_cache(maxsize=64)
def signs(seed: int, block_size: int, device: torch.device) -> torch.Tensor:
    """The diagonal ``D`` as float32 +-1 of length ``block_size``: bit 0 of the hash."""
    bits = rng.hash_range(rng.sign_key(seed), 0, block_size) & 1
    return (1.0 - 2.0 * bits.to(torch.float32)).to(device)


def butterflies_(x: torch.Tensor) -> torch.Tensor:
    """The unnormalised transform ``H_B`` of each row of a contiguous float32 ``(n, B)``
    tensor, in place: the specification's stages, strides ascending."""
    n, block = x.shape
    h = 1
    while h < block:
        v = x.view(n, block // (2 * h), 2, h)
        a, b = v[:, :, 0], v[:, :, 1]
        difference = a - b
        a.add_(b)
        b.copy_(difference)
        h *= 2
    return x


def _hadamard(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``H_B x / sqrt(B)`` of each row (into ``out`` if given, which may be ``blocks``)."""
    x = blocks.clone(memory_format=torch.contiguous_format) if out is None else out.copy_(blocks)
    return butterflies_(x).mul_(_norm_on(blocks.shape[1], x.device))


def rotate(blocks: torch.Tensor, seed: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``H D x / sqrt(B)`` for each row of a float32 ``(n_blocks, B)`` tensor."""
    x = torch.mul(blocks, signs(seed, blocks.shape[1], blocks.device), out=out)
    return _hadamard(x, x)


def unrotate(blocks: torch.Tensor, seed: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`rotate`: ``D H y / sqrt(B)`` for each row."""
    return _hadamard(blocks, out).mul_(signs(seed, blocks.shape[1], blocks.device))
