r"""``bits="auto"`` in the DDP hook: measure, per job, which exchange is fastest, and use it.

:class:`Decision` (:mod:`~hhook.decision.decision`) is the logic, plain data driven by
the slowest rank's step periods, over the candidates of :mod:`~hhook.decision.methods`
and with the descent rule of :mod:`~hhook.decision.descent`; :class:`Prober`
(:mod:`~hhook.decision.prober`) measures and reduces them; :mod:`~hhook.decision.widths` holds the THC widths it tries; and
:mod:`~hhook.decision.hook` is what the DDP hook calls for each bucket.
"""

from .decision import DRIFT, DRIFT_WINDOW, DROP_RATIO, JUMP, JUMP_STEPS, KEPT_DECISIONS, REDECIDE_EVERY, WINDOW, Decision
from .descent import DESCEND_GAIN
from .methods import BF16, DENSE_WIRE_BITS, FP32, MIN_WIDTH, PLAIN, candidates, thc_bits, wire_bits
from .hook import live_decision, new_decision, reduce_bucket_as_decided
from .prober import EXPLOIT_BATCH, LAG, Prober

__all__ = ["BF16", "DENSE_WIRE_BITS", "DESCEND_GAIN", "DRIFT", "DRIFT_WINDOW", "DROP_RATIO", "EXPLOIT_BATCH", "FP32",
           "JUMP", "JUMP_STEPS", "KEPT_DECISIONS", "LAG", "MIN_WIDTH", "PLAIN", "REDECIDE_EVERY", "WINDOW", "Decision",
           "Prober", "candidates", "live_decision", "new_decision", "reduce_bucket_as_decided", "thc_bits", "wire_bits"]
