r"""The per-call check of :func:`hhook.thc_allreduce_async`, riding in the exchange: the
ranks' tensors of one call must have one length and dtype before payloads meet (Gloo
aborts the process where payloads of different sizes meet), and the caller's thread
never waits for a peer to learn it.

* **A key that its last exchange verified** (same length, dtype, layout and options on
  this rank as then; every rank holds the same record, made where the exchange's check
  passed, on every rank alike, whatever the exchange's outcome on each): no check round. The exchange is launched at once, as the hook's (one SUM
  with predicted scales, MAX and SUM with agreed ones). A rank whose call differs sends
  filler of the *verified* size instead, marked in the prefix
  (:data:`hhook.scales.message.CHANGED`), so the sizes still meet; every rank reads how
  many ranks changed. Some, not all: every rank raises
  :class:`~hhook.errors.ConfigMismatchError` naming each rank's values. All of them (a
  key that now holds another tensor everywhere): the call is checked and exchanged again,
  in the turn of a ticket drawn at the call (every verified call draws one; it is
  skipped when nothing changed).
* **Any other call** (``key=None``, a key's first call): a check round, the options
  handshake's digest MAX-reduced (:mod:`hhook.schedule.handshake`), launched in the
  call's turn on the second communicator (a ticket of the group's sequencer), and from
  its continuation the exchange, while the sequencer holds later tickets back so that
  every rank issues the same collectives in the same order. A mismatch raises on every
  rank, naming each rank's values through the group's store (no collective: safe in a
  continuation).
* Where the second communicator is Gloo the check's vector lives on the host; under NCCL
  it lives on the device, and the continuation reads its verdict there (a device
  synchronisation on the process group's thread, not on the caller's).
* Calls that take no THC exchange of the flat schedule (float64, sparse, empty or
  expanded tensors, a two-level layout) wait for the same check round on the caller's
  thread, then go on as before.
* A rank that loaded a checkpoint since the options handshake makes the call as every
  rank verified it, filler marked :data:`CHANGED` in place of its tensor
  (:mod:`hhook.schedule.load_check`): some ranks, not all, makes every rank raise, naming
  the options and ``load_state_dict`` per rank.
"""

from __future__ import annotations

import dataclasses
import zlib

import torch
import torch.distributed as dist

from ..codec.layout import SUPPORTED_DTYPES
from ..scales.message import CallChanged
from .dense import check_dtype
from .flat import flat_allreduce_async, pieces_of, second_group
from .futures import Sequencer, attach, new_future, value_of
from .groups import pair, pair_agrees
from .handshake import call_number, digest, encode, named

WHAT = "this thc_allreduce call"


