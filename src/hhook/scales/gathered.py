r"""Gathered scales' message: one rank's codes on its own block maxima, all-gathered
(:class:`hhook.scales.ScalePolicy` with ``gather``).

A rank's message is ``[PREFIX | its block maxima (float32 bits) | its codes]``, the codes
packed in lanes as wide as the bits (the one-rank codec's: nothing is summed in a lane).
Every rank receives every message end to end in rank order, checks the sum of their
prefixes as a summed message's (:func:`hhook.scales.message.check_prefix`), dequantizes
each message on its own maxima, adds them in rank order from zero, divides by the count
and rotates the sum back once: every rank derives the same bits (the fused CPU kernel,
:func:`hhook.codec.kernels.cpu.decode_gathered`, performs these operations in this order).
"""

from __future__ import annotations

import torch

from ..codec import THCCodec, lanes, quantization, rotation
from ..codec.codec import fused_backend
from ..codec.kernels import cpu as cpu_kernels
from ..codec.layout import HEADER, wrap
from . import message
from .message import PREFIX

#: Most ranks that gathered scales suit: there each rank receives at most 1.25x the bytes
#: of agreed scales' two rounds at the same width (4 ranks, 4 bits; fewer up to 3 ranks);
#: its bytes grow with the ranks, its rounds do not. ``scales="auto"`` and ``bits="auto"``'s
#: candidates read it.
MAX_RANKS = 4


def maxima_words(solo: THCCodec, numel: int) -> int:
    """Words of the block maxima in a message of a tensor of ``numel``."""
    return -(-solo.n_blocks(numel) * 4 // (solo.layout.word_bits // 8))


def own_scales(solo: THCCodec, numel: int, prepared) -> torch.Tensor:
    """The scale vector this rank quantizes onto: its flag, a digest said unknown (its codes
    are never "identical": every rank's are summed at decode) and its own maxima."""
    head = solo.header(numel, prepared.scales[0], device=prepared.scales.device)
    return torch.cat([head, prepared.scales[HEADER:]])


def write_maxima(words: torch.Tensor, scales: torch.Tensor) -> None:
    """The block maxima of ``scales`` (a scale vector) into ``words`` as float32 bits, zeros after them."""
    maxima = words.view(torch.float32)
    n_blocks = scales.numel() - HEADER
    maxima[n_blocks:] = 0.0
    maxima[:n_blocks] = scales[HEADER:]


def decode(gathered: torch.Tensor, solo: THCCodec, world_size: int, fps: tuple, what: str, prepared,
           out: torch.Tensor) -> bool | None:
    """Write the mean of the ``world_size`` messages of ``gathered`` into ``out``; returns
    True when a rank was non-finite (``out`` is then NaN), False when every rank sent the
    same tensor (``prepared.source``, copied exactly), None otherwise. Raises what a summed
    prefix raises (:func:`hhook.scales.message.check_prefix`). This rank's message was
    written from ``prepared``: its rotated blocks go back to the fused stages' workspaces."""
    if prepared.backend is cpu_kernels:
        cpu_kernels.release(prepared)
    source = prepared.source
    n, numel = world_size, source.numel()
    rows = gathered.view(n, -1)
    count, status, fp_a, fp_b, *chunks = rows[:, :PREFIX].to(torch.int64).sum(dim=0).tolist()
    word_bits = solo.layout.word_bits
    verdict = message.check_prefix(count, status, wrap(fp_a, word_bits), wrap(fp_b, word_bits), chunks, n, fps,
                                   rows.dtype, what)
    if verdict.nonfinite:
        out.fill_(float("nan"))
        return True
    if verdict.identical:  # every rank sent these bits: they are the mean
        out.copy_(source.view(out.shape))
        return False
    n_blocks, block = solo.n_blocks(numel), solo.block_for(numel)
    meta = maxima_words(solo, numel)
    if fused_backend(out, block) is cpu_kernels:  # the same bits in one pass a block
        cpu_kernels.decode_gathered(solo, rows, PREFIX, meta, numel, out)
        return None
    total = torch.zeros(n_blocks, block, dtype=torch.float32, device=out.device)
    for row in rows:
        maxima = row[PREFIX : PREFIX + meta].view(torch.float32)[:n_blocks]
        codes = lanes.unpack(row[PREFIX + meta :], solo.layout, n_blocks * block).view(n_blocks, block)
        total += quantization.dequantize(codes, maxima, solo.levels, 1)
    mean = rotation.unrotate(total.div_(float(n)), solo.seed).view(-1)[:numel]
    out.view(-1).copy_(mean) if out.is_contiguous() else out.copy_(mean.view(out.shape))
    return None
