r"""The one wire format of every summed THC message, whichever scale policy built it.

A message is a tensor of the codec's lane words (int32 or int64), SUM-allreduced (or
reduce-scattered) by a stock backend::

    [PREFIX words | per-block side information (policy's) | packed codes]

The prefix is the same for every policy, so a receiver checks every message alike:

====== ================================================================================
word   meaning (each rank sends; the sum over ``n`` ranks is what decode reads)
====== ================================================================================
0      1: the sum is ``n``; anything else means the words were averaged, reduced with
       Min/Max, or over another set of ranks (:class:`OpMismatchError`); plus
       :data:`CHANGED` from a rank whose call differs from what its key's last exchange
       verified: it sends filler of the verified size (:class:`CallChanged`)
1      status: ``1`` if this rank's tensor held inf/NaN, plus ``RANK_FAILED`` if this
       rank failed locally (out of memory, a kernel error) and sends filler instead of
       codes: every rank then raises :class:`RankFailedError` rather than one rank
       skipping its collective while the others wait (or, on NCCL, pairing the next one)
2, 3   two 31-bit fingerprints of everything that must match: codec configuration,
       schedule options, tensor length, scale policy and step kind, and the digest of
       the scales in use; their sums equal ``n`` times each rank's exactly when all agree
4..11  the four 12-bit chunks ``c_k`` of the 48-bit digest of the tensor's bits and
       ``c_k**2``: ``n * sum(c**2) == sum(c)**2`` for all four exactly when every rank
       sent the same tensor (Cauchy-Schwarz), whose mean is then that tensor itself
====== ================================================================================
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..codec import rng
# The prefix's writer and device-side check live beside the header they encode (the fused
# CUDA kernels write and check it in the same launches as the words).
from ..codec.layout import (PREFIX, RANK_FAILED, STATUS, any_failed, any_nonfinite, digest_chunks,  # noqa: F401
                            failed_ranks, prefix_verdict, status_word, wrap, write_prefix)
from ..errors import ConfigMismatchError, OpMismatchError, RankFailedError

_SALT = 0x54484348  # "THCH"
#: Added to word 0 by a rank whose call changed (:class:`CallChanged`): the sum's high
#: part counts those ranks (below 2**15 ranks, an int32 word holds it).
CHANGED = 1 << 16


class CallChanged(ConfigMismatchError):
    """A rank's call of a key differs from what the key's last exchange verified (length,
    dtype, layout, options): ``count`` ranks said so in the exchange's prefix, whose filler
    (of the verified size) every rank then refuses (:mod:`hhook.schedule.call_check`)."""

    def __init__(self, message: str, count: int = 0):
        super().__init__(message)
        self.count = count


@functools.lru_cache(maxsize=4096)
def fingerprints(*parts: int) -> tuple[int, int]:
    """Two 31-bit hashes of ``parts`` (non-negative integers below 2**64); kept, since
    every bucket of a step asks again (a few microseconds of Python each)."""
    h = rng.mix32(_SALT)
    for part in parts:
        h = rng.mix32(h ^ (part & rng.MASK32))
        h = rng.mix32(h ^ (part >> 32))
    return h & 0x7FFFFFFF, rng.mix32(h ^ _SALT) & 0x7FFFFFFF


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What the summed prefix says, read on the host."""

    nonfinite: bool
    identical: bool


def read_prefix(sums: torch.Tensor, world_size: int, fps: tuple[int, int], what: str) -> Verdict:
    """Check a summed prefix on the host; raise on a wrong op, a failed rank or a mismatch.

    ``what`` describes this rank's configuration for the error message.
    """
    count, status, fp_a, fp_b, *chunks = sums[:PREFIX].tolist()
    return check_prefix(count, status, fp_a, fp_b, chunks, world_size, fps, sums.dtype, what)


def check_prefix(count, status, fp_a, fp_b, chunks, world_size, fps, dtype, what) -> Verdict:
    n = world_size
    changed = int(count // CHANGED) if count >= CHANGED else 0
    if changed:
        raise CallChanged(f"hhook: {changed} rank(s) called this key with another tensor or options than its last "
                          f"exchange verified (this rank: {what})", changed)
    if count != n:
        raise OpMismatchError(
            f"The compressed tensor came back with count word {count:g} instead of the world size {n}: "
            "it was averaged, or reduced with Min/Max/Adasum, or over a different set of ranks. THC's "
            "packed integer lanes need a plain SUM (the division by the world size happens in decode)."
        )
    if any_failed(status):
        raise RankFailedError(
            f"hhook: {failed_ranks(status)} rank(s) failed on this tensor and sent filler (while encoding it, or in "
            f"a collective of their own node) ({what}); see that rank's own exception"
        )
    word_bits = 32 if dtype == torch.int32 else 64
    if (fp_a, fp_b) != (wrap(n * fps[0], word_bits), wrap(n * fps[1], word_bits)):
        raise ConfigMismatchError(
            "hhook: ranks disagree on the THC configuration, the tensor length, the schedule or the "
            f"predicted scales (this rank: {what}). Every rank must use the same options and run the "
            "same steps."
        )
    identical = all(n * chunks[i + 1] == chunks[i] * chunks[i] for i in range(0, 8, 2))
    return Verdict(nonfinite=any_nonfinite(status), identical=identical)


def share_status(messages: torch.Tensor, headers: list, failed_here: bool, ok: torch.Tensor) -> None:
    """One status for every message of one rank's buffer (FSDP2's reduce-scatter: a row of
    ``messages`` per destination chunk): inf/NaN in any chunk (``headers``: the prepared
    headers of those encoded) or a local failure is said in the status word of every
    chunk's message, so every rank learns of it whichever chunk it receives. Rows not
    ``ok`` (their encoding failed) keep the filler's status."""
    flag = torch.stack(headers).gt(0).any().to(messages.dtype) if headers else messages.new_zeros(())
    messages[:, STATUS] = torch.where(ok, status_word(flag, failed_here), messages[:, STATUS])
