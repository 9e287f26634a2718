r"""``bits="auto"``'s THC widths (:mod:`hhook.decision`): one :class:`~hhook.state.THCState`
per width it tried, held in the parent state's ``variants``.

A width shares the parent's options, byte counters, node layout, second communicators,
sequencer and handshake, and its **call counter**: every call of every width (and of the
parent itself) takes the next number of one counter per group (the parent's, and on
two-level layouts the parent's ``inter`` state's for the shards' rings). The rounding
streams are keyed by the seed, the rank and that number (:func:`hhook.codec.rng.stream_key`,
:func:`~hhook.codec.rng.shared_key`), so no two calls of a run draw the same stream, whichever
widths they ran at: the rounding errors of different steps stay independent. A fixed
``bits`` has no widths: its streams are its own counter's, 0, 1, 2, ...
"""

from __future__ import annotations

import torch

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the widths are THCStates built with type(state): no import of the state module at run time
    from .state import THCState


def variant(state: THCState, bits: int) -> THCState:
    """THC at ``bits`` over ``state``'s group: its own per-key state; ``state``'s options,
    counters (calls included), node layout, second communicators, sequencer and
    handshake (the widths follow from the options)."""
    v = state.variants.get(bits)
    if v is None:
        v = state.variants[bits] = type(state)(None, bits, state.block_size, state.seed, state.error_feedback,
                                            state.start_iter, state.scales, state.chunk_mb, state.topology,
                                            rounding=state.rounding)
        v.reported_through_parent()
    if v._topo is None:
        topo = state.node_layout()
        v.process_group, v._stats, v._intra, v._topo = state.process_group, state._stats, state._intra, topo
        v._second, v._verified, v._sequencer = state._second, state._verified, state._sequencer
        v._defer_on_cpu, v._checked, v._calls_from = state._defer_on_cpu, state._checked, state
        if topo.two_level:
            if v.inter is None:
                v.inter = type(state)(topo.inter_group, bits, state.block_size, state.seed, state.error_feedback,
                                   state.start_iter, state.scales, state.chunk_mb, rounding=state.rounding)
                v.inter.reported_through_parent()
            v.inter.process_group, v.inter._stats = topo.inter_group, state.inter._stats
            v.inter._second, v.inter._sequencer = state.inter._second, state.inter._sequencer
            v.inter._calls_from = state.inter
    return v


def release_other_widths(state: THCState, key, tensor: torch.Tensor, keep: int | None) -> None:
    """Before ``key`` goes through another exchange than the width ``keep``: every other
    width forgets the key (its predicted scales are stale by its next turn) and adds its
    error-feedback residual into ``tensor``, so no gradient mass is lost on a switch.
    Widths that hold no key cost nothing (the usual case once a choice is held)."""
    for bits, v in state.variants.items():
        if bits == keep or not any(policy.keys for policy in v.policies.values()):
            continue
        pieces = v.chunks(tensor.numel(), tensor.device)
        flat = tensor.view(-1)
        for policy in v.policies.values():
            for i, (start, stop) in enumerate(pieces):
                residual = policy.release(key if len(pieces) == 1 else (key, i), stop - start)
                if residual is not None:
                    flat[start:stop].add_(residual.to(flat.dtype))


def merge_call_counters(state: THCState) -> None:
    """After loading: a checkpoint of an hhook before the shared counter holds one counter
    per width. The parent's (and its ``inter`` state's) then continues above all of them,
    so no stream already drawn is drawn again; the widths' own counters are unused."""
    for parent, widths in ((state, list(state.variants.values())),
                           (state.inter, [v.inter for v in state.variants.values() if v.inter is not None])):
        if parent is None or not widths:
            continue
        parent.calls = max([parent.calls] + [w.calls for w in widths])
        for w in widths:
            w.calls = 0
