r"""The one handshake: before hhook's first payload collective on a group, every rank says
what it is about to run, and ranks that differ raise
:class:`~hhook.errors.ConfigMismatchError` on every rank, naming each field that differs
with each rank's value.

What is compared is a list of named fields (:func:`agree`'s ``fields``): the state's
options and the codec's version (:meth:`hhook.state.Options.fields`), what runs (the DDP
hook, ``thc_allreduce``, FSDP2's comms and the all-gather's options and plans), and for
``thc_allreduce`` the tensor's length and dtype. In three steps:

1. **Arrival**, through the group's store, no collective: each rank marks its arrival at
   this process's n-th handshake on the group and waits, at most the group's timeout,
   for the others. A rank that does not run hhook here (plain DDP, another comm hook, a
   program that took another branch) never arrives: the ranks that did raise, naming
   both sets of ranks, instead of sending a collective that would meet one of that
   rank's of another size inside the backend (Gloo aborts the process on that). A rank
   whose process ended (died, or left normally: :mod:`hhook.schedule.liveness`) makes
   the others raise :class:`~hhook.errors.PeerLostError` within :data:`LOOK_S`, naming
   it and how it ended; one that is stopped, :class:`~hhook.errors.PeerTimeoutError` at
   the timeout. The store is polled, never waited on (a store wait that times out logs
   a C++ warning each time), and its failures raise hhook's errors, naming this rank.
2. **One small collective**: a MAX all-reduce of a 31-bit digest of the fields and of its
   negation (8 bytes). Its halves are equal on every rank exactly when every rank sent
   the same digest, so every rank reaches the same verdict. Where they agree, the
   group's first handshake also measures its round (:mod:`hhook.schedule.link`: three
   more rounds of one element).
3. Only where they differ, on every rank alike: an all-gather of each rank's fields as a
   fixed-size vector (:data:`WORDS` int64 words), to name them.

``thc_allreduce`` checks its calls with the same digest and the same naming, without
blocking (:mod:`hhook.schedule.call_check`): step 2 as a MAX launched in the call's turn,
step 3 through the group's store (:func:`named`: no collective, so it is safe where a
continuation finds the mismatch). Step 1 runs where ranks may not all run hhook yet: a
state's first exchange on a group, and after a checkpoint is loaded.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
import zlib

import torch

from ..codec import rng
from ..errors import ConfigMismatchError, PeerLostError, PeerTimeoutError
from . import link, liveness, membership
from .groups import agrees, explained

logger = logging.getLogger(__name__)

#: Bumped when the encoding below changes (a field of every handshake).
PROTOCOL = 1
#: Fields a handshake can carry.
MAX_FIELDS = 24
#: int64 words of the vector step 3 gathers: [magic, field count], then four per field
#: (the name's 16 bytes, the value's tag and payload: 16 bytes).
WORDS = 2 + 4 * MAX_FIELDS
_MAGIC = 0x48484853  # "HHHS"
_NONE, _INT, _BOOL, _FLOAT, _STR = range(5)

#: Most seconds between looks, while ranks have not all arrived, at whether they have or
#: a missing one ended (a look reads the store once and this rank's liveness connections).
#: The first look comes after FIRST_LOOK_S, each later one after twice the last: ranks
#: that arrive together (torchft's quorums, at every membership change) wait milliseconds.
LOOK_S, FIRST_LOOK_S = 0.2, 0.01
#: Seconds a rank that found a mismatch waits for the other ranks' fields in the store
#: (every rank found it in the same collective; one that does not come is named absent).
NAME_WAIT_S = 4.0
_lock = threading.Lock()
_calls: dict = {}  # (group instance, group name) -> calls checked on it by this process
_arrivals: dict = {}  # (group instance, group name) -> handshakes this process arrived at on it


def _bytes(value: str, size: int) -> bytes:
    """``value`` in ``size`` bytes (a longer one: its first ``size - 4`` bytes and its CRC)."""
    raw = value.encode()
    if len(raw) > size:
        raw = raw[:size - 4] + struct.pack("<I", zlib.crc32(raw))
    return raw.ljust(size, b"\0")


def _words(raw: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(raw) // 8}q", raw))


def _text(words) -> str:
    return struct.pack(f"<{len(words)}q", *words).rstrip(b"\0").decode(errors="replace")


def _value(value) -> list[int]:
    """A value as two int64 words: its type in the first byte, the value after it."""
    if isinstance(value, str):
        return _words(bytes([_STR]) + _bytes(value, 15))
    if value is None:
        return [_NONE, 0]
    if isinstance(value, bool):
        return [_BOOL, int(value)]
    if isinstance(value, float):
        return [_FLOAT, struct.unpack("<q", struct.pack("<d", value))[0]]
    return [_INT, int(value)]


def _unvalue(tag: int, payload: int):
    kind = tag & 0xFF
    if kind == _STR:
        return _text([tag, payload])[1:]
    if kind == _BOOL:
        return bool(payload)
    if kind == _INT:
        return payload
    if kind == _FLOAT:
        return struct.unpack("<d", struct.pack("<q", payload))[0]
    return None


def encode(fields) -> list[int]:
    """``fields`` (``(name, value)`` pairs: None, bool, int, float or str values) as the
    fixed-size vector of :data:`WORDS` int64 words."""
    fields = list(fields)
    if len(fields) > MAX_FIELDS:
        raise ValueError(f"hhook: a handshake carries at most {MAX_FIELDS} fields, got {len(fields)}")
    words = [_MAGIC ^ PROTOCOL, len(fields)]
    for name, value in fields:
        words += _words(_bytes(name, 16)) + _value(value)
    return words + [0] * (WORDS - len(words))


def decode(words) -> dict:
    """The ``{name: value}`` of a vector :func:`encode` made (names of up to 16 bytes and
    string values of up to 15 as they were; longer ones end in 4 bytes of their CRC)."""
    count = words[1]
    out = {}
    for i in range(min(count, MAX_FIELDS)):
        name, tag, payload = words[2 + 4 * i:4 + 4 * i], words[4 + 4 * i], words[5 + 4 * i]
        out[_text(name)] = _unvalue(tag, payload)
    return out


def digest(words) -> int:
    """31 bits of the vector, for the MAX all-reduce."""
    h = rng.mix32(_MAGIC)
    for word in words:
        h = rng.mix32(h ^ (word & rng.MASK32))
        h = rng.mix32(h ^ ((word >> 32) & rng.MASK32))
    return h & 0x7FFFFFFF


def agree(group, fields, counters=None, what: str = "hhook's options handshake", arrive: bool = True) -> None:
    """Raise :class:`~hhook.errors.ConfigMismatchError` on every rank of ``group`` (None:
    the default group) unless every rank holds the same ``fields``; blocking, on every
    rank. ``arrive``: first wait for every rank in the group's store (step 1), where a
    rank may not run hhook at all; ``counters`` (:class:`hhook.stats.Counters`) are
    charged the bytes handed to the collectives. A world of one compares nothing."""
    members = membership.of(group)
    if members.size == 1:
        return
    if arrive:
        _arrive(group, what)
    words = encode(fields)
    device = torch.device("cpu") if members.on_host else torch.device("cuda", torch.cuda.current_device())
    with explained(what, group):
        if agrees(group, digest(words), device, counters, torch.int32):
            link.measure(group, device)
            return
        mine = torch.tensor(words, dtype=torch.int64, device=device)
        rows = torch.empty(members.size * WORDS, dtype=torch.int64, device=device)
        members.all_gather(rows, mine).wait()
    if counters is not None:
        counters.add(None, 0, mine.nbytes)
    raise ConfigMismatchError(_differences(rows.view(-1, WORDS).tolist(), members.ranks, what))


def call_number(group, kind: str = "call") -> str:
    """The number of this call among the ``kind`` calls on ``group`` (``"call"``: checked
    ``thc_allreduce`` calls; ``"bucket"``: the DDP hook's buckets, drawn in hook order),
    the same on every rank (every rank makes them in the same order), for :func:`named`'s
    keys."""
    members = membership.of(group)
    key = (members.instance, members.name, kind)
    with _lock:
        n = _calls.get(key, 0)
        _calls[key] = n + 1
    return f"{kind}{n}"


def named(group, fields, number: str, what: str) -> Exception:
    """The :class:`~hhook.errors.ConfigMismatchError` naming each field of ``fields`` that
    differs between the ranks of ``group``, with each rank's value, for the checked call
    ``number`` (:func:`call_number`), where every rank found that they differ: each rank
    puts its fields in the group's store and reads the others' (no collective: safe in a
    continuation). A rank that does not put them within :data:`NAME_WAIT_S` is named absent."""
    members = membership.of(group)
    store, ranks = members.store, members.ranks
    prefix = f"hhook/named/{members.instance}/{members.name}/{number}/"
    words, keys = encode(fields), [f"{prefix}{r}" for r in range(len(ranks))]
    try:
        store.set(keys[members.rank], struct.pack(f"<{WORDS}q", *words))
        deadline = time.monotonic() + NAME_WAIT_S
        while not store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.02)
        rows = [list(struct.unpack(f"<{WORDS}q", store.get(k))) if store.check([k]) else [0, 0] for k in keys]
    except Exception as exc:  # noqa: BLE001 - the store's host is gone or stalled
        return members.store_failed(exc, what)
    return ConfigMismatchError(_differences(rows, ranks, what))


def _differences(rows: list, ranks: list[int], what: str) -> str:
    """Each field whose value is not every rank's, with each rank's value."""
    tables = [decode(row) for row in rows]
    names = list(dict.fromkeys(name for table in tables for name in table))
    said = []
    for name in names:
        values = [table.get(name, "(absent)") for table in tables]
        if len(set(map(repr, values))) > 1:
            by_value: dict = {}
            for rank, value in zip(ranks, values):
                by_value.setdefault(repr(value), []).append(rank)
            said.append(f"{name}: " + ", ".join(f"{v} on {_said(r)}" for v, r in by_value.items()))
    if not said:  # the digests differ, the fields do not: hhooks of other handshake protocols
        said.append("the encoding of the fields (ranks run different versions of hhook)")
    return (f"hhook: the ranks differ in {what}: " + "; ".join(said) + ". Every rank must run hhook with the "
            "same options (and load checkpoints saved with them), the same hhook version, and call it on tensors "
            "of the same length and dtype.")


def _said(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def _verb(ranks: list[int], singular: str) -> str:
    return singular if len(ranks) == 1 else {"runs": "run", "does": "do", "is": "are", "it": "they"}[singular]


def _arrive(group, what: str) -> None:
    """Step 1: wait in the group's store until every rank of ``group`` has arrived at this
    handshake (at most the group's timeout); else raise, naming who did and who did not:
    :class:`~hhook.errors.PeerLostError` at once for a rank whose process ended (its
    liveness connection closed), :class:`~hhook.errors.PeerTimeoutError` at the timeout
    for one that is silent there too (stopped), :class:`~hhook.errors.ConfigMismatchError`
    for one that runs elsewhere. A store that fails raises hhook's error too."""
    members = membership.of(group)
    store, ranks = members.store, members.ranks
    key = (members.instance, members.name)
    with _lock:
        n = _arrivals.get(key, 0)
        _arrivals[key] = n + 1
    prefix = f"hhook/handshake/{key[0]}/{n}/"
    rank, world, timeout = members.rank, members.size, members.timeout
    deadline = time.monotonic() + timeout.total_seconds()
    gone = members.ended(ranks)
    if gone:  # before any store call: the store's host may be among them
        raise _lost(gone, f"before {what}")
    pause = FIRST_LOOK_S
    try:
        store.set(f"{prefix}{rank}", "1")
        if store.add(f"{prefix}count", 1) == world:
            store.set(f"{prefix}all", "1")
        # Polled, not waited on: a store wait that times out logs a warning each time.
        while not store.check([f"{prefix}all"]):
            if time.monotonic() >= deadline:  # first: a rank that ran something else may end with its own timeout
                gone = {}
                break
            gone = {g: how for g, how in members.ended(ranks).items() if not store.check([f"{prefix}{ranks.index(g)}"])}
            if gone:
                break
            time.sleep(pause)
            pause = min(LOOK_S, 2 * pause)
        else:
            return
        here = [r for r in range(world) if store.check([f"{prefix}{r}"])]
    except Exception as exc:  # noqa: BLE001 - the store's host is gone or stalled
        raise members.store_failed(exc, what) from exc
    came, missing = [ranks[r] for r in here], [ranks[r] for r in range(world) if r not in here]
    if gone:
        raise _lost(gone, f"before reaching {what}, where {_said(came)} waited")
    stopped = members.quiet(missing)
    if stopped:
        raise PeerTimeoutError(
            f"hhook: {_said(stopped)} of this group did not reach {what} within the group's timeout "
            f"({timeout.total_seconds():g} s), while {_said(came)} did, and {_verb(stopped, 'is')} silent: "
            f"{_verb(stopped, 'it')} stalled (stopped, swapping, or stuck). Set the timeout with "
            "hhook.init_distributed(timeout_s=...) or torch.distributed.init_process_group(timeout=...).")
    raise ConfigMismatchError(
        f"hhook: {_said(missing)} of this group did not reach {what} within the group's timeout "
        f"({timeout.total_seconds():g} s), while {_said(came)} did: {_said(came)} {_verb(came, 'runs')} hhook here "
        f"and {_said(missing)} {_verb(missing, 'does')} not. Every rank must run hhook alike: hhook.register (or hhook.fsdp.register) on "
        "every rank's model, and the same hhook calls in the same order; a rank that runs DDP without hhook or "
        "with another comm hook never reaches it (that rank's own collective then fails when this one ends)."
    )


def _lost(gone: dict, when: str) -> PeerLostError:
    """The error for the ranks ``gone`` (``{rank: how}``, :func:`liveness.ended`)."""
    said = "; ".join(liveness.said(r, how) for r, how in sorted(gone.items()))
    return PeerLostError(f"hhook: {said}, {when}: the job cannot go on with this group; restart it (from a checkpoint)")
