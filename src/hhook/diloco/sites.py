r"""The sites of an outer-synchronized job and their process groups (DESIGN.md sec. 14).

A *site* is a group of ranks joined by fast links (a data center, a node): inside it the
model trains as usual, with DDP or FSDP2 on :attr:`Sites.site_group`. Between sites, local
rank ``j`` of every site meets local rank ``j`` of every other site in :attr:`Sites.ring`
(one group per local rank, as two-level THC's rings, docs/topology.md), so each rank
exchanges ``1 / k`` of the pseudo-gradient and every NIC of a site works.

:func:`find_sites` builds the groups once, on every rank, in the same order (PyTorch's
rule for ``new_group``): the sites from the launcher's variables or hostnames
(:func:`hhook.schedule.topology.node_census`, as two-level THC finds nodes) or ``k``
ranks per site placed site by site (torchrun's placement). :func:`sites_of_groups` takes
groups the program already has (a 2-D ``DeviceMesh``'s). Both raise on every rank alike
where the ranks ask for different layouts or the sites differ in size.

:meth:`Sites.agree` is the options check of :class:`hhook.diloco.DiLoCo`: the
schedule's one options handshake (:func:`hhook.schedule.handshake.agree`) over the default
group, so every rank raises the same :class:`~hhook.errors.ConfigMismatchError` naming each
field that differs with each rank's value, and the sites.
"""

from __future__ import annotations

import contextlib
import datetime
import time

import torch
import torch.distributed as dist

from ..errors import ConfigMismatchError, explain
from ..schedule import blame, handshake, liveness
from ..schedule.groups import timeout_of
from ..schedule.topology import node_census

_AUTO = -1


class Sites:
    """Where this rank stands: ``site`` (its index), ``local_rank`` (its place in the site),
    ``n_sites``, ``ranks_per_site``, ``site_group`` (its site's ranks; None in a world of
    one site without torch.distributed) and ``ring`` (local rank ``local_rank`` of every
    site; None for one site). ``members``: every site's global ranks, in local-rank order,
    where known (:func:`find_sites` knows them; with :func:`sites_of_groups` a rank's site
    is its rank in its ring)."""

    __slots__ = ("site", "local_rank", "n_sites", "ranks_per_site", "site_group", "ring", "members")

    def __init__(self, site: int, local_rank: int, n_sites: int, ranks_per_site: int, site_group=None, ring=None,
                 members: tuple | None = None):
        self.site, self.local_rank, self.n_sites, self.ranks_per_site = site, local_rank, n_sites, ranks_per_site
        self.site_group, self.ring, self.members = site_group, ring, members

    def describe(self) -> str:
        if self.members is None:
            return f"{self.n_sites} site(s) of {self.ranks_per_site} rank(s)"
        return ", ".join(f"site {s} = rank{'s' if len(m) > 1 else ''} {', '.join(map(str, m))}"
                         for s, m in enumerate(self.members))

    def site_of(self, rank: int) -> int | None:
        """The site of global ``rank`` (None where unknown)."""
        for s, members in enumerate(self.members or ()):
            if rank in members:
                return s
        try:
            return dist.get_process_group_ranks(self.ring).index(rank)
        except Exception:  # noqa: BLE001 - no ring, or a rank of another ring
            return None

    def source(self) -> int:
        """The global rank of site 0 in this rank's ring (where a common start comes from)."""
        if self.members is not None:
            return self.members[0][self.local_rank]
        return dist.get_global_rank(self.ring, 0)

    def agree(self, fields: list, what: str = "hhook.diloco's options check") -> None:
        """The schedule's options handshake over the default group on ``fields`` (name,
        value pairs), blocking, on every rank: every rank raises the same
        :class:`~hhook.errors.ConfigMismatchError`, naming each differing field with each
        rank's value, and the sites."""
        try:
            handshake.agree(None, fields, what=what)
        except ConfigMismatchError as e:
            raise ConfigMismatchError(f"hhook.diloco: the sites disagree ({self.describe()}): {e}") from e

    def __repr__(self) -> str:
        return f"Sites({self.describe()}; this rank: site {self.site}, local rank {self.local_rank})"


