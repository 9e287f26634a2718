r"""The candidates of ``bits="auto"`` (:mod:`hhook.decision`): their names, in probing
order, and the bits per coordinate each puts on the wire."""

from __future__ import annotations

from ..codec.error_model import wire_bits_per_coord
from ..scales.gathered import MAX_RANKS

#: The narrowest THC width tried (fewer bytes, more rounding error).
MIN_WIDTH = 2
#: The plain iterations' method and the dense candidates.
PLAIN, FP32, BF16 = "plain", "fp32", "bf16"
#: Bits per coordinate each dense candidate hands to its allreduce (THC's: :func:`wire_bits`).
DENSE_WIRE_BITS = {BF16: 16.0, FP32: 32.0}
#: THC's one-round form (gathered scales: one all-gather, :mod:`hhook.scales.gathered`) is
#: a candidate up to this many participants (:data:`hhook.scales.gathered.MAX_RANKS`).
GATHERED_MAX_RANKS = MAX_RANKS
GATHERED = "gathered"


def candidates(auto_width: int, floor: int = MIN_WIDTH, gathered: bool = False) -> list[str]:
    """The candidates in probing order: THC from ``auto_width`` down to ``floor`` bits
    (the narrow ones are tried only while narrowing pays), with ``gathered`` each width
    in THC's one-round form too, after its two-round form (below ``auto_width`` only the
    form that was faster there takes turns: :func:`hhook.decision.descent.narrowing_pays`),
    bf16, fp32.

    Example::
        >>> candidates(5)
        ['thc:5', 'thc:4', 'thc:3', 'thc:2', 'bf16', 'fp32']
        >>> candidates(3, gathered=True)
        ['thc:3', 'thc:3:gathered', 'thc:2', 'thc:2:gathered', 'bf16', 'fp32']
    """
    forms = (None, GATHERED) if gathered else (None,)
    return [thc_name(b, f) for b in range(auto_width, min(floor, auto_width) - 1, -1) for f in forms] + [BF16, FP32]


def thc_name(bits: int, scales: str | None = None) -> str:
    """The candidate of THC at ``bits`` in the form ``scales`` names (None: the two-round form).

    Example::
        >>> thc_name(4), thc_name(4, "gathered")
        ('thc:4', 'thc:4:gathered')
    """
    return f"thc:{bits}" + (f":{scales}" if scales else "")


def wire_bits(methods: list[str], participants: int, block_size: int = 1024) -> dict[str, float]:
    """Bits per coordinate each of ``methods`` puts on the wire when ``participants`` ranks
    (or nodes) sum, as the width of a ring allreduce that moves as many bytes: THC's
    :func:`~hhook.codec.error_model.wire_bits_per_coord` (lanes, whose headroom grows with
    them, and the block scales), 16 and 32 for the dense ones.

    THC's one-round form: a ring all-gather hands each rank the ``participants - 1`` other
    messages (lanes as wide as the bits), which a ring allreduce moves at ``participants / 2``
    messages' width (it moves ``2 (n - 1) / n`` of its buffer): 0.75x the two-round form's
    bytes at 4 bits and 2 ranks, 1.25x at 4 ranks.

    Example::
        >>> wire_bits(["thc:5", "thc:4", "thc:4:gathered", "thc:3", "bf16", "fp32"], 2)
        {'thc:5': 6.431, 'thc:4': 5.365, 'thc:4:gathered': 4.031, 'thc:3': 4.031, 'bf16': 16.0, 'fp32': 32.0}
    """
    def bits(m):
        if thc_bits(m) is None:
            return DENSE_WIRE_BITS[m]
        if scales_of(m) == GATHERED:
            return round(max(participants, 2) / 2 * wire_bits_per_coord(thc_bits(m), 1, block_size), 3)
        return round(wire_bits_per_coord(thc_bits(m), participants, block_size), 3)

    return {m: bits(m) for m in methods}


def thc_bits(method: str) -> int | None:
    """The width of a THC candidate (``"thc:4"``, ``"thc:4:gathered"`` -> 4), None for a dense one."""
    return int(method.split(":")[1]) if method.startswith("thc:") else None


def scales_of(method: str) -> str | None:
    """The scale mode a THC candidate names (``"thc:4:gathered"`` -> ``"gathered"``), else None."""
    parts = method.split(":")
    return parts[2] if method.startswith("thc:") and len(parts) > 2 else None


def mode_of(method: str, scales: str) -> str | None:
    """The scale mode ``method`` runs under a state's ``scales`` option: the one it names,
    else the state's (None), but agreed for ``scales="auto"``: there the one-round form is
    a candidate of its own (``"thc:4:gathered"``), measured beside ``"thc:4"``."""
    return scales_of(method) or ("agreed" if scales == "auto" else None)
