"""The errors hhook raises on every rank alike, defined at the bottom of the package so
that every layer (the codec included) can raise them without importing upward."""

import dataclasses
import re


class ConfigMismatchError(RuntimeError):
    """Ranks disagree on the codec configuration or on the tensor they reduce."""


class OpMismatchError(RuntimeError):
    """The compressed integer words were not combined with a plain SUM over the group."""


class RankFailedError(RuntimeError):
    """Some rank failed on this tensor (while encoding it, or in a collective of its own
    node) and sent filler; every other rank raises this (that rank raises its own
    exception)."""


class PeerTimeoutError(TimeoutError):
    """A collective did not complete within the process group's timeout: a peer stalled
    (stopped, swapping, stuck in a kernel) or is far slower than this rank."""


class PeerLostError(ConnectionError):
    """A peer's connection closed in the middle of a collective: that rank died (killed,
    out of memory, preempted). The job cannot go on with this group; restart it (from a
    checkpoint)."""


# Gloo's messages for the two faults (torch 2.13): a receive that timed out, and a pair
# whose socket the peer closed. Other backends' errors are passed on as they are.
_TIMED_OUT = re.compile(r"Timed out waiting (\d+)ms for \w+ operation|Application timeout caused pair closure")
_CLOSED = re.compile(r"Connection closed by peer \[?([^\s\]]+?)\]?:(\d+)|Connection reset by peer|Broken pipe")


@dataclasses.dataclass(frozen=True)
class Blame:
    """Who is at fault for a failed collective, as the job's store tells
    (:mod:`hhook.schedule.blame`): ``culprits``, the ranks reached that report no wait of their own
    (stalled, or died); ``waiting``, this rank's peers that reported waiting for them (and
    gave up at their timeout); ``this_rank``, whether a report waits for this rank;
    ``lost``, this rank's peers that reported losing a rank (they exited after it died);
    ``elsewhere``, ``(rank, collective)`` of each report that waits for this rank, and
    ``collective``, this rank's own (its description and group); ``left``, the culprits
    that left the job normally (their program finished: uneven inputs), not died."""

    culprits: tuple = ()
    waiting: tuple = ()
    this_rank: bool = False
    lost: tuple = ()
    elsewhere: tuple = ()
    collective: str = ""
    left: tuple = ()

    def crossed(self) -> tuple:
        """``(rank, collective)`` of the ranks that wait for this one in another
        collective while this one waits for them (a deadlock of order, not a stall)."""
        if self.culprits:
            return ()
        return tuple((rank, where) for rank, where in self.elsewhere if where != self.collective)


