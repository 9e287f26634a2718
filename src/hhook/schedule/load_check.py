r"""A checkpoint of other options loaded on some ranks of a group and not on others,
found at the next exchange (the DDP hook's, a ``thc_allreduce`` call's), on every rank,
without a collective that the ranks that did not load would never enter.

:meth:`hhook.THCState.load_state_dict` replaces a state's options, so the options
handshake (:mod:`hhook.schedule.handshake`) must run again, on every rank. A rank cannot
tell whether the others loaded too; its handshake would wait for them (the group's whole
timeout), while they go on into their exchange. So where every rank's next exchange is
known (DDP's, flat or two-level, or a ``thc_allreduce`` call's on a flat layout), the
loading rank keeps the context every rank last verified and the iteration the group is at (:class:`Loaded`;
under ``bits="auto"`` the state as every rank verified it, its decision included) and
takes part in that exchange as the others do, saying that it loaded:

* in a dense exchange (DDP's plain iterations before ``start_iter``, its first one
  included: a load right after :func:`hhook.register` is the common case; under
  ``bits="auto"`` also the fp32 and bf16 candidates, on the host), the count of ranks
  that loaded rides in the exchange (:func:`plain`): a rank that loaded sends zeros and
  :data:`~hhook.schedule.dense.MARK` in the last element, the others their bucket, in
  place, as without the check;
* in THC's exchange, filler of the verified size marked
  :data:`~hhook.scales.message.CHANGED`, as a ``thc_allreduce`` call that changed does
  (:mod:`hhook.schedule.call_check`), in whichever scale mode, since the mark rides in
  the SUM of the verified collectives.

Every rank reads how many ranks loaded:

* **all of them**: the loading rank waited for that first exchange (on the hook's
  thread, once per load): the handshake runs again, as before this check existed, and
  the bucket is exchanged with the new options; the filler's rounds are counted nowhere
  (the loaded call numbers stay the checkpoint's: a resumed run is bit for bit).
* **some, not all**: that exchange and every later one raise
  :class:`~hhook.errors.ConfigMismatchError` on every rank, naming each option that
  differs and ``load_state_dict`` (whether the rank loaded) with each rank's value,
  through the group's store (:func:`named_error`: no collective, safe in a continuation).

A state that :func:`hhook.thc_allreduce_async` uses does the same at its next call
(:func:`call`): the loading rank makes the call every rank verified, with its check riding
in the exchange (:mod:`hhook.schedule.call_check`), filler marked
:data:`~hhook.scales.message.CHANGED` in place of its tensor.

On a two-level layout the loading rank's shard goes between nodes as that filler, and its
ring's count travels with the shard through the node's gather
(:mod:`hhook.schedule.two_level`): every rank of every node reads the total.

A resumed run's first DDP iteration splits its buckets into the keys the state held before
the load, as the others split theirs.

An FSDP2 state keeps the verified context of each shard group's reduce-scatter
(:func:`kept_shards`), and under ``bits="auto"`` the state as every rank verified it, whose
decision and clock the loading rank runs until the check (:meth:`hhook.fsdp.auto.Decider.live`):
so its collectives stay the others'. The group's next exchange on the loading rank says
that it loaded, every rank reads the count, and :func:`settled` decides as above:

* THC's reduce-scatter: filler marked in every chunk's message (:func:`reduce_scattered`);
* the compressed all-gather: a word of the payload's header (:mod:`hhook.fsdp.all_gather`);
* FSDP2's dense all-gather and reduce-scatter (``bits="auto"``'s ``rs`` and ``dense``
  methods, a dtype THC does not take): :data:`~hhook.schedule.dense.MARK` at the end of
  the chunk or in its sum (:func:`dense_all_gather`, :func:`dense_reduce_scatter`), read
  on the host where :func:`marks_fit`. Where it does not (on a GPU, float16) the loading
  rank makes no check there and the handshake runs again, as before this check existed.

A one-sided load on GPUs whose next DDP exchange is ``bits="auto"``'s dense candidate
does the same (its count would be read on the host).
"""

from __future__ import annotations

import dataclasses

import torch

from ..codec.layout import SUPPORTED_DTYPES
from ..errors import ConfigMismatchError
from ..scales.message import CallChanged
from ..stats import Counters
from .context import CallContext
from .call_check import checked_allreduce_async, exchange_checked, options_said
from . import membership
from .dense import MARK, marks, tallied_allreduce
from .groups import reduce_scatter_flat
from .membership import all_gather_flat
from .handshake import call_number, named
from .reduce_scatter import reduce_scatter

