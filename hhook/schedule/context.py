r"""What a schedule knows of its caller: a narrow :class:`CallContext` per call, and the
:class:`GroupRuntime` the schedule owns for each group it sends on (node layout, second
communicators, launch order of agreed rounds, handshakes done, device flags to read).

A caller (:class:`hhook.state.THCState`, through its ``context()``) builds the context;
the schedule never sees the caller itself. The runtime is built on first use and never
saved; the caller keeps it (``THCState.runtime``) so that successive calls share it.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from ..codec import warm_up
from ..errors import ConfigMismatchError
from ..stats import Counters
from .groups import SecondGroup, agrees, explain
from .sequencer import Sequencer
from .topology import Topology


class GroupRuntime:
    """The transport pieces of one group. ``topo``: the node layout, once found;
    ``second``: device type -> the second communicator; ``verified``/``checked``: device
    types whose handshake ran on this group / over the whole group; ``sequencer``: the
    launch order of agreed rounds; ``pending``: device flags of decodes to read later;
    ``defer_on_cpu``: tests run the GPU's deferred checks on CPU tensors."""

    __slots__ = ("topo", "second", "verified", "checked", "sequencer", "pending", "defer_on_cpu")

    def __init__(self):
        self.topo: Topology | None = None
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
        non-blocking copy to pinned host memory and an event; :meth:`read_deferred`
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


class CallContext:
    """What one call of a schedule may use of its caller, and nothing else:

    ``group`` (``None``: the default group) and its ``runtime``; ``counters`` (calls and
    bytes) and, two-level, ``intra_counters`` (what stayed inside the node);
    ``policy()``: the scale policy of this call (:class:`hhook.scales.ScalePolicy`, with
    its per-key state); ``chunks(numel, device)``: the pieces a tensor travels in;
    ``next_call()``: a number no earlier call of this rank had (it selects the rounding
    stream); ``config_id()``: the options hash in every message's fingerprint;
    ``fingerprint(world_size)``: the handshake's value and a description of the options
    for its error; ``deferred``: the (runtime, counters) pairs whose device flags
    :meth:`check_deferred` reads (the caller's own last); ``find_layout()``: the
    :class:`~hhook.schedule.topology.Topology`, found by the caller the first time
    (:meth:`node_layout` reads it from the runtime after that); ``inter()``: two-level,
    the context of this rank's shard between nodes."""

    __slots__ = ("group", "runtime", "counters", "intra_counters", "policy", "chunks", "next_call", "config_id",
                 "fingerprint", "deferred", "find_layout", "inter")

    def __init__(self, group, runtime: GroupRuntime, counters: Counters, intra_counters: Counters | None,
                 policy: Callable, chunks: Callable, next_call: Callable[[], int], config_id: Callable[[], int],
                 fingerprint: Callable, deferred: list, find_layout: Callable[[], Topology],
                 inter: Callable[[], "CallContext"]):
        self.group, self.runtime, self.counters, self.intra_counters = group, runtime, counters, intra_counters
        self.policy, self.chunks, self.next_call, self.config_id = policy, chunks, next_call, config_id
        self.fingerprint, self.deferred, self.find_layout, self.inter = fingerprint, deferred, find_layout, inter

    def node_layout(self) -> Topology:
        """The node layout of the group: the runtime's, or found now by the caller."""
        topo = self.runtime.topo
        return topo if topo is not None else self.find_layout()

    def check_deferred(self, wait: bool = False) -> None:
        """Count and raise what earlier decodes flagged on the device, for every copy that
        has arrived (all of them with ``wait``), in each of :attr:`deferred` in turn: a bad
        prefix (different options, a wrong reduction, a failed rank) raises
        :class:`ConfigMismatchError` here, on every rank, at the next call, ``stats()`` or
        ``thc_allreduce``'s return."""
        for runtime, counters in self.deferred:
            first = runtime.read_deferred(counters, wait)
            if first is not None:
                raise ConfigMismatchError(
                    "hhook: an earlier tensor came back NaN because the ranks disagreed on the THC options, "
                    f"the tensor length or the reduction, or a rank failed while encoding (this rank: {first})"
                )

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)


def context_of(caller) -> CallContext:
    """``caller`` itself if it is a :class:`CallContext`, else the context it gives
    (``caller.context()``: a :class:`hhook.state.THCState`)."""
    return caller if isinstance(caller, CallContext) else caller.context()


def check_options(ctx: CallContext, group, device: torch.device) -> None:
    """A blocking MAX allreduce over ``group`` of the caller's options fingerprint (codec
    and schedule): differing options raise :class:`ConfigMismatchError` on every rank
    before the first message. Also builds the fused backend for ``device`` (a first
    compile belongs here, not in a later stage)."""
    f, described = ctx.fingerprint(dist.get_world_size(group))
    warm_up(device)
    try:
        agreed = agrees(group, f, device, ctx.counters)
    except BaseException as exc:  # noqa: BLE001 - a stalled or lost peer, said plainly
        raise explain(exc, "hhook's options handshake", group) from exc
    if not agreed:
        raise ConfigMismatchError(
            f"hhook: ranks use different THC options (configuration); this rank has {described}. Every rank "
            "must build THCState with the same options."
        )


def handshake(ctx: CallContext, device: torch.device) -> None:
    """Once per group and device type, blocking, in the same place on every rank:
    :func:`check_options` on the context's group, then the second communicator of
    ``device``'s type that agreed rounds use (predicted keys take one at their first
    call, too)."""
    check_options(ctx, ctx.group, device)
    runtime = ctx.runtime
    if device.type not in runtime.second:
        second = runtime.second[device.type] = SecondGroup(ctx.group, device.type)
        ctx.counters.add(None, 0, second.handshake_bytes)
    runtime.verified.add(device.type)


def ensure_checked(ctx: CallContext, device: torch.device) -> None:
    """Once per device type, blocking, on every rank, before the first collective of the
    DDP hook or :func:`hhook.thc_allreduce`: the node layout, then the options handshake
    over the whole group. Two-level callers check the parent group too (the inter-node
    rings alone miss a rank whose options differ from its node's, or a difference
    mirrored on every node), and DDP's plain iterations before ``start_iter`` depend on
    the options as much as the compressed ones."""
    runtime = ctx.runtime
    if device.type in runtime.checked:
        return
    if ctx.world_size > 1:  # in a world of one nothing is sent, nothing can mismatch
        if ctx.node_layout().two_level:
            check_options(ctx, ctx.group, device)
        else:
            handshake(ctx, device)
    runtime.checked.add(device.type)
