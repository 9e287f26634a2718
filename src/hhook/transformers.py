r"""The Hugging Face Transformers ``Trainer``: THC compression in one line, its state
saved with every checkpoint and restored on resume.

The ``Trainer`` wraps the model in DDP inside ``train()``, so the hook is registered by a
callback when training begins, on ``trainer.model_wrapped``::

    trainer = Trainer(model=model, args=args, train_dataset=data)
    state = hhook.transformers.register(trainer, bits=4)
    trainer.train()

Each rank's state goes into the checkpoint folder as ``hhook_state_rank{R}.pt`` (plain
data: ``torch.load(weights_only=True)``) and is read back from the folder that
``train(resume_from_checkpoint=...)`` resumes from (a path anywhere, or ``True``: the last
checkpoint of ``args.output_dir``). Needs ``transformers``: ``pip install "hhook[transformers]"``.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.distributed as dist

from .adapters import FrameworkHook, require
from .state import THCState

try:
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint
except ImportError as e:
    raise ImportError("hhook.transformers needs Transformers: pip install 'hhook[transformers]'") from e

logger = logging.getLogger(__name__)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class THCCallback(TrainerCallback):
    r"""Registers THC on ``trainer.model_wrapped`` at ``on_train_begin``; saves and
    restores this rank's state with the Trainer's checkpoints (restored from the folder
    ``trainer.train(resume_from_checkpoint=...)`` names); warns at ``on_train_end``
    when no gradient went through the hook. ``options`` as :class:`hhook.THCState`."""

    def __init__(self, trainer, **options):
        self.trainer = trainer
        self.hook = FrameworkHook("Transformers Trainer", **options)
        self.resume_from = None  # what the running train() call was given
        _note_resume_folder(trainer, self)

    @property
    def state(self) -> THCState:
        return self.hook.state

    def _path(self, args, global_step: int) -> str:
        return os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{global_step}", f"hhook_state_rank{_rank()}.pt")

    def _resumed_path(self, args, global_step: int) -> str:
        """This rank's file in the checkpoint folder training resumes from: the one passed to
        ``train()``, the last of ``output_dir`` for ``True``, else ``output_dir``'s of this step."""
        folder = self.resume_from
        if folder is True:
            folder = get_last_checkpoint(args.output_dir)
        if isinstance(folder, (str, os.PathLike)):
            return os.path.join(folder, f"hhook_state_rank{_rank()}.pt")
        return self._path(args, global_step)

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step > 0:  # resumed from a checkpoint
            path = self._resumed_path(args, state.global_step)
            if os.path.exists(path):
                self.state.load_state_dict(torch.load(path, weights_only=True))
            else:
                logger.warning("hhook: resuming at step %d without %s: the THC state starts afresh",
                               state.global_step, path)
        model = require(self.trainer, "model_wrapped", "Transformers", "transformers", "find the DDP-wrapped model")
        self.hook.attach(model)

    def on_save(self, args, state, control, **kwargs):
        path = self._path(args, state.global_step)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save(self.state.state_dict(), path)

    def on_train_end(self, args, state, control, **kwargs):
        self.hook.finish("training")


def _note_resume_folder(trainer, callback: THCCallback) -> None:
    """Wrap ``trainer.train`` (once per callback) so that the callback learns the checkpoint
    folder a run resumes from: the Trainer hands its callbacks the step, not the folder."""
    train = require(trainer, "train", "Transformers", "transformers", "learn the folder training resumes from")

    @functools.wraps(train)
    def noting(resume_from_checkpoint=None, *args, **kwargs):
        callback.resume_from = resume_from_checkpoint
        return train(resume_from_checkpoint, *args, **kwargs)

    trainer.train = noting


def register(trainer, **options) -> THCState:
    """Add a :class:`THCCallback` to ``trainer`` (before ``trainer.train()``); returns its state."""
    callback = THCCallback(trainer, **options)
    require(trainer, "add_callback", "Transformers", "transformers", "add hhook's callback")(callback)
    return callback.state
