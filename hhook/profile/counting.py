"""Bytes handed to collectives, counted from outside: what a method really sends, whatever
reduces it (a comm hook, hhook's second communicator, a compressor's all-gather)."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def collective_bytes(counter: dict | None = None):
    """Within the block, add to ``counter["bytes"]`` the size of every tensor passed to
    ``dist.all_reduce`` / ``all_gather`` / ``all_gather_into_tensor`` /
    ``reduce_scatter_tensor`` and to hhook's second communicator, and of the input of
    ``dist.all_to_all_single`` (two-level THC inside a node). DDP without a hook reduces in
    C++ and is not seen: charge it its gradients' size; neither is node-local shared memory."""
    import torch.distributed as dist

    from hhook.groups import SecondGroup

    counter = {"bytes": 0} if counter is None else counter
    counter.setdefault("bytes", 0)
    names = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor")
    originals = {(dist, name): getattr(dist, name) for name in names + ("all_to_all_single",)}
    originals[(SecondGroup, "all_reduce")] = SecondGroup.all_reduce

    def wrap(fn, second):  # the tensor handed over is the second argument (self; output)
        def counted(*args, **kwargs):
            tensor = args[1] if second else args[0]
            t = tensor[0] if isinstance(tensor, list) else tensor
            counter["bytes"] += t.nbytes
            return fn(*args, **kwargs)

        return counted

    for (owner, name), fn in originals.items():
        setattr(owner, name, wrap(fn, owner is SecondGroup or name == "all_to_all_single"))
    try:
        yield counter
    finally:
        for (owner, name), fn in originals.items():
            setattr(owner, name, fn)
