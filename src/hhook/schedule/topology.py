r"""Nodes of a job: which ranks share a machine, and the process groups of two-level THC.

Two-level THC (:mod:`hhook.schedule.two_level`, DESIGN.md sec. 8) reduces densely inside each node
and compresses only between nodes, so it needs to know the nodes. :func:`detect_topology`
finds them and builds the sub-groups, once:

* ``ranks_per_node="auto"`` reads the launcher (:func:`hhook.launch.launcher_layout`:
  torchrun's ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``/``GROUP_RANK``, Open MPI's
  ``OMPI_COMM_WORLD_LOCAL_RANK``/``_LOCAL_SIZE``, MPICH's ``MPI_LOCALRANKID``/
  ``MPI_LOCALNRANKS``, SLURM's ``SLURM_LOCALID``/``SLURM_NODEID``/tasks per node); nodes
  are told apart by the launcher's node index where it gives one, else by hostname.
  Without launcher variables the hostnames alone decide.
* an integer ``k``: ranks ``[i k, (i + 1) k)`` form node ``i`` (torchrun's placement).
* ``"flat"``: no nodes; every rank is a peer (the flat THC path).

Every rank sends one small record (what it was asked, what its launcher says, a hash of
its hostname) in **one** all-gather over the group, and every rank computes the layout
from the same gathered records: so they all reach the same answer, and an invalid
request (``k`` not dividing the world, ranks asking for different layouts, launcher
variables that contradict each other) raises the same :class:`TopologyError` on every
rank, after the collective, never a hang. A layout two-level THC cannot use (nodes of
different sizes, one rank per node, a single node) degrades to flat with one log line.

Sub-groups follow PyTorch's rule for ``new_group``: every rank of the default group
creates every sub-group, in the same order (here: the intra-node groups of all nodes, a
second intra-node group per node for the all-gather, then one inter-node group per local
rank). So :func:`detect_topology` must be called at the same point of the program on
every rank, like any ``new_group``, and the groups mix with the program's own.
Two-level needs the default group as parent (a sub-group's non-members cannot join those
``new_group`` calls): on a sub-group ``"auto"`` degrades to flat, an integer is refused.

Example::
    >>> topo = detect_topology(ranks_per_node="auto")     # on every rank, once
    >>> topo.describe()
    '4 ranks as 2 nodes x 2 (two-level)'
    >>> inter = THCState(process_group=topo.inter_group, bits=4)
    >>> fut = hhook.schedule.two_level.two_level_allreduce_async(grad, topo, inter, key="w")
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import secrets
import socket

import torch
import torch.distributed as dist

from ..codec import rng
from . import liveness
from .futures import Sequencer
from .groups import explained, others_of, timeout_of
from .membership import all_gather_flat
from ..launch import launcher_layout
from .node_memory import SHM_DIR, NodeMemory, budget_bytes, free_bytes, sweep_stale

logger = logging.getLogger(__name__)

#: Bumped when the layout rules or the record change: part of the fingerprint.
TOPOLOGY_VERSION = 1

# The request each rank makes, as one integer of its record.
_AUTO, _FLAT, _INVALID = -1, -2, -3
_RECORD = 9  # [request, local_rank, local_size, node_rank, host_hi, host_lo, rank, version, token]


class TopologyError(ValueError):
    """A node layout that cannot be used as asked; raised on every rank alike."""


def _request_code(ranks_per_node) -> int:
    if ranks_per_node == "auto":
        return _AUTO
    if ranks_per_node == "flat" or ranks_per_node is None:
        return _FLAT
    if isinstance(ranks_per_node, int) and not isinstance(ranks_per_node, bool) and ranks_per_node >= 1:
        return ranks_per_node
    return _INVALID


def _describe_request(code: int) -> str:
    return {_AUTO: "'auto'", _FLAT: "'flat'", _INVALID: "an invalid value"}.get(code, str(code))


def _host_hash(name: str) -> tuple[int, int]:
    h = hashlib.sha1(name.encode(), usedforsecurity=False).digest()
    return int.from_bytes(h[:4], "little") >> 1, int.from_bytes(h[4:8], "little") >> 1


def local_record(rank: int, ranks_per_node, environ=None, hostname: str | None = None) -> list[int]:
    """This rank's record for the one all-gather (integers; -1 where unknown)."""
    try:
        lay = launcher_layout(environ)
    except ValueError:  # malformed launcher variables: decided from hostnames instead
        lay = None
    hi, lo = _host_hash(hostname if hostname is not None else socket.gethostname())
    return [
        _request_code(ranks_per_node),
        -1 if lay is None else lay.local_rank,
        -1 if lay is None else lay.local_world_size,
        -1 if lay is None or lay.node_rank is None else lay.node_rank,
        hi,
        lo,
        rank,
        TOPOLOGY_VERSION,
        secrets.randbits(62),  # names this job's shared-memory files (the node's first rank's)
    ]


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the gathered records decide: ``nodes`` (global ranks per node, each sorted,
    nodes ordered by their first rank) for two-level, or None and the ``reason`` for flat."""

    nodes: tuple[tuple[int, ...], ...] | None
    reason: str
    source: str  # "launcher", "hostname", "ranks_per_node", "flat"


def _group_by(keys: list) -> list[list[int]]:
    groups: dict = {}
    for r, k in enumerate(keys):
        groups.setdefault(k, []).append(r)
    return sorted(groups.values(), key=lambda g: g[0])


def plan_layout(records: list[list[int]], parent_is_world: bool = True) -> Plan:
    """The layout every rank derives from the gathered records (a pure function of them,
    so every rank gets the same answer or the same :class:`TopologyError`)."""
    world = len(records)
    requests = [r[0] for r in records]
    if len(set(requests)) > 1:
        firsts = {}
        for rank, code in enumerate(requests):
            firsts.setdefault(code, rank)
        asked = ", ".join(f"rank {rank} asked {_describe_request(code)}" for code, rank in sorted(firsts.items(), key=lambda kv: kv[1]))
        raise TopologyError(f"hhook: ranks disagree on the node layout ({asked}); pass the same topology on every rank")
    versions = {r[7] for r in records}
    if len(versions) > 1:
        raise TopologyError(f"hhook: ranks run different hhook topology versions {sorted(versions)}")
    request = requests[0]
    if request == _INVALID:
        raise TopologyError("hhook: topology must be 'flat', 'auto' or a positive number of ranks per node")
    if request == _FLAT:
        return Plan(None, "topology='flat'", "flat")
    if request > 0:
        k = request
        if world % k:
            raise TopologyError(
                f"hhook: topology={k} ranks per node does not divide the world of {world} ranks "
                f"({world} = {world // k} x {k} + {world % k}); pass a divisor of {world}, 'auto' or 'flat'"
            )
        if not parent_is_world and k > 1 and k < world:
            raise TopologyError(
                "hhook: two-level THC needs the default process group (its sub-groups are created by every rank "
                "of it); on a sub-group use topology='flat'"
            )
        nodes = [list(range(i, i + k)) for i in range(0, world, k)]
        source = "ranks_per_node"
    else:
        if not parent_is_world:
            return Plan(None, "two-level THC needs the default process group; this state reduces over a sub-group", "flat")
        nodes, source = _auto_nodes(records)
    sizes = sorted({len(n) for n in nodes})
    if len(nodes) == 1:
        return Plan(None, f"one node of {world} ranks", source)
    if sizes == [1]:
        return Plan(None, f"one rank per node ({world} nodes)", source)
    if len(sizes) > 1:
        counts = [len(n) for n in nodes]
        return Plan(None, f"nodes of different sizes {counts}", source)
    return Plan(tuple(tuple(n) for n in nodes), "", source)


def _consistent(nodes: list[list[int]], records: list[list[int]]) -> bool:
    """Every node holds as many ranks as its members' launcher says, with local ranks 0..k-1."""
    for node in nodes:
        if any(records[r][2] != len(node) for r in node):
            return False
        if sorted(records[r][1] for r in node) != list(range(len(node))):
            return False
    return True


