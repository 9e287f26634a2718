"""A checkpoint of other options loaded on one rank of an FSDP2 job under ``bits="auto"``
(``hhook.fsdp.register``'s default; issue 58, item 5): every rank raises
ConfigMismatchError at the next all-gather or reduce-scatter, within seconds, naming the
option and each rank's value. Until that exchange the loading rank runs the decision every
rank verified (hhook.fsdp.auto.Decider.live), so its collectives stay the others'; the mark
rides in the compressed all-gather's header, at the end of a dense all-gather's chunk, in a
dense reduce-scatter's sum or in THC's reduce-scatter (hhook.schedule.load_check). Before,
both ranks raised Gloo's own timeout after the group's whole timeout (:data:`PG_TIMEOUT_S`
here), naming nothing.

Ranks that all load go on as before, bit for bit: the check costs one marked exchange,
counted nowhere.
"""

import time

import pytest
import torch
import torch.distributed as dist

from tests.reliability.test_one_sided_load import FAST_S, PG_TIMEOUT_S, _check, _said
from tests.reliability.test_one_sided_load_fsdp import _MESH, _group, _model, trained, trains
from tests.support.distributed import run_outcomes

pytest.importorskip("torch.distributed.fsdp")

#: Each case: (the method the decision holds, or None: a fresh decision, loaded right after
#: register; where rank 1 loads: "between" steps, "before optimizer step", "after forward";
#: the parameters' all-gather customised (small min_numel) or FSDP's own; compiled).
CASES = {
    "fresh": (None, "between", True, False),
    "rs+ag": ("rs+ag", "between", True, False),
    "rs": ("rs", "between", True, False),
    "dense": ("dense", "between", True, False),
    "dense, FSDP's all-gather": ("dense", "between", False, False),
    "rs, before the optimizer step": ("rs", "before optimizer step", True, False),
    "rs+ag, after the forward": ("rs+ag", "after forward", True, False),
    "dense, after the forward": ("dense", "after forward", True, False),
    "rs+ag, compiled": ("rs+ag", "between", True, True),
}


def _state(held):
    import hhook
    from hhook.decision import Decision
    from hhook.fsdp.auto import CANDIDATES

    state = hhook.THCState(bits="auto")
    if held is not None:
        decision = Decision(list(CANDIDATES))
        decision.phase, decision.choice, decision.decided_at = "exploit", held, 0
        state.decision = decision.state_dict()
    return state


def _register(state, customised):
    import hhook.fsdp
    from hhook.fsdp.all_gather import AllGatherOptions

    model = _model()
    hhook.fsdp.register(model, state=state, all_gather=AllGatherOptions(min_numel=256) if customised else None)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _loss(model, rank):
    return (model(torch.randn(8, 6)) * (1 + 9 * rank)).sum()  # rank 1's gradient about 10x rank 0's


def _train(model, opt, rank):
    _loss(model, rank).backward()
    opt.step()
    opt.zero_grad()


def _one_sided(rank, held, where, customised, compiled):
    """Two optimizer steps (none for a fresh decision), then rank 1 alone loads a
    checkpoint of another ``block_size`` at ``where``: what the rest of that step raised
    (the forward alone where the load came between steps and the all-gather is hhook's,
    so the error must come from it), in how many seconds from the load, and the method the
    others ran. Then every rank loads it and registers a new model: what two more steps
    raised (nothing)."""
    import hhook

    saved = hhook.THCState(bits="auto", block_size=256).state_dict()
    state = _state(held)
    model, opt = _register(state, customised)
    run = torch.compile(model) if compiled else model
    for _ in range(0 if held is None else 2):
        _train(run, opt, rank)
    dist.barrier(_group())
    loss = _loss(run, rank) if where == "after forward" else None
    if where == "before optimizer step":
        _loss(run, rank).backward()
    start = time.monotonic()
    if rank == 1:
        state.load_state_dict(saved)
    if where == "before optimizer step":
        opt.step()
        opt.zero_grad()
    if loss is not None:
        first = _said(loss.backward)
    elif customised:
        first = _said(lambda: run(torch.randn(8, 6)))
    else:
        first = _said(lambda: _train(run, opt, rank))
    seconds = time.monotonic() - start
    state.load_state_dict(saved)
    model, opt = _register(state, customised)
    recovered = _said(lambda: _train(model, opt, rank)) + _said(lambda: _train(model, opt, rank))
    return first, seconds, recovered, state.options.block_size


def _worker(rank, world, subgroup):
    if not trains(rank, subgroup):
        return None
    return {name: _one_sided(rank, *case) for name, case in CASES.items()}


@pytest.mark.parametrize("subgroup", [False, True], ids=["world", "subgroup"])
def test_a_one_sided_load_under_bits_auto_raises_on_every_rank_at_the_next_exchange(subgroup):
    for rank, cases in trained(_worker, subgroup):
        for name, (first, seconds, recovered, now) in cases.items():
            _check(first, "block_size", [(0, 1024), (1, 256)])
            _check(first, "load_state_dict", [(0, False), (1, True)])
            assert seconds < FAST_S, (rank, name, seconds)
            assert recovered == "" and now == 256, (rank, name, recovered)


def _grads(model):
    return [p.grad.full_tensor().detach().clone() for p in model.parameters()]


def _reload_worker(rank, world):
    """Per held method and a fresh decision: two runs alike, one reloading its own state
    on every rank after two steps; the next step's gradients, the method it ran and the
    counted calls (reduce-scatter and all-gather) match the run without the reload."""
    import hhook.fsdp

    _MESH.clear()
    out = {}
    for held in (None, "rs+ag", "rs", "dense"):
        runs = []
        for reload in (False, True):
            state = _state(held)
            model, opt = _register(state, True)
            torch.manual_seed(10 + rank)
            for _ in range(2):
                _train(model, opt, rank)
            if reload:
                state.load_state_dict(state.state_dict())
            _loss(model, rank).backward()
            gathered = hhook.fsdp.all_gather_stats(model)
            runs.append((_grads(model), state.decision.method_of(state.iter), state.stats()["compressed_calls"],
                         state.stats()["dense_calls"], gathered["compressed_calls"], gathered["dense_calls"]))
        out[held] = runs
    return out


def test_a_reload_on_every_rank_under_bits_auto_resumes_bit_for_bit():
    outcomes = run_outcomes(_reload_worker, 2, pg_timeout_s=PG_TIMEOUT_S, timeout=300)
    for rank, o in enumerate(outcomes):
        assert o["error"] is None, (rank, o)
        for held, (plain, reloaded) in o["value"].items():
            assert plain[1] == reloaded[1] == (held or "rs+ag"), (held, plain[1:], reloaded[1:])
            assert plain[2:] == reloaded[2:], (held, plain[2:], reloaded[2:])
            assert all(torch.equal(a, b) for a, b in zip(plain[0], reloaded[0])), held