WHAT = "the THC options after load_state_dict on some ranks"
#: The dtypes in which an FSDP2 dense exchange carries the count (:func:`marks_fit`).
MARKED_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


@dataclasses.dataclass
class Loaded:
    """What a rank that loaded a checkpoint keeps until its next exchange tells whether
    every rank loaded: ``ctx``, the context every rank verified (its counters this
    record's own); ``iter``, the DDP iteration the group is at (this rank's before the
    load, counted on by the hook): before the verified ``start_iter`` the others' next
    exchange is a plain allreduce; ``shadow``: under ``bits="auto"``, the state as every
    rank verified it (its decision, clock and widths; :func:`hhook.state.checkpoint.shadow_of`),
    which the DDP hook runs on, marked, to make the exchanges the others make
    (:func:`hhook.decision.hook.reduce_bucket_as_decided`); ``layouts``: the checkpointed
    keys' layouts before the load (:func:`hhook.state.checkpoint.saved_layouts`), which a
    resumed run's first DDP iteration splits its buckets into; ``some``: an exchange found
    that some ranks, not all, loaded; ``shards``: FSDP2's shard group -> the context of its
    reduce-scatter every rank verified (:func:`kept_shards`; ``ctx`` is then None), until
    that group's next reduce-scatter tells."""

    ctx: CallContext | None
    iter: int
    shadow: object = None
    layouts: dict = dataclasses.field(default_factory=dict)
    some: bool = False
    shards: dict = dataclasses.field(default_factory=dict)

    @property
    def plain(self) -> bool:
        return self.iter < dict(self.ctx.fields)["start_iter"]


def kept(ctx: CallContext | None, iteration: int, shadow=None, layouts: dict | None = None) -> Loaded | None:
    """The record of ``ctx`` (the hook's verified context) at DDP iteration ``iteration``
    (``shadow``, ``layouts``: as :class:`Loaded`'s), where its exchanges are known: over
    several ranks, flat or two-level; else None (the handshake runs again)."""
    if ctx is None or ctx.world_size == 1:
        return None
    return Loaded(own_counters(ctx), iteration, shadow, layouts if layouts is not None else {})


def kept_shards(contexts: dict, shadow=None) -> Loaded | None:
    """The record of an FSDP2 state (``contexts``: shard group -> the agreed context of its
    reduce-scatter, every rank verified; ``shadow()``: under ``bits="auto"``, the state as
    every rank verified it, whose decision this rank runs until the check), where some
    group has more than one rank; else None."""
    shards = {group: own_counters(ctx) for group, ctx in contexts.items() if ctx.world_size > 1}
    return Loaded(None, 0, shadow=None if shadow is None else shadow(), shards=shards) if shards else None


def own_counters(ctx: CallContext, counters: Counters | None = None) -> CallContext:
    """``ctx`` counting (and drawing call numbers) in ``counters`` (default: new ones), and,
    two-level, in new counters of its own inside nodes and between them: the exchanges of
    a rank that loaded leave the loaded state's counters as they were (a resume stays bit
    for bit)."""
    inter = None if ctx.inter is None else dataclasses.replace(ctx.inter, counters=Counters())
    intra = None if ctx.intra_counters is None else Counters()
    return dataclasses.replace(ctx, counters=counters if counters is not None else Counters(), intra_counters=intra,
                               inter=inter)


def plain(ctx: CallContext, tensor: torch.Tensor, changed: CallChanged | None = None,
          dtype: torch.dtype | None = None) -> torch.futures.Future:
    """DDP's plain allreduce of ``tensor`` (the iterations before ``start_iter``; in
    ``dtype``, bf16: ``bits="auto"``'s bf16 candidate) tallying the ranks that loaded a
    checkpoint since the handshake (``changed``: this rank did, and sends zeros;
    :func:`~hhook.schedule.dense.tallied_allreduce`). Where some did, the future raises
    :class:`~hhook.scales.message.CallChanged` counting them."""

    def check(loaded: int) -> None:
        if loaded:
            err = changed or CallChanged(f"hhook: {loaded} rank(s) loaded a checkpoint since the options handshake")
            err.count = loaded
            raise err

    return tallied_allreduce(ctx, tensor, 0 if changed is None else 1, check, dtype)


