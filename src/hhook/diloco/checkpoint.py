r"""What :meth:`hhook.diloco.DiLoCo.load_state_dict` accepts: the whole checkpoint checked
before anything is touched, so a bad one raises ``ValueError`` naming what is wrong and
leaves the synchronizer as it was (a hand-edited dict, another run's checkpoint, a
truncated file), instead of failing half-way or, later, on one rank while the others wait.
"""

from __future__ import annotations

import hashlib

import torch

#: Version of :meth:`DiLoCo.state_dict`'s layout.
STATE_FORMAT = 1
_KEYS = ("format", "options", "position", "syncs", "outer", "outer_optimizer", "thc", "counters", "pending")


def model_digest(shards: list[torch.Tensor]) -> int:
    """62 bits of this rank's shards of the model's parameters: what a checkpoint expects
    the model to hold when the synchronizer starts (the model's checkpoint loaded)."""
    h = hashlib.sha1()
    for t in shards:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return int.from_bytes(h.digest()[:8], "little") >> 2


def _bad(what: str) -> ValueError:
    return ValueError(f"hhook.diloco: not a DiLoCo.state_dict() of this run (nothing was loaded): {what}")


def _count(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _bad(f"{what} must be a non-negative integer, got {value!r}")
    return value


def _shard(value, length: int, what: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dim() != 1 or value.dtype != torch.float32 or len(value) != length:
        said = f"a {value.dtype} tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else repr(type(value))
        raise _bad(f"{what} must be a 1-D float32 tensor of {length} values, got {said}")
    return value


def validated(saved, options: dict, lengths: list[int], offsets: list[int], has_thc: bool) -> dict:
    """``saved`` checked against this run (its ``options``, shard ``lengths`` and
    fragment ``offsets``): types, lengths, the inner-step counts of the exchanges in flight.
    Raises ``ValueError`` naming the first fault; returns ``saved`` with its pending
    exchanges keyed by int."""
    if not isinstance(saved, dict) or saved.get("format") != STATE_FORMAT:
        raise _bad(f"its format is not {STATE_FORMAT}")
    missing = [k for k in _KEYS if k not in saved]
    if missing:
        raise _bad(f"it lacks {missing}")
    if not isinstance(saved["options"], dict):
        raise _bad("options must be a dict")
    differ = {k: (v, saved["options"].get(k, "(absent)")) for k, v in options.items() if saved["options"].get(k, "(absent)") != v}
    if differ:
        raise ValueError(f"hhook.diloco: the checkpoint was saved with other options (this run, checkpoint: {differ})")
    position = _count(saved["position"], "position")
    _count(saved["syncs"], "syncs")
    if not isinstance(saved["outer"], (list, tuple)) or len(saved["outer"]) != len(lengths):
        raise _bad(f"outer must be a list of {len(lengths)} shards")
    for p, (t, n) in enumerate(zip(saved["outer"], lengths)):
        _shard(t, n, f"the outer shard of fragment {p}")
    groups = saved["outer_optimizer"].get("param_groups") if isinstance(saved["outer_optimizer"], dict) else None
    if not isinstance(groups, list) or len(groups) != 1 or not isinstance(saved["outer_optimizer"].get("state"), dict):
        raise _bad("outer_optimizer must be an optimizer's state_dict with one param group")
    if has_thc != isinstance(saved["thc"], dict) or not (has_thc or saved["thc"] is None):
        raise _bad("thc must be THC's state_dict (bits set) or None (an fp32 exchange)")
    if not isinstance(saved["counters"], dict) or not all(isinstance(v, int) for v in saved["counters"].values()):
        raise _bad("counters must be a dict of integers")
    if not isinstance(saved["pending"], dict):
        raise _bad("pending must be a dict")
    pending = {}
    every = options["every"]
    for key, e in saved["pending"].items():
        p = key if isinstance(key, int) and not isinstance(key, bool) else -1
        if not 0 <= p < len(lengths) or not isinstance(e, dict):
            raise _bad(f"pending names fragment {key!r} of {len(lengths)}")
        launched, merge = _count(e.get("launched_at"), "launched_at"), _count(e.get("merge_at"), "merge_at")
        if launched % every != offsets[p] or merge != launched + options["overlap"] or not launched <= position < merge:
            raise _bad(f"fragment {p}'s exchange in flight (launched after inner step {launched}, merged after {merge}) "
                       f"does not fit the schedule at inner step {position}")
        _shard(e.get("mean"), lengths[p], f"the mean in flight of fragment {p}")
        _shard(e.get("snap"), lengths[p], f"the local shard at the launch of fragment {p}")
        pending[p] = e
    if saved.get("model") is not None and not isinstance(saved["model"], int):
        raise _bad("model must be an integer digest")
    return dict(saved, pending=pending)


def loaded_outer(saved: dict, factory, thc) -> tuple:
    """The outer shards of ``saved`` (:func:`validated`) and a new outer optimizer over
    them with its state loaded, and THC's state loaded into ``thc`` (restored as it was
    where that raises): what :meth:`DiLoCo.load_state_dict` assigns, so a failure leaves
    the synchronizer as it was."""
    outer = [t.detach().clone() for t in saved["outer"]]
    optimizer = factory(outer)
    optimizer.load_state_dict(saved["outer_optimizer"])
    if thc is not None:
        before = thc.state_dict()
        try:
            thc.load_state_dict(saved["thc"])
        except Exception:
            thc.load_state_dict(before)
            raise
    return outer, optimizer
