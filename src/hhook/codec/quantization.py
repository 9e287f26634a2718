r"""Unbiased stochastic rounding of rotated blocks onto ``L`` levels.

With the agreed block scale ``M`` (the max of ``|y|`` over the block and over all ranks)
the levels are ``-M, -M + s, ..., M`` with step ``s = 2 M / (L - 1)``, and

    c = floor((y + M) * inv + u),   inv = (L - 1) / (2 M)  (0 where M == 0)

with ``u`` uniform in [0, 1) from :mod:`hhook.codec.rng`: independent across ranks, or
correlated (:class:`hhook.codec.rng.Stream`: the ranks' thresholds for one coordinate spread
over the ``n`` strata of [0, 1), each still uniform). ``E[c s - M] = y``: unbiased. The
float32 operations are, in this order: ``a = y + M``, ``b = a * inv``, ``t = b + u``,
``floor(t)``, clamp to ``[0, L - 1]`` (guards rounding at ``y = M``; a NaN ``t`` gives
code 0). A kernel that
performs the same rounded operations (no fused multiply-add) gives the same codes.

Decoding the sum ``S`` of ``n`` ranks' codes gives the mean: ``S * (s / n) - M``.
"""

from __future__ import annotations

import torch

from . import rng

# The codec works through rows in chunks of about this many coordinates (1 MB of
# float32): small enough for the random numbers and temporaries to stay in cache, large
# enough for torch to split each op across threads. Measured on 2 cores, 25 MB, 4 bits:
# 2**15: 0.25 GB/s, 2**16: 0.41, 2**18: 0.58-0.62, 2**20: 0.53, whole bucket: 0.2.
CHUNK = 1 << 18


# Divisions below go through tensors: torch on CUDA computes ``tensor / python_float``
# as a multiply by the reciprocal, which can differ by an ulp from the true division
# that the CPU and the CUDA kernels perform.


def inverse_steps(scales: torch.Tensor, levels: int) -> torch.Tensor:
    """``(L - 1) / (2 M)`` per block; 0 where that is not finite (M == 0, or M so small
    that the quotient overflows), which makes every code of the block 0."""
    inv = torch.full_like(scales, float(levels - 1)).div_(scales * 2.0)
    return inv.masked_fill_(~torch.isfinite(inv), 0.0)


def steps(scales: torch.Tensor, levels: int) -> torch.Tensor:
    """Quantization step ``2 M / (L - 1)`` per block."""
    return (scales * 2.0).div_(torch.full_like(scales, float(levels - 1)))


def quantize_into(
    codes: torch.Tensor,
    blocks: torch.Tensor,
    scales: torch.Tensor,
    levels: int,
    key,
    residual: torch.Tensor | None = None,
) -> None:
    """Write the codes of ``blocks`` (float32 ``(n_blocks, B)``) into ``codes[:n_blocks*B]``.

    ``codes`` is an integer buffer (any dtype that holds ``L - 1``). The threshold of
    coordinate ``i`` (row-major over ``blocks``) is ``rng.thresholds(key, i, B)``; ``key`` is
    a :class:`hhook.codec.rng.Stream` or a bare private key (independent rounding). When
    ``residual`` (shaped like ``blocks``) is given, it receives ``y - (c s - M)``: the
    rounding error of this rank's own codes, for error feedback.
    """
    n_blocks, block = blocks.shape
    stream = rng.as_stream(key)
    inv = inverse_steps(scales, levels)
    step = steps(scales, levels) if residual is not None else None
    rows = max(1, CHUNK // block)
    for first in range(0, n_blocks, rows):
        last = min(first + rows, n_blocks)
        y = blocks[first:last]
        m = scales[first:last, None]
        t = (y + m).mul_(inv[first:last, None])
        t.add_(rng.thresholds(stream, first * block, (last - first) * block, block, y.device).view_as(t))
        c = t.floor_().clamp_(0, levels - 1).nan_to_num_(0.0)  # NaN: code 0, as every backend
        codes[first * block : last * block] = c.view(-1)
        if residual is not None:
            torch.sub(y, c.mul_(step[first:last, None]).sub_(m), out=residual[first:last])


def dequantize(sums: torch.Tensor, scales: torch.Tensor, levels: int, world_size: int) -> torch.Tensor:
    """Mean of the rotated blocks from the lane sums ``S`` (float32 ``(n_blocks, B)``), in place."""
    scale = steps(scales, levels).div_(torch.full_like(scales, float(world_size)))
    return sums.mul_(scale[:, None]).sub_(scales[:, None])
