r"""THC allreduce over torch.distributed: the transport of :mod:`hhook.codec`.

Two collectives per tensor, both stock: a MAX allreduce of the small scale vector
(blocking, a few hundred bytes for a 25 MB tensor) and an asynchronous SUM allreduce
of the packed integer words. Decoding runs as the second one's continuation.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import rng
from .state import THCState


def _completed(value: torch.Tensor) -> torch.futures.Future:
    fut = torch.futures.Future()
    fut.set_result(value)
    return fut


def _handshake(state: THCState, device: torch.device) -> None:
    codec = state.codec()
    vector = codec.handshake_vector(device)
    dist.all_reduce(vector, dist.ReduceOp.MAX, group=state.process_group)
    state.count(None, 0, vector.nbytes)
    codec.check_handshake(vector)
    state._verified = True


def thc_allreduce_async(tensor: torch.Tensor, state: THCState, key=0) -> torch.futures.Future:
    r"""Start averaging ``tensor`` in place over ``state.process_group`` through the codec.

    Returns a future holding ``tensor`` once it holds the mean. ``key`` names the tensor
    for error feedback (a DDP bucket index, a parameter name); it must be stable across
    steps. If any rank's tensor holds inf or NaN, every rank's result is all NaN.
    """
    if tensor.numel() == 0:
        return _completed(tensor)
    codec = state.codec()
    group = state.process_group
    if not state._verified:
        _handshake(state, tensor.device)
    target = tensor if tensor.is_contiguous() else tensor.contiguous()

    n_blocks, block = codec.n_blocks(tensor.numel()), codec.block_for(tensor.numel())
    residual = state.residual(key, (n_blocks, block), tensor.device) if state.error_feedback else None
    prepared = codec.prepare(target)
    agreed = prepared.scales
    dist.all_reduce(agreed, dist.ReduceOp.MAX, group=group)
    codec.verify(agreed, tensor.numel())

    stream = rng.stream_key(state.seed, state.rank, state.calls)
    state.calls += 1
    words = codec.quantize(prepared, agreed, stream, residual)

    def finish(summed: torch.Tensor) -> torch.Tensor:
        codec.decode(prepared, agreed, summed, target)
        if target is not tensor:
            tensor.copy_(target)
        return tensor

    dense = 4 * tensor.numel()
    state.count("compressed_calls", dense, agreed.nbytes + words.nbytes)
    fut = dist.all_reduce(words, dist.ReduceOp.SUM, group=group, async_op=True).get_future()
    return fut.then(lambda f: finish(f.value()[0]))


def thc_allreduce(tensor: torch.Tensor, state: THCState, key=0) -> torch.Tensor:
    r"""Average ``tensor`` in place across ``state.process_group`` (None = WORLD).

    The blocking form of :func:`thc_allreduce_async`.

    Example::
        >>> state = hhook.THCState(bits=4)
        >>> hhook.thc_allreduce(grad, state, key="layer1.weight")
    """
    return thc_allreduce_async(tensor, state, key).wait()