def exchange(loaded: Loaded, launch) -> torch.futures.Future | None:
    """The loading rank's exchange after a load: ``launch(changed)``, its future, makes the
    exchange every rank verified, marked with ``changed`` (a
    :class:`~hhook.scales.message.CallChanged`) where it can carry the mark (:func:`marked`;
    ``bits="auto"``: :func:`hhook.decision.hook.reduce_bucket_as_decided`). The first
    marked one is waited for here: None where every rank loaded (the caller forgets
    ``loaded``, runs the handshake and exchanges its tensor), else its future, which
    raises ``changed`` (:func:`named_error` names it), as every later marked one does,
    not waited for. An unmarked one (``changed.count`` stays 0: no mark rode in it) is
    returned as it is. ``launch`` returns None where the exchange cannot carry the mark,
    nothing launched: so does this (the handshake runs again, as without the check)."""
    changed = CallChanged("hhook: this rank loaded a checkpoint since the group's options handshake")
    fut = launch(changed)
    if fut is None or loaded.some:
        return fut
    try:
        fut.wait()
    except BaseException:  # noqa: BLE001 - read below; the future keeps it for the waiter
        pass
    if changed.count == 0:  # unmarked: the next exchange tells
        return fut
    if changed.count == loaded.ctx.world_size:
        return None
    loaded.some = True
    return fut


def marked(loaded: Loaded, tensor: torch.Tensor, key, layout, changed: CallChanged) -> torch.futures.Future:
    """At a fixed width, the exchange every rank verified of ``tensor`` (``key``,
    ``layout``), marked with ``changed``: before ``start_iter`` the others' plain allreduce
    (:func:`plain`), this rank's bucket as zeros; after it, filler of the verified size.
    A tensor that every rank exchanges dense (sparse; after ``start_iter`` float64, empty)
    goes as it is, unmarked."""
    if tensor.is_sparse or (not loaded.plain and (tensor.dtype not in SUPPORTED_DTYPES or tensor.numel() == 0)):
        return loaded.ctx.schedule(loaded.ctx, tensor, key, layout)  # dense (or nothing) on every rank: no mark
    if loaded.plain:  # the others' plain allreduce, this rank's bucket as zeros, marked
        return plain(loaded.ctx, tensor, changed)
    return filler(loaded.ctx, tensor, key, layout, changed)


