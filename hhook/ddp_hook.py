r"""The DDP communication hook: THC compression for every gradient bucket."""

# No ``from __future__ import annotations`` here: DDP inspects the hook's annotations
# and compares them with dist.GradBucket and Future[Tensor] objects, not strings.
import logging

import torch
import torch.distributed as dist

from .allreduce import thc_allreduce_async
from .state import THCState

logger = logging.getLogger(__name__)


def _dense_allreduce(state: THCState, buffer: torch.Tensor) -> torch.futures.Future:
    """What DDP does without a hook: divide by the world size, then SUM-allreduce."""
    buffer.div_(state.world_size)
    state.count("dense_calls", 4 * buffer.numel(), buffer.nbytes)
    fut = dist.all_reduce(buffer, group=state.process_group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def thc_hook(state: THCState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    r"""Average a gradient bucket with homomorphic THC compression.

    1. Before ``state.start_iter``, run DDP's plain allreduce (buckets are rebuilt after
       the first iteration).
    2. Otherwise rotate the bucket (randomized Hadamard, shared seed) and MAX-allreduce
       the per-block maxima, a header carrying the non-finite flag and the configuration
       fingerprint.
    3. Quantize with unbiased stochastic rounding onto the agreed scales, pack the codes
       into lanes with headroom, and SUM-allreduce the integer words.
    4. Decode the sum once, into ``bucket.buffer()``, already averaged.

    Example::
        >>> state = THCState(process_group=None, bits=4)
        >>> ddp_model.register_comm_hook(state, thc_hook)
    """
    buffer = bucket.buffer()
    if state.iter < state.start_iter:
        fut = _dense_allreduce(state, buffer)
    else:
        fut = thc_allreduce_async(buffer, state, key=bucket.index())
    state.maybe_increase_iter(bucket)
    return fut


def register(ddp_model: "torch.nn.parallel.DistributedDataParallel", **options) -> THCState:
    r"""Register :func:`thc_hook` on ``ddp_model``; ``options`` go to :class:`THCState`.

    The process group defaults to the model's own.

    Example::
        >>> state = hhook.register(ddp_model, bits=4)
    """
    options.setdefault("process_group", getattr(ddp_model, "process_group", None))
    state = THCState(**options)
    ddp_model.register_comm_hook(state, thc_hook)
    return state
