r"""How many bits THC needs: the predicted error of the mean over ``N`` participants
(ranks, or node means on two-level layouts) and ``bits="auto"``'s rule, the fewest bits
that match 4 bits over 4 ranks; and the bits per coordinate each width puts on the wire.

The model is fitted to :func:`hhook.simulation.heavy_tailed` gradients and checked against
simulated allreduces up to 1024 ranks (tests/schedule/test_topology.py, docs/topology.md).
"""

from __future__ import annotations

import math

from .codec import THCCodec

#: The reference every ``bits="auto"`` choice must match: 4 bits over 4 flat ranks
#: (vNMSE of the mean about 9e-3 on :func:`hhook.simulation.heavy_tailed` gradients).
REFERENCE_BITS, REFERENCE_RANKS = 4, 4
#: Share of the block maxima's energy that is per-rank noise in
#: :func:`hhook.simulation.heavy_tailed` gradients (fitted: 0.30-0.44 for 2-128 nodes of
#: 2-8 ranks; the low end is taken). A node's mean keeps ``1 - f (1 - 1/k)`` of it.
HEAVY_TAILED_NOISE_FRACTION = 0.3
# Stochastic rounding's variance per coordinate relative to (step)^2 / 6, by bits: with
# 2 levels every value sits near the middle (p(1-p) near 1/4, not 1/6 on average).
_ROUNDING_EXCESS = {1: 1.4, 2: 1.08}
# vNMSE at the reference, calibrated on heavy_tailed (the codec's documented 9e-3).
_REFERENCE_VNMSE = 9e-3
# Correlated rounding's error relative to independent rounding's: a + c / N by bits
# (``b >= 3`` share one row) and whether N is a power of two (N ranks then fill the
# 2**L strata, :class:`hhook.codec.rng.Stream`). Upper envelope of heavy_tailed simulations
# over 2-1024 flat ranks (tests/schedule/test_topology.py checks it): 0.50-0.53
# from 4 ranks at 3-8 bits, 0.63 at 2, 0.68 at 3; 0.38-0.66 at 2 bits; 0.12-0.48 at 1.
# Node means (two-level) measured lower still (0.44 at 8 x 8, 3 bits).
_CORRELATED_GAIN = {  # bits: ((a, c) for powers of two, (a, c) otherwise)
    1: ((0.13, 0.44), (0.13, 1.15)),
    2: ((0.40, 0.40), (0.42, 0.75)),
    3: ((0.50, 0.30), (0.50, 0.56)),
}


def correlated_gain(bits: int, n: int) -> float:
    """Correlated rounding's vNMSE of the mean over ``n`` participants as a fraction of
    independent rounding's (1 for a single participant, which rounds nothing away)."""
    if n <= 1:
        return 1.0
    a, c = _CORRELATED_GAIN[min(bits, 3)][0 if n & (n - 1) == 0 else 1]
    return min(1.0, a + c / n)


def predicted_vnmse(bits: int, n_nodes: int, ranks_per_node: int = 1, block_size: int = 1024,
                    noise_fraction: float = HEAVY_TAILED_NOISE_FRACTION, rounding: str = "correlated") -> float:
    r"""Predicted vNMSE of the mean of THC at ``bits`` over ``n_nodes`` participants, each
    the exact mean of ``ranks_per_node`` ranks (1: flat THC over ``n_nodes`` ranks).

    Every participant rounds onto steps ``2 M / (2^b - 1)`` with ``M`` the block's maximum
    over participants; the rounding noise of the mean falls as ``1 / N``; ``M^2`` grows as
    the log of the ``N B`` values it is the maximum of; a node mean keeps
    ``rho = 1 - f (1 - 1/k)`` of the maxima's energy (``f``: the per-rank noise share,
    ``noise_fraction``; 0 bounds it for any data)::

        vNMSE(b, N, k) = c ln(N B) g(b) rho(k) / (N (2^b - 1)^2)

    ``c`` is fixed by the reference (4 bits, 4 ranks, independent rounding: 9e-3);
    ``g(1) = 1.4``, ``g(2) = 1.08``, else 1. ``rounding="correlated"`` multiplies it by
    :func:`correlated_gain` (about 1/2 from 8 participants at 3 bits and more). Checked
    against :func:`hhook.simulation.simulate_allreduce` up to 1024 simulated ranks
    (tests/schedule/test_topology.py).
    """
    if not 0.0 <= noise_fraction <= 1.0:
        raise ValueError(f"noise_fraction must lie in [0, 1], got {noise_fraction!r}")

    def shape(b, n, k, f):
        rho = 1.0 - f * (1.0 - 1.0 / k)
        return math.log(n * block_size) * _ROUNDING_EXCESS.get(b, 1.0) * rho / (n * (2**b - 1) ** 2)

    ref = shape(REFERENCE_BITS, REFERENCE_RANKS, 1, 0.0)
    gain = correlated_gain(bits, n_nodes) if rounding == "correlated" else 1.0
    return _REFERENCE_VNMSE * shape(bits, n_nodes, ranks_per_node, noise_fraction) / ref * gain


def auto_bits(n_nodes: int, ranks_per_node: int = 1, block_size: int = 1024,
              noise_fraction: float = HEAVY_TAILED_NOISE_FRACTION, rounding: str = "correlated") -> int:
    r"""``bits="auto"``: the fewest bits (1..8) whose :func:`predicted_vnmse` over
    ``n_nodes`` THC participants (nodes of ``ranks_per_node``; 1 for flat THC over
    ``n_nodes`` ranks) with ``rounding`` is no worse than 4 bits over 4 flat ranks
    rounding independently (the bound before correlated rounding).

    Large jobs average more rounding noise away, so they need fewer levels, and fewer
    levels mean narrower lanes. Correlated rounding halves the error, so from 4 ranks on
    it needs one bit fewer than independent rounding.
    ``noise_fraction=0`` makes the rule hold for gradients without per-rank noise too
    (more bits on two-level layouts).

    Example::
        >>> [auto_bits(n) for n in (2, 4, 16, 64, 128, 1024)]
        [5, 4, 4, 3, 3, 2]
        >>> auto_bits(128, ranks_per_node=8)
        2
    """
    if isinstance(n_nodes, bool) or not isinstance(n_nodes, int) or n_nodes < 1:
        raise ValueError(f"n_nodes must be a positive integer, got {n_nodes!r}")
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be a positive integer, got {ranks_per_node!r}")
    if n_nodes == 1:  # nothing is rounded for a world of one
        return REFERENCE_BITS
    target = predicted_vnmse(REFERENCE_BITS, REFERENCE_RANKS, 1, block_size, 0.0, "independent")
    for bits in range(1, 9):
        if predicted_vnmse(bits, n_nodes, ranks_per_node, block_size, noise_fraction, rounding) <= target * (1 + 1e-9):
            return bits
    return 8


def wire_bits_per_coord(bits: int, n: int, block_size: int = 1024) -> float:
    """Bits per coordinate THC hands to the wire over ``n`` participants (lanes and the
    per-block scale), for a large tensor."""
    numel = 1 << 22
    return 8 * THCCodec(bits, block_size, 0, n).wire_bytes(numel) / numel
