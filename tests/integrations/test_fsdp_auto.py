"""hhook.fsdp.register's bits="auto" (src/hhook/fsdp/auto.py): the DDP hook's decision between
THC's reduce-scatter with the compressed all-gather, THC's reduce-scatter alone and plain
FSDP2, on FSDP2 with Gloo on CPU. Step times come from a fake clock per rank."""

from __future__ import annotations

import pytest
import torch

from tests.support.distributed import case_values, logged, run_cases, run_world
from tests.support.fsdp_auto import model as _model, shard as _shard

fsdp = pytest.importorskip("torch.distributed.fsdp")


def _fake_clock(state, switch, costs):
    """Each call ends the step that ran under ``switch``'s method: time moves by its cost."""
    now = [0.0]

    def clock():
        now[0] += costs[switch.method]
        return now[0]

    state.prober.clock = clock


def _decide(rank, world, costs, param_dtype=None, steps=30):
    import hhook.fsdp
    from hhook.fsdp.all_gather import find_state

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


FASTEST = [
    # rank 1 is slow with the compressed all-gather: the slowest rank's periods decide
    ([{"rs+ag": 0.10, "rs": 0.20, "dense": 0.30}, {"rs+ag": 0.35, "rs": 0.20, "dense": 0.30}], "rs"),
    ([{"rs+ag": 0.10, "rs": 0.20, "dense": 0.30}, {"rs+ag": 0.12, "rs": 0.20, "dense": 0.30}], "rs+ag"),
    ([{"rs+ag": 0.50, "rs": 0.40, "dense": 0.30}, {"rs+ag": 0.50, "rs": 0.40, "dense": 0.30}], "dense"),
]
BF16_COSTS = [{"rs+ag": 0.5, "rs": 0.4, "dense": 0.3}] * 2


@pytest.fixture(scope="module")
def shared():
    """``key -> [what each rank returned]``: this module's 2-rank scenarios that neither
    raise on purpose nor patch a class (``_accumulate``'s timed reduce-scatter stays in
    worlds of its own), in one world (not 7), each with its own model, sharding, state and
    fake clock."""
    cases = [*[(("fastest", choice), _decide, (costs,)) for costs, choice in FASTEST],
             (("bf16",), _decide, (BF16_COSTS, torch.bfloat16)), (("hsdp",), _hsdp, ()), (("fixed",), _fixed, ()),
             (("two_forwards",), _two_forwards, ())]
    runs = run_cases(cases, 2)
    return lambda *key: case_values(runs[key])


@pytest.mark.parametrize("costs,choice", FASTEST)
def test_auto_keeps_the_fastest_on_every_rank(shared, costs, choice):
    outs = shared("fastest", choice)
    assert outs[0] == outs[1]  # the same decisions and the same method every step, on every rank
    decision, seen = outs[0]
    assert decision["phase"] == "exploit" and decision["choice"] == choice, decision
    assert {m for m, *_ in seen[:20]} == {"rs+ag", "rs", "dense"} or choice == "dense"
    # the comms follow the switch: the all-gather compressed only under rs+ag, the reduce-scatter under both THC ones
    assert all(ag == (m == "rs+ag") and rs == (m != "dense") for m, ag, rs in seen), seen
    assert all(m == choice for m, *_ in seen[-5:])


def test_auto_with_bf16_policy(shared):
    outs = shared("bf16")
    assert outs[0][0]["choice"] == "dense"


def _mismatch(rank, world, other, named):
    """Rank 1 registers with other options: the registration's handshake raises on every
    rank, before any collective could pair with another, naming the option that differs
    and each rank's value."""
    import hhook.fsdp
    from hhook.errors import ConfigMismatchError

    model = _shard(_model())
    try:
        hhook.fsdp.register(model, **({} if rank == 0 else other))
    except ConfigMismatchError as e:
        return "raised" if named in str(e) else str(e)
    return "ok"


@pytest.mark.parametrize("other, named", [({"all_gather": False}, "all_gather: 'compressed' on rank 0, 'plain' on rank 1"),
                                          ({"bits": 4}, "bits: 'auto' on rank 0, 4 on rank 1"),
                                          ({"all_gather": 6}, "ag_bits: 8 on rank 0, 6 on rank 1")])