@dataclasses.dataclass(frozen=True)
class Verified:
    """What a key's last exchange verified on every rank: the ``signature`` (numel, dtype,
    layout, device type) a later call must match to skip the check round, whose first
    three shape the filler of a rank whose call changed."""

    signature: tuple

    @property
    def numel(self) -> int:
        return self.signature[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.signature[1]

    @property
    def layout(self):
        return self.signature[2]


def signature_of(tensor: torch.Tensor, layout=None) -> tuple:
    """The :class:`Verified` signature of a call of ``tensor`` (``layout`` None: its shape
    and dtype, as :func:`hhook.thc_allreduce_async` takes it)."""
    layout = (tuple(tensor.shape), str(tensor.dtype)) if layout is None else layout
    return tensor.numel(), tensor.dtype, layout, tensor.device.type


def expanded(tensor: torch.Tensor) -> bool:
    """Whether elements share memory (a stride 0, as ``expand`` makes): no in-place mean."""
    return not tensor.is_sparse and any(st == 0 and n > 1 for st, n in zip(tensor.stride(), tensor.shape))


def exchange_checked(ctx, tensor: torch.Tensor, key, layout) -> torch.futures.Future:
    """The exchange of a call that passed its check on another path than the flat THC one
    (float64, sparse, empty or expanded tensors, a two-level layout), or needs none (one
    rank): a dtype hhook refuses (:func:`~hhook.schedule.dense.check_dtype`) or a tensor
    whose elements share memory raises here, on every rank alike; else ``ctx``'s schedule."""
    check_dtype(tensor)
    if expanded(tensor):
        raise ValueError(
            f"hhook averages the tensor in place, but this one is expanded (shape {tuple(tensor.shape)}, strides "
            f"{tensor.stride()}): several of its elements are one memory location, which cannot hold different "
            "means. Pass tensor.contiguous() (a copy) and use the result"
        )
    return ctx.schedule(ctx, tensor, key, layout)


def call_fields(tensor: torch.Tensor) -> tuple:
    """What every rank of a :func:`thc_allreduce_async` call must hand in alike."""
    return (("runs", "thc_allreduce"), ("numel", tensor.numel()), ("dtype", str(tensor.dtype)[6:]),
            ("sparse", tensor.is_sparse), ("expanded", expanded(tensor)))


def checked_allreduce_async(ctx, tensor: torch.Tensor, key, layout, loaded: tuple | None = None) \
        -> torch.futures.Future | None:
    """Launch the flat THC exchange of ``tensor`` with its check (the module's three
    cases); returns its future, or None once a call that takes another path has passed
    its check (waited for here). ``loaded``: this rank loaded a checkpoint since the
    options handshake, ``ctx`` is the context every rank verified before
    (:mod:`hhook.schedule.load_check`), and ``loaded`` the fields of its options now: it
    takes part in the others' call with filler marked :data:`CHANGED`, and its future
    raises a :class:`CallChanged` counting the ranks that loaded where all of them did."""
    number, fields = call_number(ctx.group), call_fields(tensor)
    said = options_said(ctx.fields if loaded is None else loaded, loaded is not None)
    if tensor.numel() == 0 or tensor.is_sparse or tensor.dtype not in SUPPORTED_DTYPES or expanded(tensor) \
            or ctx.inter is not None:
        done = new_future(tensor)
        _run(ctx, tensor, (fields, number), done, second_group(ctx, tensor.device), None)
        done.wait()
        return None
    signature = signature_of(tensor, layout)
    layout = signature[2]
    record = ctx.verified.get(key) if key is not None else None
    sequencer, result = ctx.runtime.sequencer, new_future(tensor)
    mark = None if loaded is None else CallChanged("hhook: this rank loaded a checkpoint since the options handshake")
    if record is None:
        second, ticket = second_group(ctx, tensor.device), sequencer.ticket()
        exchange = (key, layout, signature, _calls(ctx, tensor), mark, said)
        sequencer.launch(ticket, lambda: _run(ctx, tensor, (fields, number), result, second, exchange))
        return result
    changed = mark if mark is not None else \
        (None if record.signature == signature else CallChanged("hhook: this rank's call changed"))
    if changed is None:
        fut = flat_allreduce_async(ctx, tensor, key, layout)
    else:  # filler of the verified size: the sizes meet, the prefix says why
        filler = torch.zeros(record.numel, dtype=record.dtype, device=tensor.device)
        fut = flat_allreduce_async(ctx, filler, key, record.layout, changed)
        redo = (key, layout, signature, _calls(ctx, tensor), None, said)  # should every rank have changed
    spare = sequencer.ticket()  # after the exchange's own: a redo's turn, should every rank have changed

    def done(f: torch.futures.Future) -> None:
        try:
            value = f.value()
        except CallChanged as exc:
            if mark is not None and exc.count == ctx.world_size:  # every rank loaded: load_check goes on
                sequencer.launch(spare, None)
                result.set_exception(exc)
                return
            if changed is not None and exc.count == ctx.world_size:  # every rank: check and exchange again
                second = ctx.runtime.second.get(tensor.device.type)
                if second is not None:
                    sequencer.launch(spare, lambda: _run(ctx, tensor, (fields, number), result, second, redo))
                    return
            sequencer.launch(spare, None)
            what, crc = f"{WHAT} (key {key!r}, which its last exchange verified)", zlib.crc32(repr(layout).encode())
            result.set_exception(named(ctx.group, fields + (("layout_crc32", crc),) + said, number, what))
            return
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter as it is
            sequencer.launch(spare, None)
            result.set_exception(exc)
            return
        sequencer.launch(spare, None)
        result.set_result(value)

    attach(fut, done, ctx.group)
    return result


def _run(ctx, tensor: torch.Tensor, call: tuple, result: torch.futures.Future, second, exchange: tuple | None) -> None:
    """In the call's turn of the group's sequencer, which holds later tickets back until
    this call's collectives are launched: the check round on ``second`` and, from its
    continuation, the exchange (``(key, layout, signature, call numbers)``; None: complete ``result``
    with None once the check passed). ``call``: its fields and :func:`call_number`. Never
    waits."""
    (fields, number), sequencer = call, ctx.runtime.sequencer
    sequencer.hold()
    try:
        host = isinstance(second.backend, dist.ProcessGroupGloo)  # read in a continuation: on the host if it can
        vector = pair(digest(encode(fields)), "cpu" if host else tensor.device, torch.int32)
        work = second.all_reduce(vector, dist.ReduceOp.MAX)
        ctx.counters.add(None, 0, vector.nbytes)
    except BaseException as exc:  # noqa: BLE001 - handed to the waiter
        sequencer.resume()
        result.set_exception(exc)
        return

    def checked(f: torch.futures.Future) -> None:
        try:
            value_of(f, f"the check of {WHAT}", ctx.group)  # named by its group, as its MAX would be
            same = pair_agrees(vector)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            sequencer.resume()
            result.set_exception(exc)
            return
        if not same:
            sequencer.resume()
            result.set_exception(named(ctx.group, fields, number, WHAT))
            return
        if exchange is None:
            sequencer.resume()
            result.set_result(None)
            return
        key, layout, signature, calls, mark, said = exchange
        if key is not None:  # every rank launches this exchange now, whatever its outcome here
            ctx.verified[key] = Verified(signature)
        own = Sequencer()  # the exchange's collectives, in its pieces' order, while the group's holds
        try:
            sent = tensor if mark is None else torch.zeros_like(tensor)  # a rank that loaded: filler, marked
            fut = flat_allreduce_async(ctx, sent, key, layout, mark, lane=(second, own, calls))
        except BaseException as exc:  # noqa: BLE001 - handed to the waiter
            sequencer.resume()
            result.set_exception(exc)
            return
        own.launch(own.ticket(), sequencer.resume)  # once its collectives are all launched

        def exchanged(g: torch.futures.Future) -> None:
            try:
                value = g.value()
            except CallChanged as exc:  # only ever marked by a rank that loaded a checkpoint
                if mark is not None and exc.count == ctx.world_size:  # every rank did: load_check goes on
                    result.set_exception(exc)
                else:
                    result.set_exception(named(ctx.group, fields + said, number, WHAT))
                return
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                result.set_exception(exc)
                return
            result.set_result(value)

        attach(fut, exchanged, ctx.group)

    attach(work.get_future(), checked, ctx.group)


def options_said(fields, loaded: bool) -> tuple:
    """What a rank says of its options where an exchange found a call that changed or a
    checkpoint loaded on some ranks: the options it runs (``fields``, :meth:`hhook.state.
    Options.fields`) and whether it loaded a checkpoint since the handshake."""
    return tuple(fields) + (("load_state_dict", loaded),)


def _calls(ctx, tensor: torch.Tensor):
    """The call numbers (rounding streams, the same on every rank) of the pieces of an
    exchange encoded later in a continuation, drawn now, in call order."""
    count = len(pieces_of(ctx, tensor))
    return iter([ctx.counters.next_call() for _ in range(count)])
