"""Bytes handed to collectives, counted from outside: what a method really sends, whatever
reduces it (a comm hook, hhook's second communicator, a compressor's all-gather, FSDP2's
reduce-scatter and all-gather)."""

from __future__ import annotations

import contextlib
import threading

#: Counted per kind as well as in ``counter["bytes"]``: the reduce-scatter's input (the
#: whole buffer of ``world_size`` chunks) and the all-gather's output (the whole gathered
#: tensor), the ``S`` of NCCL's ring formulas ``(n - 1) / n * S`` for both.
REDUCE_SCATTER = ("reduce_scatter_tensor", "reduce_scatter_single")
ALL_GATHER = ("all_gather_into_tensor", "all_gather_single")


@contextlib.contextmanager
def collective_bytes(counter: dict | None = None):
    """Within the block, add to ``counter["bytes"]`` the size of every tensor passed to
    ``dist.all_reduce`` / ``all_gather`` (its output list's first tensor), the output of
    ``all_gather_into_tensor`` / ``all_gather_single`` (FSDP2's parameter all-gather),
    the input of ``reduce_scatter_tensor`` / ``reduce_scatter_single`` (FSDP2's gradient
    reduce-scatter, hhook.fsdp's messages) and of ``dist.all_to_all_single`` (two-level THC
    inside a node), and of what hhook's second communicator reduces (or gathers: its
    output). The reduce-scatters' and the all-gathers' bytes are also added to
    ``counter["reduce_scatter"]`` and ``counter["all_gather"]``. A collective that calls another one of these (torch's
    ``reduce_scatter_tensor`` calls ``reduce_scatter_single``) counts once. DDP without a
    hook reduces in C++ and is not seen: charge it its gradients' size; neither is
    node-local shared memory."""
    import torch.distributed as dist

    from hhook.schedule.groups import SecondGroup

    counter = {"bytes": 0} if counter is None else counter
    for key in ("bytes", "reduce_scatter", "all_gather"):
        counter.setdefault(key, 0)
    names = ("all_reduce", "all_gather", "all_to_all_single") + REDUCE_SCATTER + ALL_GATHER
    originals = {(dist, name): getattr(dist, name) for name in names if hasattr(dist, name)}
    originals[(SecondGroup, "all_reduce")] = SecondGroup.all_reduce
    originals[(SecondGroup, "all_gather")] = SecondGroup.all_gather
    local = threading.local()  # nesting depth per thread (continuations run on Gloo's threads)

    def handed(owner, name, args, kwargs):
        """The tensor whose size is charged: the first argument, except as said above."""
        if owner is SecondGroup:  # (self, tensor) or, all-gathering, (self, output, input)
            return args[1]
        if name in REDUCE_SCATTER:  # (output, input): the input
            return args[1] if len(args) > 1 else kwargs["input"]
        if name == "all_to_all_single":  # (output, input): the input
            return args[1] if len(args) > 1 else kwargs["input"]
        if args:
            return args[0]
        return kwargs.get("output_tensor", kwargs.get("tensor", kwargs.get("output")))

    def wrap(owner, name, fn):
        kind = "reduce_scatter" if name in REDUCE_SCATTER else "all_gather" if name in ALL_GATHER else None

        def counted(*args, **kwargs):
            depth = getattr(local, "depth", 0)
            if depth == 0:
                tensor = handed(owner, name, args, kwargs)
                t = tensor[0] if isinstance(tensor, list) else tensor
                counter["bytes"] += t.nbytes
                if kind is not None:
                    counter[kind] += t.nbytes
            local.depth = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                local.depth = depth

        return counted

    for (owner, name), fn in originals.items():
        setattr(owner, name, wrap(owner, name, fn))
    try:
        yield counter
    finally:
        for (owner, name), fn in originals.items():
            setattr(owner, name, fn)