def test_auto_options_mismatch_raises_on_every_rank(other, named):
    assert run_world(_mismatch, 2, other, named) == ["raised", "raised"]


def _hsdp(rank, world):
    import hhook.fsdp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
    model = _shard(_model(), mesh=mesh)
    with logged("hhook.fsdp") as lines:
        state = hhook.fsdp.register(model)
    model(torch.randn(4, 37)).sum().backward()
    return lines, state.decision, state.stats()["compressed_calls"] > 0


def test_auto_on_a_replicate_mesh_compresses_without_measuring(shared):
    for lines, decision, compressed in shared("hsdp"):
        assert any("without measuring: its mesh has a replicate dimension" in ln for ln in lines), lines
        assert decision is None and compressed


def _fixed(rank, world):
    import hhook.fsdp

    model = _shard(_model())
    state = hhook.fsdp.register(model, bits=4)
    model(torch.randn(4, 37)).sum().backward()
    return state.decision, hhook.fsdp.all_gather_stats(model)


def test_integer_bits_never_measure(shared):
    assert shared("fixed") == [(None, None)] * 2


def _timed_comms(switch, now, forward_cost, reduce_scatter_cost):
    """Fake time in this rank's process: every training forward of the root (a
    microbatch) costs ``forward_cost[method]``, every reduce-scatter call
    ``reduce_scatter_cost[method]`` of the method running then."""
    from hhook.fsdp.reduce_scatter import THCReduceScatter

    call = THCReduceScatter.__call__

    def timed(self, *args, **kwargs):
        now[0] += reduce_scatter_cost[switch.method]
        return call(self, *args, **kwargs)

    THCReduceScatter.__call__ = timed  # this rank's process only (a forked worker)

    def forward(module, args):
        if module.training and torch.is_grad_enabled():
            now[0] += forward_cost[switch.method]

    return forward


def _accumulate(rank, world, micro, steps=40):
    """``micro`` microbatches per optimizer step, FSDP's gradient sync off on all but the last."""
    import hhook.fsdp
    from hhook.fsdp.all_gather import find_state

    model = _shard(_model())
    state = hhook.fsdp.register(model)
    switch = find_state(model).switch
    now = [0.0]
    # Per microbatch the compressed all-gather is a little slower and plain FSDP a little
    # faster; the reduce-scatter, once a step, decides: THC's at 0.05 s a call, plain 0.8 s.
    forward = _timed_comms(switch, now, {"rs+ag": 0.12, "rs": 0.13, "dense": 0.10},
                           {"rs+ag": 0.05, "rs": 0.05, "dense": 0.8})
    model.register_forward_pre_hook(forward)  # after the decision's pre-hook, which is prepended
    state.prober.clock = lambda: now[0]
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    torch.manual_seed(3)
    methods = []
    for step in range(steps):
        seen = set()
        for i in range(micro):
            model.set_requires_gradient_sync(i == micro - 1)
            model(torch.randn(8, 37)).square().mean().backward()
            seen.add(switch.method)
        methods.append(seen)
        opt.step()
        opt.zero_grad()
    return state.stats()["decision"], methods, state.iter


@pytest.mark.parametrize("micro", [4, 8])
def test_auto_measures_whole_optimizer_steps_under_gradient_accumulation(micro):
    """One optimizer step costs micro * forward + 4 reduce-scatter calls (4 FSDP modules):
    rs+ag 0.12 * micro + 0.2, rs 0.13 * micro + 0.2, dense 0.10 * micro + 3.2. The step
    decides (rs+ag), not the microbatches without a reduce-scatter (where plain is fastest)."""
    outs = run_world(_accumulate, 2, micro)
    assert outs[0] == outs[1]
    decision, methods, steps = outs[0]
    assert decision["choice"] == "rs+ag", decision
    true = {m: 1e3 * (f * micro + 4 * r) for m, f, r in (("rs+ag", 0.12, 0.05), ("rs", 0.13, 0.05),
                                                          ("dense", 0.10, 0.8))}
    record = decision["decisions"][0]
    for m, ms in {**record["periods_ms"], **record["dropped_ms"]}.items():
        assert ms == pytest.approx(true[m]), (m, ms, true[m])
    assert all(len(seen) == 1 for seen in methods), methods  # one method for every microbatch of a step
    assert steps == 40  # state.iter counts optimizer steps, not forwards


