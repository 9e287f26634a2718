"""Test-only method ``_hang`` for ``hhook-profile train`` (tests/profiler/test_train_profile.py).

Python imports ``sitecustomize`` at startup from the path, so every process started with
this directory on PYTHONPATH (torchrun, the ranks it launches, their training children)
registers the method with :mod:`hhook.profile.train` before doing anything else: the
parents can parse ``--methods ..._hang...`` and the children attach its hook. The library
itself has no such method.
"""

import torch
import torch.distributed as dist

from hhook.profile import methods, train


def _hang_hook(state, bucket):
    """A hook whose future never completes from the third step on, as a hung collective."""
    state["iter"] += bucket.is_last()
    if state["iter"] <= 2:
        return dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True).get_future().then(
            lambda f: f.value()[0])
    return torch.futures.Future()


def _attach(method, ddp, seed):
    ddp.register_comm_hook({"iter": 0}, _hang_hook)


train.KINDS += (methods.plain("_hang"),)
train.ATTACH["_hang"] = _attach