def one_site() -> Sites:
    """A world of one site: this process alone (torch.distributed need not be initialized)."""
    if dist.is_initialized():
        world = dist.get_world_size()
        return Sites(0, dist.get_rank(), 1, world, dist.group.WORLD, None, (tuple(range(world)),))
    return Sites(0, 0, 1, 1, None, None, ((0,),))


def gather_ints(values: list[int], group=None, what: str = "hhook.diloco's options check") -> list[list[int]]:
    """Every rank's ``values`` in rank order (``all_gather_object``: a few integers, once
    at construction or resume, on whichever backend the group has)."""
    out: list = [None] * dist.get_world_size(group)
    with explained(what, group):
        dist.all_gather_object(out, [int(v) for v in values], group=group)
    return out


def gather_site(values: list[int], sites: Sites) -> list[list[int]]:
    """Every local rank's ``values`` of this rank's site, in local-rank order."""
    return gather_ints(values, sites.site_group, "hhook.diloco's options check inside the site")


def all_gather_flat(out: torch.Tensor, mine: torch.Tensor, group) -> None:
    """Every rank's equal ``mine`` into ``out``, blocking: ``all_gather_single`` (torch
    2.13), else its older name ``all_gather_into_tensor`` (2.11)."""
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, mine, group=group)


def hold_one_model(sites: Sites, digest: int) -> bool:
    """Whether every rank's ``digest`` (62 bits of what it holds of the model: its shards
    and the rest, :func:`hhook.diloco.checkpoint.model_digest`) equals that of every rank
    of its ring: the sites already start from one model (seeded alike, or one checkpoint
    loaded everywhere), and the common start need not send site 0's over the slowest
    link. One small all-gather over the default group (any backend), the same answer on
    every rank."""
    rows = gather_ints([sites.local_rank, digest], None, "hhook.diloco's check that the sites hold one model")
    rings: dict = {}
    for local_rank, held in rows:
        rings.setdefault(local_rank, set()).add(held)
    return all(len(held) == 1 for held in rings.values())