def _two_forwards(rank, world, steps=24):
    """Two forwards (A and B) before one backward, every step; every all-gather of module
    0 in a step (forward A, forward B, the backward's re-gathers) must give the same bits."""
    import hhook.fsdp
    from hhook.fsdp.all_gather import THCAllGather, find_state

    model = _shard(_model())
    state = hhook.fsdp.register(model)
    ag = find_state(model)
    _fake_clock(state, ag.switch, {"rs+ag": 0.10, "rs": 0.11, "dense": 0.12})
    gathered = []
    call = THCAllGather.__call__

    def recorded(self, output_tensor, input_tensor, group, async_op=False):
        out = call(self, output_tensor, input_tensor, group, async_op)
        if self.name == "0":
            gathered.append((ag.switch.method, output_tensor.detach().clone()))
        return out

    THCAllGather.__call__ = recorded
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        torch.manual_seed(3)
        differ, methods = [], set()
        for step in range(steps):
            gathered.clear()
            if step == 0:  # one step of one forward: the later steps' forwards B fall on either parity
                model(torch.randn(8, 37)).square().mean().backward()
            else:
                a, b = model(torch.randn(8, 37)), model(torch.randn(8, 37))
                (a.square().mean() - b.mean()).backward()
                assert len(gathered) >= 3, len(gathered)  # forward A, forward B, the backward's re-gather
            opt.step()
            opt.zero_grad()
            methods |= {m for m, _ in gathered}
            if any(m != gathered[0][0] or not torch.equal(t, gathered[0][1]) for m, t in gathered):
                differ.append(step)
    finally:  # the world's other scenarios (the shared fixture) gather unrecorded
        THCAllGather.__call__ = call
    return differ, sorted(methods)


def test_two_forwards_before_one_backward_use_one_method(shared):
    for differ, methods in shared("two_forwards"):
        assert methods == ["dense", "rs", "rs+ag"]  # the turns switched methods between steps
        assert differ == []


COSTS = {"rs+ag": 0.30, "rs": 0.20, "dense": 0.25}


def _resumable(rank, world, save_at, steps=30):
    """Train ``steps`` steps; with ``save_at``, save the state there and go on in a fresh
    registration (a new model, as a restarted job builds) loaded from it."""
    import hhook.fsdp
    from hhook.decision import Prober
    from hhook.fsdp.all_gather import find_state

    def build():
        model = _shard(_model())
        state = hhook.fsdp.register(model)
        switch = find_state(model).switch
        return model, state, switch, torch.optim.SGD(model.parameters(), lr=0.01)

    model, state, switch, opt = build()
    _fake_clock(state, switch, COSTS)
    torch.manual_seed(3)
    inflight_saved = None
    for step in range(steps):
        if step == save_at:
            saved = state.state_dict()
            model, state, switch, opt = build()
            state.load_state_dict(saved)
            now = [0.0]

            def clock():
                now[0] += COSTS[switch.method]
                return now[0]

            state.prober = Prober(clock)
        model(torch.randn(8, 37)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if save_at is not None and step == save_at + 1:
            inflight_saved = len(state.state_dict()["decision"]["arrived"])  # the reductions in flight, read in
    return state.stats()["decision"], state.iter, inflight_saved


def _whole_and_resumed(rank, world):
    return _resumable(rank, world, None), _resumable(rank, world, 9)  # one world, not two


def test_resume_continues_the_decision_on_each_candidates_true_cost():
    whole, resumed = zip(*run_world(_whole_and_resumed, 2))
    assert whole[0][0]["choice"] == "rs" and whole[0][1] == 30
    for decision, steps, inflight in resumed:
        assert steps == 30 and inflight > 0
        assert decision["choice"] == "rs", decision
        for record in decision["decisions"]:
            for m, ms in {**record["periods_ms"], **record["dropped_ms"]}.items():
                assert ms == pytest.approx(1e3 * COSTS[m]), (m, record)
