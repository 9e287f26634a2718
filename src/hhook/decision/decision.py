r"""``bits="auto"`` in the DDP hook: measure, per job, which exchange is fastest, and use it.

The contract (the rules, their constants and the measurements behind them:
docs/decision.md, "How it decides"):

* **Candidates** (:func:`candidates`): THC at :func:`hhook.codec.error_model.auto_bits`'s
  width and narrower widths down to :data:`MIN_WIDTH` while narrowing pays
  (:data:`DESCEND_GAIN`; on flat layouts of 2-4 ranks in both forms, two rounds and one,
  of which the faster at the auto width descends), a bf16 dense allreduce and DDP's plain
  fp32 allreduce.
* **Lockstep turns** of :data:`WINDOW` iterations, switched on DDP's iteration counter.
* **One verdict on every rank**: each rank's step period is MAX-allreduced with a
  fingerprint of the decision's state, asynchronously, and read :data:`LAG` iterations
  later, so every rank feeds :class:`Decision` the same numbers and takes the same
  decision; a rank whose state differs makes every rank raise
  :class:`~hhook.errors.ConfigMismatchError`.
* **Pruning** (:data:`DROP_RATIO`) and **re-deciding** (:data:`REDECIDE_EVERY`,
  :data:`DRIFT`, :data:`DRIFT_WINDOW`).
* **Switching keeps the guarantees**: a THC width that is left hands each key's
  error-feedback residual to the next exchange of that key and forgets its predicted scales.

:class:`Decision` is plain data (``state_dict``/``load_state_dict``; pickled with the
:class:`~hhook.state.THCState`); :class:`~hhook.decision.Prober` holds the clock and the
in-flight reduction and is rebuilt after loading. Saving, on any rank at any time, changes
nothing in the running state, and a resumed run takes the decisions of the uninterrupted one.
"""

from __future__ import annotations

import json
import logging
import math
import zlib

from ..state.validate import DECISION_FIELDS
from . import descent
from .descent import median as _median
from .methods import PLAIN, scales_of, thc_bits, thc_name

logger = logging.getLogger(__name__)

