"""Two-level THC through the public API: ``THCState(topology=...)`` behind the DDP hook and
:func:`hhook.thc_allreduce`, at 4 ranks as 2 nodes x 2, in both scale modes, compiled,
beside the program's own sub-groups, with heterogeneous ranks, checkpointed, and refused
where the layout cannot hold (on every rank, at registration)."""

import io
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import hhook
from hhook.simulation import heavy_tailed, vnmse
from hhook.codec.error_model import auto_bits
from hhook.schedule.topology import TopologyError
from tests.support.distributed import case_values, logged, run_cases, run_world

MODES = ["agreed", "predicted"]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 10))


def _batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(16, 20, generator=g)
    # heterogeneous ranks: rank 1's gradient is 10x, rank 3's is zero
    return x * (10.0 if rank == 1 else 0.0 if rank == 3 else 1.0)


def _ddp_worker(rank, world, scales, compiled):
    torch.manual_seed(rank)
    own = dist.new_group([1, 2, 3])  # the program's own sub-group, made before hhook's
    plain = nn.parallel.DistributedDataParallel(_model())
    ddp = nn.parallel.DistributedDataParallel(_model())
    state = hhook.register(ddp, bits=8, topology=2, scales=scales, start_iter=0)
    out = {"describe": state.node_layout().describe(), "errors": [], "grads": []}
    run = torch.compile(ddp, backend="aot_eager") if compiled else ddp
    for step in range(3):
        for m in (plain, ddp):
            m.zero_grad()
        x = _batch(rank, step)
        plain(x).square().sum().backward()
        run(x).square().sum().backward()
        exact = torch.cat([p.grad.flatten() for p in plain.parameters()])
        got = torch.cat([p.grad.flatten() for p in ddp.parameters()])
        out["errors"].append(((got - exact).norm() / exact.norm()).item())
        out["grads"].append(got)
        if rank in (1, 2, 3):  # the program's group still pairs its own collectives
            t = torch.ones(2)
            dist.all_reduce(t, group=own)
            assert t.tolist() == [3.0, 3.0]
    out["stats"] = state.stats()
    out["inter_bits"] = state.inter.codec_bits()
    buf = io.BytesIO()
    torch.save(state, buf)
    out["saved"] = buf.getvalue()
    return out


def _reset_dynamo():
    import torch._dynamo

    torch._dynamo.reset()


@pytest.fixture(scope="module")
def ddp_runs():
    """``(scales, compiled) -> [(ok, what the rank returned)]``: the 4 runs of the test
    below in one 4-rank world (not 4), each with its own models, sub-group and hook state,
    dynamo's caches reset before each (a compiled run compiles from scratch)."""
    cases = [((scales, compiled), _ddp_worker, (scales, compiled)) for compiled in (False, True) for scales in MODES]
    return run_cases(cases, 4, before_each=_reset_dynamo, timeout=600)


@pytest.mark.parametrize("scales", MODES)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_ddp_hook_two_level_matches_plain_ddp(ddp_runs, scales, compiled):
    res = case_values(ddp_runs[scales, compiled])
    for r in res:
        assert r["describe"] == "4 ranks as 2 nodes x 2 (two-level)"
        assert max(r["errors"]) < 0.03, r["errors"]  # 8 bits; a swapped or unsynchronised bucket is off by O(1)
        for a, b in zip(r["grads"], res[0]["grads"]):
            assert torch.equal(a, b)  # the same bits on every rank
    s = res[0]["stats"]
    assert s["compressed_calls"] >= 3 and s["inter_calls"] >= 3
    assert s["intra_wire_bytes"] > 0 and s["inter_wire_bytes"] == s["wire_bytes"] > 0
    assert s["ratio"] > 2.0  # 8 bits over 2 nodes on half of each bucket
    assert res[0]["inter_bits"] == 8


