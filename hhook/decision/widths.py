r"""``bits="auto"``'s THC widths (:mod:`hhook.decision`): one :class:`~hhook.state.THCState`
per width it tried, held in the parent state's ``variants``.

A width shares the parent's options, byte counters and group runtime (node layout, second
communicators, launch order, handshake), and its **call counter**: every call of every
width (and of the parent itself) takes the next number of one counter per group (the
parent's, and on two-level layouts the parent's ``inter`` state's for the shards'
rings). The rounding streams are keyed by the seed, the rank and that number
(:func:`hhook.codec.rng.stream_key`, :func:`~hhook.codec.rng.shared_key`), so no two calls
of a run draw the same stream, whichever widths they ran at: the rounding errors of
different steps stay independent. A fixed ``bits`` has no widths: its streams are its own
counter's, 0, 1, 2, ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..schedule.context import GroupRuntime
from ..state import report

if TYPE_CHECKING:
    from ..state import THCState


def variant(state: THCState, bits: int) -> THCState:
    """THC at ``bits`` over ``state``'s group: its own per-key state; ``state``'s options,
    counters (calls included) and group runtime. On two-level layouts its inter-node state
    sends on the parent's inter-node communicators and counters, and checks its own
    options over the nodes' ring."""
    width = state.variants.get(bits)
    if width is None:
        width = state.variants[bits] = type(state)(None, bits, state.block_size, state.seed, state.error_feedback,
                                                   state.start_iter, state.scales, state.chunk_mb, state.topology,
                                                   rounding=state.rounding)
        report.covered_by_parent(width)
    if width.runtime is not state.runtime:
        topo = state.node_layout()
        width.process_group, width.runtime, width.calls_from = state.process_group, state.runtime, state
        width.counters, width.intra_counters = state.counters, state.intra_counters
        if topo.two_level:
            if width.inter is None:
                width.inter = type(state)(topo.inter_group, bits, state.block_size, state.seed, state.error_feedback,
                                          state.start_iter, state.scales, state.chunk_mb, rounding=state.rounding)
                report.covered_by_parent(width.inter)
            inter = width.inter
            inter.process_group, inter.counters, inter.calls_from = topo.inter_group, state.inter.counters, state.inter
            inter.runtime = GroupRuntime()
            inter.runtime.share_transport(state.inter.runtime)
    return width


def release_other_widths(state: THCState, key, tensor: torch.Tensor, keep: int | None) -> None:
    """Before ``key`` goes through another exchange than the width ``keep``: every other
    width forgets the key (its predicted scales are stale by its next turn) and adds its
    error-feedback residual into ``tensor``, so no gradient mass is lost on a switch.
    Widths that hold no key cost nothing (the usual case once a choice is held)."""
    for bits, width in state.variants.items():
        if bits == keep or not any(policy.keys for policy in width.keys.policies.values()):
            continue
        pieces = width.options.chunks(tensor.numel(), tensor.device)
        flat = tensor.view(-1)
        for policy in width.keys.policies.values():
            for i, (start, stop) in enumerate(pieces):
                residual = policy.release(key if len(pieces) == 1 else (key, i), stop - start)
                if residual is not None:
                    flat[start:stop].add_(residual.to(flat.dtype))