def _auto_nodes(records: list[list[int]]) -> tuple[list[list[int]], str]:
    hosts = _group_by([(r[4], r[5]) for r in records])
    if not all(r[2] >= 1 for r in records):  # some rank has no launcher variables: hostnames decide
        return hosts, "hostname"
    if all(r[3] >= 0 for r in records):
        by_index = _group_by([r[3] for r in records])
        if _consistent(by_index, records):
            return by_index, "launcher"
    if _consistent(hosts, records):
        return hosts, "launcher+hostname"
    # A launcher that names no node but places ranks node by node (torchrun, Open MPI's
    # default --map-by slot) on hosts of one name (containers): rank - local_rank.
    blocks = _group_by([rank - r[1] for rank, r in enumerate(records)])
    if _consistent(blocks, records):
        return blocks, "launcher"
    sizes = sorted({r[2] for r in records})
    raise TopologyError(
        "hhook: the launcher's variables do not describe one node layout (local world sizes "
        f"{sizes} on {len(records)} ranks, {len(hosts)} distinct hostnames); pass ranks_per_node explicitly "
        "or topology='flat'"
    )


def node_census(group, flag: int) -> tuple[list[list[int]], str, list[int]]:
    """``(nodes, source, flags)``: the ranks of ``group`` (indices in the group) per node,
    found as ``ranks_per_node="auto"`` finds them (the launcher's variables, else the
    hostnames; ``source`` says which), and every rank's ``flag``. One all-gather; every
    rank gets the same answer or the same :class:`TopologyError`."""
    records = _gather_records(local_record(dist.get_rank(group), "auto") + [flag], group)
    nodes, source = _auto_nodes(records)
    return nodes, source, [r[-1] for r in records]