def filler(ctx: CallContext, tensor: torch.Tensor, key, layout, changed: CallChanged) -> torch.futures.Future:
    """THC's exchange over ``ctx`` (its schedule: flat, or two-level, whose shard goes
    between nodes marked) of zeros the size of ``tensor`` (``key``, ``layout``), marked
    with ``changed``: a loading rank's part in the others' THC exchange."""
    zeros = torch.zeros(tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    return ctx.schedule(ctx, zeros, key, layout, changed)


def call(state, tensor: torch.Tensor, key, layout) -> torch.futures.Future | None:
    """The loading rank's :func:`hhook.thc_allreduce_async` call after a load (``state``'s
    record): the call every rank verified, its check riding in the exchange as the
    others' does (:func:`~hhook.schedule.call_check.checked_allreduce_async`), its own
    tensor replaced by filler marked :data:`~hhook.scales.message.CHANGED`. The first one
    is waited for here: None where every rank loaded (the caller forgets the record, runs
    the handshake and exchanges ``tensor``), else its future, which raises the
    :class:`~hhook.errors.ConfigMismatchError` naming each rank's options, as every later
    one does, not waited for. A call that every rank reduces dense (float64, sparse,
    empty) goes as it is, unmarked."""
    loaded = state.pending_load
    fut = checked_allreduce_async(loaded.ctx, tensor, key, layout, state.options.fields())
    if fut is None:  # its check passed; another path, unmarked
        return exchange_checked(loaded.ctx, tensor, key, layout)
    if loaded.some:
        return fut
    try:
        fut.wait()
    except CallChanged as exc:
        if exc.count == loaded.ctx.world_size:
            return None
    except BaseException:  # noqa: BLE001 - the future keeps it for the waiter
        pass
    loaded.some = True
    return fut


def reduce_scattered(state, group, output: torch.Tensor, buffer: torch.Tensor, name, said: tuple) -> None:
    """The loading rank's FSDP2 reduce-scatter on ``group`` after a load (``state``'s
    record holds the group's verified context): filler of the verified sizes, marked in
    every chunk's message (:func:`hhook.schedule.reduce_scatter.reduce_scatter`), blocking
    as FSDP's comm is. Returns where every rank loaded (the group leaves the record; the
    caller runs the handshake and reduce-scatters ``buffer``); else raises the
    :class:`~hhook.errors.ConfigMismatchError` naming each rank's options (``said``, this
    call's :func:`said`), as every later reduce-scatter on the group does."""
    loaded = state.pending_load
    ctx = loaded.shards[group]
    changed = CallChanged("hhook: this rank loaded a checkpoint since the group's options handshake")
    try:
        reduce_scatter(ctx, output, buffer, name, changed)
    except CallChanged:
        pass  # changed itself: its count says how many ranks loaded
    settled(state, group, changed.count, said)


def settled(state, group, count: int, said: tuple) -> None:
    """The loading rank read ``count`` ranks that loaded in FSDP2's exchange on ``group``:
    returns where every rank did (the group leaves the record; the caller runs the
    handshake and its own exchange), else raises the
    :class:`~hhook.errors.ConfigMismatchError` naming each rank's options (``said``), as
    every later exchange on the group does."""
    loaded = state.pending_load
    if count == membership.of(group).size and not loaded.some:
        handshook(state, group)
        return
    loaded.some = True
    raise named_error(said)


def marks_fit(tensor: torch.Tensor) -> bool:
    """Whether FSDP2's dense exchange of ``tensor`` carries the count of ranks that loaded
    (:func:`dense_all_gather`, :func:`dense_reduce_scatter`): read on the host, where that
    is free, in a dtype that holds :data:`~hhook.schedule.dense.MARK` times the ranks
    exactly."""
    return tensor.device.type == "cpu" and tensor.dtype in MARKED_DTYPES and tensor.numel() > 0


def dense_all_gather(output: torch.Tensor, buffer: torch.Tensor, group, mark: bool, read: bool = True) -> int:
    """FSDP2's plain all-gather of ``buffer`` into ``output`` on ``group`` (``mark``: this
    rank loaded a checkpoint and sends zeros ending in :data:`~hhook.schedule.dense.MARK`
    instead): how many ranks' chunks end in it, where ``read`` and :func:`marks_fit` (else 0). The
    others' buffers go as they are: no copy; a parameter of exactly 2**100 at the end of a
    chunk would read as a mark."""
    sent = kept = buffer
    if mark:  # FSDP's buffer is this rank's chunk of its output: kept for the exchange after the check
        sent, kept = torch.zeros_like(buffer), buffer.clone()
        sent.view(-1)[-1] = MARK
    all_gather_flat(output, sent, group=group)
    tally = 0
    if read and marks_fit(buffer):
        tally = sum(1 for value in output.view(membership.of(group).size, -1)[:, -1].tolist() if value == MARK)
    if kept is not buffer:
        buffer.copy_(kept)
    return tally


def dense_reduce_scatter(output: torch.Tensor, buffer: torch.Tensor, group, mark: bool) -> int:
    """FSDP2's plain SUM-reduce-scatter of ``buffer`` into ``output`` on ``group`` (``mark``:
    this rank sends zeros with :data:`~hhook.schedule.dense.MARK` at the end of every
    chunk instead): how many ranks marked, read in this rank's chunk where
    :func:`marks_fit` (else 0), as :func:`~hhook.schedule.dense.tallied_allreduce` counts."""
    world = membership.of(group).size
    sent = kept = buffer
    if mark:  # kept, should the output share the buffer's memory
        sent, kept = torch.zeros_like(buffer), buffer.clone()
        sent.view(world, -1)[:, -1] = MARK
    reduce_scatter_flat(output, sent, group=group)
    tally = marks(float(output.view(-1)[-1])) if marks_fit(buffer) else 0
    if kept is not buffer:
        buffer.copy_(kept)
    return tally if tally <= world else 0  # more marks than ranks: a gradient's sum, not marks


def handshook(state, group) -> None:
    """Every rank of FSDP2's shard ``group`` loaded, or ran the handshake there again (a
    model registered anew): ``state``'s record no longer keeps the group."""
    loaded = state.pending_load
    loaded.shards.pop(group, None)
    if loaded.ctx is None and not loaded.shards:
        state.pending_load = None


def said(state, group=None, kind: str = "bucket") -> tuple:
    """What an exchange (a DDP bucket's; ``kind`` and ``group``: FSDP2's reduce-scatter on
    its shard group) would say, should it find a checkpoint loaded on some ranks: this
    rank's options (:meth:`hhook.state.Options.fields`), whether it loaded one, and the
    exchange's number among ``kind``'s on ``group`` (default: the state's;
    :func:`~hhook.schedule.handshake.call_number`), taken when it is launched. Read later,
    in the continuation, a rank whose program went on (DDP raised the first bucket's error
    while the others' ran) could say what it loaded since, and number the buckets in the
    order their continuations ran."""
    fields = options_said(state.options.fields(), state.pending_load is not None)
    group = state.process_group if group is None else group
    return group, fields, call_number(group, kind)


def named_error(said: tuple) -> ConfigMismatchError:
    """The error of an exchange that found a checkpoint loaded on some ranks, not all, each
    rank's options named as :func:`said` took them (:func:`hhook.schedule.handshake.named`)."""
    group, fields, number = said
    return named(group, fields, number, WHAT)
