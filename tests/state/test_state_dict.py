"""``THCState.state_dict()`` / ``load_state_dict()``: plain data that ``torch.load(...,
weights_only=True)`` reads, the one representation pickling uses too, and a resume that
continues bit for bit like the run that was never interrupted (DDP, eager and compiled,
both scale modes, heterogeneous ranks, a subgroup beside WORLD)."""

import io

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hhook
from hhook.stats import Counters
from tests.support.distributed import run_world
from tests.support.ready_order import ReadyOrderMLP

MODES = ["agreed", "predicted", "gathered"]
STEPS, SAVE_AT = 8, 4


def _round_trip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _net(compiled=False):
    """Compiled DDP makes gradients ready in yet another order (the compiled backward's), so
    a bucket of one parameter is the model whose order cannot change."""
    if compiled:
        torch.manual_seed(0)
        return torch.nn.Linear(16, 4, bias=False)
    return ReadyOrderMLP()


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 16, generator=g) * (10.0 if rank == 1 else 1.0)  # rank 1's gradient is ~10x
    return x, torch.randint(0, 4, (16,), generator=g)


def _run(rank, scales, compiled, steps, checkpoint=None, via_register=False):
    """Train ``steps`` from scratch, or from ``checkpoint`` (model, optimizer and hook state
    as ``torch.load(weights_only=True)`` returned them); returns the parameters and, at
    ``SAVE_AT``, a checkpoint."""
    own = dist.new_group([0, 1])  # the program's own sub-group beside WORLD
    model = _net(compiled)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ddp = DDP(model)
    first = 0
    if checkpoint is not None and via_register:  # the docstring's resume: register(new_ddp, state=<a state dict>)
        state = hhook.register(ddp, state=checkpoint["hhook"])
    else:
        state = hhook.register(ddp, bits=3, scales=scales, error_feedback=True)
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
        opt.load_state_dict(checkpoint["opt"])
        if not via_register:
            state.load_state_dict(checkpoint["hhook"])
        first = checkpoint["step"]
    run = torch.compile(ddp, backend="aot_eager") if compiled else ddp
    saved = None
    for step in range(first, steps):
        if step == SAVE_AT and checkpoint is None:
            saved = _round_trip({"model": model.state_dict(), "opt": opt.state_dict(),
                                 "hhook": state.state_dict(), "step": step})
        opt.zero_grad()
        x, y = _batch(rank, step)
        torch.nn.functional.cross_entropy(run(x), y).backward()
        opt.step()
        t = torch.ones(1)
        dist.all_reduce(t, group=own)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return params, saved, state.stats()


def _resume_worker(rank, world, scales, compiled):
    whole, saved, stats = _run(rank, scales, compiled, STEPS)
    resumed, _, resumed_stats = _run(rank, scales, compiled, STEPS, checkpoint=saved)
    carried = sum(ks["residual"] is not None for p in saved["hhook"]["policies"].values() for ks in p["keys"].values())
    return torch.equal(whole, resumed), stats, resumed_stats, carried, saved["hhook"]["calls"]


@pytest.mark.parametrize("compiled", [pytest.param(False, marks=pytest.mark.quick), True], ids=["eager", "compiled"])
@pytest.mark.parametrize("scales", MODES)
def test_ddp_resume_from_state_dict_is_bit_exact(scales, compiled):
    for identical, stats, resumed, carried, calls in run_world(_resume_worker, 2, scales, compiled, timeout=300):
        assert carried >= 1 and calls >= 1  # the checkpoint carries residuals and the call counter
        assert identical  # against the run that was never interrupted
        assert stats["compressed_calls"] == STEPS - 2  # start_iter=2
        assert resumed["compressed_calls"] == stats["compressed_calls"] and resumed["iter"] == STEPS


def _register_dict_worker(rank, world, scales):
    whole, saved, _ = _run(rank, scales, False, STEPS)
    resumed, _, stats = _run(rank, scales, False, STEPS, checkpoint=saved, via_register=True)
    errors = []
    ddp = DDP(torch.nn.Linear(2, 2))
    for bad in (42, {"ranks": [saved["hhook"]]}):
        try:
            hhook.register(ddp, state=bad)
        except TypeError as e:
            errors.append(str(e))
    return torch.equal(whole, resumed), stats, errors


@pytest.mark.parametrize("scales", MODES)
def test_register_takes_a_state_dict(scales):
    """hhook.register(new_ddp, state=torch.load(path, weights_only=True)["hook"]), the
    docstring's resume, raised AttributeError: 'dict' object has no attribute 'node_layout'."""
    for identical, stats, errors in run_world(_register_dict_worker, 2, scales):
        assert identical and stats["compressed_calls"] == STEPS - 2 and stats["iter"] == STEPS
        assert len(errors) == 2 and "state must be a THCState or a THCState.state_dict() dict" in errors[0]
        assert "got int" in errors[0] and "'ranks'" in errors[1], errors


