r"""``bits="auto"`` in the DDP hook: the state's decision, and each bucket reduced by the
method the decision gives its iteration, timed by the state's :class:`~hhook.decision.Prober`."""

from __future__ import annotations

import torch

from ..codec.error_model import auto_bits
from ..schedule.allreduce import thc_allreduce_async
from ..schedule.flat import cast_allreduce, dense_allreduce
from ..state import THCState
from .decision import Decision
from .methods import BF16, PLAIN, candidates, thc_bits, wire_bits
from .prober import Prober
from .widths import release_other_widths, variant


def live_decision(state: THCState) -> Decision:
    """``state.decision``: built on first use (:func:`new_decision`), or restored from the
    plain data a :meth:`THCState.load_state_dict` left there."""
    if isinstance(state.decision, dict):
        state.decision = Decision.from_state_dict(state.decision)
    elif state.decision is None:
        state.decision = new_decision(state)
    return state.decision


def new_decision(state: THCState) -> Decision:
    """The decision of a ``bits="auto"`` state, its candidates sized by the node layout:
    THC from the auto rule's width for the node count (two-level) or the world size
    (flat) down, bf16, fp32."""
    topo = state.node_layout()
    if topo.two_level and state.error_feedback:
        raise ValueError("hhook: bits='auto' with error_feedback=True on two-level layouts is not supported yet; "
                         "pass an integer bits= (THC always) or error_feedback=False")
    participants = topo.n_nodes if topo.two_level else state.world_size
    width = auto_bits(participants, topo.ranks_per_node if topo.two_level else 1, rounding=state.rounding)
    names = candidates(width)
    return Decision(names, wire_bits=wire_bits(names, participants, state.block_size))


def reduce_bucket_as_decided(state: THCState, bucket, layout, split=None) -> torch.futures.Future:
    """The DDP hook's ``bits="auto"`` path: the method of this iteration, timed and decided
    by :class:`Decision`, for one bucket. ``split(reduce)``: a resumed run's first
    iteration reduces the bucket as the saved keys it holds (``reduce(key, tensor,
    layout)`` is this iteration's exchange), or returns None for the usual path."""
    buffer = bucket.buffer()
    prober = state.prober
    if prober is None:
        prober = state.prober = Prober()
    if not prober.verified:
        prober.verify(state, state.decision, buffer.device)
    if prober.first:
        prober.method = prober.begin(state, state.decision, state.iter)
    prober.first = bucket.is_last()
    method = prober.method
    fut = split(lambda key, tensor, lay: _reduce_as(method, state, key, tensor, lay)) if split is not None else None
    if fut is None:
        fut = _reduce_as(method, state, bucket.index(), buffer, layout)
    if bucket.is_last():
        prober.launch(state, state.decision, state.iter, buffer.device)
    return fut


def _reduce_as(method: str, state: THCState, key: int, buffer: torch.Tensor, layout) -> torch.futures.Future:
    bits = thc_bits(method)
    if buffer.is_sparse:
        return dense_allreduce(state, buffer)
    if method != PLAIN:
        release_other_widths(state, key, buffer, keep=bits)
    if bits is not None:
        return thc_allreduce_async(buffer, variant(state, bits), key=key, layout=layout)
    if method == BF16 and buffer.dtype == torch.float32:
        return cast_allreduce(state, buffer, torch.bfloat16)
    return dense_allreduce(state, buffer)
