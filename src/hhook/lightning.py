r"""PyTorch Lightning and Fabric: THC compression in one line, its state in Lightning's
checkpoints.

Lightning's own ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)`` registers the hook
on CUDA devices only (on CPU such a run trains uncompressed; hhook warns at exit that no
tensor went through the state) and keeps no hook state in checkpoints. The callback
registers once the strategy has wrapped the model, on any device, with every hhook option,
and saves every rank's state in the checkpoint::

    trainer = L.Trainer(strategy="ddp", callbacks=[hhook.lightning.THCCallback(bits=4)])

It also serves Ray Train's ``RayDDPStrategy`` (a ``DDPStrategy``). Fabric has no hook
argument: after ``model = fabric.setup(model)``, ``state = hhook.lightning.register(model, bits=4)``;
``fabric.save(path, {..., "hhook": hhook.lightning.every_rank(state)})`` keeps every rank's
state (``fabric.save`` writes on rank 0 only: ``state.state_dict()`` there is rank 0's, and
with ``error_feedback=True`` the other ranks' residuals would start afresh).
Needs ``lightning`` (or ``pytorch_lightning``): ``pip install "hhook[lightning]"``.
"""

from __future__ import annotations

from .adapters import EveryRank, FrameworkHook, require
from .ddp_hook import register as _register
from .state import THCState

try:
    import lightning.pytorch as pl

    _DISTRIBUTION = "lightning"
except ImportError:  # the standalone package
    try:
        import pytorch_lightning as pl

        _DISTRIBUTION = "pytorch-lightning"
    except ImportError as e:
        raise ImportError("hhook.lightning needs PyTorch Lightning: pip install 'hhook[lightning]'") from e


class THCCallback(pl.Callback):
    r"""Register THC on the strategy's DDP model at ``on_fit_start`` and keep its state in
    checkpoints (every rank's: ``state_dict`` gathers them).

    Args:
        options: :class:`hhook.THCState`'s (``bits``, ``topology``, ``start_iter``, ...).

    ``self.state`` is the :class:`hhook.THCState` (``state.stats()``). At the end of
    training it warns when no gradient went through the hook.
    """

    def __init__(self, **options):
        self.hook = FrameworkHook("Lightning", **options)

    @property
    def state(self) -> THCState:
        return self.hook.state

    def on_fit_start(self, trainer, pl_module) -> None:
        strategy = require(trainer, "strategy", "Lightning", _DISTRIBUTION, "find the strategy that wraps the model")
        self.hook.attach(require(strategy, "model", "Lightning", _DISTRIBUTION, "find the DDP-wrapped model"))

    def on_train_end(self, trainer, pl_module) -> None:
        self.hook.finish("training")

    def state_dict(self) -> dict:
        return self.hook.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.hook.load_state_dict(state_dict)


def register(fabric_model, **options) -> THCState:
    """Fabric: :func:`hhook.register` on the DDP model inside ``fabric.setup(model)``'s
    wrapper (``options`` as :class:`hhook.THCState`)."""
    inner = require(fabric_model, "_forward_module", "Lightning Fabric", _DISTRIBUTION, "find the DDP-wrapped model") \
        if type(fabric_model).__name__ == "_FabricModule" else fabric_model
    return _register(inner, **options)


def every_rank(state: THCState) -> EveryRank:
    """Fabric: what to put in ``fabric.save``/``fabric.load``'s state for every rank's THC
    state to be kept (:class:`hhook.adapters.EveryRank`)."""
    return EveryRank(state)
