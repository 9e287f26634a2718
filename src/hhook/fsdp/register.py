""":func:`register`, :func:`compress_all_gather` and :func:`all_gather_stats`: FSDP2's
comms set on every ``FSDPModule`` of a model (:mod:`hhook.fsdp`)."""

from __future__ import annotations

import logging

from . import all_gather as fsdp_all_gather
from . import auto as fsdp_auto
from .all_gather import AllGatherOptions, AllGatherState
from .modules import check_params, fsdp_modules, mesh_sizes, param_group
from .reduce_scatter import SCALES_REFUSED, THCReduceScatter
from ..schedule import handshake
from ..state import THCState

logger = logging.getLogger("hhook.fsdp")


def _all_gather_options(all_gather, seed: int) -> AllGatherOptions | bool | None:
    """``register``'s ``all_gather`` as :class:`AllGatherOptions` (a width), or as given."""
    if isinstance(all_gather, int) and not isinstance(all_gather, bool):
        return AllGatherOptions(bits=all_gather, seed=seed)
    if all_gather not in (None, False) and not isinstance(all_gather, AllGatherOptions):
        raise TypeError("hhook.fsdp.register: all_gather must be None, False, a width or AllGatherOptions, got "
                        f"{all_gather!r}")
    return all_gather


def _plan(module) -> list[tuple]:
    """``[(name, FSDPModule, param group, shard size, replicate size)]`` of the modules
    ``register`` compresses; raises before anything changes."""
    found = fsdp_modules(module)
    check_params(module)
    plan = []
    for name, m in found:
        group = param_group(m)
        if group is None:
            continue
        comm = getattr(group, "_reduce_scatter_comm", None)
        if comm is not None and type(comm).__name__ != "DefaultReduceScatter":
            raise ValueError(f"hhook.fsdp.register: {name} ({type(m).__name__}) already has a custom reduce-scatter "
                             f"({type(comm).__name__}); hhook cannot combine with it")
        shard, replicate = mesh_sizes(group)
        if shard is None:
            raise ValueError(f"hhook.fsdp.register: {name} is replicated without sharding (a mesh with only a "
                             "replicate dimension, FSDP2's replicate): it has no reduce-scatter to compress. Use "
                             "hhook.register on DDP, or shard it (fully_shard on a 1-D mesh, or register_hsdp for "
                             "shard + replicate)")
        plan.append((name, m, group, shard, replicate))
    return plan


class Registered:
    """``state.registration`` of a state :mod:`hhook.fsdp` registered: what its warning at
    exit says when no tensor went through it (:func:`hhook.state.advice.idle_state`)."""

    def __init__(self, advice: str):
        self.advice = advice


def register(module, state: THCState | None = None, *, all_gather: int | AllGatherOptions | bool | None = None,
             **options) -> THCState:
    """Compress FSDP2's gradient reduce-scatter of every ``FSDPModule`` in ``module``, and
    with ``all_gather`` (8, 6, 4 or :class:`AllGatherOptions`) its parameter all-gather
    (:mod:`hhook.fsdp.all_gather`; :func:`all_gather_stats`). ``options`` are
    :class:`hhook.THCState`'s, or pass ``state``; returns the state. 1-D meshes and native
    2-D HSDP meshes (whose replica all-reduce stays dense; :func:`register_hsdp`).

    ``bits="auto"`` (the default) measures the optimizer step with THC's reduce-scatter
    plus the compressed all-gather (``all_gather``'s width, 8 by default; ``False`` leaves
    it out), THC's reduce-scatter alone and plain FSDP2 in turns, and keeps the fastest
    (:mod:`hhook.fsdp.auto`; on 2-D meshes it compresses without measuring). A state
    loaded before (or pickled) continues its decision. An integer ``bits`` always
    compresses the reduce-scatter.

    Raises ``ValueError`` for a module without ``FSDPModule``, a reduce-scatter or
    all-gather already customised, a replicate-only mesh, ``scales`` other than ``"agreed"``,
    ``error_feedback=True`` or a bad width; ``TypeError`` for float64/complex parameters;
    ``ConfigMismatchError`` on every rank, naming what differs, when ranks differ in the
    state's options, the all-gather's, the parameters they would quantize or
    ``bits="auto"``, or when a rank does not register alike (the options handshake,
    blocking, once per shard group: :mod:`hhook.schedule.handshake`); ``RuntimeError``
    for a torch without ``set_custom_all_gather``. Modules the
    compressed all-gather cannot serve keep FSDP's, named in one log line (docs/fsdp.md).
    Nothing is changed on the model when it raises.
    """
    state = _state_of(state, options)
    _register(module, state, all_gather)
    return state


