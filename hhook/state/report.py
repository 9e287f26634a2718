r"""What a :class:`~hhook.state.THCState` reports: its statistics, what earlier decodes
flagged on the device, and at the end of a run or of the program whether any tensor went
through it at all."""

from __future__ import annotations

import atexit
import logging
import weakref

from ..stats import two_level_stats
from .advice import idle_state

logger = logging.getLogger(__name__)

#: The states a program built, weakly held: at exit each one that no tensor went through
#: says so (:func:`warn_if_idle`), e.g. a state handed to a framework that never
#: registered its hook. States hhook builds for itself leave the set.
LIVE: "weakref.WeakSet" = weakref.WeakSet()


@atexit.register
def _report_idle_states() -> None:
    for state in list(LIVE):
        try:
            state.warn_if_idle("the program")
        except Exception:  # noqa: BLE001 - at exit, a deferred error has had its chance to raise
            pass


def check_deferred(state, wait: bool = False) -> None:
    """:meth:`THCState.check_deferred`: count and raise what earlier decodes flagged on
    the device, in the state, its inter-node state and its widths
    (:meth:`hhook.schedule.context.CallContext.check_deferred`)."""
    state.context().check_deferred(wait)


def covered_by_parent(state) -> None:
    """A state another one holds (a width, the inter-node state) is not reported idle at
    exit on its own: its parent's report covers it."""
    LIVE.discard(state)


def stats(state) -> dict:
    """:meth:`THCState.stats`: bytes since creation (or ``reset_stats()``) on this rank.

    ``dense_bytes``: what the same calls would have sent as float32.
    ``wire_bytes``: what was handed to collectives: codes, scales and the one-time
    configuration handshake, or the dense tensors of plain-allreduce iterations.
    ``local_calls``: calls in a world of one rank, which send and count nothing.
    ``nonfinite_calls``: tensors that came back NaN because some rank's held inf/NaN
    (GradScaler skips those steps); on GPUs counted once the flag's copy has arrived.

    Two-level (``node_layout()``): ``wire_bytes`` = ``inter_wire_bytes``, what was
    handed to collectives that cross nodes (the shards' codes and scales, handshakes,
    exact allreduces), ``intra_wire_bytes`` what stayed inside the node, ``ratio``
    dense over inter-node bytes, ``inter_calls`` the shards' THC calls
    (:func:`hhook.stats.two_level_stats`). ``iter``: the DDP iterations; ``decision``:
    ``bits="auto"``'s method, phase and last decisions.
    """
    state.check_deferred()
    if state.inter is not None:
        s = two_level_stats(state.inter.stats(), state.intra_counters, state.counters.snapshot())
    else:
        s = state.counters.snapshot()
    s["iter"] = state.iter
    if hasattr(state.decision, "summary"):  # not while it is still the plain data of a checkpoint
        s["decision"] = state.decision.summary()
    return s


def warn_if_idle(state, where: str) -> bool:
    """Log a warning when no tensor went through ``state`` by the end of ``where`` (a
    training run, the program): its hook was never called, so that run trained
    uncompressed, or not data-parallel. Returns True when it warned; either way the
    state is not checked again at exit."""
    LIVE.discard(state)
    s = state.stats()
    if s["compressed_calls"] + s["dense_calls"] + s["local_calls"]:
        return False
    logger.warning("hhook: %s ended but no tensor went through this THCState (%s): nothing was compressed. %s",
                   where, state.options.describe(), idle_state(state.registration, where))
    return True
