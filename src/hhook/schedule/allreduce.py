r"""THC allreduce, the public entry: :func:`thc_allreduce_async` and :func:`thc_allreduce`
check what each call's ranks hand in, then run the schedule the state's context says (the
flat one, :mod:`hhook.schedule.flat`, or where the node layout found several nodes the
two-level one, :mod:`hhook.schedule.two_level`: dense inside the node, THC between
nodes), as the integrations do (``ctx.schedule``)."""

from __future__ import annotations

import torch

from ..codec import warm_up
from . import load_check
from .call_check import Verified, checked_allreduce_async, exchange_checked, signature_of
from .flat import check_tensor, second_group


def thc_allreduce_async(tensor: torch.Tensor, state, key=None, layout=None) -> torch.futures.Future:
    r"""Start averaging ``tensor`` in place over ``state.process_group`` through the codec
    (``state``: a :class:`~hhook.state.THCState`).

    Returns a future holding ``tensor`` once it holds the mean. ``key`` names the tensor
    for error feedback and predicted scales (a DDP bucket index, a parameter name) and
    must be stable across steps; ``None`` (the default) carries nothing from one call to
    the next, so every call takes an agreed round. ``layout`` says what the key holds
    (default: the tensor's shape and dtype); when it changes the key's state starts
    afresh. A tensor above ``state``'s ``chunk_mb`` travels in pieces, each encoded while the previous one is on the wire.
    Call it in the same order on every rank, and wait for a key's future before reducing
    that key again (its decode updates the key's state). If any rank's tensor holds inf
    or NaN, every rank's result is all NaN. In a world of one rank the tensor is returned
    as it is. With ``THCState(topology=...)`` finding several nodes the tensor is averaged
    two-level (:mod:`hhook.schedule.two_level`), with the same guarantees.

    Returns at once: no peer is waited for on this thread (the state's first exchange on
    a group excepted: the options handshake; and a rank's first call after
    ``state.load_state_dict``, which learns whether every rank loaded,
    :mod:`hhook.schedule.load_check`). The ranks' calls are checked in the
    exchange (:mod:`hhook.schedule.call_check`): a key whose last exchange verified the
    same length, dtype, layout and options takes no extra round; another call (``key``
    None, a key's first) takes one small check round, launched, not waited for. A rank
    whose tensor has another length or dtype (or, for a verified key, layout) makes the
    future raise :class:`~hhook.errors.ConfigMismatchError` on every rank, naming each
    rank's, before payloads of different sizes meet. float32, float16 and bfloat16
    tensors are compressed; float64 and sparse tensors take an exact plain allreduce (one
    log line says so, once); any other dtype (integers, bool, complex) raises
    :class:`TypeError` on every rank, an expanded tensor (elements sharing memory)
    :class:`ValueError`: these, empty tensors and two-level layouts wait for their check
    round here.
    """
    check_tensor(tensor)
    if state.pending_load is not None:  # this rank loaded a checkpoint since the handshake: did every rank?
        fut = load_check.call(state, tensor, key, layout)
        if fut is not None:
            return fut
        state.pending_load = None  # every rank did: the handshake runs again (state.context())
    ctx = state.context(device=tensor.device)
    if ctx.world_size > 1:
        fut = checked_allreduce_async(ctx, tensor, key, layout)
        if fut is not None:
            return fut
    return exchange_checked(ctx, tensor, key, layout)


def connect(state, device, verified: dict | None = None) -> None:
    """What ``state``'s first exchange on ``device`` would wait for, done now, blocking, on
    every rank of its group: the options handshake, the node layout and the second
    communicator. After it every :func:`thc_allreduce_async` on a flat layout returns at
    once (:mod:`hhook.diloco` calls it at its common start). ``verified``: key -> a tensor
    of the length and dtype that every rank's calls of the key will hand in, which the
    caller has checked alike on every rank (:mod:`hhook.diloco`'s options check covers its
    fragments): their calls take no check round
    (:class:`~hhook.schedule.call_check.Verified`), and under gathered scales (one
    all-gather on the group) no second communicator is made, as none of them takes one
    (on a delay link of 50 ms each way its making took 0.91 s of the common start). The
    fused codec for ``device`` is built or loaded here too (:func:`~hhook.codec.warm_up`):
    else the first launch did it, 8-11 ms where the library was cached, the compile's
    seconds where it was not."""
    warm_up(torch.device(device))
    ctx = state.context(device=torch.device(device))
    for key, tensor in (verified or {}).items():
        ctx.verified[key] = Verified(signature_of(tensor))
    if ctx.world_size > 1 and ctx.inter is None and not (verified and ctx.policy.gather):
        second_group(ctx, torch.device(device))


def thc_allreduce(tensor: torch.Tensor, state, key=None) -> torch.Tensor:
    r"""Average ``tensor`` in place across ``state.process_group`` (None = WORLD).

    The blocking form of :func:`thc_allreduce_async`.

    Example::
        >>> state = hhook.THCState(bits=4)
        >>> hhook.thc_allreduce(grad, state, key="layer1.weight")
    """
    out = thc_allreduce_async(tensor, state, key).wait()
    state.check_deferred(wait=True)  # the device flags of its decodes (GPUs), read now
    return out
