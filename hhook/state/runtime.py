r"""How a THCState talks to its group, built on first use and never saved: the node
layout, the options handshake and the second communicators, the launch order of agreed
rounds, and the device checks read later.

A ``bits="auto"`` width shares its parent's runtime (:mod:`hhook.decision.widths`); the
inter-node state of a two-level layout has its own, over the nodes' ring.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from ..codec import warm_up
from ..codec.error_model import auto_bits
from ..errors import ConfigMismatchError
from ..schedule.groups import SecondGroup, agrees, explain
from ..schedule.sequencer import Sequencer
from ..schedule.topology import Topology, TopologyError, detect_topology
from .keys import drop_residuals, start_afresh

logger = logging.getLogger(__name__)


class GroupRuntime:
    """The transport pieces of one state. ``topo``: the node layout, once found;
    ``saved_layout``/``saved_origin``: the layout and rank a loaded checkpoint was saved
    with, compared when the layout is found; ``second``: device type -> the second
    communicator; ``verified``/``checked``: device types whose handshake ran on this
    group / over the whole group; ``sequencer``: the launch order of agreed rounds;
    ``pending``: device flags of decodes to read later; ``defer_on_cpu``: tests run the
    GPU's deferred checks on CPU tensors."""

    __slots__ = ("topo", "saved_layout", "saved_origin", "second", "verified", "checked", "sequencer", "pending",
                 "defer_on_cpu")

    def __init__(self):
        self.topo: Topology | None = None
        self.saved_layout, self.saved_origin = None, None
        self.second: dict[str, SecondGroup] = {}
        self.verified: set = set()
        self.checked: set = set()
        self.sequencer = Sequencer()
        self.pending: list = []
        self.defer_on_cpu = False

    def share_transport(self, other: "GroupRuntime") -> None:
        """Send on ``other``'s second communicators in ``other``'s launch order (a width's
        inter-node state on its parent's ring); handshakes stay this runtime's own."""
        self.second, self.sequencer = other.second, other.sequencer

    def second_group(self, device: torch.device) -> SecondGroup:
        return self.second[device.type]

    def defer(self, bad: torch.Tensor, nonfinite: torch.Tensor, what: str) -> None:
        """Keep device flags of a decode to read later without a synchronisation: a
        non-blocking copy to pinned host memory and an event; :func:`check_deferred`
        reads the copies whose event has completed."""
        flags = torch.stack((bad, nonfinite)).to(torch.int32)
        if flags.is_cuda:
            host = torch.empty(2, dtype=torch.int32, pin_memory=True)
            host.copy_(flags, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host, event = flags, None
        self.pending.append((event, host, what))

    def read_deferred(self, counters, wait: bool) -> str | None:
        """Read the flags that have arrived (all with ``wait``), count the non-finite ones
        in ``counters``; returns what the first bad one described, or None."""
        still, first = [], None
        for event, host, what in self.pending:
            if event is not None and not wait and not event.query():
                still.append((event, host, what))
                continue
            if event is not None:
                event.synchronize()
            bad, nonfinite = host.tolist()
            if nonfinite:
                counters.add("nonfinite_calls")
            if bad and first is None:
                first = what
        self.pending = still
        return first


def check_deferred(state, wait: bool = False) -> None:
    """:meth:`THCState.check_deferred`: count and raise what earlier decodes flagged on
    the device, for every copy that has arrived (all of them with ``wait``), in the
    state, its inter-node state and its widths: a bad prefix (different options, a wrong
    reduction, a failed rank) raises :class:`ConfigMismatchError` here, on every rank, at
    the next hook call, ``stats()`` or ``thc_allreduce``'s return."""
    if state.inter is not None:
        check_deferred(state.inter, wait)
    for width in state.variants.values():
        check_deferred(width, wait)
    first = state.runtime.read_deferred(state.counters, wait)
    if first is not None:
        raise ConfigMismatchError(
            "hhook: an earlier tensor came back NaN because the ranks disagreed on the THC options, "
            f"the tensor length or the reduction, or a rank failed while encoding (this rank: {first})"
        )


def node_layout(state) -> Topology:
    """:meth:`THCState.node_layout`: the node layout of ``process_group`` under the
    ``topology`` option, found once.

    The first call (on every rank, at the same point of the program: it may create
    process groups) runs :func:`~hhook.schedule.topology.detect_topology` (one small
    all-gather, also for ``"flat"``, so ranks that disagree fail together), checks it
    against the layout a checkpoint was saved with, and for two-level builds
    ``state.inter``, the THC state of this rank's shard between nodes (same options;
    ``bits="auto"`` sized for the node count). Raises
    :class:`~hhook.schedule.topology.TopologyError` on every rank alike."""
    runtime = state.runtime
    if runtime.topo is None:
        if not dist.is_initialized():
            raise RuntimeError("hhook: torch.distributed is not initialized (see hhook.init_distributed)")
        # One small all-gather even for "flat": ranks that disagree on the layout then
        # raise TopologyError together instead of one rank waiting in a collective
        # the others never start.
        adopt_layout(state, detect_topology(state.process_group, ranks_per_node=state.topology))
    return runtime.topo


def adopt_layout(state, topo: Topology) -> None:
    """Use ``topo``: compare it with a checkpoint's layout and rank, build or reattach
    ``state.inter``.

    A checkpoint of another layout (another world size: an elastic restart with fewer
    or more ranks; other nodes) starts its per-key state afresh with one log line; one
    saved by another rank of the same layout keeps its scales (the same on every rank)
    but not its residuals (that rank's own rounding errors)."""
    runtime = state.runtime
    try:
        topo.check_record(runtime.saved_layout)
    except TopologyError as exc:
        start_afresh(state, str(exc).split(". Per-shard", 1)[0].replace("hhook: the checkpoint", "the checkpoint"))
    else:
        origin = runtime.saved_origin
        if origin is not None and origin.get("rank") != topo.rank and drop_residuals(state):
            logger.warning("hhook: this rank (%d) loaded the THC state of rank %s: its error-feedback residuals "
                           "start afresh (save every rank's state to keep them)", topo.rank, origin.get("rank"))
    runtime.saved_layout, runtime.saved_origin = None, None
    if topo.two_level:
        if state.inter is None:
            bits = (auto_bits(topo.n_nodes, topo.ranks_per_node, rounding=state.rounding) if state.bits == "auto"
                    else state.bits)
            state.inter = type(state)(
                topo.inter_group, bits, state.block_size, state.seed, state.error_feedback, state.start_iter,
                state.scales, state.chunk_mb, rounding=state.rounding,
            )
            state.inter.reported_through_parent()
        else:  # restored from a checkpoint of the same layout
            state.inter.process_group = topo.inter_group
    elif state.inter is not None:
        raise TopologyError("hhook: this THCState holds two-level state but the layout found is flat")
    runtime.topo = topo


def check_options(state, group, device: torch.device) -> None:
    """:meth:`THCState.check_options`: a blocking MAX allreduce over ``group`` of the
    state's options fingerprint (codec and schedule): differing options raise
    :class:`ConfigMismatchError` on every rank before the first message. Also builds the
    fused backend for ``device`` (a first compile belongs here, not in a later stage)."""
    world = dist.get_world_size(group)
    f, codec = state.options.fingerprint(world, state.decision)
    warm_up(device)
    try:
        agreed = agrees(group, f, device, state.counters)
    except BaseException as exc:  # noqa: BLE001 - a stalled or lost peer, said plainly
        raise explain(exc, "hhook's options handshake", group) from exc
    if not agreed:
        raise ConfigMismatchError(
            "hhook: ranks use different THC options (configuration); this rank has "
            f"{state.describe()} (codec {codec.describe()}). Every rank must build THCState "
            "with the same options."
        )


def handshake(state, device: torch.device) -> None:
    """:meth:`THCState.handshake`: once per state and device type, blocking, in the same
    place on every rank: :func:`check_options` on the state's group, then the second
    communicator of ``device``'s type that agreed rounds use (predicted keys take one at
    their first call, too)."""
    check_options(state, state.process_group, device)
    runtime = state.runtime
    if device.type not in runtime.second:
        second = runtime.second[device.type] = SecondGroup(state.process_group, device.type)
        state.counters.add(None, 0, second.handshake_bytes)
    runtime.verified.add(device.type)


def ensure_checked(state, device: torch.device) -> None:
    """:meth:`THCState.ensure_checked`: once per device type, blocking, on every rank,
    before the first collective of the DDP hook or :func:`hhook.thc_allreduce`: the node
    layout, then the options handshake over the whole group. Two-level states check the
    parent group too (the inter-node rings alone miss a rank whose options differ from
    its node's, or a difference mirrored on every node), and DDP's plain iterations
    before ``start_iter`` depend on the options as much as the compressed ones."""
    runtime = state.runtime
    if device.type in runtime.checked:
        return
    if state.world_size > 1:  # in a world of one nothing is sent, nothing can mismatch
        if node_layout(state).two_level:
            check_options(state, state.process_group, device)
        else:
            handshake(state, device)
    runtime.checked.add(device.type)
