r"""THCState's checkpoint: one plain representation for ``state_dict()`` and pickling,
and the node layout a state runs on, compared with the one its checkpoint was saved with.

Everything a resumed run needs, as tensors, numbers, strings, tuples, lists and dicts, so
``torch.load(..., weights_only=True)`` reads it: the options, the counters, every key's
residual and predicted scales (per scale policy), the two-level ``inter`` state, the
node layout and rank it was saved with, and ``bits="auto"``'s decision and widths. The
keys and their meaning are :data:`STATE_FORMAT` 1; files and pickles written by earlier
hhooks load (tests/state/test_fixtures.py).
"""

from __future__ import annotations

import copy
import logging

import torch.distributed as dist

from ..codec import CODEC_VERSION
from ..codec.error_model import auto_bits
from ..schedule import load_check, membership
from ..schedule.topology import Topology, TopologyError, detect_topology, flat_topology
from ..stats import Counters
from . import report
from .keys import KeyStore, drop_residuals, start_afresh
from .options import NAMES, Options
from .validate import STATE_FORMAT, checked

logger = logging.getLogger(__name__)


class Checkpointed:
    """:class:`~hhook.state.THCState`'s checkpoint and node layout: a base class of it, so
    these are the state's own methods, kept beside the format they write."""

    __slots__ = ()

    def state_dict(self) -> dict:
        """Everything a resumed run needs, as plain data (tensors, numbers, strings,
        tuples, lists, dicts), so ``torch.load(..., weights_only=True)`` loads it: the
        options, counters, every key's residual and predicted scales (per scale policy),
        the two-level ``inter`` state, the node layout and ``bits="auto"``'s decision (with
        its reductions in flight read in: saving changes nothing) and widths.
        ``torch.save(state)`` pickles this same dict. The process group is not saved.

        Example::
            >>> ckpt = {"model": model.state_dict(), "hhook": state.state_dict()}
            >>> state.load_state_dict(torch.load(path, weights_only=True)["hhook"])
        """
        runtime = self.runtime
        saved = {"format": STATE_FORMAT, "codec_version": CODEC_VERSION,
                 "layout": runtime.topo.record() if runtime.topo is not None else self.restored[0],
                 "origin": None if not dist.is_initialized() and membership.registered(self.process_group) else {
                     "rank": membership.of(self.process_group).rank, "world_size": membership.of(self.process_group).size}}
        saved.update(self.options.as_dict())
        decision = self.decision
        if self.prober is not None and decision is not None and not isinstance(decision, dict):
            decision = self.prober.checkpoint(decision)
        elif hasattr(decision, "state_dict"):
            decision = decision.state_dict()
        saved.update({
            "policies": self.keys.state_dict(), "iter": self.iter, "calls": self.counters.calls,
            "_stats": self.counters.state_dict(), "inter": None if self.inter is None else self.inter.state_dict(),
            "_intra": self.intra_counters.state_dict(), "decision": decision,
            "variants": {bits: width.state_dict() for bits, width in self.variants.items()},
        })
        return saved

    __getstate__ = state_dict  # as PowerSGDState: the process group is not pickled

    def load_state_dict(self, saved: dict, *, announce: bool = True) -> None:
        """Continue from :meth:`state_dict` (or an older hhook's pickled state): options,
        counters and per-key state are replaced (``announce``: one log line names the
        options that change); the state's process group and the model
        :func:`hhook.register` gave it stay. The next exchange runs the options handshake
        again (:mod:`hhook.schedule.handshake`): ranks that loaded checkpoints of other
        options raise :class:`~hhook.errors.ConfigMismatchError` there, on every rank.
        Where one rank's DDP hook state loads and another's does not (at a fixed width or
        ``bits="auto"``, flat or two-level, before ``start_iter`` as after it), every rank
        raises it at that next exchange, naming each rank's options, instead of waiting in
        the handshake (:mod:`hhook.schedule.load_check`); so does an FSDP2 state at its
        next all-gather or reduce-scatter (``bits="auto"`` too, on the host). Per-key state that
        cannot describe this run starts afresh with one log line: a checkpoint of another
        node layout or world size (compared when the layout is found, or now if it is
        known) or of another codec version; another rank's residuals. A component missing
        from ``saved`` (saved before it existed) keeps its value. A malformed ``saved`` (a
        field of the wrong type, range or shape) raises ``ValueError`` naming the field and
        changes nothing (:mod:`~hhook.state.validate`)."""
        checked(saved, self.options, self.decision)  # the whole of it, before any change
        options = Options(**{name: saved.get(name, getattr(self.options, name)) for name in NAMES})  # before any change
        changed = [f"{name} {getattr(self.options, name)!r} -> {getattr(options, name)!r}" for name in NAMES
                   if getattr(options, name) != getattr(self.options, name)]
        if changed and announce:
            logger.warning("hhook: the checkpoint's THC options replace this state's: %s", ", ".join(changed))
        topo = self.runtime.topo
        if self.pending_load is not None:  # loaded again: the next exchange asks again whether every rank did
            self.pending_load.some = False
        elif self.runtime.agreed and _exchange_known(self):  # a load on some ranks only is found there
            shadow = shadow_of(self) if self.options.bits == "auto" else None  # the decision every rank runs
            self.pending_load = load_check.kept(self.contexts.get((None, None)), self.iter, shadow,
                                               saved_layouts(self))
        else:  # FSDP2's exchanges on its shard groups (bits="auto": its decision's, run on the shadow)
            self.pending_load = load_check.kept_shards(
                {group: self.context(group, "agreed") for group, runtime in self.runtimes.items() if runtime.agreed},
                (lambda: shadow_of(self)) if self.options.bits == "auto" else None)
        self.reset_runtime()
        self.restored = (saved.get("layout"), saved.get("origin"))
        self.options = options
        version = saved.get("codec_version", 0)  # 0: saved before hhook recorded its codec's version
        if version != CODEC_VERSION:  # nothing computed with other bits is loaded (its parts not either)
            saved = {k: v for k, v in saved.items() if k not in ("policies", "inter", "decision", "variants")}
            start_afresh(self, f"it was saved by codec version {version}, this hhook's is {CODEC_VERSION}: the same "
                         "words decode to other bits")
        _load_components(self, saved)
        if self.variants:
            merge_call_counters(self)  # a checkpoint of one counter per width
        if topo is not None:
            adopt_layout(self, topo)

    def __setstate__(self, saved: dict) -> None:
        """Every slot at its default, then :meth:`load_state_dict` of what ``__getstate__``
        returned, or of the dict an hhook before ``state_dict()`` pickled (its live
        objects included)."""
        type(self).__init__(self)
        if "format" not in saved:
            if saved.get("scales", "auto") == "auto":  # saved before there was a choice, or with "auto"
                saved["scales"] = "agreed"
            saved.setdefault("chunk_mb", 0)  # saved before tensors were split
            saved.setdefault("rounding", "independent")  # saved before there was a choice: what it ran
            if "residuals" in saved or "predicted" in saved:
                saved.pop("residuals", None)
                saved.pop("predicted", None)
                logger.warning("hhook: a THCState saved by an older hhook: its residuals and predicted scales "
                               "start afresh")
        self.load_state_dict(saved, announce=False)

    def node_layout(self) -> Topology:
        """The node layout of ``process_group`` under the ``topology`` option, found once.
        The first call (on every rank, at the same point of the program: it may create
        process groups) runs :func:`~hhook.schedule.topology.detect_topology` (one small
        all-gather, also for ``"flat"``, so ranks that disagree fail together) and
        :func:`adopt_layout`. Raises :class:`~hhook.schedule.topology.TopologyError` on
        every rank alike."""
        if self.runtime.topo is None and not membership.registered(self.process_group):
            if self.options.topology != "flat":
                raise ValueError("hhook: two-level THC (topology=...) needs a torch.distributed group; "
                                 f"{self.process_group.name!r} is not one: use topology='flat'")
            members = self.process_group
            adopt_layout(self, flat_topology(members.size, members.rank, "a group torch.distributed does not know",
                                             members))
        if self.runtime.topo is None:
            if not dist.is_initialized():
                raise RuntimeError("hhook: torch.distributed is not initialized (see hhook.init_distributed)")
            adopt_layout(self, detect_topology(self.process_group, ranks_per_node=self.options.topology))
        return self.runtime.topo