def _gather_records(record: list[int], group) -> list[list[int]]:
    backend = str(dist.get_backend(group))
    device = torch.device("cpu")
    if "gloo" not in backend and "mpi" not in backend and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    mine = torch.tensor(record, dtype=torch.int64, device=device)
    world = dist.get_world_size(group)
    out = torch.empty(world * len(record), dtype=torch.int64, device=device)
    with explained("hhook's layout detection (an all-gather of every rank's node)", group):
        all_gather_flat(out, mine, group=group)
    return out.view(world, len(record)).tolist()


def _is_world(group) -> bool:
    return group is None or group is dist.group.WORLD or (
        dist.get_world_size(group) == dist.get_world_size()
        and dist.get_process_group_ranks(group) == list(range(dist.get_world_size()))
    )


class Topology:
    """The node layout of a process group and, for two-level, this rank's sub-groups.

    Attributes:
        two_level: True when :mod:`hhook.schedule.two_level` applies (else the flat path).
        world_size, rank: of the parent group.
        nodes: global ranks of every node (two-level), or None.
        n_nodes, ranks_per_node: 1 and ``world_size`` for flat.
        node, local_rank: this rank's node and its position in it (the shard it owns).
        intra_group: this rank's node (the dense reduce-scatter).
        gather_group: the same ranks, a second communicator (the all-gather, launched from
            continuations in sequenced order while ``intra_group`` takes new tensors).
        inter_group: the ranks of this ``local_rank`` on every node (the THC ring).
        fingerprint: 24-bit hash of the layout (exact in float32): for handshakes and
            checkpoint checks.
        reason: why the layout is flat ("" for two-level).
        source: what decided it ("launcher", "hostname", "ranks_per_node", "flat").
    """

    def __init__(self, group, world_size: int, rank: int, plan: Plan, groups: dict | None = None,
                 token: int = 0):
        self.group = group
        self.world_size = world_size
        self.rank = rank
        self.nodes = plan.nodes
        self.reason = plan.reason
        self.source = plan.source
        self.two_level = plan.nodes is not None
        if self.two_level:
            self.n_nodes = len(plan.nodes)
            self.ranks_per_node = len(plan.nodes[0])
            self.node = next(i for i, n in enumerate(plan.nodes) if rank in n)
            self.local_rank = plan.nodes[self.node].index(rank)
        else:
            self.n_nodes, self.ranks_per_node, self.node, self.local_rank = 1, world_size, 0, rank
        groups = groups or {}
        self.intra_group = groups.get("intra")
        self.gather_group = groups.get("gather")
        self.inter_group = groups.get("inter")
        self.fingerprint = layout_fingerprint(world_size, plan.nodes)
        self.token = token  # the same on every rank of this node, random per job
        #: CPU tensors meet inside the node in shared memory (probed at detection; a
        #: :class:`~hhook.schedule.node_memory.NodeMemory`), else through collectives on
        #: ``intra_group``/``gather_group``.
        self.node_memory: NodeMemory | None = None
        self._sequencers: dict = {}

    @property
    def shared_memory(self) -> bool:
        return self.node_memory is not None

    def describe(self) -> str:
        if self.two_level:
            return f"{self.world_size} ranks as {self.n_nodes} nodes x {self.ranks_per_node} (two-level)"
        return f"{self.world_size} ranks, flat ({self.reason})"

    def __repr__(self) -> str:
        return f"Topology({self.describe()}, fingerprint={self.fingerprint:#08x})"

    def record(self) -> dict:
        """What a checkpoint keeps of the layout (plain data)."""
        return {"two_level": self.two_level, "world_size": self.world_size, "n_nodes": self.n_nodes,
                "ranks_per_node": self.ranks_per_node, "fingerprint": self.fingerprint}

    def check_record(self, saved: dict | None) -> None:
        """Raise :class:`TopologyError` if ``saved`` (a :meth:`record` from a checkpoint)
        describes another layout than this one. Every rank loads the same checkpoint and
        holds the same layout, so every rank raises alike. ``None`` (saved before layouts
        were recorded) passes."""
        if saved is None or saved.get("fingerprint") == self.fingerprint:
            return
        was = ("two-level {n_nodes} nodes x {ranks_per_node}" if saved.get("two_level") else "flat").format(**saved)
        raise TopologyError(
            f"hhook: the checkpoint was saved with {saved.get('world_size')} ranks, {was}; this run has "
            f"{self.describe()}. Per-shard state (residuals, predicted scales) does not carry over: "
            "resume with the same layout, or drop the THC state from the checkpoint"
        )

    def sequencer(self, name: str):
        """A :class:`~hhook.schedule.futures.Sequencer` shared by every two-level call on this
        topology for the collectives it launches from continuations on one group."""
        seq = self._sequencers.get(name)
        if seq is None:
            seq = self._sequencers[name] = Sequencer()
        return seq

    def __getstate__(self):
        raise TypeError("a Topology holds process groups and cannot be pickled; save Topology.record() instead")