@contextlib.contextmanager
def explained(what: str, group):
    """A peer of ``group`` that stalls or dies makes a collective inside raise
    :class:`~hhook.errors.PeerTimeoutError` or :class:`~hhook.errors.PeerLostError`
    naming ``what`` and the group's other ranks (:func:`hhook.errors.explain`)."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - re-raised, explained where it can be
        err = explain(exc, what, None, peers(group))
        if err is exc:
            raise
        raise err from exc


def peers(group) -> str:
    """The global ranks of ``group`` other than this one, for messages."""
    try:
        others = [r for r in dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
                  if r != dist.get_rank()]
    except Exception:  # noqa: BLE001 - a group of another process, a destroyed one
        return ""
    return "" if not others else f"rank {others[0]}" if len(others) == 1 else f"one of ranks {others}"


def _finish_key(tag: str, rank: int) -> str:
    return f"hhook.diloco/{liveness.instance()}/{tag}/finished/{rank}"


def say_finished(sites: Sites, tag: str, position: int) -> None:
    """Say in the job's store that this rank finished (:meth:`DiLoCo.finish`) after inner
    step ``position``, then wait (at most the ring's timeout) until every site of its ring
    has: ConfigMismatchError on every rank where a site finished after another count, or
    did not finish in time (it trains on: the sites ran different numbers of steps)."""
    store, me = dist.distributed_c10d._get_default_store(), dist.get_rank()
    ring = dist.get_process_group_ranks(sites.ring)
    with liveness.store_calls("hhook.diloco's finish", ring):
        store.set(_finish_key(tag, me), str(position))
    limit = timeout_of(sites.ring).total_seconds()
    deadline = time.monotonic() + limit
    while True:
        with liveness.store_calls("hhook.diloco's finish", ring):
            said = finished(sites, tag)
        if len(said) == len(ring) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    if len(set(said.values())) > 1 or len(said) < len(ring):
        counts = "; ".join(f"site {sites.site_of(r)} (rank {r}) " + (f"after inner step {said[r]}" if r in said else
                           f"not within {limit:g} s: it trains on") for r in ring)
        raise ConfigMismatchError(f"hhook.diloco: the sites finished after different numbers of inner steps ({counts}). "
                                  "Every site must run the same number of inner steps (data of equal length per site, "
                                  "or a common step count) and then call finish()")


def finished(sites: Sites, tag: str, bound_s: float | None = None) -> dict:
    """``{global rank: inner steps}`` of the ranks of this rank's ring that said they
    finished; ``bound_s``: the store's operations time out after that meanwhile (on an
    error path, where the store's host may be the rank that died)."""
    store = dist.distributed_c10d._get_default_store()
    keys = {r: _finish_key(tag, r) for r in dist.get_process_group_ranks(sites.ring)}
    with blame.bounded(store, bound_s) if bound_s is not None else contextlib.nullcontext():
        return {r: int(store.get(k)) for r, k in keys.items() if store.check([k])}


def find_sites(ranks_per_site: int | str = "auto", timeout: datetime.timedelta | None = None) -> Sites:
    r"""The sites of the default group, and their groups; call it on every rank at the
    same point of the program (it creates process groups, like ``new_group``).

    ``ranks_per_site``: ``"auto"`` (a site is a node, found from the launcher's variables,
    else the hostnames: ``ci/netcluster.sh launch N --ranks-per-node K``, torchrun on
    several hosts) or ``k`` (ranks ``[i k, (i + 1) k)`` form site ``i``; ``1``: every rank
    its own site). ``timeout``: of the new groups (default: the default group's). One
    all-gather, then ``n_sites + k`` ``new_group`` calls (none in a world of one site).
    Raises ``ValueError`` on every rank where ranks ask for different layouts, ``k`` does
    not divide the world, or the sites differ in size.

    Example::
        >>> sites = hhook.diloco.find_sites("auto")
        >>> ddp = DDP(model, process_group=sites.site_group)
    """
    if ranks_per_site != "auto" and (isinstance(ranks_per_site, bool) or not isinstance(ranks_per_site, int)
                                     or ranks_per_site < 1):
        raise ValueError(f"hhook.diloco: ranks_per_site must be 'auto' or a positive integer, got {ranks_per_site!r}")
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return one_site()
    world, rank = dist.get_world_size(), dist.get_rank()
    request = _AUTO if ranks_per_site == "auto" else ranks_per_site
    asked = {row[0] for row in gather_ints([request])}
    if len(asked) > 1:
        said = ", ".join("'auto'" if a == _AUTO else str(a) for a in sorted(asked))
        raise ValueError(f"hhook.diloco: ranks ask for different sites (ranks_per_site {said}); pass the same on every rank")
    if request == _AUTO:
        nodes, _, _ = node_census(None, 0)
    elif world % request:
        raise ValueError(f"hhook.diloco: ranks_per_site={request} does not divide the world of {world} ranks")
    else:
        nodes = [list(range(i, i + request)) for i in range(0, world, request)]
    sizes = sorted({len(n) for n in nodes})
    if len(sizes) > 1:
        raise ValueError(f"hhook.diloco: the sites differ in size ({[len(n) for n in nodes]} ranks): every site needs "
                         "as many ranks, one ring per local rank joins them")
    members = tuple(tuple(n) for n in nodes)
    site = next(i for i, n in enumerate(members) if rank in n)
    local, k = members[site].index(rank), sizes[0]
    if len(members) == 1:
        return Sites(0, local, 1, k, dist.group.WORLD, None, members)
    kw = {"timeout": timeout_of(None) if timeout is None else timeout}  # torch's own default is 30 min
    groups = {}
    with liveness.store_calls("hhook.diloco's groups of sites", range(world)):  # they meet through the store
        for i, node in enumerate(members):  # the same calls in the same order on every rank
            groups[("site", i)] = dist.new_group(list(node), **kw)
        for j in range(k):
            groups[("ring", j)] = dist.new_group([node[j] for node in members], **kw)
    return Sites(site, local, len(members), k, groups[("site", site)], groups[("ring", local)], members)


def sites_of_groups(site_group, ring) -> Sites:
    """Sites from groups the program already has: ``site_group`` (this rank's site) and
    ``ring`` (this local rank across sites), e.g. a 2-D mesh's
    ``mesh["shard"].get_group()`` and ``mesh["replicate"].get_group()``. Local: the
    layout of every site is learnt (and checked) at the first options check."""
    if ring is None or dist.get_world_size(ring) == 1:
        return one_site()
    return Sites(dist.get_rank(ring), dist.get_rank(site_group), dist.get_world_size(ring),
                 dist.get_world_size(site_group), site_group, ring)