def ranks_text(ranks) -> str:
    """``(2,)`` -> "rank 2"; ``(1, 2)`` -> "one of ranks [1, 2]"."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"one of ranks {list(ranks)}"


def _stalled(blame: Blame | None, peers: str) -> str:
    """The subject of "... stalled or is far behind"."""
    if blame is not None and blame.culprits:
        return f"a peer ({ranks_text(blame.culprits)})"
    if blame is not None and blame.this_rank:
        return "this rank"
    return f"a peer ({peers})" if peers else "a peer of the group"


_SET_TIMEOUT = ("Set the timeout with hhook.init_distributed(timeout_s=...) or "
                "torch.distributed.init_process_group(timeout=...)")


#: What a job of torch.distributed does after a rank died.
RESTART = "Restart the job from its last checkpoint (torchrun --max-restarts does it for you)"


def explain(exc: BaseException, what: str, timeout_s: float | None = None, peers: str = "",
            blame=None, recovery: str = RESTART) -> BaseException:
    """``exc`` as the error a user can act on, or ``exc`` itself.

    A transport's timeout becomes :class:`PeerTimeoutError` and a closed connection
    :class:`PeerLostError`, each naming ``what`` (the collective and its tensor), the
    group's timeout and who is at fault, with the transport's message kept at the end;
    the original stays the ``__cause__``. ``peers`` says who could be (``"rank 1"``);
    ``blame(kind)`` (kind ``"timeout"`` or ``"lost"``), where given, returns a
    :class:`Blame` that names the rank that stalled even where it is not this rank's peer,
    and tells a peer that gave up waiting (a closed connection that is a
    :class:`PeerTimeoutError`) from one that died. Anything else (and an error already
    explained) is returned unchanged. ``recovery``: what the job does after a lost rank
    (the group's :attr:`~hhook.schedule.membership.Membership.recovery`).
    """
    if isinstance(exc, (PeerTimeoutError, PeerLostError)):
        return exc
    text = str(exc)
    limit = f"{timeout_s:g} s" if timeout_s is not None else "the process group's timeout"
    found = _TIMED_OUT.search(text)
    if found:
        who = blame("timeout") if blame is not None else None
        waited = f"{int(found.group(1)) / 1000:g} s; the group's is {limit}" if found.group(1) else limit
        through = f"; {ranks_text(who.waiting)}, which this rank waits for, waits for it too" if who and who.waiting \
            and who.culprits else ""
        crossed = who.crossed() if who is not None else ()
        if crossed:
            theirs = "; ".join(f"rank {rank} in {where}" for rank, where in crossed)
            err = PeerTimeoutError(
                f"hhook: {what} did not complete within the timeout ({waited}): the ranks wait in different "
                f"collectives, each for the other: this rank in {who.collective}; {theirs}. No rank stalled: the "
                "program launched these collectives in a different order on these ranks (look for a collective, "
                f"a barrier or an hhook call that only some ranks make, or make in another order). Transport: "
                f"{_first_line(text)}")
        else:
            err = PeerTimeoutError(
                f"hhook: {what} did not complete within the timeout ({waited}): {_stalled(who, peers)} stalled or is "
                f"far behind (stopped, swapping, or stuck){through}. {_SET_TIMEOUT}. Transport: {_first_line(text)}")
    else:
        found = _CLOSED.search(text)
        if not found:
            return exc
        who = blame("lost") if blame is not None else None
        if who is not None and who.waiting:  # it gave up waiting: a stall, not a death
            err = PeerTimeoutError(
                f"hhook: {what} failed: {_stalled(who, peers)} stalled or is far behind (stopped, swapping, or "
                f"stuck): {ranks_text(who.waiting)} waited the timeout ({limit}) for it and closed its connection. "
                f"{_SET_TIMEOUT}. Transport: {_first_line(text)}")
        elif who is not None and who.left and set(who.culprits) <= set(who.left):
            err = PeerLostError(
                f"hhook: {what} failed: {ranks_text(who.left)} left the job normally (its program finished or "
                "destroyed its process group) while this rank still waited for it in this collective: every rank "
                "must run the same collectives (uneven inputs: a rank out of data must not stop before the others; "
                f"use DDP's join() or stop every rank at the same step). Transport: {_first_line(text)}")
        else:
            # The rank the reports lead to (a peer that only exited after losing it names it), else the peers.
            dead = ranks_text(who.culprits) if who is not None and who.culprits else peers
            after = f"; {ranks_text(who.lost)}, which this rank was in a collective with, lost it first and exited" \
                if who is not None and who.lost and who.culprits else ""
            at = f"at {found.group(1)}:{found.group(2)}" if found.group(1) and not after else ""
            said = ", ".join(filter(None, (dead, at)))
            err = PeerLostError(
                f"hhook: {what} failed: a peer{f' ({said})' if said else ' of the group'} closed its connection, so "
                f"that rank died (killed, out of memory, preempted){after}. {recovery}. Transport: {_first_line(text)}")
    err.__cause__ = exc
    return err


def store_failed(exc: BaseException, rank, what: str, cause: str, ended: bool = False) -> Exception:
    """The job's store (or the connections made through it) failed under ``what`` on
    ``rank``: :class:`PeerTimeoutError` where it timed out and no rank is known to have
    ended (``ended``), else :class:`PeerLostError`, naming the rank, ``cause`` and the
    store's own first line; ``exc`` is the ``__cause__``. Raised on every store or
    network call of hhook's (the handshake, the second communicator's set-up, the launch)."""
    said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    kind = PeerTimeoutError if not ended and re.search(r"time(d)? ?out", said, re.I) else PeerLostError
    err = kind(f"hhook: rank {rank}: the job's store failed in {what}: {cause}. The job cannot go on; restart it "
               f"(from a checkpoint). Store: {said}")
    err.__cause__ = exc
    return err


def _first_line(text: str) -> str:
    """The transport's own message, without torch's callback wrapping and traceback."""
    text = text.split("\n\nAt:", 1)[0].strip()
    return text.replace("Got the following error when running the callback: ", "")