def _exchange_known(state) -> bool:
    """Whether every rank's next exchange, under the options every rank verified, is known
    to a rank that loads a checkpoint now (:mod:`hhook.schedule.load_check`): a DDP hook's
    (its plain allreduce before ``start_iter``, THC at the fixed width, or under
    ``bits="auto"`` the decision's, run on :func:`shadow_of`; a resumed run's first
    iteration splits its buckets into the keys :func:`saved_layouts` finds now), or a
    ``thc_allreduce`` call's at a fixed width (a state :func:`hhook.register` did not take)."""
    return state.registration is not None or state.options.bits != "auto"


def saved_layouts(state) -> dict:
    """Bucket index -> the parameters a checkpointed key of that bucket holds, from every
    state that keys DDP buckets: this one, or two-level its shards' state, and each
    ``bits="auto"`` width (one width that ran tells the layout of every width): how a
    resumed run's first iteration splits DDP's initial buckets
    (:func:`hhook.ddp_hook._before_rebuild`)."""
    saved: dict = {}
    for owner in (state, *state.variants.values()):
        holder = owner.inter if owner.inter is not None else owner  # two-level: the shards' state holds the keys
        for policy in holder.keys.policies.values():
            for key, key_state in policy.keys.items():
                top = key[0] if isinstance(key, tuple) and len(key) == 2 and isinstance(key[1], int) else key
                if isinstance(top, int) and not isinstance(top, bool) and key_state.layout is not None:
                    saved.setdefault(top, key_state.layout)
    return saved


