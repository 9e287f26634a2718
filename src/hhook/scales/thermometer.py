r"""Predicted scales' in-band maximum: a thermometer of each rank's block maxima that a
SUM can carry (:class:`hhook.scales.ScalePolicy` with ``predict``).

A sum cannot carry a maximum directly, so each rank sends, per block, one bit "my block
is not all zero" and, for each of :data:`THRESHOLDS` (quarter octaves from 1/4 to 4 times
the scale in use), one bit "my block maximum is above it". Lanes of ``log2(n + 1)`` bits
sum the bits into counts of ranks; the highest threshold any rank passed bounds the
maximum from below, the next one from above, and that upper bound (times the policy's
headroom) is the next step's scale. Every operation on the summed counts is an exact
integer or elementwise float32 one, so every rank derives the same scales.
"""

from __future__ import annotations

import torch

from ..codec import THCCodec, lanes
from ..codec.layout import constant

#: Thermometer thresholds per octave and their range in octaves around the scale in use.
THERMO_PER_OCTAVE = 4
THERMO_OCTAVES = 2
THRESHOLDS = tuple(2.0 ** (i / THERMO_PER_OCTAVE) for i in range(-THERMO_OCTAVES * THERMO_PER_OCTAVE,
                                                               THERMO_OCTAVES * THERMO_PER_OCTAVE + 1))
#: Thermometer bits per block: "my block is not all zero", then one per threshold.
THERMO_BITS = 1 + len(THRESHOLDS)
#: Blocks whose scale is below this fraction of the tensor's largest one are measured
#: against that floor (a block whose scale was zero would otherwise stay zero forever).
_FLOOR = 2.0**-12


def lane_layout(codec: THCCodec) -> lanes.LaneLayout:
    """Thermometer lanes: each holds the count of ranks above one threshold."""
    width = codec.world_size.bit_length()
    word_bits = codec.layout.word_bits
    return lanes.LaneLayout(width, word_bits // width, codec.layout.word_dtype)


def words(codec: THCCodec, numel: int) -> int:
    """Words of the thermometer of a tensor of ``numel``."""
    return lane_layout(codec).n_words(codec.n_blocks(numel) * THERMO_BITS)


def _reference(scales: torch.Tensor) -> torch.Tensor:
    return torch.maximum(scales, scales.max() * _FLOOR)


def encode(maxima: torch.Tensor, scales: torch.Tensor, codec: THCCodec) -> torch.Tensor:
    """This rank's thermometer words: its block ``maxima`` against the ``scales`` in use."""
    ratio = maxima / _reference(scales)
    thresholds = constant((0.0, *THRESHOLDS), torch.float32, ratio.device)
    layout = lane_layout(codec)
    codes = lanes.code_buffer(ratio.numel() * THERMO_BITS, layout, ratio.device)
    # A NaN ratio (this rank is non-finite: the step is skipped anyway) counts as below.
    torch.gt(ratio[:, None], thresholds[None, :], out=codes[: ratio.numel() * THERMO_BITS].view(ratio.numel(), -1))
    return lanes.pack(codes, layout)


def decode(summed: torch.Tensor, codec: THCCodec, n_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(zero, passed)`` per block from the summed thermometer words: whether every
    rank's block was all zero (it decodes to exactly zero), and how many thresholds the
    largest rank passed."""
    counts = lanes.unpack(summed, lane_layout(codec), n_blocks * THERMO_BITS).view(n_blocks, -1)
    zero = counts[:, 0] == 0
    passed = (counts[:, 1:] > 0).sum(dim=1)  # thermometer: counts never rise
    return zero, passed


def out_of_range(zero: torch.Tensor, passed: torch.Tensor) -> torch.Tensor:
    """Whether some non-zero block passed no threshold or all of them (0-d bool): its
    maximum is then unknown."""
    return ((passed == 0) & ~zero).any() | (passed == len(THRESHOLDS)).any()


def next_scales(passed: torch.Tensor, scales: torch.Tensor, headroom: float) -> torch.Tensor:
    """The next step's scales: ``headroom`` times the thermometer's upper bound on each
    block's maximum over ranks."""
    bounds = constant((*THRESHOLDS, 2 * THRESHOLDS[-1]), torch.float32, passed.device)
    # Elementwise float32 operations on identical integers: identical on every rank.
    return bounds[passed].mul_(headroom).mul_(_reference(scales))