def _allreduce_worker(rank, world, scales):
    """thc_allreduce on a subgroup: state_dict, pickling and the live state continue alike."""
    group = dist.new_group([0, 1])
    live = hhook.THCState(group, bits=3, error_feedback=True, seed=5, scales=scales)
    for step in range(3):
        x = torch.randn(5000, generator=torch.Generator().manual_seed(step)) * (0.0 if rank == 1 else 1.0)
        hhook.thc_allreduce(x, live, key="w")
    plain = _round_trip(live.state_dict())
    from_dict = hhook.THCState(group)
    from_dict.load_state_dict(plain)
    buf = io.BytesIO()
    torch.save(live, buf)
    buf.seek(0)
    pickled = torch.load(buf, weights_only=False)
    pickled.process_group = group
    outs = []
    for state in (live, from_dict, pickled):
        x = torch.randn(5000, generator=torch.Generator().manual_seed(9)) * (rank + 1)
        hhook.thc_allreduce(x, state, key="w")
        outs.append(x)
    same_group = from_dict.process_group is group
    return [torch.equal(outs[0], o) for o in outs[1:]], same_group, from_dict.stats()["compressed_calls"], outs[0]


@pytest.mark.parametrize("scales", MODES)
def test_thc_allreduce_state_dict_and_pickle_continue_alike(scales):
    res = run_world(_allreduce_worker, 2, scales)
    for same, same_group, calls, _ in res:
        assert same == [True, True] and same_group and calls == 4
    expected = torch.randn(5000, generator=torch.Generator().manual_seed(9)) * 1.5
    assert ((res[0][3] - expected).norm() / expected.norm()).item() < 0.6  # 3 bits plus carried residuals: the mean, not noise (~1)


def test_state_dict_is_plain_data():
    state = hhook.THCState(bits=4, scales="predicted", topology=2)
    state.policy("predicted").key_state(0, 100, 2, layout=(((4, 5), "torch.float32"),))
    saved = _round_trip(state.state_dict())
    assert saved["bits"] == 4 and saved["topology"] == 2 and saved["format"] == 1
    assert saved["policies"]["predicted"]["keys"][0]["layout"] == (((4, 5), "torch.float32"),)
    loaded = hhook.THCState()
    loaded.load_state_dict(saved)
    assert (loaded.options.bits, loaded.options.scales, loaded.options.topology) == (4, "predicted", 2)
    assert loaded.policy("predicted").keys[0].numel == 100


def test_old_pickles_still_load():
    """What ``torch.save(state)`` wrote before state_dict(): live objects in a dict."""
    old = {"bits": 3, "block_size": 1024, "seed": 1, "error_feedback": False, "start_iter": 2, "scales": "auto",
           "topology": "flat", "iter": 7, "calls": 11, "_stats": {"compressed_calls": 5, "wire_bytes": 10},
           "policies": {"agreed": hhook.scales.ScalePolicy(3, predict=False)}, "inter": None,
           "_intra": Counters(), "layout": None}
    state = hhook.THCState.__new__(hhook.THCState)
    state.__setstate__(old)
    o = state.options
    assert (o.bits, o.scales, o.chunk_mb, state.iter, state.counters.calls) == (3, "agreed", 0, 7, 11)
    assert state.counters.snapshot()["compressed_calls"] == 5 and state.process_group is None


def test_components_with_their_own_state_dict_are_saved_through_it():
    """The counters and a live decision are saved as their state_dict() and load in place."""
    from hhook.decision import Decision

    state = hhook.THCState(bits="auto")
    state.counters.add("dense_calls", 4, 4)
    state.decision = Decision(["thc:4", "fp32"])
    state.decision.plain.append(0.25)
    saved = _round_trip(state.state_dict())
    assert saved["_stats"]["dense_calls"] == 1 and saved["decision"]["plain"] == [0.25]
    fresh = hhook.THCState()
    fresh.decision = decision = Decision(["thc:4", "fp32"])
    counters = fresh.counters
    fresh.load_state_dict(saved)
    assert fresh.counters is counters and counters.snapshot()["dense_calls"] == 1 and fresh.options.bits == "auto"
    assert fresh.decision is decision and decision.plain == [0.25]


@pytest.mark.quick
@pytest.mark.parametrize("bad", [None, {"model": 1}, {"bits": 99}, {"bits": 4, "format": 99}])
def test_bad_state_dicts_are_refused(bad):
    with pytest.raises(ValueError):
        hhook.THCState().load_state_dict(bad)
