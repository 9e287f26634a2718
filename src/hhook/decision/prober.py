r"""The measuring half of ``bits="auto"`` (:mod:`hhook.decision`): the clock, the start of
the running iteration, and the MAX reductions that give every rank the slowest rank's step
periods, with the decision's fingerprint. Rebuilt on every process (never saved)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..codec.layout import constant
from ..errors import ConfigMismatchError
from ..schedule.groups import agrees, explain, reduces_on_host

if TYPE_CHECKING:
    from .decision import Decision
    from ..state import THCState

#: The period of iteration j is fed to the decision at iteration j + LAG: its reduction is
#: launched behind j + 1's last bucket and has a whole iteration to complete.
LAG = 3
#: While a choice is held, the periods go into one reduction every this many iterations
#: (an extra collective a step was what holding cost beyond the fixed method's exchange;
#: a drift is then seen up to this many iterations later).
EXPLOIT_BATCH = 8


class Prober:
    r"""The measuring half, rebuilt on every process: the clock, the start of the running
    iteration, and the reduction of the last period (measured at one iteration's first
    bucket, launched behind its last, read at the next one's first). ``clock`` (seconds)
    may be replaced, e.g. by tests."""

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.first = True  # the next hook call is an iteration's first
        self.start = None  # (iteration, clock) of the running iteration's first call
        self.measured = []  # [iteration, period]: measured here, to reduce behind a last bucket
        self.inflight = []  # (iterations, fingerprint, work, vector, host copy, event), oldest first
        self.method = None  # the running iteration's method
        self.verified = False
        self.group = None  # the group of the reduction in flight (for messages)
        self.batch = EXPLOIT_BATCH  # iterations per reduction while a choice is held (the same on every rank)

    def verify(self, state: THCState, decision: Decision, device: torch.device) -> None:
        """Once per process, at the hook's first call (a blocking point already): the
        decision states' fingerprints over the group, so ranks resumed from different
        checkpoints raise together before they pick different exchanges."""
        if not agrees(state.process_group, float(decision.fingerprint()), device, state.counters, torch.float64):
            raise ConfigMismatchError("hhook: the ranks' bits='auto' decision states differ; every rank must resume "
                                      "from the same checkpoint (torch.save of the THCState of the same step)")
        self.verified = True

    def begin(self, state: THCState, decision: Decision, iteration: int, plain: bool = False) -> str:
        """At an iteration's first bucket: read the reductions that are due, measure the
        period that just ended (:meth:`launch` reduces it), and return this iteration's
        method (``plain``: an iteration before the caller's ``start_iter``, exchanged plain)."""
        now = self.clock()
        # The period of iteration j is reduced behind a later iteration's last bucket (j + 1,
        # or while a choice is held the next multiple of EXPLOIT_BATCH) and fed here LAG
        # iterations after j (or after the batch's last): a whole iteration after its
        # launch, so it has completed (no wait on the backward's path), and at the same
        # iteration on every rank.
        self.settle(decision, upto=iteration - LAG)
        decision.feed_due(iteration - LAG)
        if iteration > 0:
            started = self.start is not None and self.start[0] == iteration - 1
            self.measured.append([iteration - 1, now - self.start[1] if started else -1.0])
        self.start = (iteration, now)
        self.method = decision.method_for(iteration, plain=plain)
        return self.method

    def launch(self, state: THCState, decision: Decision, iteration: int, device: torch.device) -> None:
        """Behind ``iteration``'s last bucket: launch the MAX reduction of the periods
        :meth:`begin` measured, with the decision's fingerprint. Every iteration while
        exploring; while a choice is held, once every :data:`EXPLOIT_BATCH` iterations
        (holding then costs one small collective per batch, not per step). Issued from
        the hook's thread after every bucket's own launch on this group, on an iteration
        and a phase every rank shares, so every rank pairs the same collectives."""
        if not self.measured or (decision.phase == "exploit" and iteration % self.batch):
            return
        fp = float(decision.fingerprint())
        iterations = [i for i, _ in self.measured]
        # A group with Gloo reduces it on the host; NCCL alone on the GPU, staged through
        # pinned memory both ways, so the host never waits on the stream.
        on_device = device.type == "cuda" and not reduces_on_host(state.process_group)
        vector = constant([p for _, p in self.measured] + [fp, -fp], torch.float64, device if on_device else "cpu")
        self.measured = []
        work = dist.all_reduce(vector, dist.ReduceOp.MAX, group=state.process_group, async_op=True)
        self.group = state.process_group
        state.counters.add(None, 0, vector.nbytes)
        host = event = None
        if on_device:  # read later from pinned memory: no host read of the stream now
            work.wait()  # NCCL: the current stream waits for the reduction, the host does not
            host = torch.empty(vector.numel(), dtype=torch.float64, pin_memory=True)
            host.copy_(vector, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        self.inflight.append((iterations, fp, work, vector, host, event))

    def settle(self, decision: Decision, upto: int | None = None) -> None:
        """Read the reductions in flight of the periods of iterations up to ``upto`` (all:
        None) and hand the slowest rank's periods to ``decision`` (:meth:`Decision.arrive`);
        raise on every rank if the ranks' decision states differed."""
        while self.inflight and (upto is None or self.inflight[0][0][-1] <= upto):
            self._settle_one(decision, *self.inflight.pop(0))

    def _settle_one(self, decision: Decision, iterations, fp, work, vector, host, event) -> None:
        values = self._read(work, vector, host, event)
        high, low = values[-2:]
        if high != -low:
            raise ConfigMismatchError(
                "hhook: the ranks' bits='auto' decisions differ (their states' fingerprints disagree at iteration "
                f"{iterations[-1]}); every rank must start from the same checkpoint and options"
            )
        for iteration, period in zip(iterations, values):
            decision.arrive(iteration, period)

    def _read(self, work, vector, host, event) -> list:
        """The reduced ``[periods..., fingerprint, -fingerprint]`` of one reduction in flight
        (waits for it: it was launched on every rank an iteration or more ago)."""
        if event is not None:
            event.synchronize()
            return host.tolist()
        try:
            work.wait()
        except BaseException as exc:  # noqa: BLE001 - a stalled or lost peer, said plainly
            raise explain(exc, "bits='auto''s step-time reduction", self.group) from exc
        return vector.tolist()

    def checkpoint(self, decision: Decision) -> dict:
        """``decision.state_dict()`` as a resumed run needs it: the reductions in flight
        read into ``arrived`` (fed at the iterations they are due, as in a run never
        saved). Changes nothing here, in the decision or in this prober: any rank may save
        at any time, any number of times (rank 0 alone included), and every rank trains on
        as if none had. A resumed run cannot measure the period that spans the save: it
        goes unmeasured there (the run that saved counts it)."""
        saved = decision.state_dict()
        for iterations, _, work, vector, host, event in self.inflight:
            saved["arrived"] += [[i, p] for i, p in zip(iterations, self._read(work, vector, host, event))]
        # measured here but not reduced yet (a held choice's batch): unmeasured after a resume,
        # alike on every rank (this rank's own clock is not the slowest rank's)
        saved["arrived"] += [[i, -1.0] for i, _ in self.measured]
        return saved
