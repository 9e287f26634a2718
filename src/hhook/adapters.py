r"""What every framework adapter (:mod:`hhook.lightning`, :mod:`hhook.accelerate`,
:mod:`hhook.transformers`) shares: a THC state built from hhook's own options, registered
once the framework has wrapped the model in DDP (through :func:`hhook.register`, so the
node layout is found and the codec warmed up there), carried through the framework's
checkpoints with every rank's part, and a warning when a run ends with no call. Each
adapter only finds the DDP model and the framework's events."""

from __future__ import annotations

import importlib.metadata

import torch.distributed as dist

from .ddp_hook import register
from .decision.hook import NotMeasured
from .state import THCState


def framework_version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"


def require(obj, attribute: str, framework: str, distribution: str, why: str):
    """``obj.attribute``, or a clear error naming the framework, its version and what is
    missing (an API hhook relies on changed): never a silently uncompressed run."""
    try:
        return getattr(obj, attribute)
    except AttributeError:
        raise RuntimeError(
            f"hhook: {framework} {framework_version(distribution)}: {type(obj).__name__} has no '{attribute}', "
            f"which hhook relies on to {why}. This version changed the API hhook was written against; "
            "register on the DDP model yourself with hhook.register(ddp_model, ...)."
        ) from None


class FrameworkHook:
    r"""One THC state for a framework's training run.

    Args:
        framework: the framework's name, for messages.
        options: :class:`hhook.THCState`'s options (topology, warm-up ``start_iter``, ...).

    :meth:`state_dict` gathers every rank's state (frameworks save their checkpoint from
    rank 0; residuals differ between ranks), :meth:`load_state_dict` takes this rank's
    (:class:`EveryRank`).
    """

    def __init__(self, framework: str, **options):
        self.framework = framework
        self.state = THCState(**options)
        self._model = None

    def attach(self, ddp_model) -> THCState:
        """Register on ``ddp_model`` (once per model; a second call with it does nothing)."""
        if self._model is not ddp_model:
            register(ddp_model, state=self.state)
            self._model = ddp_model
        return self.state

    def finish(self, what: str = "training") -> bool:
        """At the end of a run: warn when no gradient went through the hook (not where
        ``bits="auto"`` installed none on purpose: one host, CPU tensors)."""
        if isinstance(self.state.decision, NotMeasured):
            return False
        return self.state.warn_if_idle(f"{self.framework} {what}")

    def state_dict(self) -> dict:
        """``{"ranks": [each rank's THCState.state_dict()]}`` (:class:`EveryRank`: a
        collective, call it on every rank, as frameworks do)."""
        return EveryRank(self.state).state_dict()

    def load_state_dict(self, saved: dict) -> None:
        EveryRank(self.state).load_state_dict(saved)


class EveryRank:
    r"""A checkpointable view of ``state`` that keeps every rank's part: ``state_dict()``
    gathers each rank's :meth:`THCState.state_dict` (``{"ranks": [...]}``; a collective
    over the state's group when torch.distributed is initialized: call it on every rank,
    as ``fabric.save`` does), ``load_state_dict()`` loads this rank's (rank 0's in a run
    of another size, whose per-key state then starts afresh). Error-feedback residuals
    differ between ranks: a checkpoint of ``state.state_dict()`` written by rank 0 alone
    restarts the other ranks' residuals.

    Example (Fabric, whose ``save`` converts it on every rank and writes on rank 0)::
        >>> fabric.save(path, {"model": model, "hhook": hhook.lightning.every_rank(state)})
        >>> fabric.load(path, {"model": model, "hhook": hhook.lightning.every_rank(state)})
    """

    def __init__(self, state: THCState):
        if not isinstance(state, THCState):
            raise TypeError(f"every_rank needs a THCState, got {type(state).__name__}")
        self.state = state

    def state_dict(self) -> dict:
        mine = self.state.state_dict()
        group = self.state.process_group
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return {"ranks": [mine]}
        every = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, mine, group=group)
        return {"ranks": every}

    def load_state_dict(self, saved: dict) -> None:
        if not isinstance(saved, dict) or not isinstance(saved.get("ranks"), list) or not saved["ranks"]:
            raise ValueError("hhook: not a checkpoint of every rank's THC state ({'ranks': [...]}); a single "
                             "THCState.state_dict() loads with state.load_state_dict()")
        ranks = saved["ranks"]
        rank = dist.get_rank(self.state.process_group) if dist.is_initialized() else 0
        # A run with another number of ranks (an elastic restart) takes rank 0's: the state
        # then finds another layout and starts its per-key state afresh, with one log line.
        self.state.load_state_dict(ranks[rank] if len(ranks) > rank else ranks[0])
