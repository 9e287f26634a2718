r"""Lanes: several unsigned codes per integer word, with headroom for the sum.

Each of ``n`` ranks contributes codes in ``[0, L-1]``, so a lane holding their sum needs
``w = ceil(log2(n (L-1) + 1))`` bits. ``k = floor(W / w)`` lanes fit in a ``W``-bit word.
Adding two words adds every lane at once and no carry crosses a lane boundary, because
every lane's final sum stays below ``2**w``. Signed wraparound of the top lane is
harmless: the bit pattern of the word is that of the unsigned sum.

The layout of the words (:class:`~hhook.codec.layout.LaneLayout`, with the codec's other
formats) is planar: a bucket of ``count`` codes is padded to ``k * n_words`` and lane ``j``
of word ``i`` holds code ``j * n_words + i``, so packing and unpacking are ``k``
shift-or passes over contiguous slices (and coalesced loads on a GPU).
"""

from __future__ import annotations

import torch

from .layout import LaneLayout


#: Widest lane: lane sums are decoded through float32, exact up to 2**24.
MAX_WIDTH = 24


def lane_width(world_size: int, levels: int) -> int:
    """Bits needed to hold the sum of ``world_size`` codes each at most ``levels - 1``."""
    return (world_size * (levels - 1)).bit_length()


def choose_layout(world_size: int, levels: int) -> LaneLayout:
    """The densest of int32 and int64 words for this lane width (int32 on a tie)."""
    if world_size < 1 or levels < 2:
        raise ValueError(f"need world_size >= 1 and levels >= 2, got {world_size}, {levels}")
    width = lane_width(world_size, levels)
    if width > MAX_WIDTH:
        raise ValueError(
            f"{world_size} ranks at {levels} levels need {width}-bit lanes; at most {MAX_WIDTH} "
            "are supported (use fewer bits)"
        )
    candidates = [(torch.int32, 32), (torch.int64, 64)]
    best = None
    for dtype, bits in candidates:
        lanes = bits // width
        if lanes and (best is None or bits / lanes < best.bits_per_code):
            best = LaneLayout(width, lanes, dtype)
    return best


def code_buffer(count: int, layout: LaneLayout, device=None) -> torch.Tensor:
    """A buffer of ``lanes * n_words`` codes in the word dtype, ready for :func:`pack`.

    Quantizers write the first ``count`` codes into it; the padding after them is zero
    and packs to lanes that decode to nothing.
    """
    codes = torch.empty(layout.lanes * layout.n_words(count), dtype=layout.word_dtype, device=device)
    codes[count:] = 0
    return codes


def pack(codes: torch.Tensor, layout: LaneLayout) -> torch.Tensor:
    """Pack a :func:`code_buffer` (each code ``< 2**width``) into words."""
    if codes.dtype != layout.word_dtype or codes.numel() % layout.lanes:
        raise ValueError("pack expects a code_buffer of the layout's word dtype")
    planes = codes.view(layout.lanes, -1)
    words = planes[0].clone()
    for lane in range(1, layout.lanes):
        words.bitwise_or_(planes[lane] << (lane * layout.width))
    return words


def unpack(words: torch.Tensor, layout: LaneLayout, count: int, dtype=torch.float32) -> torch.Tensor:
    """Lane values of ``words`` in code order, cropped to ``count``.

    float32 (the default, what decoding needs) holds every lane exactly, since lanes
    are at most :data:`MAX_WIDTH` bits wide.
    """
    n_words = words.numel()
    out = torch.empty(layout.lanes * n_words, dtype=dtype, device=words.device)
    planes = out.view(layout.lanes, n_words)
    for lane in range(layout.lanes):
        planes[lane].copy_((words >> (lane * layout.width)).bitwise_and_(layout.mask))
    return out[:count]