def shadow_of(state):
    """``state`` as every rank verified it, for a ``bits="auto"`` DDP hook state that loads
    a checkpoint (:class:`~hhook.schedule.load_check.Loaded`'s ``shadow``): its options,
    group runtime, decision (a copy: a live one continues in place on load) and clock
    (:class:`hhook.decision.Prober`, its reductions in flight), and copies of its widths
    (a width bound to the group keeps its contexts and, two-level, its ring's handshake;
    another is bound again on first use, :func:`hhook.decision.widths.variant`).
    Its exchanges count, and draw call numbers, in counters of its own, so the state that
    loaded trains on as if they had not run (a resume stays bit for bit)."""
    shadow = _apart(state, Counters(), Counters())
    shadow.pending_load = None
    shadow.decision = copy.deepcopy(state.decision)
    shadow.variants = {}
    for bits, width in state.variants.items():
        if width.runtime is state.runtime:
            shadow.variants[bits] = _apart(width, shadow.counters, shadow.intra_counters)
        else:
            shadow.variants[bits] = _slot_copy(width)
            shadow.variants[bits].runtime = None
    return shadow


def _apart(state, counters: Counters, intra: Counters):
    """A copy of ``state`` counting in ``counters`` and ``intra``, its contexts too, and its
    ring's state (two-level) in counters of its own: its runtime, options and keys shared."""
    other = _slot_copy(state)
    other.counters, other.intra_counters = counters, intra
    other.contexts = {k: load_check.own_counters(ctx, counters) for k, ctx in state.contexts.items()}
    if state.inter is not None:
        other.inter = _apart(state.inter, Counters(), Counters())
    return other


def _slot_copy(state):
    """A shallow copy of a THCState's slots (``copy.copy`` would go through its checkpoint)."""
    other = object.__new__(type(state))
    for slot in type(state).__slots__:
        if slot != "__weakref__":
            setattr(other, slot, getattr(state, slot))
    return other