#: Iterations per candidate's turn; the first of each turn is not measured. Five samples
#: per candidate, so that one noisy step (a shared host) does not pick the wrong one.
WINDOW = 6
#: A candidate whose first two measured steps both exceed this times the best so far, or
#: whose median of three or more does, is dropped (one step never drops it).
DROP_RATIO = 1.5
#: Re-decide this many iterations after a decision.
REDECIDE_EVERY = 1000
#: Re-decide when the median of the running method's last DRIFT_WINDOW periods is more
#: than 1 + DRIFT times its baseline (the median of its first DRIFT_WINDOW periods after
#: the decision), or less than 1 / (1 + DRIFT) of it.
#: Bursts of a dozen slower steps on a shared host stay below the drift; a change that
#: moves the winner (10 Gbit/s to 100 Mbit/s: fp32's step 27x) shows within 9 steps,
#: smaller ones wait for the scheduled round.
DRIFT = 0.5
DRIFT_WINDOW = 16
#: ... and at once when the last JUMP_STEPS periods all moved JUMP times from the
#: baseline (a link that dropped to a tenth: 3 slow steps, not 9, before the new round).
JUMP = 3.0
JUMP_STEPS = 3
#: Decisions kept in ``stats()`` (and checkpoints).
KEPT_DECISIONS = 8
class Decision:
    r"""The decision's logic and state, plain data only, driven by reduced numbers.

    The hook calls :meth:`method_for` once per iteration (at its first bucket) and
    :meth:`observe` with the slowest rank's period of an earlier iteration; both are pure
    functions of what was fed before, so ranks fed alike decide alike.

    Args:
        candidates: names in probing order (:func:`candidates`).
        wire_bits: bits per coordinate of each candidate (:func:`wire_bits`); without
            them the descent goes by measured gains alone.
        window, drop_ratio, redecide_every, drift, drift_window: as the module's constants.
    """

    def __init__(self, candidates: list[str], window: int = WINDOW, drop_ratio: float = DROP_RATIO,
                 redecide_every: int = REDECIDE_EVERY, drift: float = DRIFT, drift_window: int = DRIFT_WINDOW,
                 wire_bits: dict[str, float] | None = None):
        if not candidates or len(set(candidates)) != len(candidates):
            raise ValueError(f"candidates must be distinct and not empty, got {candidates!r}")
        if wire_bits is not None and (set(wire_bits) != set(candidates) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in wire_bits.values())):
            raise ValueError(f"wire_bits must give a positive number for each candidate, got {wire_bits!r}")
        if window < 2 or drift_window < 1 or redecide_every < 1 or not drop_ratio > 1 or not drift > 0:
            raise ValueError("window >= 2, drift_window >= 1, redecide_every >= 1, drop_ratio > 1 and drift > 0 needed")
        self.options = {"candidates": list(candidates), "window": window, "drop_ratio": drop_ratio,
                        "redecide_every": redecide_every, "drift": drift, "drift_window": drift_window}
        if wire_bits is not None:  # (absent from the options of states saved before it)
            self.options["wire_bits"] = {m: float(wire_bits[m]) for m in candidates}
        self.phase = "explore"
        self.reason = "start"
        self.started = 0  # iteration the current exploration began
        self.queue = list(candidates)
        self.current = None  # the candidate whose turn it is
        self.assigned = 0  # iterations given to its turn so far
        self.samples: dict[str, list[float]] = {}
        self.dropped: dict[str, float] = {}  # dropped early -> the period (or bound) that dropped it
        self.plain: list[float] = []  # fp32 periods of DDP's plain iterations
        self.choice = None
        self.reference = None  # the choice's period at the decision
        self.baseline = None  # the choice's median period over its first drift_window steps after it
        self.decided_at = None
        self.recent: list[float] = []
        self.history: dict[str, list] = {}  # str(iteration) -> [method, measured?]: awaiting their period
        self.last_probe = -1  # the last iteration given to a turn of this exploration
        self.observed = -1  # the last iteration whose period came back
        self.arrived: list = []  # [iteration, period]: reduced, fed at the iteration LAG after it
        self.decisions: list[dict] = []
        self.marks: dict = {}  # what the code that drives it keeps with it (hhook.fsdp: how its steps end)

    # -- checkpoints ---------------------------------------------------------------
    _FIELDS = DECISION_FIELDS  # one list, which the checkpoint's validation (a layer below) reads too
    _SINCE = {"arrived": [], "marks": {}}  # fields newer than some saved states: their value in those

    def _fields(self) -> dict:
        return {name: getattr(self, name) for name in self._FIELDS}

    def state_dict(self) -> dict:
        """Everything, as numbers, strings, lists and dicts (copies)."""
        return json.loads(json.dumps(self._fields()))

    def load_state_dict(self, saved: dict) -> None:
        """Continue from :meth:`state_dict`, or from a :class:`hhook.decision.hook.NotMeasured`'s
        checkpoint: the decision it kept, else a new one with these options."""
        if "not_measured" in saved:
            saved = saved["kept"] if saved["kept"] is not None else type(self)(**self.options).state_dict()
        missing = [name for name in self._FIELDS if name not in saved and name not in self._SINCE]
        if missing:
            raise ValueError(f"not a Decision state (missing {missing})")
        for name in self._FIELDS:
            setattr(self, name, json.loads(json.dumps(saved.get(name, self._SINCE.get(name)))))

    __getstate__, __setstate__ = state_dict, load_state_dict  # pickles carry the plain data

    @classmethod
    def from_state_dict(cls, saved: dict) -> "Decision":
        d = cls(saved["options"]["candidates"])
        d.load_state_dict(saved)
        return d

    def fingerprint(self) -> int:
        """24 bits of the whole state (exact in a float32): equal on ranks fed alike.
        Once per iteration: one JSON pass over the fields, no copy."""
        return zlib.crc32(json.dumps(self._fields(), sort_keys=True).encode()) >> 8

    def options_digest(self) -> int:
        """24 bits of the options: part of the hook's options handshake."""
        return zlib.crc32(json.dumps(self.options, sort_keys=True).encode()) >> 8

    # -- the two calls ---------------------------------------------------------------
    def method_for(self, iteration: int, plain: bool = False) -> str:
        """The method of ``iteration`` (``plain``: DDP's iterations before ``start_iter``)."""
        if plain:
            self.history[str(iteration)] = [PLAIN, iteration > 0]  # the first iteration pays set-up
            return PLAIN
        if self.phase == "exploit":
            self.history[str(iteration)] = [self.choice, True]
            return self.choice
        o = self.options
        while True:
            if self.current is not None and self.assigned < o["window"] and self.current not in self.dropped:
                measured = self.assigned > 0
                self.assigned += 1
                self.last_probe = iteration
                self.history[str(iteration)] = [self.current, measured]
                return self.current
            if not self.queue or descent.awaits_wider_turn(self, self.queue[0]):
                break  # (the latter: the best so far runs until the turn above is all back)
            self.current, self.assigned = self.queue.pop(0), 0
            bound = descent.bound(self, self.current)
            best = descent.best(self, exclude=self.current)
            if bound is not None and best is not None and bound > 2 * o["drop_ratio"] * best:
                self.dropped[self.current] = bound
                self._log_drop(self.current, bound, best, "model")
            elif not descent.narrowing_pays(self, self.current):
                wider = thc_name(thc_bits(self.current) + 1, scales_of(self.current))
                self.dropped[self.current] = self.dropped.get(wider) or self.estimates().get(wider) or 0.0
                logger.info("hhook: bits='auto' skips %s (its form was the slower at the auto width, or one bit "
                            "more was no faster than two more, nor would its bytes make it)", self.current)
        self.current = None
        self._maybe_decide(iteration)
        method = self.choice if self.phase == "exploit" else self._hold()
        self.history[str(iteration)] = [method, True]
        return method

    def method_of(self, iteration: int) -> str | None:
        """The method :meth:`method_for` gave ``iteration`` until its period is observed (None: not given)."""
        return self.history.get(str(iteration), [None])[0]

    def arrive(self, iteration: int, period: float) -> None:
        """The reduced period of ``iteration`` (negative: not measured), held until
        :meth:`feed_due` feeds it at the same iteration on every rank."""
        self.arrived.append([iteration, period])

    def feed_due(self, upto: int) -> None:
        """Feed the arrived periods of iterations up to ``upto`` to :meth:`observe`, in order."""
        due = sorted(a for a in self.arrived if a[0] <= upto)
        self.arrived = [a for a in self.arrived if a[0] > upto]
        for iteration, period in due:
            self.observe(iteration, period if period >= 0 else None)

    def observe(self, iteration: int, period: float | None) -> None:
        """The slowest rank's period of ``iteration`` in seconds (None: not measured)."""
        entry = self.history.pop(str(iteration), None)
        if entry is None:
            return
        self.observed = max(self.observed, iteration)
        method, measured = entry
        if period is not None and not (period >= 0 and math.isfinite(period)):
            period = None
        if method == PLAIN:
            if measured and period is not None:
                self.plain.append(period)
            return
        if period is not None and self.phase == "exploit" and method == self.choice:
            self.recent = (self.recent + [period])[-self.options["drift_window"]:]
        elif period is not None and self.phase == "explore" and measured:
            self.samples.setdefault(method, []).append(period)
        if self.phase == "explore":
            if period is not None and method not in self.dropped:
                best = descent.best(self, exclude=method)
                ratio = self.options["drop_ratio"]
                taken = self.samples.get(method, [])
                # One step, however far off, must not drop a candidate: a period that spans
                # an evaluation or a save is 3x and more. Its first two measured steps both
                # slow, or the median of three or more, drop it.
                worst = None if len(taken) < 2 else min(taken) if len(taken) == 2 else _median(taken)
                if best is not None and worst is not None and worst > ratio * best:
                    self.dropped[method] = worst
                    self._log_drop(method, worst, best, "measured")
            self._maybe_decide(iteration)
        else:
            self._maybe_redecide(iteration)

    # -- inside ----------------------------------------------------------------------
    def estimates(self) -> dict[str, float]:
        """This exploration's median period per candidate (seconds)."""
        return {m: _median(v) for m, v in self.samples.items() if v}

    def _ranked(self) -> list[str]:
        est = self.estimates()
        order = self.options["candidates"]
        return sorted(est, key=lambda m: (est[m], order.index(m) if m in order else len(order)))

    def _hold(self) -> str:
        """While the last turns' periods are in flight: the best so far (or the running choice)."""
        ranked = self._ranked()
        return ranked[0] if ranked else (self.choice or self.options["candidates"][0])

    def _maybe_decide(self, iteration: int) -> None:
        """Decide once every turn has been given and every turn's period has come back."""
        o = self.options
        if self.queue or (self.current is not None and self.current not in self.dropped
                          and self.assigned < o["window"]) or self.observed < self.last_probe:
            return
        ranked = self._ranked()
        est = self.estimates()
        self.choice = ranked[0] if ranked else self.options["candidates"][0]
        self.reference = est.get(self.choice)
        self.decided_at = iteration
        record = {"iter": iteration, "reason": self.reason, "periods_ms": {m: round(1e3 * v, 3) for m, v in est.items()},
                  "dropped_ms": {m: round(1e3 * v, 3) for m, v in self.dropped.items()}, "choice": self.choice}
        self.decisions = (self.decisions + [record])[-KEPT_DECISIONS:]
        logger.info("hhook: bits='auto' chose %s at iteration %d (%s); median step ms: %s%s", self.choice, iteration,
                    self.reason, ", ".join(f"{m} {1e3 * v:.1f}" for m, v in sorted(est.items(), key=lambda kv: kv[1])),
                    f"; dropped early: {', '.join(self.dropped)}" if self.dropped else "")
        self.phase, self.current, self.recent = "exploit", None, []
        self.samples, self.dropped = {}, {}

    def _maybe_redecide(self, iteration: int) -> None:
        o = self.options
        reason, newest = None, None
        if iteration - self.decided_at >= o["redecide_every"]:
            reason = "schedule"
        elif len(self.recent) >= o["drift_window"] and self.baseline is None:
            self.baseline = _median(self.recent)  # measured while exploiting: no switching in it
        elif self.baseline is not None:
            now, last = _median(self.recent), self.recent[-JUMP_STEPS:]
            jumped = len(last) == JUMP_STEPS and (min(last) > JUMP * self.baseline
                                                  or max(last) < self.baseline / JUMP)
            if jumped or now > (1 + o["drift"]) * self.baseline or now < self.baseline / (1 + o["drift"]):
                reason = f"drift {1e3 * self.baseline:.1f} -> {1e3 * (_median(last) if jumped else now):.1f} ms"
                newest = last if jumped else None
        if reason is not None:
            self.explore(iteration, reason, newest)

    def explore(self, iteration: int, reason: str, newest: list | None = None) -> None:
        """Start a new round; the running choice's recent periods (``newest``, else the
        newer half: after a drift, the new regime) stand for it."""
        self.phase, self.reason, self.started = "explore", reason, iteration
        newest = list(newest) if newest is not None else self.recent[len(self.recent) // 2:]
        self.samples = {self.choice: newest} if newest else {}
        self.queue = [m for m in self.options["candidates"] if m not in self.samples]
        self.current, self.assigned, self.dropped, self.recent = None, 0, {}, []
        self.baseline = None
        self.last_probe = iteration  # periods of the old choice still in flight count for it

    def _log_drop(self, method: str, period: float, best: float, how: str) -> None:
        logger.info("hhook: bits='auto' drops %s (%s: %.1f ms against the best %.1f ms)", method, how,
                    1e3 * period, 1e3 * best)

    def summary(self) -> dict:
        """For ``stats()``: the method in use, the phase and the last decisions."""
        return {"method": self.choice if self.phase == "exploit" else (self.current or self._hold()),
                "phase": self.phase, "choice": self.choice, "decisions": [dict(d) for d in self.decisions]}
