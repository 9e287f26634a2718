r"""Randomized Hadamard rotation, applied per block of ``B`` coordinates.

``rotate`` computes ``y = H_B D x / sqrt(B)`` for every block, ``unrotate`` its inverse
``x = D H_B y / sqrt(B)``. ``D`` is a +-1 diagonal drawn from the shared seed, so all
ranks rotate identically and the rotation commutes with the sum. The rotation is
orthogonal: it keeps norms and spreads outliers, so one scale per block wastes few
quantization levels.

``H_B`` is applied with the Kronecker identity ``H_B = H_b1 (x) H_b2`` (``b1 * b2 = B``):
a block viewed as a ``b1 x b2`` matrix ``X`` becomes ``H_b1 X H_b2``, two small matrix
products. On CPU this measured about 8x faster than ``log2(B)`` butterfly passes.
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
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h


@functools.lru_cache(maxsize=64)
def _factors(block_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(H_b1 / sqrt(B), H_b2)`` on ``device``; the normalisation rides on the first."""
    b1 = 1 << (block_size.bit_length() - 1) // 2
    b2 = block_size // b1
    left = (_hadamard_cpu(b1) / math.sqrt(block_size)).to(device)
    return left, _hadamard_cpu(b2).to(device)


@functools.lru_cache(maxsize=64)
def signs(seed: int, block_size: int, device: torch.device) -> torch.Tensor:
    """The diagonal ``D`` as float32 +-1 of length ``block_size``: bit 0 of the hash."""
    bits = rng.hash_range(rng.sign_key(seed), 0, block_size) & 1
    return (1.0 - 2.0 * bits.to(torch.float32)).to(device)


def _hadamard(blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    n_blocks, block_size = blocks.shape
    left, right = _factors(block_size, blocks.device)
    shape = (n_blocks, left.shape[0], right.shape[0])
    x = torch.matmul(left, blocks.reshape(shape))
    if out is None:
        return torch.matmul(x, right).reshape(n_blocks, block_size)
    torch.matmul(x, right, out=out.view(shape))
    return out


def rotate(blocks: torch.Tensor, seed: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``H D x / sqrt(B)`` for each row of a float32 ``(n_blocks, B)`` tensor."""
    return _hadamard(blocks * signs(seed, blocks.shape[1], blocks.device), out)


def unrotate(blocks: torch.Tensor, seed: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`rotate`: ``D H y / sqrt(B)`` for each row."""
    return _hadamard(blocks, out).mul_(signs(seed, blocks.shape[1], blocks.device))
