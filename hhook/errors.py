"""The errors hhook raises on every rank alike, defined at the bottom of the package so
that every layer (the codec included) can raise them without importing upward."""

import re


class ConfigMismatchError(RuntimeError):
    """Ranks disagree on the codec configuration or on the tensor they reduce."""


class OpMismatchError(RuntimeError):
    """The compressed integer words were not combined with a plain SUM over the group."""


class RankFailedError(RuntimeError):
    """Some rank failed while encoding this tensor; every rank raises this (that rank
    raises its own exception)."""


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


def explain(exc: BaseException, what: str, timeout_s: float | None = None, peers: str = "") -> BaseException:
    """``exc`` as the error a user can act on, or ``exc`` itself.

    A transport's timeout becomes :class:`PeerTimeoutError` and a closed connection
    :class:`PeerLostError`, each naming ``what`` (the collective and its tensor), the
    group's timeout and ``peers`` (who could be at fault: ``"rank 1"``), with the transport's message
    kept at the end; the original stays the ``__cause__``. Anything else (and an error
    already explained) is returned unchanged.
    """
    if isinstance(exc, (PeerTimeoutError, PeerLostError)):
        return exc
    text = str(exc)
    limit = f"{timeout_s:g} s" if timeout_s is not None else "the process group's timeout"
    found = _TIMED_OUT.search(text)
    if found:
        waited = f"{int(found.group(1)) / 1000:g} s; the group's is {limit}" if found.group(1) else limit
        err = PeerTimeoutError(
            f"hhook: {what} did not complete within the timeout ({waited}): a peer{f' ({peers})' if peers else ' of the group'} stalled or is far behind (stopped, swapping, or "
            "stuck). Set the timeout with hhook.init_distributed(timeout_s=...) or "
            f"torch.distributed.init_process_group(timeout=...). Transport: {_first_line(text)}")
    else:
        found = _CLOSED.search(text)
        if not found:
            return exc
        who = ", ".join(filter(None, (peers, f"at {found.group(1)}:{found.group(2)}" if found.group(1) else "")))
        err = PeerLostError(
            f"hhook: {what} failed: a peer{f' ({who})' if who else ' of the group'} closed its connection, so that rank "
            f"died (killed, out of memory, preempted). Restart the job from its last checkpoint (torchrun "
            f"--max-restarts does it for you). Transport: {_first_line(text)}")
    err.__cause__ = exc
    return err


def _first_line(text: str) -> str:
    """The transport's own message, without torch's callback wrapping and traceback."""
    text = text.split("\n\nAt:", 1)[0].strip()
    return text.replace("Got the following error when running the callback: ", "")
