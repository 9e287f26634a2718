r"""Scale policies: how every rank comes to hold the same per-block scales, on one message
format (:mod:`~hhook.scales.message`).

:class:`ScalePolicy` (:mod:`~hhook.scales.policy`) agrees on each step's maxima with a MAX
round, or predicts them from the previous step through a thermometer carried in the SUM
itself (:mod:`~hhook.scales.thermometer`); :class:`PredictedScales`
(:mod:`~hhook.scales.one_round`) is the one-round form for Horovod's ``compress``. A
policy never communicates: the schedule runs the collectives.
"""

from .one_round import PredictedScales
from .policy import KeyState, Plan, ScalePolicy, default_headroom
from .thermometer import THRESHOLDS

# Pickles written before ``THCState.state_dict()`` name ``hhook.scales.ScalePolicy`` and
# ``hhook.scales.KeyState`` (tests/state/test_fixtures.py loads one).
__all__ = ["KeyState", "Plan", "PredictedScales", "ScalePolicy", "THRESHOLDS", "default_headroom"]