def _probe_shared_memory(topo: Topology) -> NodeMemory | None:
    """Do the ranks of every node see one another's writes in one file of
    :data:`~hhook.schedule.node_memory.SHM_DIR`? (Not where "nodes" given by an integer span
    hosts.) Blocking, at detection: first the files of dead jobs go
    (:func:`~hhook.schedule.node_memory.sweep_stale`), every rank writes its rank into its slot, a
    barrier inside the node, every rank reads all slots; then every rank of the parent
    group agrees (MIN) on the verdict and on the byte budget. Gloo only: the probe's
    collectives are on CPU tensors. None where shared memory cannot be used."""
    if "gloo" not in str(dist.get_backend(topo.group)):
        return None
    memory = NodeMemory(f"hhook-{topo.token:016x}-node{topo.node}-", topo.ranks_per_node, 0)
    sweep_stale(memory.directory)
    path = memory.path("probe")
    ok = 1
    try:
        memory.open_file("probe")
        storage = torch.UntypedStorage.from_file(path, True, 8 * topo.ranks_per_node)
        slots = torch.empty(0, dtype=torch.int64).set_(storage.untyped(), 0, (topo.ranks_per_node,), (1,))
        slots[topo.local_rank] = topo.rank + 1
    except (OSError, RuntimeError):
        ok, slots = 0, None
    with explained("hhook's shared-memory probe", topo.intra_group):
        dist.all_reduce(torch.zeros(1, dtype=torch.float32), group=topo.intra_group)  # every rank of the node has written
    if slots is not None and slots.tolist() != [r + 1 for r in topo.nodes[topo.node]]:
        ok = 0
    try:
        budget, bad = budget_bytes(free_bytes(memory.directory)), None
    except ValueError as exc:  # told to every rank by the MIN below (-1), raised on each
        budget, bad = -1, exc
    verdict = torch.tensor([ok, budget], dtype=torch.int64)
    with explained("hhook's shared-memory probe", topo.group):
        dist.all_reduce(verdict, dist.ReduceOp.MIN, group=topo.group)  # every rank has read
    memory.done(path)
    ok, memory.budget = verdict.tolist()
    if memory.budget < 0:
        memory.release()
        raise bad or ValueError("hhook: HHOOK_SHM_MB on another rank of this node group is not a number of MB "
                                "(0 or more): that rank says which value; every rank stops here")
    if not ok:
        memory.release()
        return None
    return memory


