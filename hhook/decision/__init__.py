r"""``bits="auto"`` in the DDP hook: measure, per job, which exchange is fastest, and use it.

:class:`Decision` (:mod:`~hhook.decision.decision`) is the logic, plain data driven by
the slowest rank's step periods; :class:`Prober` (:mod:`~hhook.decision.prober`) measures
and reduces them; :mod:`~hhook.decision.widths` holds the THC widths it tries; and
:mod:`~hhook.decision.hook` is what the DDP hook calls for each bucket.
"""

from .decision import (BF16, DENSE_WIRE_BITS, DESCEND_GAIN, DRIFT, DRIFT_WINDOW, DROP_RATIO, FP32, JUMP, JUMP_STEPS,
                       KEPT_DECISIONS, MIN_WIDTH, PLAIN, REDECIDE_EVERY, WINDOW, Decision, candidates, thc_bits,
                       wire_bits)
from .hook import live_decision, new_decision, reduce_bucket_as_decided
from .prober import EXPLOIT_BATCH, LAG, Prober

__all__ = ["BF16", "DENSE_WIRE_BITS", "DESCEND_GAIN", "DRIFT", "DRIFT_WINDOW", "DROP_RATIO", "EXPLOIT_BATCH", "FP32",
           "JUMP", "JUMP_STEPS", "KEPT_DECISIONS", "LAG", "MIN_WIDTH", "PLAIN", "REDECIDE_EVERY", "WINDOW", "Decision",
           "Prober", "candidates", "live_decision", "new_decision", "reduce_bucket_as_decided", "thc_bits", "wire_bits"]
