"""Byte and call counters, one definition for every integration (DDP hook, thc_allreduce,
Horovod, FSDP)."""

from __future__ import annotations

import threading

#: ``dense_bytes``: what the same calls would have sent as float32 (sparse and float64
#: tensors: their own size). ``wire_bytes``: what was handed to collectives.
#: ``compressed_calls``/``dense_calls``: tensors sent as codes / exactly.
#: ``local_calls``: calls in a world of one rank (nothing sent). ``nonfinite_calls``:
#: tensors that came back NaN because some rank's held inf/NaN.
FIELDS = ("dense_bytes", "wire_bytes", "compressed_calls", "dense_calls", "local_calls", "nonfinite_calls")


class Counters:
    """Thread-safe counters (continuations count from the process group's threads): the
    bytes and calls of :data:`FIELDS`, and ``calls``, the number of the next call, which
    selects its rounding stream (never reset: no two calls of a run may draw the same
    stream). A ``bits="auto"`` width shares its parent's (:mod:`hhook.decision.widths`)."""

    def __init__(self, saved: dict | None = None):
        self._lock = threading.Lock()
        self.calls = 0
        self.load_state_dict(saved or {})

    def next_call(self) -> int:
        """A number no earlier call counted here had."""
        with self._lock:
            self.calls += 1
            return self.calls - 1

    def add(self, kind: str | None, dense_bytes: int = 0, wire_bytes: int = 0) -> None:
        """One call of ``kind`` (None: bytes that are not a call, e.g. a handshake)."""
        with self._lock:
            if kind is not None:
                self._values[kind] += 1
            self._values["dense_bytes"] += dense_bytes
            self._values["wire_bytes"] += wire_bytes

    def snapshot(self) -> dict:
        """The counters and ``ratio`` (dense over wire bytes; NaN before any traffic)."""
        with self._lock:
            s = dict(self._values)
        s["ratio"] = s["dense_bytes"] / s["wire_bytes"] if s["wire_bytes"] else float("nan")
        return s

    def reset(self) -> None:
        with self._lock:
            self._values = dict.fromkeys(FIELDS, 0)

    def state_dict(self) -> dict:
        with self._lock:
            return dict(self._values)

    def load_state_dict(self, saved: dict) -> None:
        with self._lock:
            self._values = dict.fromkeys(FIELDS, 0)
            self._values.update({k: v for k, v in saved.items() if k in self._values})

    def __getstate__(self):
        return self.state_dict()

    def __setstate__(self, saved):
        self.__init__(saved)  # (an older hhook's pickle: the call number is the state's, loaded with it)


def two_level_stats(inter_stats: dict, intra: Counters, parent: dict | None = None) -> dict:
    """One ``stats()`` dict for a two-level state, from the inter state's ``stats()``, the
    ``intra_stats`` counters and (``parent``) the counters of calls that went over the
    whole parent group (DDP's plain iterations before ``start_iter``): the call counts and
    ``dense_bytes`` of the whole tensors; ``wire_bytes`` = ``inter_wire_bytes``, what may
    cross nodes (the shards' codes and scales, handshakes, exact allreduces);
    ``intra_wire_bytes``, what was handed to the collectives inside the node; ``ratio``,
    dense over inter-node bytes. ``inter_calls`` counts the shards' THC calls."""
    mine = intra.snapshot()
    parent = parent or {}
    out = dict(inter_stats)
    out["inter_calls"] = inter_stats.get("compressed_calls", 0)
    for name in ("dense_bytes", "compressed_calls", "dense_calls", "local_calls", "nonfinite_calls"):
        out[name] = mine[name] + parent.get(name, 0)
    out["intra_wire_bytes"] = mine["wire_bytes"]
    out["inter_wire_bytes"] = inter_stats["wire_bytes"] + parent.get("wire_bytes", 0)
    out["wire_bytes"] = out["inter_wire_bytes"]
    out["ratio"] = out["dense_bytes"] / out["inter_wire_bytes"] if out["inter_wire_bytes"] else float("nan")
    return out