def _state_of(state: THCState | None, options: dict) -> THCState:
    if state is None:
        return THCState(**{"bits": "auto", **options})
    if options:
        raise TypeError("hhook.fsdp.register: pass either state or options, not both")
    return state


def _register(module, state: THCState, all_gather, decide_over=None, candidates=fsdp_auto.CANDIDATES):
    """:func:`register`; returns ``bits="auto"``'s :class:`~hhook.fsdp.auto.Switch` (None
    where it does not measure). ``decide_over``: the group whose ranks make its one
    decision (default: the shard group), between ``candidates`` (less ``rs+ag`` where
    ``all_gather`` is False)."""
    options = state.options
    if not options.agreed_unless_gathered():
        raise ValueError(SCALES_REFUSED[options.scales])
    if options.error_feedback:
        raise ValueError("hhook.fsdp.register does not support error_feedback (agreed scales are unbiased "
                         "without it)")
    all_gather = _all_gather_options(all_gather, options.seed)
    plan = _plan(module)
    decider = None
    if options.bits == "auto":
        measured = [c for c in candidates if all_gather is not False or c != fsdp_auto.BOTH]
        decider = fsdp_auto.decider(state, plan, measured, decide_over)
    if decider is not None and all_gather is None:
        all_gather = AllGatherOptions(seed=options.seed)  # the candidate's: 8 bits
    gather_state = None if all_gather in (None, False) else AllGatherState(all_gather)
    gathers, groups = fsdp_all_gather.plan([(name, m, group) for name, m, group, *_ in plan], gather_state)
    decision = ("decision", decider.digest() if decider else 0)
    for pg, digest in groups.values():  # one handshake per shard group, for the reduce-scatter and the all-gather
        state.agree(pg, "FSDP2", (decision,) + fsdp_all_gather.fields(gather_state, digest))
    switch = decider.switch if decider is not None else None
    for name, m, group, shard, replicate in plan:
        factor = group.gradient_divide_factor
        hsdp = replicate is not None
        m.set_custom_reduce_scatter(THCReduceScatter(state, name, factor, returns_sum=hsdp or factor is not None,
                                                     switch=switch))
        if shard == 1:
            continue  # FSDP never calls the comm in a shard group of one: leave its division alone
        m.set_force_sum_reduction_for_comms(True)
        if factor is None and not hsdp:
            m.set_gradient_divide_factor(1.0)
    if any(replicate is not None and replicate > 1 for *_, replicate in plan):
        logger.info("hhook.fsdp.register: native HSDP mesh: the reduce-scatter inside the shard group is "
                    "compressed, FSDP's replica all-reduce stays dense (register_hsdp compresses both)")
    if gather_state is not None:
        fsdp_all_gather.apply(gathers, switch)
    if decider is not None:
        decider.attach(module)
    state.registration = Registered(
        "It was registered by hhook.fsdp.register on an FSDP2 model, but no gradient reduce-scatter went through it: "
        "was another model trained, did training end before its first backward, or did every backward run with "
        "set_requires_gradient_sync(False)?")
    return switch


def compress_all_gather(module, bits: int = 8, **options) -> AllGatherState:
    """Compress only the parameter all-gather of every ``FSDPModule`` in ``module``
    (``options``: :class:`AllGatherOptions`' others); the reduce-scatter stays FSDP2's.
    Raises as :func:`register` does for the all-gather, before changing anything."""
    state = AllGatherState(AllGatherOptions(bits=bits, **options))
    entries = [(name, m, group) for name, m in fsdp_modules(module, "compress_all_gather")
               if (group := param_group(m)) is not None]
    gathers, groups = fsdp_all_gather.plan(entries, state)
    for pg, digest in groups.values():
        handshake.agree(pg, (("runs", "FSDP2 all-gather"),) + fsdp_all_gather.fields(state, digest), state.counters)
    fsdp_all_gather.apply(gathers)
    return state


def all_gather_stats(module) -> dict | None:
    """Bytes and calls of ``module``'s compressed all-gathers (``AllGatherState.stats``);
    None where its all-gather is not compressed."""
    state = fsdp_all_gather.find_state(module)
    return None if state is None else state.stats()