def layout_fingerprint(world_size: int, nodes) -> int:
    """24-bit hash of a layout (``nodes`` None: flat)."""
    h = rng.mix32(0x544F504F ^ TOPOLOGY_VERSION)
    h = rng.mix32(h ^ world_size)
    if nodes is not None:
        for node in nodes:
            h = rng.mix32(h ^ 0x9E3779B9)
            for r in node:
                h = rng.mix32(h ^ r)
    return h >> 8


def flat_topology(world_size: int = 1, rank: int = 0, reason: str = "topology='flat'", group=None) -> Topology:
    """A flat layout without any collective (what ``"flat"`` means where no check is wanted)."""
    return Topology(group, world_size, rank, Plan(None, reason, "flat"))


def detect_topology(group=None, ranks_per_node="auto", environ=None, hostname: str | None = None,
                    intra: str = "auto") -> Topology:
    r"""Find the nodes of ``group`` (None: the default group) and build the sub-groups.

    Call it on every rank, at the same point of the program (it creates process groups).
    One small all-gather over ``group``; for two-level ``2 n_nodes + ranks_per_node``
    ``new_group`` calls on every rank. ``environ`` and ``hostname`` replace
    ``os.environ`` and ``socket.gethostname()`` (tests, unusual launchers).

    ``intra`` says how CPU tensors meet inside a node: ``"auto"`` (default) in shared
    memory when every node's ranks can map one file of :data:`SHM_DIR` (probed here: two
    tiny collectives; ``HHOOK_SHM=0`` turns it off), else through Gloo collectives;
    ``"collectives"``; ``"shm"`` (an error where it fails). CUDA tensors always use
    collectives (NCCL).

    Raises :class:`TopologyError` on every rank for a ``ranks_per_node`` that does not
    divide the world, ranks asking for different layouts, or launcher variables that
    contradict each other. Returns a flat :class:`Topology` (and logs one line on rank 0)
    where two-level cannot apply: uneven nodes, one rank per node, one node, a world of one.
    """
    if not dist.is_initialized():
        raise RuntimeError("hhook: torch.distributed is not initialized (see hhook.init_distributed)")
    if intra not in ("auto", "collectives", "shm"):
        raise ValueError(f"intra must be 'auto', 'collectives' or 'shm', got {intra!r}")
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if world == 1:
        return flat_topology(1, 0, "a world of one rank", group)
    records = _gather_records(local_record(rank, ranks_per_node, environ, hostname), group)
    parent_is_world = _is_world(group)
    plan = plan_layout(records, parent_is_world)
    if plan.nodes is None:
        if rank == 0 and plan.source != "flat":
            logger.warning("hhook: topology %r: %s: the flat THC path is used", ranks_per_node, plan.reason)
        return Topology(group, world, rank, plan)
    mine: dict = {}
    # The sub-groups wait as long as the parent (new_group's default is torch's 30 minutes).
    timeout = timeout_of(group)
    with liveness.store_calls("hhook's two-level sub-groups", others_of(group)):
        for role in ("intra", "gather"):  # the same calls, in the same order, on every rank
            for node in plan.nodes:
                g = dist.new_group(list(node), timeout=timeout)
                if rank in node:
                    mine[role] = g
        for j in range(len(plan.nodes[0])):
            ring = [node[j] for node in plan.nodes]
            g = dist.new_group(ring, timeout=timeout)
            if rank in ring:
                mine["inter"] = g
    first = plan.nodes[next(i for i, n in enumerate(plan.nodes) if rank in n)][0]
    topo = Topology(group, world, rank, plan, mine, token=records[first][8])
    if intra == "shm" or (intra == "auto" and os.environ.get("HHOOK_SHM", "1") != "0"):
        topo.node_memory = _probe_shared_memory(topo)
        if intra == "shm" and not topo.shared_memory:
            raise TopologyError("hhook: intra='shm' but the ranks of a node do not share memory in " + SHM_DIR)
    if rank == 0:
        logger.info("hhook: topology %r: %s (from %s)", ranks_per_node, topo.describe(), plan.source)
    return topo
