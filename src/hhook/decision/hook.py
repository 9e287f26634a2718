r"""``bits="auto"`` in the DDP hook: the state's decision, and each bucket reduced by the
method the decision gives its iteration, timed by the state's :class:`~hhook.decision.Prober`."""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.distributed as dist

from ..codec.error_model import auto_bits
from ..schedule import load_check
from ..schedule.dense import cast_allreduce, dense_allreduce
from ..schedule.topology import TopologyError, node_census
from ..state import THCState, report
from .decision import Decision
from .methods import BF16, GATHERED_MAX_RANKS, PLAIN, candidates, mode_of, thc_bits, wire_bits
from .prober import Prober
from .widths import release_other_widths, variant

logger = logging.getLogger(__name__)

#: ``bits="auto"`` with every rank on one host exchanging CPU tensors: ``"skip"`` (the
#: default) installs no hook, ``"measure"`` measures as on several hosts.
ONE_HOST_ENV = "HHOOK_AUTO_ONE_HOST"
_ONE_HOST_MODES = ("skip", "measure")  # (the flags of one_host's record know them too)


class NotMeasured:
    r"""``state.decision`` of a ``bits="auto"`` state whose :func:`hhook.register` installed
    no hook (:func:`one_host`): DDP's own fp32 allreduce runs, without Python. ``stats()``
    reports it (:meth:`summary`). Its checkpoint (``{"not_measured": reason, "kept": ...}``)
    keeps what the state held before (``kept``: a :class:`Decision`'s plain data, or None),
    so loading it into this state keeps the report, and a run resumed on several hosts
    continues that decision or starts one afresh (:func:`live_decision`)."""

    def __init__(self, reason: str, kept=None):
        self.reason = reason
        self.kept = _measured(kept)

    def summary(self) -> dict:
        return {"method": PLAIN, "phase": "not measured", "choice": PLAIN, "hook": None, "reason": self.reason,
                "decisions": []}

    def state_dict(self) -> dict:
        return {"not_measured": self.reason,
                "kept": self.kept.state_dict() if hasattr(self.kept, "state_dict") else self.kept}

    def load_state_dict(self, saved) -> None:
        self.kept = _measured(saved)


def _measured(decision):
    """The measuring decision (or its plain data, or None) that ``decision`` holds."""
    if isinstance(decision, NotMeasured):
        return decision.kept
    if isinstance(decision, dict) and "not_measured" in decision:
        return decision["kept"]
    return decision


def one_host(state: THCState, ddp_model) -> str | None:
    """Why ``hhook.register`` should install nothing for ``bits="auto"``, or None to
    measure. Nothing is installed when every rank of the state's group is on one node
    (:mod:`hhook.schedule.topology`'s detection: the launcher's node index, else the
    hostname) and holds its parameters in host memory: the exchange crosses no network
    (Gloo over loopback or shared memory), so no candidate can beat DDP's own fp32
    allreduce, and measuring them costs steps. GPUs on one host keep measuring (without
    NVLink their exchange crosses PCIe, where compression may pay), and so does a state
    whose ``topology`` makes nodes of the ranks. ``HHOOK_AUTO_ONE_HOST=measure`` on any
    rank measures anyway. A collective: one all-gather of every rank's
    node record with its flags, so every rank reaches the same answer."""
    mode = os.environ.get(ONE_HOST_ENV, "skip")
    group = state.process_group
    # This rank's flags: 1 its parameters are all on the CPU, 2 it asked to measure, 4 its
    # HHOOK_AUTO_ONE_HOST is not a mode (every rank raises, after the gather).
    on_cpu = all(p.device.type == "cpu" for p in ddp_model.parameters())
    flag = int(on_cpu) | {"skip": 0, "measure": 2}.get(mode, 4)
    try:
        nodes, source, flags = node_census(group, flag)
    except TopologyError:  # launcher variables that describe no layout: measure, as before
        nodes, source, flags = None, None, None
    if flags is not None and any(f & 4 for f in flags):
        bad = [rank for rank, f in enumerate(flags) if f & 4]
        raise ValueError(f"hhook: {ONE_HOST_ENV} must be one of {_ONE_HOST_MODES} on every rank; ranks {bad} have "
                         f"another value (this rank's: {mode!r})")
    if nodes is None or len(nodes) != 1 or not all(f == 1 for f in flags) or state.node_layout().two_level:
        return None  # (two-level: the state's topology says nodes, e.g. ranks_per_node=K)
    how = {"hostname": "their hostnames"}.get(source, "the launcher's variables")
    return (f"bits='auto': all {len(flags)} ranks run on one host (by {how}) with CPU tensors, so no "
            "gradient crosses a network and no compressed or narrower exchange can beat DDP's own fp32 allreduce: "
            f"no hook is installed (measuring the candidates would only cost steps). {ONE_HOST_ENV}=measure "
            "measures anyway; bits=N always compresses")


_said_one_host: list = []  # whether this process said it at WARNING already


def skip_measuring(state: THCState, reason: str) -> None:
    """Leave ``state`` as :func:`hhook.register` returns it when it installs nothing:
    ``state.decision`` says so (:class:`NotMeasured`), one log line on rank 0 (WARNING
    the first time in the process: the user asked for compression and gets none, so it
    must show at the default log level; INFO after), and no idle warning at exit (no
    tensor goes through it, by design)."""
    state.decision = NotMeasured(reason, state.decision)
    state.prober = None
    report.LIVE.discard(state)
    if dist.get_rank(state.process_group) == 0:
        logger.log(logging.INFO if _said_one_host else logging.WARNING, "hhook: %s", reason)
        _said_one_host.append(True)


