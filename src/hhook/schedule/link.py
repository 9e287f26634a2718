r"""What a round costs on a group, measured once at its first options handshake and the same
on every rank: whether a tensor above the piece size (``chunk_mb="auto"``) still travels in
pieces.

A tensor above the piece size travels in pieces (:func:`hhook.schedule.flat.pieces`) so
that one piece is encoded while the previous one is on the wire. Each piece costs its own
rounds: one with gathered or predicted scales, two with agreed scales, whose SUM waits for
its MAX. Where a round takes milliseconds (between sites) agreed pieces cost more rounds
than their overlap saves: on two emulated links (1 Gbit/s with 10 ms each way, 100 Mbit/s
with 50 ms) a CNN whose 21 MB bucket went whole took 0.90x and 0.82x the step time of two
agreed pieces, while two gathered pieces stepped faster than the whole tensor
(docs/usage.md).
So on a slow link an agreed exchange travels whole; a one-round one keeps its pieces.

The measurement rides on the handshake (:func:`hhook.schedule.handshake.agree`), which
every rank runs at the same point, once per group and process: after the handshake's own
round (which leaves the ranks in step, its connections open), two one-element all-reduces,
each timed on each rank (the shorter is one round trip, give or take the ranks' skew), then
a MAX of that time, negated (8 bytes): every rank holds the shortest among the ranks, and so
splits every tensor alike.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time

import torch
import torch.distributed as dist

from . import membership

#: A round at least this long (seconds) is a wide-area one. Loopback and LANs take well
#: under a millisecond (0.24 ms on loopback here), a busy host's scheduling a few; two
#: sites 5 ms apart each way, 10.
SLOW_ROUND_S = 0.005


@dataclasses.dataclass(frozen=True)
class Link:
    """One group's measured round: ``round_s``, the seconds of a one-element all-reduce."""

    round_s: float

    @property
    def slow(self) -> bool:
        return self.round_s >= SLOW_ROUND_S


_lock = threading.Lock()
_links: dict = {}  # (group instance, group name) -> Link


def of(group) -> Link | None:
    """``group``'s :class:`Link`, where its handshake measured one."""
    members = membership.of(group)
    with _lock:
        return _links.get((members.instance, members.name))


def measure(group, device) -> None:
    """After a handshake of ``group`` that every rank passed (blocking, on every rank): the
    group's :class:`Link` (the module's docstring), once per group and process. Its 24
    bytes are no state's: no state's stats count them."""
    members = membership.of(group)
    key = (members.instance, members.name)
    with _lock:
        if key in _links:
            return
    seconds = math.inf
    for _ in range(2):
        start = time.monotonic()
        _shortest(members, 0.0, device)
        seconds = min(seconds, time.monotonic() - start)
    measured = Link(_shortest(members, seconds, device))
    with _lock:
        _links[key] = measured


def _shortest(members, seconds: float, device) -> float:
    """The shortest of every rank's ``seconds`` (a MAX of their negations)."""
    vector = torch.tensor([-seconds], dtype=torch.float64 if members.on_host else torch.float32, device=device)
    members.all_reduce(vector, dist.ReduceOp.MAX).wait()
    return -float(vector.item())


def limit(ctx) -> tuple[int, int]:
    """The piece limit of ``ctx``'s exchanges (:attr:`~hhook.schedule.context.CallContext.piece_limit`,
    elements on the CPU and elsewhere; 0: whole tensors), read at each call: its group's
    link is measured at the group's first handshake, which for a two-level ring comes after
    its context is made."""
    return limit_for(dict(ctx.fields).get("chunk_mb"), ctx.group, ctx.policy, ctx.piece_limit)


def limit_for(chunk_mb, group, policy, configured: tuple[int, int]) -> tuple[int, int]:
    """``configured`` (the limit ``chunk_mb`` gives: :meth:`hhook.state.Options.piece_limit`),
    or whole tensors where ``chunk_mb`` is ``"auto"``, ``group``'s link is slow and
    ``policy``'s exchanges take two rounds (agreed scales: neither gathered nor predicted)."""
    if chunk_mb != "auto" or policy is None or policy.gather or policy.predict:  # one round: pieces pay
        return configured
    measured = of(group)
    return (0, 0) if measured is not None and measured.slow else configured
