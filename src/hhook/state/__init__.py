r"""THCState, the state users construct and checkpoint (:mod:`~hhook.state.thc_state`),
and its parts: options (:mod:`~hhook.state.options`), per-key state
(:mod:`~hhook.state.keys`), the checkpoint format and node layout
(:mod:`~hhook.state.checkpoint`) and what a state reports (:mod:`~hhook.state.report`);
:mod:`~hhook.state.advice` words the warnings about states nothing went through. The
schedule's runtime of a state's group lives in :mod:`hhook.schedule.context`."""

from .checkpoint import STATE_FORMAT
from .options import DEFAULT_CHUNK_MB, SCALE_MODES, SCALES, TOPOLOGIES, Options
from .thc_state import THCState

# Pickles of every hhook name ``hhook.state.THCState`` (tests/state/test_fixtures.py).
__all__ = ["DEFAULT_CHUNK_MB", "Options", "SCALE_MODES", "SCALES", "STATE_FORMAT", "THCState", "TOPOLOGIES"]
