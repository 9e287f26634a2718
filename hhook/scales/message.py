r"""The one wire format of every summed THC message, whichever scale policy built it.

A message is a tensor of the codec's lane words (int32 or int64), SUM-allreduced (or
reduce-scattered) by a stock backend::

    [PREFIX words | per-block side information (policy's) | packed codes]

The prefix is the same for every policy, so a receiver checks every message alike:

====== ================================================================================
word   meaning (each rank sends; the sum over ``n`` ranks is what decode reads)
====== ================================================================================
0      1: the sum is ``n``; anything else means the words were averaged, reduced with
       Min/Max, or over another set of ranks (:class:`OpMismatchError`)
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

import torch

from ..codec import rng
from ..codec.layout import constant
from ..errors import ConfigMismatchError, OpMismatchError, RankFailedError

#: Words at the front of every message.
PREFIX = 12
#: Where the status word is in a message (:func:`status_word`).
STATUS = 1
#: Added to the status word by a rank that failed locally (more than any count of
#: non-finite ranks can reach).
RANK_FAILED = 1 << 20
_SALT = 0x54484348  # "THCH"


def status_word(nonfinite, failed: bool):
    """The failure protocol, one definition for every exchange (the prefix of a summed
    message, FSDP2's reduce-scatter, which says every chunk's in each message, its
    all-gather's payload header, the shards of two-level's gather): what a rank sends
    is 1 if its tensor held inf/NaN (a bool or a 0-d tensor), plus :data:`RANK_FAILED` if
    it failed locally and sends filler. Summed over ranks, :func:`any_failed`,
    :func:`failed_ranks` and :func:`any_nonfinite` read it (a count of non-finite ranks stays below
    :data:`RANK_FAILED`)."""
    return nonfinite + (RANK_FAILED if failed else 0)


def any_failed(status):
    """Whether a status word (one rank's, or a sum) says some rank failed (a number or a
    tensor; inf, a sum that overflowed a float16, says so too)."""
    return status >= RANK_FAILED


def failed_ranks(status: int) -> int:
    """How many ranks failed, from a summed status word read on the host."""
    return int(status // RANK_FAILED)


def any_nonfinite(status):
    """Whether a status word says some rank's tensor held inf/NaN."""
    return status % RANK_FAILED > 0


def share_status(messages: torch.Tensor, headers: list, failed_here: bool, ok: torch.Tensor) -> None:
    """One status for every message of one rank's buffer (FSDP2's reduce-scatter: a row of
    ``messages`` per destination chunk): inf/NaN in any chunk (``headers``: the prepared
    headers of those encoded) or a local failure is said in the status word of every
    chunk's message, so every rank learns of it whichever chunk it receives. Rows not
    ``ok`` (their encoding failed) keep the filler's status."""
    flag = torch.stack(headers).gt(0).any().to(messages.dtype) if headers else messages.new_zeros(())
    messages[:, STATUS] = torch.where(ok, status_word(flag, failed_here), messages[:, STATUS])


def wrap(value: int, word_bits: int) -> int:
    """``value`` as the two's-complement integer of ``word_bits`` bits that holds it."""
    value &= (1 << word_bits) - 1
    return value - (1 << word_bits) if value >> (word_bits - 1) else value


def fingerprints(*parts: int) -> tuple[int, int]:
    """Two 31-bit hashes of ``parts`` (non-negative integers below 2**64)."""
    h = rng.mix32(_SALT)
    for part in parts:
        h = rng.mix32(h ^ (part & rng.MASK32))
        h = rng.mix32(h ^ (part >> 32))
    return h & 0x7FFFFFFF, rng.mix32(h ^ _SALT) & 0x7FFFFFFF


def digest_chunks(header: torch.Tensor) -> torch.Tensor:
    """The four 12-bit chunks of the 48-bit digest in a prepared header
    (:data:`hhook.codec.HEADER`), each followed by its square."""
    halves = header[3:6:2].to(torch.int64)  # a view: indexing with a list would copy the list to the GPU and wait
    chunks = torch.stack((halves & 0xFFF, halves >> 12), dim=1).reshape(-1)
    return torch.stack((chunks, chunks * chunks), dim=1).reshape(-1)


def write_prefix(words: torch.Tensor, fps: tuple[int, int], header: torch.Tensor | None, failed: bool = False) -> None:
    """Fill ``words[:PREFIX]``. ``header`` is the codec's prepared header (flag and
    digest); None (a failed rank) sends no flag and a digest no other rank matches."""
    prefix = words[:PREFIX]
    prefix[:4] = constant([1, status_word(0, failed), fps[0], fps[1]], words.dtype, words.device)
    if header is not None:
        prefix[STATUS] += (header[0] > 0).to(words.dtype)
        prefix[4:] = digest_chunks(header)
    else:
        prefix[4:] = constant([1, 1, 0, 0, 0, 0, 0, 0], words.dtype, words.device)


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
    if count != n:
        raise OpMismatchError(
            f"The compressed tensor came back with count word {count:g} instead of the world size {n}: "
            "it was averaged, or reduced with Min/Max/Adasum, or over a different set of ranks. THC's "
            "packed integer lanes need a plain SUM (the division by the world size happens in decode)."
        )
    if any_failed(status):
        raise RankFailedError(
            f"hhook: {failed_ranks(status)} rank(s) failed while encoding this tensor ({what}); "
            "see that rank's own exception"
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


def device_verdict(sums: torch.Tensor, world_size: int, fps: tuple[int, int]):
    """``(bad, nonfinite)`` of a summed prefix as 0-d bool tensors, without a host read:
    ``bad`` covers a wrong op, a failed rank and a mismatch (decode writes NaN; the
    caller raises later, where reading the flag is free)."""
    word_bits = 32 if sums.dtype == torch.int32 else 64
    p = sums[:PREFIX]
    bad = (p[0] != world_size) | any_failed(p[STATUS])
    bad = bad | (p[2] != wrap(world_size * fps[0], word_bits)) | (p[3] != wrap(world_size * fps[1], word_bits))
    return bad, any_nonfinite(p[STATUS])
