"""hhook.fsdp.register's bits="auto" (hhook/fsdp_auto.py): the DDP hook's decision between
THC's reduce-scatter with the compressed all-gather, THC's reduce-scatter alone and plain
FSDP2, on FSDP2 with Gloo on CPU. Step times come from a fake clock per rank."""

from __future__ import annotations

import pytest
import torch

from distributed import logged, run_world

fsdp = pytest.importorskip("torch.distributed.fsdp")


def _model():
    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(nn.Linear(37, 131), nn.Tanh(), nn.Linear(131, 67), nn.LayerNorm(67), nn.Linear(67, 3))


def _shard(model, mesh=None, param_dtype=None):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=param_dtype)}
    if mesh is not None:
        kw["mesh"] = mesh
    for i in (0, 2, 4):
        fully_shard(model[i], **kw)
    return fully_shard(model, **kw)


def _fake_clock(state, switch, costs):
    """Each call ends the step that ran under ``switch``'s method: time moves by its cost."""
    now = [0.0]

    def clock():
        now[0] += costs[switch.method]
        return now[0]

    state.prober.clock = clock


def _decide(rank, world, costs, param_dtype=None, steps=30):
    import hhook.fsdp
    from hhook.fsdp_all_gather import find_state

    model = _shard(_model(), param_dtype=param_dtype)
    state = hhook.fsdp.register(model)  # no options: bits="auto"
    ag = find_state(model)
    _fake_clock(state, ag.switch, costs[rank])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []
    torch.manual_seed(3)
    for step in range(steps):
        before = (dict(ag.stats()), dict(state.stats()))
        model(torch.randn(8, 37)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        after = (ag.stats(), state.stats())
        ag_compressed = after[0].get("compressed_calls", 0) - before[0].get("compressed_calls", 0)
        rs_compressed = after[1].get("compressed_calls", 0) - before[1].get("compressed_calls", 0)
        seen.append((ag.switch.method, ag_compressed > 0, rs_compressed > 0))
        if step % 10 == 9:
            with torch.no_grad():  # an evaluation: not a step, the running method
                model.eval()
                model(torch.randn(4, 37))
                model.train()
    return state.stats()["decision"], seen


@pytest.mark.parametrize("costs,choice", [
    # rank 1 is slow with the compressed all-gather: the slowest rank's periods decide
    ([{"rs+ag": 0.10, "rs": 0.20, "dense": 0.30}, {"rs+ag": 0.35, "rs": 0.20, "dense": 0.30}], "rs"),
    ([{"rs+ag": 0.10, "rs": 0.20, "dense": 0.30}, {"rs+ag": 0.12, "rs": 0.20, "dense": 0.30}], "rs+ag"),
    ([{"rs+ag": 0.50, "rs": 0.40, "dense": 0.30}, {"rs+ag": 0.50, "rs": 0.40, "dense": 0.30}], "dense"),
])
def test_auto_keeps_the_fastest_on_every_rank(costs, choice):
    outs = run_world(_decide, 2, costs)
    assert outs[0] == outs[1]  # the same decisions and the same method every step, on every rank
    decision, seen = outs[0]
    assert decision["phase"] == "exploit" and decision["choice"] == choice, decision
    assert {m for m, *_ in seen[:20]} == {"rs+ag", "rs", "dense"} or choice == "dense"
    # the comms follow the switch: the all-gather compressed only under rs+ag, the reduce-scatter under both THC ones
    assert all(ag == (m == "rs+ag") and rs == (m != "dense") for m, ag, rs in seen), seen
    assert all(m == choice for m, *_ in seen[-5:])


def test_auto_with_bf16_policy():
    outs = run_world(_decide, 2, [{"rs+ag": 0.5, "rs": 0.4, "dense": 0.3}] * 2, torch.bfloat16)
    assert outs[0][0]["choice"] == "dense"


def _mismatch(rank, world, other):
    """Rank 1 registers with other options: the registration's handshake raises on every
    rank, before any collective could pair with another."""
    import hhook.fsdp
    from hhook.errors import ConfigMismatchError

    model = _shard(_model())
    try:
        hhook.fsdp.register(model, **({} if rank == 0 else other))
    except ConfigMismatchError as e:
        return "raised" if "bits='auto'" in str(e) else str(e)
    return "ok"


@pytest.mark.parametrize("other", [{"all_gather": False}, {"bits": 4}, {"all_gather": 6}])
def test_auto_options_mismatch_raises_on_every_rank(other):
    assert run_world(_mismatch, 2, other) == ["raised", "raised"]


def _hsdp(rank, world):
    import hhook.fsdp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
    model = _shard(_model(), mesh=mesh)
    with logged("hhook.fsdp") as lines:
        state = hhook.fsdp.register(model)
    model(torch.randn(4, 37)).sum().backward()
    return lines, state.decision, state.stats()["compressed_calls"] > 0


def test_auto_on_a_replicate_mesh_compresses_without_measuring():
    for lines, decision, compressed in run_world(_hsdp, 2):
        assert any("without measuring: its mesh has a replicate dimension" in ln for ln in lines), lines
        assert decision is None and compressed


def _fixed(rank, world):
    import hhook.fsdp

    model = _shard(_model())
    state = hhook.fsdp.register(model, bits=4)
    model(torch.randn(4, 37)).sum().backward()
    return state.decision, hhook.fsdp.all_gather_stats(model)


def test_integer_bits_never_measure():
    assert run_world(_fixed, 2) == [(None, None)] * 2