def live_decision(state: THCState) -> Decision:
    """``state.decision``: built on first use (:func:`new_decision`), or restored from the
    plain data a :meth:`THCState.load_state_dict` left there."""
    state.decision = _measured(state.decision)  # a state (or checkpoint) of a job that measured nothing
    if isinstance(state.decision, dict):
        state.decision = Decision.from_state_dict(state.decision)
    elif state.decision is None:
        state.decision = new_decision(state)
    return state.decision


def new_decision(state: THCState) -> Decision:
    """The decision of a ``bits="auto"`` state, its candidates sized by the node layout:
    THC from the auto rule's width for the node count (two-level) or the world size
    (flat) down, bf16, fp32; on a flat layout of at most :data:`GATHERED_MAX_RANKS` ranks
    with agreed scales, THC's one-round form (gathered scales) at that width too."""
    topo, options = state.node_layout(), state.options
    if topo.two_level and options.error_feedback:
        raise ValueError("hhook: bits='auto' with error_feedback=True on two-level layouts is not supported yet; "
                         "pass an integer bits= (THC always) or error_feedback=False")
    participants = topo.n_nodes if topo.two_level else topo.world_size
    width = auto_bits(participants, topo.ranks_per_node if topo.two_level else 1, rounding=options.rounding)
    gathered = not topo.two_level and participants <= GATHERED_MAX_RANKS and options.agreed_unless_gathered()
    names = candidates(width, gathered=gathered)
    return Decision(names, wire_bits=wire_bits(names, participants, options.block_size))


def reduce_bucket_as_decided(state: THCState, bucket, layout, split=None, changed=None) -> torch.futures.Future:
    """The DDP hook's ``bits="auto"`` path: the method of this iteration, timed and decided
    by :class:`Decision`, for one bucket. ``split(reduce)``: a resumed run's first
    iteration reduces the bucket as the saved keys it holds (``reduce(key, tensor,
    layout)`` is this iteration's exchange), or returns None for the usual path.
    ``changed``: ``state`` is the shadow of a state that loaded a checkpoint
    (:func:`hhook.state.checkpoint.shadow_of`), and the exchange says so
    (:func:`_reduce_as`), or returns None where it cannot, nothing launched."""
    buffer = bucket.buffer()
    prober = state.prober
    if prober is None:
        prober = state.prober = Prober()
    if not prober.verified:
        prober.verify(state, state.decision, buffer.device)
    if prober.first:
        prober.method = prober.begin(state, state.decision, state.iter, plain=state.iter < state.options.start_iter)
    prober.first = bucket.is_last()
    reduce = functools.partial(_reduce_as, prober.method, state, changed=changed)
    fut = split(reduce) if split is not None else None
    if fut is None:
        fut = reduce(bucket.index(), buffer, layout)
        if fut is None:  # a mark this exchange cannot carry
            return None
    if bucket.is_last():
        prober.launch(state, state.decision, state.iter, buffer.device)
    return fut


def _on_host(buffer: torch.Tensor) -> bool:
    """Whether a dense exchange of ``buffer`` carries the count of ranks that loaded a
    checkpoint (:func:`_reduce_as`): where the host reads it without waiting for a device."""
    return buffer.device.type == "cpu"


def _reduce_as(method: str, state: THCState, key: int, buffer: torch.Tensor, layout,
               changed=None) -> torch.futures.Future:
    """``buffer`` through ``method``. A rank that loaded a checkpoint since the handshake
    says so where every rank reads it (:mod:`hhook.schedule.load_check`): THC's exchange
    carries a mark (``changed``: filler marked :data:`~hhook.scales.message.CHANGED`), a
    dense one on the host the count of ranks that loaded
    (:func:`~hhook.schedule.dense.tallied_allreduce`: in its last element, no copy; a
    loading rank sends zeros). On a GPU a dense exchange carries none (its count would be
    read on the host, waiting for the device): with ``changed``, None, nothing launched."""
    bits, mode = thc_bits(method), mode_of(method, state.options.scales)
    if buffer.is_sparse:
        return dense_allreduce(state.context(), buffer)
    if changed is None and method != PLAIN:
        release_other_widths(state, key, buffer, keep=bits, mode=mode)
    if bits is not None:
        ctx = variant(state, bits).context(mode=mode)
        if changed is None:
            return ctx.schedule(ctx, buffer, key, layout)
        return load_check.filler(ctx, buffer, key, layout, changed)
    ctx = state.context()
    # bf16 holds the count of up to 256 marks exactly; beyond, the marked exchange is fp32's
    cast = torch.bfloat16 if method == BF16 and buffer.dtype == torch.float32 else None
    if _on_host(buffer):
        return load_check.plain(ctx, buffer, changed, cast if ctx.world_size <= 256 else None)
    if changed is not None:  # no mark on a device: the caller runs the handshake again, as without the check
        return None
    return cast_allreduce(ctx, buffer, cast) if cast is not None else dense_allreduce(ctx, buffer)
