"""The schedule over a group that torch.distributed does not know (a
:class:`hhook.schedule.membership.Membership`, as hhook.torchft's quorums): the same bits
as over a registered group, in both scale modes, with heterogeneous ranks; its records
keyed by the membership's name, so members that start a new membership at different
points of their lives (a restarted process) still meet."""

import datetime

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

import hhook
from hhook.errors import ConfigMismatchError
from hhook.schedule import membership

from tests.support.distributed import run_world


class Private(membership.Membership):
    """A Gloo backend of its own over the job's store, under ``name``: registered nowhere."""

    def __init__(self, name: str, ranks: list[int]):
        me = dist.get_rank()
        self.name, self.rank, self.size, self.ranks = name, ranks.index(me), len(ranks), list(range(len(ranks)))
        self.timeout, self.on_host = datetime.timedelta(seconds=20), True
        self.store = dist.PrefixStore(f"test/{name}/", dist.distributed_c10d._get_default_store())
        self.backend = dist.ProcessGroupGloo(dist.PrefixStore("pg/", self.store), self.rank, self.size, self.timeout)

    def all_reduce(self, tensor, op):
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        return self.backend.allreduce([tensor], opts)

    def all_gather(self, output, input):
        return self.backend.allgather([list(output.chunk(self.size))], [input], AllgatherOptions())


def _inputs(rank: int, world: int) -> torch.Tensor:
    """Heterogeneous ranks: rank 1's tensor 10x rank 0's, the last rank's zero."""
    x = torch.randn(5000, generator=torch.Generator().manual_seed(7 + rank))
    return x * (10.0 if rank == 1 else 0.0 if rank == world - 1 else 1.0)


def _same_bits_worker(rank, world, scales):
    out = {}
    for label, group in (("registered", None), ("private", Private("a", list(range(world))))):
        state = hhook.THCState(process_group=group, bits=4, scales=scales)
        results = []
        for step in range(3):  # predicted scales: the first call agreed, the later ones predicted
            y = _inputs(rank, world) * (1 + step)
            hhook.thc_allreduce(y, state, key="w")
            results.append(y)
        out[label] = torch.stack(results)
        out[label + "_stats"] = state.stats()["compressed_calls"]
    # a subgroup beside the whole world: ranks 0 and 1 only, the others not taking part
    if rank < 2:
        state = hhook.THCState(process_group=Private("pair", [0, 1]), bits=4, scales=scales)
        y = _inputs(rank, world)
        hhook.thc_allreduce(y, state)
        out["pair"] = y
    return out


@pytest.mark.parametrize("scales", ["agreed", "predicted"])
def test_a_private_membership_gives_the_registered_groups_bits(scales):
    world = 3
    outs = run_world(_same_bits_worker, world, scales)
    for out in outs:
        assert torch.equal(out["private"], out["registered"])  # same codec, same streams: same bits
        assert torch.equal(out["private"], outs[0]["private"])  # identical on every rank
        assert out["private_stats"] == 3
    mean = sum(_inputs(r, world) for r in range(world)) / world
    err = (outs[0]["private"][0] - mean).norm() / mean.norm()
    assert err < 0.5, err  # a sum, or another rank's tensor, would be off by more than 1
    assert torch.equal(outs[0]["pair"], outs[1]["pair"])
    pair_mean = (_inputs(0, world) + _inputs(1, world)) / 2
    assert (outs[0]["pair"] - pair_mean).norm() / pair_mean.norm() < 0.5


def _restart_worker(rank, world):
    """Rank 0 made two memberships before (a survivor of earlier quorums); the others
    made none (restarted): under a new name they meet all the same."""
    if rank == 0:
        for earlier in ("q1", "q2"):
            state = hhook.THCState(process_group=Private(earlier, [0]), bits=4)
            hhook.thc_allreduce(torch.ones(10), state)  # a world of one: no collective
    state = hhook.THCState(process_group=Private("q3", list(range(world))), bits=4)
    y = _inputs(rank, world)
    hhook.thc_allreduce(y, state)
    mismatch = hhook.THCState(process_group=Private("q4", list(range(world))), bits=3 + (rank == 2))
    try:
        hhook.thc_allreduce(torch.ones(10), mismatch)
        said = None
    except ConfigMismatchError as exc:
        said = str(exc)
    return y, said


def test_members_meet_under_a_new_name_and_mismatches_are_named():
    outs = run_world(_restart_worker, 3)
    assert all(torch.equal(y, outs[0][0]) for y, _ in outs)
    for _, said in outs:
        assert said is not None and "bits" in said and "rank 2" in said, said


def test_a_membership_refuses_two_level():
    class Bare(membership.Membership):
        name, rank, size, ranks = "bare", 0, 2, [0, 1]

    state = hhook.THCState(process_group=Bare(), topology="auto")
    with pytest.raises(ValueError, match="topology='flat'"):
        state.node_layout()
