r"""How far ``bits="auto"`` descends below its width (:mod:`hhook.decision`): a narrower
THC width takes its turn only while fewer bytes still buy time, and a dense candidate's
period is bounded before it runs. Pure functions of a :class:`~hhook.decision.Decision`'s
samples."""

from __future__ import annotations

import statistics

from .methods import DENSE_WIRE_BITS, FP32, scales_of, thc_bits, thc_name

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
    the bytes save). Where both THC forms (two rounds, one round) are candidates below
    the auto width, only the form that was faster at the auto width descends
    (:func:`form_won`): the other's narrower widths would cost turns and lose."""
    bits, form = thc_bits(method), scales_of(method)
    if bits is None:
        return True
    names = d.options["candidates"]
    if forms_compete(d, bits) and not form_won(d, form):
        return False
    if thc_name(bits + 2, form) not in names:
        return True
    wider, widest = thc_name(bits + 1, form), thc_name(bits + 2, form)
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


def top_width(d) -> int:
    """The auto width: the widest THC candidate."""
    return max(b for b in map(thc_bits, d.options["candidates"]) if b is not None)


def forms_at(names: list[str], bits: int) -> list[str]:
    """The THC candidates at ``bits``, in probing order."""
    return [m for m in names if thc_bits(m) == bits]


def forms_compete(d, bits: int) -> bool:
    """Whether both THC forms are candidates at ``bits``, below the auto width: there only
    the form that won at the auto width takes its turn (:func:`form_won`)."""
    return bits < top_width(d) and len(forms_at(d.options["candidates"], bits)) > 1


def form_won(d, form: str | None) -> bool:
    """Whether THC's ``form`` measured fastest of the forms at the auto width this
    exploration (ties: the earlier candidate); a form dropped or not measured lost."""
    names, est, top = d.options["candidates"], d.estimates(), top_width(d)
    measured = [m for m in forms_at(names, top) if m not in d.dropped and est.get(m) is not None]
    return bool(measured) and min(measured, key=lambda m: (est[m], names.index(m))) == thc_name(top, form)


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
    """Whether a narrower THC ``method``'s turn must wait for periods of the turns that
    judge it (:func:`narrowing_pays`): the width above it in its form, judged on its whole
    turn, not on the first periods back (with two of five, one slow step stopped the
    descent at 100 Mbit/s), and where two forms descend, both forms at the auto width."""
    bits, form = thc_bits(method), scales_of(method)
    if bits is None:
        return False
    names = d.options["candidates"]
    judges = set()
    if thc_name(bits + 2, form) in names:
        judges.add(thc_name(bits + 1, form))
    if forms_compete(d, bits):
        judges.update(forms_at(names, top_width(d)))
    return any(entry[0] in judges and entry[0] not in d.dropped and int(it) <= d.last_probe
               for it, entry in d.history.items())


def best(d, exclude: str | None = None) -> float | None:
    """The shortest period measured this exploration but ``exclude``'s (fp32's plain
    iterations count for fp32 until it runs)."""
    values = [v for m, v in d.estimates().items() if m != exclude]
    fp32 = fp32_estimate(d)
    if exclude != FP32 and not d.samples.get(FP32) and fp32 is not None:
        values.append(fp32)
    return min(values) if values else None
