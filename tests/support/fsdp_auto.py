"""What the tests of FSDP2's ``bits="auto"`` share (tests/integrations/test_fsdp_auto*.py):
the model, its sharding, and a fake clock that advances by what actually ran."""

from __future__ import annotations

import torch


def model():
    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(nn.Linear(37, 131), nn.Tanh(), nn.Linear(131, 67), nn.LayerNorm(67), nn.Linear(67, 3))


def shard(module, mesh=None, param_dtype=None):
    """``fully_shard`` on layers 0, 2 and 4, then the root (which holds the LayerNorm's)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=param_dtype)}
    if mesh is not None:
        kw["mesh"] = mesh
    for i in (0, 2, 4):
        fully_shard(module[i], **kw)
    return fully_shard(module, **kw)


class Clock:
    """One rank's fake time, advanced by the cost of every call that ran
    (``costs[kind] = (compressed, dense)`` seconds per call, kinds ``rs``, ``ag``, ``ar``),
    read off the states' counters whenever the clock is read: so a step's period is what
    its calls cost, however often the decider reads it. :meth:`step` adds ``extra`` (the
    optimizer step, loading the data) and returns the calls since the last one."""

    def __init__(self, costs: dict, extra: float = 0.0):
        self.costs, self.extra = costs, extra
        self.now = 0.0
        self.sources: dict = {}
        self.last: dict = {}
        self.ran: list[tuple[str, bool]] = []

    def __call__(self) -> float:
        self._advance()
        return self.now

    def watch(self, state=None, all_gather=None, replica=None) -> None:
        """Count the calls of these states (a new registration's) from now on."""
        self._advance()
        self.sources = {k: s for k, s in (("rs", state), ("ag", all_gather), ("ar", replica)) if s is not None}
        self.last = {k: self._calls(s) for k, s in self.sources.items()}

    @staticmethod
    def _calls(source) -> tuple[int, int]:
        snap = source.counters.snapshot()
        return snap.get("compressed_calls", 0), snap.get("dense_calls", 0)

    def _advance(self) -> None:
        for kind, source in self.sources.items():
            compressed, dense = self._calls(source)
            c, d = compressed - self.last[kind][0], dense - self.last[kind][1]
            self.last[kind] = (compressed, dense)
            self.ran += [(kind, True)] * c + [(kind, False)] * d
            self.now += c * self.costs[kind][0] + d * self.costs[kind][1]

    def step(self) -> list[tuple[str, bool]]:
        """After an optimizer step: ``extra`` more, and the calls ``(kind, compressed)``
        since the last step."""
        self._advance()
        self.now += self.extra
        ran, self.ran = self.ran, []
        return ran


def ran_as(ran) -> str:
    """The candidate that the calls ``ran`` (:meth:`Clock.step`) of one optimizer step
    are, or ``"mixed"`` where one kind of call ran both ways."""
    modes = {kind: {c for k, c in ran if k == kind} for kind in ("rs", "ag", "ar")}
    if any(len(m) > 1 for m in modes.values()):
        return "mixed"
    if True in modes["ag"]:
        return "rs+ag"
    return "rs" if True in modes["rs"] else "ar" if True in modes["ar"] else "dense"


def clocked(state, clock: Clock) -> None:
    """Give ``state``'s decision ``clock`` (a registration or a load_state_dict builds its
    prober with the real one)."""
    from hhook.decision import Prober

    state.prober = Prober(clock)