def _api_worker(rank, world):
    out = {}
    # thc_allreduce on a two-level state: the mean within 4-bit error, identical everywhere
    os.environ.update(LOCAL_RANK=str(rank % 2), LOCAL_WORLD_SIZE="2", GROUP_RANK=str(rank // 2))
    state = hhook.THCState(bits="auto", topology="auto", error_feedback=True)
    xs = heavy_tailed(40_000, world, seed=3)
    t = xs[rank].clone()
    hhook.thc_allreduce(t, state, key="w")
    out["vnmse"] = vnmse(t, xs)
    out["result"] = t
    out["inter_bits"] = state.inter.codec_bits()
    out["flat_auto_bits"] = hhook.THCState(bits="auto").codec_bits()
    # a checkpoint carries the shards' residuals; a reload continues bit for bit
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    # ... and so does its state_dict(), plain data read with weights_only=True
    buf = io.BytesIO()
    torch.save(state.state_dict(), buf)
    buf.seek(0)
    from_dict = hhook.THCState(topology="auto")
    from_dict.load_state_dict(torch.load(buf, weights_only=True))
    a, b, c = (xs[rank].clone() * 0.5 for _ in range(3))
    hhook.thc_allreduce(a, state, key="w")
    hhook.thc_allreduce(b, loaded, key="w")
    hhook.thc_allreduce(c, from_dict, key="w")
    out["resumed_identical"] = torch.equal(a, b) and torch.equal(a, c)
    out["residual_keys"] = sorted(str(k) for p in loaded.inter.keys.policies.values() for k in p.keys)
    # the same checkpoint on another layout (an elastic restart): its per-key state starts afresh
    other = hhook.THCState(topology=4)  # one node of 4: flat
    saved = loaded.state_dict()
    saved["topology"] = 4
    other.load_state_dict(saved)
    with logged("hhook.state") as lines:
        two_level = other.node_layout().two_level
    out["relayout"] = (two_level, other.inter, other.keys.policies, lines)
    return out


def test_thc_allreduce_two_level_auto_bits_and_checkpoints():
    res = run_world(_api_worker, 4, timeout=300)
    for r in res:
        assert torch.equal(r["result"], res[0]["result"])
        assert r["vnmse"] < 2.5e-2, r["vnmse"]
        assert r["inter_bits"] == auto_bits(2, 2) and r["flat_auto_bits"] == auto_bits(4) == 4
        assert r["resumed_identical"]
        assert r["residual_keys"], "the shards' residuals travel in the checkpoint"
        two_level, inter, policies, lines = r["relayout"]
        assert not two_level and inter is None and policies == {}, r["relayout"]
        assert len(lines) == 1 and "saved with 4 ranks, two-level 2 nodes x 2" in lines[0], lines


def _bad_worker(rank, world):
    out = {}
    for name, topology in (("three", 3), ("disagree", 2 if rank == 0 else "auto")):
        ddp = nn.parallel.DistributedDataParallel(_model())
        try:
            hhook.register(ddp, bits=4, topology=topology)
            out[name] = "registered"
        except (TopologyError, hhook.ConfigMismatchError) as e:
            out[name] = str(e)
    # one rank per node: the flat path, with the same results as topology='flat'
    state = hhook.THCState(bits=4, topology=1)
    t = torch.full((1000,), float(rank))
    hhook.thc_allreduce(t, state)
    out["one_per_node"] = (state.node_layout().two_level, state.inter, t.mean().item())
    return out


def test_bad_topology_raises_at_register_on_every_rank():
    res = run_world(_bad_worker, 4, timeout=240)
    for r in res:
        assert "does not divide the world of 4" in r["three"], r["three"]
        assert "topology: 2 on rank 0, 'auto' on ranks [1, 2, 3]" in r["disagree"], r["disagree"]  # the handshake
        two_level, inter, mean = r["one_per_node"]
        assert not two_level and inter is None and abs(mean - 1.5) < 0.05


@pytest.mark.parametrize("bad", [0, -2, "nodes", 2.0, True])
def test_topology_option_is_validated(bad):
    with pytest.raises(ValueError, match="topology must be"):
        hhook.THCState(topology=bad)
