r"""The DDP communication hook: THC compression for every gradient bucket."""

# No ``from __future__ import annotations`` here: DDP inspects the hook's annotations
# and compares them with dist.GradBucket and Future[Tensor] objects, not strings.
import logging

import torch
import torch.distributed as dist

from .allreduce import dense_allreduce, thc_allreduce_async
from .codec import warm_up
from .state import THCState

logger = logging.getLogger(__name__)


def thc_hook(state: THCState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    r"""Average a gradient bucket with homomorphic THC compression.

    1. Before ``state.start_iter``, run DDP's plain allreduce (buckets are rebuilt after
       the first iteration). So do float64 and sparse buckets, always.
    2. Otherwise rotate the bucket (randomized Hadamard, shared seed) and take its block
       maxima. With ``scales="agreed"`` MAX-allreduce them (and a header with the
       non-finite flag, the configuration fingerprint and a digest); with
       ``scales="predicted"`` use the scales predicted from the previous step instead.
    3. Quantize with unbiased stochastic rounding, pack the codes into lanes with
       headroom, and SUM-allreduce the integer words (with predicted scales, this step's
       block maxima ride along for the next step's prediction).
    4. Decode the sum once, into ``bucket.buffer()``, already averaged.

    The hook returns at once; every later stage is a continuation of a collective.

    Example::
        >>> state = THCState(process_group=None, bits=4)
        >>> ddp_model.register_comm_hook(state, thc_hook)
    """
    buffer = bucket.buffer()
    # With predicted scales the last plain iteration is the warm-up that measures the first
    # scales: the same number of exact iterations as with agreed scales.
    predicted = state.mode(buffer.device) == "predicted"
    dense_until = state.start_iter - (1 if predicted and state.start_iter > 0 else 0)
    if state.iter < dense_until or buffer.is_sparse:
        fut = dense_allreduce(state, buffer)
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
    for param in ddp_model.parameters():
        warm_up(param.device)  # compile the fused codec now, not in the first backward pass
        break
    return state
