r"""``bits="auto"``'s THC widths (:mod:`hhook.decision`): one :class:`~hhook.state.THCState`
per width it tried, held in the parent state's ``variants``.

A width shares the parent's options, group runtime (node layout, second communicators,
launch order, handshake) and counters, whose **call number** is the one every call of
every width (and of the parent itself) takes the next of: one per group (the parent's,
and on two-level layouts the parent's ``inter`` state's for the shards' rings). The rounding streams are keyed by the seed, the rank and that number
(:func:`hhook.codec.rng.stream_key`, :func:`~hhook.codec.rng.shared_key`), so no two calls
of a run draw the same stream, whichever widths they ran at: the rounding errors of
different steps stay independent. A fixed ``bits`` has no widths: its streams are its own
counter's, 0, 1, 2, ...
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..schedule import link
from ..schedule.context import GroupRuntime
from ..schedule.flat import pieces
from ..state import report

if TYPE_CHECKING:
    from ..state import THCState


def variant(state: THCState, bits: int) -> THCState:
    """THC at ``bits`` over ``state``'s group: its own per-key state; ``state``'s options,
    counters and group runtime. On two-level layouts its inter-node state sends on the
    parent's inter-node communicators and counters, and checks its own options over the
    nodes' ring."""
    width = state.variants.get(bits)
    o = state.options
    if width is None:
        width = state.variants[bits] = type(state)(None, bits, o.block_size, o.seed, o.error_feedback, o.start_iter,
                                                   o.scales, o.chunk_mb, o.topology, rounding=o.rounding)
        report.covered_by_parent(width)
    if width.runtime is not state.runtime:
        topo = state.node_layout()
        width.process_group, width.runtime, width.contexts = state.process_group, state.runtime, {}
        width.counters, width.intra_counters = state.counters, state.intra_counters
        if topo.two_level:
            if width.inter is None:
                width.inter = type(state)(topo.inter_group, bits, o.block_size, o.seed, o.error_feedback, o.start_iter,
                                          o.scales, o.chunk_mb, rounding=o.rounding)
                report.covered_by_parent(width.inter)
            inter = width.inter
            inter.process_group, inter.counters, inter.contexts = topo.inter_group, state.inter.counters, {}
            inter.runtime = GroupRuntime()
            inter.runtime.share_transport(state.inter.runtime)
    return width


def release_other_widths(state: THCState, key, tensor: torch.Tensor, keep: int | None, mode: str | None = None) -> None:
    """Before ``key`` goes through another exchange than the width ``keep`` in scale
    ``mode`` (None: the state's own): every other width and mode forgets the key (its
    predicted scales are stale by its next turn) and adds its error-feedback residual into
    ``tensor``, so no gradient mass is lost on a switch. Widths that hold no key cost
    nothing (the usual case once a choice is held)."""
    kept = mode or state.options.scales
    for bits, width in state.variants.items():
        if not any(policy.keys for name, policy in width.keys.policies.items() if (bits, name) != (keep, kept)):
            continue
        flat = tensor.view(-1)
        for name, policy in width.keys.policies.items():
            if (bits, name) == (keep, kept):
                continue
            limit = link.limit_for(width.options.chunk_mb, width.process_group, policy,
                                    width.options.piece_limit())  # as its exchanges split
            parts = pieces(tensor.numel(), tensor.device, limit, width.options.block_size)
            for i, (start, stop) in enumerate(parts):
                residual = policy.release(key if len(parts) == 1 else (key, i), stop - start)
                if residual is not None:
                    flat[start:stop].add_(residual.to(flat.dtype))
