r"""The candidates of ``bits="auto"`` (:mod:`hhook.decision`): their names, in probing
order, and the bits per coordinate each puts on the wire."""

from __future__ import annotations

from ..codec.error_model import wire_bits_per_coord

#: The narrowest THC width tried (fewer bytes, more rounding error).
MIN_WIDTH = 2
#: The plain iterations' method and the dense candidates.
PLAIN, FP32, BF16 = "plain", "fp32", "bf16"
#: Bits per coordinate each dense candidate hands to its allreduce (THC's: :func:`wire_bits`).
DENSE_WIRE_BITS = {BF16: 16.0, FP32: 32.0}


def candidates(auto_width: int, floor: int = MIN_WIDTH) -> list[str]:
    """The candidates in probing order: THC from ``auto_width`` down to ``floor`` bits
    (the narrow ones are tried only while narrowing pays), bf16, fp32.

    Example::
        >>> candidates(5)
        ['thc:5', 'thc:4', 'thc:3', 'thc:2', 'bf16', 'fp32']
    """
    widths = range(auto_width, min(floor, auto_width) - 1, -1)
    return [f"thc:{b}" for b in widths] + [BF16, FP32]


def wire_bits(methods: list[str], participants: int, block_size: int = 1024) -> dict[str, float]:
    """Bits per coordinate each of ``methods`` puts on the wire when ``participants`` ranks
    (or nodes) sum: THC's :func:`~hhook.codec.error_model.wire_bits_per_coord` (lanes, whose
    headroom grows with them, and the block scales), 16 and 32 for the dense ones.

    Example::
        >>> wire_bits(["thc:5", "thc:4", "thc:3", "bf16", "fp32"], 2)
        {'thc:5': 6.431, 'thc:4': 5.365, 'thc:3': 4.031, 'bf16': 16.0, 'fp32': 32.0}
    """
    return {m: DENSE_WIRE_BITS[m] if thc_bits(m) is None
            else round(wire_bits_per_coord(thc_bits(m), participants, block_size), 3) for m in methods}


def thc_bits(method: str) -> int | None:
    """The width of a THC candidate (``"thc:4"`` -> 4), None for a dense one."""
    return int(method.split(":")[1]) if method.startswith("thc:") else None
