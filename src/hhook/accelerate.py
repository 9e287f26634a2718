r"""Hugging Face Accelerate: THC compression in one line after ``accelerator.prepare``, its
state in ``accelerator.save_state`` / ``load_state``.

``DistributedDataParallelKwargs(comm_hook=...)`` takes only Accelerate's own hooks (fp16,
bf16, PowerSGD), not a callable, so hhook registers on the prepared model::

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state = hhook.accelerate.register(accelerator, model, bits=4)

This is :func:`hhook.register` plus ``accelerator.register_for_checkpointing`` of every
rank's state (``register_for_checkpointing(state)`` on a :class:`hhook.THCState` works
too, but saves rank 0's state only, which is every rank's unless ``error_feedback``).
A model Accelerate left unwrapped (one process) gets a warning, not an AttributeError.
Needs ``accelerate``: ``pip install "hhook[accelerate]"``.
"""

from __future__ import annotations

from .adapters import FrameworkHook, require
from .state import THCState

try:
    import accelerate  # noqa: F401 - the adapter's framework, checked on import
except ImportError as e:
    raise ImportError("hhook.accelerate needs Accelerate: pip install 'hhook[accelerate]'") from e


def register(accelerator, model, **options) -> THCState:
    """Register THC on ``model`` (what ``accelerator.prepare`` returned) and add its state
    to the accelerator's checkpoints; ``options`` as :class:`hhook.THCState`."""
    hook = FrameworkHook("Accelerate", **options)
    hook.attach(model)
    require(accelerator, "register_for_checkpointing", "Accelerate", "accelerate",
            "save the hook state in save_state()")(hook)
    return hook.state