def _load_components(state, saved: dict) -> None:
    if "policies" in saved:
        state.keys = KeyStore.from_saved(saved["policies"])
    if "iter" in saved:
        state.iter = saved["iter"]
    for key, slot in (("_stats", "counters"), ("_intra", "intra_counters")):
        if key in saved:  # counters load in place; an older hhook pickled the object itself
            if isinstance(saved[key], Counters):
                setattr(state, slot, saved[key])
            else:
                getattr(state, slot).load_state_dict(saved[key])
    if "calls" in saved:
        state.counters.calls = saved["calls"]
    if "inter" in saved:
        inter = saved["inter"]
        state.inter = loaded(type(state), inter) if isinstance(inter, dict) else inter
    if "decision" in saved:
        decision = saved["decision"]
        if isinstance(decision, dict) and hasattr(state.decision, "load_state_dict"):
            state.decision.load_state_dict(decision)  # a live Decision (hhook.decision) continues
        else:
            state.decision = decision  # plain data until hhook.decision restores it
    if "variants" in saved:
        state.variants = {bits: width if isinstance(width, type(state)) else loaded(type(state), width)
                          for bits, width in saved["variants"].items()}


def loaded(cls, saved: dict):
    """A state built from a :meth:`~Checkpointed.state_dict` (a component: not reported idle)."""
    state = cls()
    report.covered_by_parent(state)
    state.load_state_dict(saved, announce=False)
    return state


def merge_call_counters(state) -> None:
    """After loading: a checkpoint of an hhook before the shared counter holds one counter
    per width. The parent's (and its ``inter`` state's) then continues above all of them,
    so no stream already drawn is drawn again; the widths' own counters are unused."""
    for parent, widths in ((state, list(state.variants.values())),
                           (state.inter, [v.inter for v in state.variants.values() if v.inter is not None])):
        if parent is None or not widths:
            continue
        parent.counters.calls = max([parent.counters.calls] + [w.counters.calls for w in widths])
        for w in widths:
            w.counters.calls = 0


def adopt_layout(state, topo: Topology) -> None:
    """Use ``topo`` as ``state``'s node layout (:meth:`Checkpointed.node_layout` finds it):
    compare it with a checkpoint's layout and rank, build or reattach ``state.inter``.

    A checkpoint of another layout (another world size: an elastic restart with fewer
    or more ranks; other nodes) starts its per-key state afresh with one log line; one
    saved by another rank of the same layout keeps its scales (the same on every rank)
    but not its residuals (that rank's own rounding errors)."""
    saved_layout, saved_origin = state.restored
    try:
        topo.check_record(saved_layout)
    except TopologyError as exc:
        start_afresh(state, str(exc).split(". Per-shard", 1)[0].replace("hhook: the checkpoint", "the checkpoint"))
    else:
        if saved_origin is not None and saved_origin.get("rank") != topo.rank and drop_residuals(state):
            logger.warning("hhook: this rank (%d) loaded the THC state of rank %s: its error-feedback residuals "
                           "start afresh (save every rank's state to keep them)", topo.rank, saved_origin.get("rank"))
    state.restored = (None, None)
    if topo.two_level:
        if state.inter is None:
            o = state.options
            bits = auto_bits(topo.n_nodes, topo.ranks_per_node, rounding=o.rounding) if o.bits == "auto" else o.bits
            state.inter = type(state)(topo.inter_group, bits, o.block_size, o.seed, o.error_feedback, o.start_iter,
                                      o.scales, o.chunk_mb, rounding=o.rounding)
            report.covered_by_parent(state.inter)
        else:  # restored from a checkpoint of the same layout
            state.inter.process_group = topo.inter_group
    elif state.inter is not None:
        raise TopologyError("hhook: this THCState holds two-level state but the layout found is flat")
    state.runtime.topo = topo
