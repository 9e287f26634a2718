r"""What a schedule knows of its caller: a :class:`CallContext` of plain data, made once per
group and configuration, and the :class:`GroupRuntime` of each group it sends on (the
handshake done, the second communicators, the launch order of agreed rounds, device flags
to read, the node layout).

The caller (:meth:`hhook.state.THCState.context`) makes the context and keeps it; a
schedule reads its fields and never calls back into the caller. The runtime is built on
first use and never saved.
"""

from __future__ import annotations

import dataclasses

import torch

from ..errors import ConfigMismatchError
from ..stats import Counters
from .futures import Sequencer
from .groups import SecondGroup
from .topology import Topology


class GroupRuntime:
    """The transport pieces of one group. ``agreed``: the options handshake
    (:mod:`hhook.schedule.handshake`) passed on this group; ``topo``: the node layout, once
    found; ``second``: device type -> the second communicator; ``sequencer``: the launch
    order of agreed rounds; ``pending``: device flags of decodes to read later;
    ``defer_on_cpu``: tests run the GPU's deferred checks on CPU tensors."""

    __slots__ = ("agreed", "topo", "second", "sequencer", "pending", "defer_on_cpu")

    def __init__(self):
        self.agreed = False
        self.topo: Topology | None = None
        self.second: dict[str, SecondGroup] = {}
        self.sequencer = Sequencer()
        self.pending: list = []
        self.defer_on_cpu = False

    def share_transport(self, other: "GroupRuntime") -> None:
        """Send on ``other``'s second communicators in ``other``'s launch order (a width's
        inter-node ring on its parent's); the handshake stays this runtime's own."""
        self.second, self.sequencer = other.second, other.sequencer

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

    def read_deferred(self, counters: Counters, wait: bool) -> str | None:
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


def check_deferred(deferred: list, wait: bool = False) -> None:
    """Count and raise what earlier decodes flagged on the device, for every copy that
    has arrived (all of them with ``wait``), in each ``(runtime, counters)`` of
    ``deferred`` in turn: a bad prefix (different options, a wrong reduction, a failed
    rank) raises :class:`ConfigMismatchError` here, on every rank, at the next call,
    ``stats()`` or ``thc_allreduce``'s return."""
    for runtime, counters in deferred:
        first = runtime.read_deferred(counters, wait)
        if first is not None:
            raise ConfigMismatchError(
                "hhook: an earlier tensor came back NaN because the ranks disagreed on the THC options, "
                f"the tensor length or the reduction, or a rank failed while encoding (this rank: {first})"
            )


@dataclasses.dataclass(eq=False)
class CallContext:
    """What one call of a schedule may use, as plain data; made once per group and
    configuration by :meth:`hhook.state.THCState.context`.

    ``group`` (None: the default group), this rank's ``rank`` in it and its
    ``world_size``; its ``runtime``; ``counters`` (bytes and calls, and the number of the
    next call, which selects its rounding stream) and, two-level, ``intra_counters`` (what
    stayed inside the node); ``policy``: the scale policy of this configuration
    (:class:`hhook.scales.ScalePolicy`, with its per-key state); ``piece_limit``: the most
    elements of a piece on the CPU and elsewhere (0: tensors travel whole), and
    ``block_size``, the codec's block, which pieces are made of; ``config``: the options hash every message carries;
    ``fields``: what the options handshake compares (:mod:`hhook.schedule.handshake`);
    ``deferred``: the ``(runtime, counters)`` pairs whose device flags
    :func:`check_deferred` reads (this context's own last); ``schedule``: the schedule
    this group's layout takes, ``schedule(ctx, tensor, key, layout) -> Future``
    (:func:`hhook.schedule.flat.flat_allreduce_async`, or
    :func:`hhook.schedule.two_level.two_level_allreduce_async` where ``topo`` found several
    nodes); ``inter``: two-level, the context of this rank's shard between nodes (its
    group, ``topo.inter_group``), else None; ``topo``: the node layout (None where no
    layout was asked for: FSDP's groups); ``verified``: key -> what its last
    ``thc_allreduce`` exchange verified on every rank
    (:class:`hhook.schedule.call_check.Verified`)."""

    group: object
    rank: int
    world_size: int
    runtime: GroupRuntime
    counters: Counters
    policy: object
    piece_limit: tuple[int, int]
    block_size: int
    config: int
    fields: tuple
    deferred: list
    schedule: object
    intra_counters: Counters | None = None
    topo: Topology | None = None
    inter: "CallContext | None" = None
    verified: dict = dataclasses.field(default_factory=dict)
