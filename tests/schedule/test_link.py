"""Pieces sized from the link (issue 57, hhook.schedule.link): a group's first handshake
measures its round, the same on every rank; on a slow link an agreed tensor travels whole
(its pieces' MAX and SUM rounds cost more than their overlap saves), a one-round one keeps
its pieces, and on a fast link every tensor splits as configured."""

import pytest
import torch
import torch.distributed as dist

import hhook
from hhook.schedule import link, membership

from tests.support.distributed import run_world

#: Rounds of 20 ms (sites 10 ms apart each way) and of 0.3 ms (a LAN).
SLOW, FAST = link.Link(0.020), link.Link(0.0003)


@pytest.mark.parametrize("scales", ["agreed", "gathered", "predicted"])
def test_the_rule(scales, monkeypatch):
    policy = hhook.THCState(bits=4, scales=scales).policy(scales, 2)
    configured, given = hhook.state.Options(bits=4, scales=scales).piece_limit(), (2**20, 2**20)
    for measured in (SLOW, FAST, None):
        monkeypatch.setattr(link, "of", lambda group, m=measured: m)
        expected = (0, 0) if scales == "agreed" and measured is SLOW else configured
        assert link.limit_for("auto", None, policy, configured) == expected, (scales, measured)
        assert link.limit_for(4, None, policy, given) == given  # chunk_mb given: as given


def _measure_worker(rank, world, subgroup):
    """Every rank's link of its group, rank 1 arriving 0.3 s late."""
    import time

    group = dist.new_group([0, 1]) if subgroup else None
    if rank == 2:
        return None
    if rank == 1:
        time.sleep(0.3)
    state = hhook.THCState(bits=4, process_group=group)
    hhook.thc_allreduce(torch.randn(1000), state, key="x")
    return link.of(group).round_s


@pytest.mark.parametrize("subgroup", [False, True], ids=["world", "subgroup"])
def test_every_rank_holds_the_same_link(subgroup):
    outs = run_world(_measure_worker, 3 if subgroup else 2, subgroup)
    assert outs[0] == outs[1], outs
    assert 0 < outs[0] < 0.1, outs  # the late rank's 0.3 s is not a round


def _pieces_worker(rank, world, scales, slow, compiled):
    """One exchange of 600k elements, pieces of 0.1 MB configured (23 pieces), on a group
    whose link is slow or as the handshake measures loopback: a thc_allreduce call, or
    (``compiled``) a DDP step of a model under ``torch.compile`` whose one bucket holds its
    600k parameters. The calls counted, the mean's relative error, the result."""
    import hhook.state.options
    from torch.nn.parallel import DistributedDataParallel as DDP

    hhook.state.options.DEFAULT_CHUNK_MB = 0.1
    if slow:
        members = membership.of(None)
        link._links[(members.instance, members.name)] = SLOW  # the handshake keeps a measured link
    torch.manual_seed(rank)
    if compiled:
        torch.manual_seed(0)
        ddp = DDP(torch.nn.Linear(600, 1000, bias=False), bucket_cap_mb=100)
        state = hhook.register(ddp, bits=4, scales=scales, start_iter=0)
        torch.manual_seed(rank)
        x = torch.randn(4, 600) * (1 + 9 * rank)  # rank 1's gradient 10x rank 0's
        torch.compile(ddp, backend="aot_eager")(x).square().sum().backward()
        mine = torch.autograd.grad(ddp.module(x).square().sum(), ddp.module.weight)[0].view(-1)
        out = ddp.module.weight.grad.view(-1)
    else:
        state = hhook.THCState(bits=4, scales=scales)
        mine = torch.randn(600_000) * (1 + 9 * rank)
        out = mine.clone()
        hhook.thc_allreduce(out, state, key="x")
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    mean = torch.stack(everyone).mean(0)
    return state.stats()["compressed_calls"], ((out - mean).norm() / mean.norm()).item(), out


@pytest.mark.parametrize("compiled", [False, True], ids=["thc_allreduce", "ddp-compiled"])
@pytest.mark.parametrize("scales", ["agreed", "gathered"])
def test_a_slow_link_sends_agreed_tensors_whole_and_gathered_in_pieces(scales, compiled):
    for slow in (True, False):
        outs = run_world(_pieces_worker, 2, scales, slow, compiled)
        for calls, err, _ in outs:
            if slow and scales == "agreed":
                assert calls == 1, (scales, slow, calls)  # whole
            else:
                assert calls >= 23, (scales, slow, calls)  # in pieces, as configured (DDP's bucket: 24)
            assert err < 0.35, err  # 4 bits, 2 ranks
        assert torch.equal(outs[0][2], outs[1][2])
