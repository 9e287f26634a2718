r"""How far ``bits="auto"`` descends below its width (:mod:`hhook.decision`): a narrower
THC width takes its turn only while fewer bytes still buy time, and a dense candidate's
period is bounded before it runs. Pure functions of a :class:`~hhook.decision.Decision`'s
samples."""

from __future__ import annotations

import statistics

from .methods import DENSE_WIRE_BITS, FP32, thc_bits

#: A width below auto - 1 takes a turn only if the width above it was at least this
#: fraction faster than the one above that: fewer bytes must still be buying time.
DESCEND_GAIN = 0.03


def median(values) -> float | None:
    return statistics.median(values) if values else None


def fp32_estimate(d) -> float | None:
    """fp32's period: its samples, or at the job's start its plain iterations'."""
    if d.samples.get(FP32):
        return median(d.samples[FP32])
    return median(d.plain) if not d.decisions else None  # plain iterations: the job's start only


def bound(d, method: str) -> float | None:
    """A lower bound on ``method``'s period before it runs: fp32's own sample; bf16
    sends half the bytes of fp32, so it takes at least half its step."""
    fp32 = fp32_estimate(d)
    if fp32 is None or method not in DENSE_WIRE_BITS:
        return None
    return fp32 * DENSE_WIRE_BITS[method] / DENSE_WIRE_BITS[FP32]


def narrowing_pays(d, method: str) -> bool:
    """Whether THC ``method`` should take its turn: always for dense candidates, the
    auto width and the one below it; a narrower width only while the width above it
    ran :data:`DESCEND_GAIN` faster than the one above that, or ran within that of it
    and would save as much by the bytes it saves (:func:`byte_gain`): fewer bytes
    still buy time. A width above it that was dropped or skipped, or measured more than
    that slower than the one above that, stops the descent (the codec costs more than
    the bytes save)."""
    bits = thc_bits(method)
    if bits is None or f"thc:{bits + 2}" not in d.options["candidates"]:
        return True
    wider, widest = f"thc:{bits + 1}", f"thc:{bits + 2}"
    est = d.estimates()
    if wider in d.dropped or est.get(wider) is None:
        return False
    if widest in d.dropped:  # one bit fewer survived where two more were dropped
        return True
    if est.get(widest) is None:
        return False
    if est[wider] <= (1 - DESCEND_GAIN) * est[widest]:
        return True  # measured
    # within the noise of a turn (not measured slower by as much): the bytes decide
    return (est[wider] <= (1 + DESCEND_GAIN) * est[widest]
            and byte_gain(d, wider, est[wider], method) >= DESCEND_GAIN * est[wider])


def byte_gain(d, wider: str, period: float, method: str) -> float:
    """The time ``method`` would save on THC ``wider`` (its median ``period``) by its
    fewer bytes alone, at the time per wire bit that fp32 against ``wider`` measured
    (0 where fp32 was not slower, or unknown). fp32 against THC spans five times the bytes of one width
    against the next, so noise that hides a 3% gain between widths does not hide this
    one; THC's codec cost only makes it an underestimate."""
    wire, fp32 = d.options.get("wire_bits"), fp32_estimate(d)
    if not wire or fp32 is None:
        return 0.0
    per_bit = (fp32 - period) / (wire[FP32] - wire[wider])
    return max(per_bit, 0.0) * (wire[wider] - wire[method])


def awaits_wider_turn(d, method: str) -> bool:
    """Whether a narrower THC ``method``'s turn must wait for periods of the turn of
    the width above it (:func:`narrowing_pays` judges that width on its whole turn,
    not on the first periods back: with two of five, one slow step stopped the
    descent at 100 Mbit/s)."""
    bits = thc_bits(method)
    if bits is None or f"thc:{bits + 2}" not in d.options["candidates"]:
        return False
    wider = f"thc:{bits + 1}"
    return wider not in d.dropped and any(
        entry[0] == wider and int(it) <= d.last_probe for it, entry in d.history.items())


def best(d, exclude: str | None = None) -> float | None:
    """The shortest period measured this exploration but ``exclude``'s (fp32's plain
    iterations count for fp32 until it runs)."""
    values = [v for m, v in d.estimates().items() if m != exclude]
    fp32 = fp32_estimate(d)
    if exclude != FP32 and not d.samples.get(FP32) and fp32 is not None:
        values.append(fp32)
    return min(values) if values else None
