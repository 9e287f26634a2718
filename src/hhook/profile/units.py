r"""Sizes on the command line and in tables.

Suffixes follow nccl-tests for the bare letters (``K``, ``M``, ``G`` are powers of
1024, as in ``-e 128M``) and SI for ``KB``, ``MB``, ``GB`` (powers of 1000, so
``25MB`` is 25,000,000 bytes); ``KiB``, ``MiB``, ``GiB`` are explicit powers of 1024.
"""

from __future__ import annotations

import math
import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "m": 1 << 20,
    "g": 1 << 30,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """``"25MB"`` -> 25000000, ``"4K"`` -> 4096, ``"1.5MiB"`` -> 1572864.

    Raises ``ValueError`` with a readable message for anything else.
    """
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"cannot read size {text!r} (examples: 4096, 4K, 1MiB, 25MB)")
    number, unit = m.groups()
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise ValueError(f"unknown size unit {unit!r} in {text!r} (use K, M, G, KiB, MiB, GiB, KB, MB, GB)")
    value = float(number) * factor
    if value != int(value):
        raise ValueError(f"size {text!r} is not a whole number of bytes")
    return int(value)


def sweep(begin: int, end: int, factor: float) -> list[int]:
    """``begin, begin * factor, ...`` up to ``end`` inclusive (sizes rounded to bytes)."""
    if begin <= 0 or end < begin or factor <= 1:
        raise ValueError("a sweep needs 0 < begin <= end and factor > 1")
    sizes, size = [], float(begin)
    while size <= end * (1 + 1e-12):
        if not sizes or int(size) != sizes[-1]:
            sizes.append(int(size))
        size *= factor
    return sizes


def format_size(nbytes: float) -> str:
    """Short human form, binary below 1 MB-ish: ``4 KiB``, ``1 MiB``, ``25 MB``."""
    n = float(nbytes)
    if n < 1024:
        return f"{n:.0f} B"
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= factor and (n / factor).is_integer():
            return f"{n / factor:.0f} {unit}"
    for unit, factor in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= factor:
            return f"{n / factor:.3g} {unit}"
    return f"{n:.0f} B"


def iterations(nbytes: int, iters: int, warmup: int, fixed: bool, knee: int = 4 << 20) -> tuple[int, int]:
    """Timed and warm-up iterations for one size.

    Up to ``knee`` bytes every size runs ``iters`` (after ``warmup``); above it the count
    falls as ``1 / size`` to keep long sweeps short, never below ``min(iters, 3)`` timed
    and one warm-up. ``fixed`` keeps ``iters`` and ``warmup`` at every size.
    """
    if fixed or nbytes <= knee:
        return iters, warmup
    scaled = max(min(iters, 3), math.ceil(iters * knee / nbytes))
    return scaled, min(warmup, max(1, math.ceil(warmup * knee / nbytes)))


_RATE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z/]*)\s*$")
_RATE_UNITS = {  # to bytes per second
    "bit": 1 / 8,
    "kbit": 1e3 / 8,
    "mbit": 1e6 / 8,
    "gbit": 1e9 / 8,
    "b/s": 1,
    "kb/s": 1e3,
    "mb/s": 1e6,
    "gb/s": 1e9,
    "gbps": 1e9,  # a nod to tables that print GB/s as GBps
}


def parse_rate(text: str) -> float:
    """Link rate in bytes per second: ``1gbit``, ``100mbit``, ``0.118GB/s``, ``117MB/s``."""
    m = _RATE.match(str(text))
    if not m or m.group(2).lower() not in _RATE_UNITS:
        raise ValueError(f"cannot read rate {text!r} (examples: 1gbit, 100mbit, 0.118GB/s)")
    value = float(m.group(1)) * _RATE_UNITS[m.group(2).lower()]
    if value <= 0:
        raise ValueError(f"rate {text!r} must be positive")
    return value
