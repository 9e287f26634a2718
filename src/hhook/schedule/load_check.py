r"""A checkpoint of other options loaded on some ranks of a group and not on others,
found at the DDP hook's next exchange, on every rank, without a collective that the
ranks that did not load would never enter.

:meth:`hhook.THCState.load_state_dict` replaces a state's options, so the options
handshake (:mod:`hhook.schedule.handshake`) must run again, on every rank. A rank cannot
tell whether the others loaded too; its handshake would wait for them (the group's whole
timeout), while they go on into their exchange. So where every rank's next exchange is a
THC one of the flat schedule at a fixed width (DDP's iterations from ``start_iter`` on),
the loading rank keeps the context every rank last verified (:class:`Loaded`: the old
options, scale policy and transport) and sends, in that exchange, filler of the verified
size marked :data:`~hhook.scales.message.CHANGED`, as a ``thc_allreduce`` call that
changed does (:mod:`hhook.schedule.call_check`), in whichever scale mode, since the mark
rides in the SUM of the verified collectives. Every rank reads how many ranks loaded:

* **all of them**: the loading rank waited for that first exchange (on the hook's
  thread, once per load): the handshake runs again, as before this check existed, and
  the bucket is exchanged with the new options; the filler's rounds are counted nowhere
  (the loaded call numbers stay the checkpoint's: a resumed run is bit for bit).
* **some, not all**: that exchange and every later one raise
  :class:`~hhook.errors.ConfigMismatchError` on every rank, naming each option that
  differs and ``load_state_dict`` (whether the rank loaded) with each rank's value,
  through the group's store (:func:`named_error`: no collective, safe in a continuation).

Elsewhere (``bits="auto"``, two-level layouts, a load before ``start_iter``, FSDP2,
``thc_allreduce``) the handshake runs again at the next exchange as before.
"""

from __future__ import annotations

import dataclasses

import torch

from ..codec.layout import SUPPORTED_DTYPES
from ..errors import ConfigMismatchError
from ..scales.message import CallChanged
from ..stats import Counters
from .context import CallContext
from .flat import flat_allreduce_async
from .handshake import call_number, named

WHAT = "the THC options after load_state_dict on some ranks"


@dataclasses.dataclass
class Loaded:
    """What a rank that loaded a checkpoint keeps until its next exchange tells whether
    every rank loaded: ``ctx``, the context every rank verified (its counters this
    record's own); ``some``: an exchange found that some ranks, not all, loaded."""

    ctx: CallContext
    some: bool = False


def kept(ctx: CallContext | None) -> Loaded | None:
    """The record of ``ctx`` (the hook's verified context), where its exchanges are THC
    ones of the flat schedule over several ranks; else None (the handshake runs again)."""
    if ctx is None or ctx.world_size == 1 or ctx.inter is not None:
        return None
    return Loaded(dataclasses.replace(ctx, counters=Counters()))


def exchange(loaded: Loaded, tensor: torch.Tensor, key, layout) -> torch.futures.Future | None:
    """The loading rank's exchange of ``tensor`` (``key``, ``layout``) after a load: filler
    of the verified size, marked. The first one is waited for here: None where every rank
    loaded (the caller forgets ``loaded``, runs the handshake and exchanges ``tensor``),
    else its future, which raises :class:`~hhook.scales.message.CallChanged`
    (:func:`named_error` names it), as every later one does, not waited for. A tensor
    that every rank exchanges dense (sparse, float64, empty) goes as it is, unmarked."""
    if tensor.is_sparse or tensor.dtype not in SUPPORTED_DTYPES or tensor.numel() == 0:
        return flat_allreduce_async(loaded.ctx, tensor, key, layout)  # dense (or nothing) on every rank: no mark
    changed = CallChanged("hhook: this rank loaded a checkpoint since the group's options handshake")
    filler = torch.zeros(tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    fut = flat_allreduce_async(loaded.ctx, filler, key, layout, changed)
    if loaded.some:
        return fut
    try:
        fut.wait()
    except BaseException:  # noqa: BLE001 - read below; the future keeps it for the waiter
        pass
    if changed.count == loaded.ctx.world_size:
        return None
    loaded.some = True
    return fut


def named_error(group, fields: tuple, loaded: bool) -> ConfigMismatchError:
    """The error of an exchange that found a checkpoint loaded on some ranks, not all:
    ``fields`` (this rank's options, :meth:`hhook.state.Options.fields`) and whether this
    rank ``loaded`` one, each rank's named (:func:`hhook.schedule.handshake.named`)."""
    return named(group, tuple(fields) + (("load_state_dict", loaded),), call_number(group), WHAT)
