r"""THC allreduce, the entry every integration calls: the flat schedule
(:mod:`hhook.schedule.flat`) or, on a state whose topology found several nodes, the two-level one
(:mod:`hhook.schedule.two_level`: dense inside the node, THC between nodes)."""

from __future__ import annotations

import torch

from .context import context_of, ensure_checked
from .flat import check_tensor, flat_allreduce_async
from .two_level import two_level_allreduce_async


def thc_allreduce_async(tensor: torch.Tensor, state, key=None, layout=None) -> torch.futures.Future:
    r"""Start averaging ``tensor`` in place over ``state.process_group`` through the codec.
    ``state``: a :class:`~hhook.state.THCState` (or the
    :class:`~hhook.schedule.context.CallContext` one gives).

    Returns at once a future holding ``tensor`` once it holds the mean. ``key`` names the
    tensor for error feedback and predicted scales (a DDP bucket index, a parameter name)
    and must be stable across steps; ``None`` (the default) carries nothing from one call
    to the next, so every call takes an agreed round. ``layout`` says what the key holds
    (default: the tensor's shape and dtype); when it changes the key's state starts afresh.
    A tensor above ``state.chunk_mb`` travels in pieces, each encoded while the previous
    one is on the wire. Call it in the same order on every rank, and wait for a key's
    future before reducing that key again (its decode updates the key's state). If any
    rank's tensor holds inf or NaN, every rank's result is all NaN. In a world of one
    rank the tensor is returned as it is. float64 and sparse tensors take an exact plain
    allreduce. With ``THCState(topology=...)`` finding several nodes the tensor is
    averaged two-level (:mod:`hhook.schedule.two_level`), with the same guarantees.
    """
    check_tensor(tensor)
    ctx = context_of(state)
    ensure_checked(ctx, tensor.device)
    topo = ctx.node_layout()
    if not topo.two_level:
        return flat_allreduce_async(tensor, ctx, key, layout)
    ctx.check_deferred()
    return two_level_allreduce_async(tensor, topo, ctx.inter(), key, ctx.intra_counters, layout)


def thc_allreduce(tensor: torch.Tensor, state, key=None) -> torch.Tensor:
    r"""Average ``tensor`` in place across ``state.process_group`` (None = WORLD).

    The blocking form of :func:`thc_allreduce_async`.

    Example::
        >>> state = hhook.THCState(bits=4)
        >>> hhook.thc_allreduce(grad, state, key="layer1.weight")
    """
    ctx = context_of(state)
    out = thc_allreduce_async(tensor, ctx, key).wait()
    ctx.check_deferred(wait=True)
    return out
