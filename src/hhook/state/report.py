r"""What a :class:`~hhook.state.THCState` reports: its statistics, what earlier decodes
flagged on the device, and at the end of a run or of the program whether any tensor went
through it at all."""

from __future__ import annotations

import atexit
import logging
import weakref

from ..schedule.context import check_deferred
from ..stats import two_level_stats
from .advice import idle_state

logger = logging.getLogger(__name__)

#: The states a program built, weakly held: at exit each one that no tensor went through
#: says so (:meth:`Reporting.warn_if_idle`), e.g. a state handed to a framework that never
#: registered its hook. States hhook builds for itself leave the set.
LIVE: "weakref.WeakSet" = weakref.WeakSet()


@atexit.register
def _report_idle_states() -> None:
    for state in list(LIVE):
        try:
            state.warn_if_idle("the program")
        except Exception:  # noqa: BLE001 - at exit, a deferred error has had its chance to raise
            pass


def covered_by_parent(state) -> None:
    """A state another one holds (a width, the inter-node state) is not reported idle at
    exit on its own: its parent's report covers it."""
    LIVE.discard(state)


def deferred_sources(state) -> list:
    """The ``(runtime, counters)`` pairs whose device flags ``state``'s checks read
    (:func:`hhook.schedule.context.check_deferred`): its inter-node state's, each width's
    (theirs first, recursively), then its own."""
    sources = []
    for held in (state.inter, *state.variants.values()):
        if held is not None:
            sources += deferred_sources(held)
    return sources + [(state.runtime, state.counters)]


class Reporting:
    """What a :class:`~hhook.state.THCState` reports: a base class of it, so these are the
    state's own methods."""

    __slots__ = ()

    def check_deferred(self, wait: bool = False) -> None:
        """Count and raise what earlier decodes flagged on the device, in the state, its
        inter-node state and its widths (:func:`hhook.schedule.context.check_deferred`)."""
        check_deferred(deferred_sources(self), wait)

    def stats(self) -> dict:
        """Bytes since creation (or ``reset_stats()``) on this rank.

        ``dense_bytes``: what the same calls would have sent as float32.
        ``wire_bytes``: what was handed to collectives: codes, scales, the options
        handshake and ``thc_allreduce``'s check of each call, or the dense tensors of
        plain-allreduce iterations. ``local_calls``: calls in a world of one rank, which
        send and count nothing. ``nonfinite_calls``: tensors that came back NaN because
        some rank's held inf/NaN (GradScaler skips those steps); on GPUs counted once the
        flag's copy has arrived.

        Two-level (``node_layout()``): ``wire_bytes`` = ``inter_wire_bytes``, what was
        handed to collectives that cross nodes (the shards' codes and scales, handshakes,
        exact allreduces), ``intra_wire_bytes`` what stayed inside the node, ``ratio``
        dense over inter-node bytes, ``inter_calls`` the shards' THC calls
        (:func:`hhook.stats.two_level_stats`). ``iter``: the DDP iterations; ``decision``:
        ``bits="auto"``'s method, phase and last decisions. Where ``bits="auto"``
        installed no hook (one host, CPU tensors): ``installed: False``, ``method`` says
        why, and ``ratio`` is None (nothing went through hhook to compare).
        """
        self.check_deferred()
        if self.inter is not None:
            s = two_level_stats(self.inter.stats(), self.intra_counters, self.counters.snapshot())
        else:
            s = self.counters.snapshot()
        s["iter"] = self.iter
        if hasattr(self.decision, "summary"):  # not while it is still the plain data of a checkpoint
            s["decision"] = self.decision.summary()
            if s["decision"].get("phase") == "not measured" and s["decision"].get("hook") is None:
                # hhook.register installed nothing: no tensor went through hhook, so a
                # ratio (the handshake's bytes against none) would read as a result
                s.update(installed=False, method="none: " + s["decision"]["reason"], ratio=None)
        return s

    def warn_if_idle(self, where: str) -> bool:
        """Log a warning when no tensor went through this state by the end of ``where`` (a
        training run, the program): its hook was never called, so that run trained
        uncompressed, or not data-parallel. Returns True when it warned; either way the
        state is not checked again at exit."""
        LIVE.discard(self)
        s = self.stats()
        if s["compressed_calls"] + s["dense_calls"] + s["local_calls"]:
            return False
        logger.warning("hhook: %s ended but no tensor went through this THCState (%s): nothing was compressed. %s",
                       where, self.options.describe(), idle_state(self.registration, where))
        return True
