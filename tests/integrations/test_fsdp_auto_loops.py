"""hhook.fsdp.register's bits="auto" in the training loops users write (issue 51): a step
is an optimizer step whatever the loop, its method is fixed before its first all-gather
of any kind, and a loaded state keeps its decision in every registration order. Gloo on
CPU, 2 ranks; each rank's clock advances by the calls that ran (tests/support/fsdp_auto.py)."""

from __future__ import annotations

import io

import pytest
import torch

from tests.support.distributed import logged, run_world
from tests.support.fsdp_auto import Clock, clocked, model, ran_as, shard

fsdp = pytest.importorskip("torch.distributed.fsdp")

#: Seconds per call, (compressed, dense): per optimizer step of one forward and backward
#: rs+ag 0.36, rs 0.20, dense 0.08 (4 reduce-scatters; 2 modules' all-gathers, twice).
COSTS = {"rs": (0.04, 0.01), "ag": (0.05, 0.01)}


def _registered(clock):
    import hhook.fsdp
    from hhook.fsdp.all_gather import find_state

    m = shard(model())
    state = hhook.fsdp.register(m)
    clock.watch(state, find_state(m))
    clocked(state, clock)
    return m, state, torch.optim.SGD(m.parameters(), lr=0.01)


def _loop(rank, world, loop, steps=30):
    """``loop``: "eval" (the root in eval mode while gradients flow), "accumulate" (four
    microbatches, each with its reduce-scatter), "sam" (two passes, the second on
    perturbed parameters), "manual" (a hand-written update, no torch optimizer)."""
    clock = Clock(COSTS, extra=1.0)
    m, state, opt = _registered(clock)
    if loop == "eval":
        m.eval()
    torch.manual_seed(3 + rank)
    params = list(m.parameters())
    per_step = []
    for _ in range(steps):
        start = clock()
        passes = 4 if loop == "accumulate" else 2 if loop == "sam" else 1
        for i in range(passes):
            m(torch.randn(8, 37)).square().mean().backward()
            if loop == "sam" and i == 0:  # ascend to the neighbourhood's worst point, then its gradient
                with torch.no_grad():
                    ascent = [0.05 * p.grad for p in params]
                    for p, e in zip(params, ascent):
                        p.add_(e)
                opt.zero_grad()
        if loop == "manual":
            with torch.no_grad():
                for p in params:
                    p.add_(p.grad, alpha=-0.01)
                    p.grad = None
        else:
            if loop == "sam":
                with torch.no_grad():
                    for p, e in zip(params, ascent):
                        p.sub_(e)
            opt.step()
            opt.zero_grad()
        per_step.append((ran_as(clock.step()), clock.now - start))
    return state.stats()["decision"], per_step


@pytest.mark.parametrize("loop", ["eval", "accumulate", "sam", "manual"])
def test_a_step_is_an_optimizer_step_whatever_the_loop(loop):
    """Rows 1 and 5: the root in eval mode decided nothing (every step ran rs+ag); four
    reduce-scatters per optimizer step made each microbatch a step (methods changed
    inside an optimizer step, and the turns measured microbatches). Every optimizer step
    runs one method, the turns measure whole optimizer steps, and the choice is the
    cheapest of them, within the usual number of steps."""
    from hhook.decision import LAG, WINDOW

    outs = run_world(_loop, 2, loop)
    assert outs[0] == outs[1]
    decision, per_step = outs[0]
    assert "mixed" not in [m for m, _ in per_step], per_step
    true = {}
    for method, cost in per_step[2:]:  # (a job's first steps before its first optimizer step may split in two)
        true.setdefault(method, set()).add(round(cost, 6))
    assert all(len(costs) == 1 for costs in true.values()), true
    true = {m: costs.pop() for m, costs in true.items()}
    assert set(true) == {"rs+ag", "rs", "dense"}, true
    assert decision["phase"] == "exploit" and decision["choice"] == min(true, key=true.get) == "dense", decision
    record = decision["decisions"][0]
    assert record["iter"] <= 3 * WINDOW + LAG + 2, record
    for m, ms in {**record["periods_ms"], **record["dropped_ms"]}.items():
        assert ms == pytest.approx(1e3 * true[m]), (m, ms, true)
    assert all(m == "dense" for m, _ in per_step[record["iter"] + 1:])


def _one_method(rank, world, loop, steps=24):
    """Every all-gather of module 0 within one optimizer step gives the same bits:
    "reentrant" checkpoints the root (a no_grad forward, then the backward's recomputation),
    "prefetch" unshards module 0 (async) before the root's forward."""
    from torch.utils.checkpoint import checkpoint

    from hhook.fsdp.all_gather import THCAllGather

    clock = Clock(COSTS)
    m, state, opt = _registered(clock)
    gathered = []
    call = THCAllGather.__call__

    def recorded(self, output_tensor, input_tensor, group, async_op=False):
        out = call(self, output_tensor, input_tensor, group, async_op)
        if self.name == "0":
            gathered.append(output_tensor.detach().clone())
        return out

    THCAllGather.__call__ = recorded  # this rank's process only (a forked worker)
    torch.manual_seed(3 + rank)
    differ, methods = [], set()
    for step in range(steps):
        gathered.clear()
        x = torch.randn(8, 37, requires_grad=True)
        if loop == "reentrant":
            out = checkpoint(m, x, use_reentrant=True)
        else:
            m[0].unshard(async_op=True)
            out = m(x)
        out.square().mean().backward()
        opt.step()
        opt.zero_grad()
        methods.add(ran_as(clock.step()))
        assert len(gathered) >= 2, len(gathered)  # the forward's and the backward's
        if any(not torch.equal(t, gathered[0]) for t in gathered):
            differ.append(step)
    return differ, sorted(methods)


@pytest.mark.parametrize("loop", ["reentrant", "prefetch"])
def test_a_step_keeps_its_method_from_its_first_all_gather(loop):
    """Row 4: the no_grad forward of reentrant checkpointing, or a prefetch, all-gathered
    with the previous step's method and the backward with the next one's (module 0's
    weights differed by up to 6.5e-4 at every switch)."""
    for differ, methods in run_world(_one_method, 2, loop):
        assert methods == ["dense", "rs", "rs+ag"]  # the turns switched methods between steps
        assert differ == []


def _snapshot(state) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    return {"dict": state.state_dict(), "pickle": buf.getvalue()}


def _resumed(snapshot, order, params, clock):
    """A fresh model and registration (a restarted job) from ``snapshot``, in ``order``."""
    import hhook
    import hhook.fsdp
    from hhook.fsdp.all_gather import find_state

    m = shard(model())
    m.load_state_dict(params)
    if order == "register, load":
        state = hhook.fsdp.register(m)
        state.load_state_dict(snapshot["dict"])
    else:
        if order == "load, register":
            state = hhook.THCState(bits="auto")
            state.load_state_dict(snapshot["dict"])
        else:  # a pickled state
            state = torch.load(io.BytesIO(snapshot["pickle"]), weights_only=False)
        hhook.fsdp.register(m, state=state)
    clock.watch(state, find_state(m))
    clocked(state, clock)
    return m, state, torch.optim.SGD(m.parameters(), lr=0.01)


def _train(rank, world, order, save, steps=30):
    """Steps of two microbatches (gradient accumulation: the first unsynchronized), saved
    before microbatch ``save[1]`` of step ``save[0]`` (0: between steps, 1: inside the
    step) and resumed in ``order``; the method of every optimizer step."""
    clock = Clock({"rs": (0.04, 0.03), "ag": (0.05, 0.01)}, extra=0.5)
    m, state, opt = _registered(clock)
    torch.manual_seed(3 + rank)
    methods = []
    for step in range(steps):
        for i in range(2):
            if save == (step, i):
                m, state, opt = _resumed(_snapshot(state), order, m.state_dict(), clock)
            m.set_requires_gradient_sync(i > 0)
            m(torch.randn(8, 37)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        methods.append(ran_as(clock.step()))
    return methods, state.stats()["decision"]["choice"], state.iter


SAVES = (None, (7, 0), (11, 1), (24, 1))  # None: the uninterrupted job


def _train_saved(rank, world, order):
    """:func:`_train` without a save and with each of ``SAVES``, one after another in one
    world (a world each cost a start of 2 ranks, four times a test)."""
    return [_train(rank, world, order, save) for save in SAVES]


@pytest.mark.parametrize("order", ["register, load", "load, register", "pickled"])
def test_a_resumed_job_runs_every_step_as_the_job_that_saved(order):
    """Row 2: a state loaded before registration (or pickled) lost its decision and
    explored again (12 of 24 resumed steps ran slower candidates). Saved in the middle of
    the exploration, inside a step (between its microbatches) and after the decision,
    the resumed job runs the method of the uninterrupted job at every step."""
    ranks = run_world(_train_saved, 2, order)
    whole = [runs[0] for runs in ranks]
    assert whole[0] == whole[1] and whole[0][1] == "dense" and whole[0][2] == 30
    assert "mixed" not in whole[0][0] and len(set(whole[0][0])) == 3
    for i, save in enumerate(SAVES[1:], 1):
        for runs in ranks:
            methods, choice, steps = runs[i]
            assert (methods, choice, steps) == whole[0], (save, methods, whole[0][0])


def _eval_resumed(rank, world, order, steps=22):
    """Evaluate right before and right after a save (the latter starts the next step),
    and right after resuming from either save: the same outputs, bit for bit."""
    clock = Clock(COSTS)
    m, state, opt = _registered(clock)
    torch.manual_seed(3 + rank)
    x_eval = torch.randn(4, 37)

    def evaluate(module):
        module.eval()
        with torch.no_grad():
            out = module(x_eval)
        module.train()
        return out

    differ, methods = [], set()
    for step in range(steps):
        m(torch.randn(8, 37)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        methods.add(ran_as(clock.step()))
        before = _snapshot(state)  # between steps
        ours = evaluate(m)
        inside = _snapshot(state)  # inside the step the evaluation started
        for snap in (before, inside):
            fresh, _, _ = _resumed(snap, order, m.state_dict(), Clock(COSTS))
            if not torch.equal(evaluate(fresh), ours):
                differ.append((step, snap is inside))
    return differ, sorted(methods)


@pytest.mark.parametrize("order", ["register, load", "load, register", "pickled"])
def test_evaluation_after_a_resume_is_the_evaluation_before_the_save(order):
    """Row 6: a fresh registration all-gathered with rs+ag whatever the loaded decision
    said (outputs differed by up to 5.4e-3)."""
    for differ, methods in run_world(_eval_resumed, 2, order, timeout=400):
        assert differ == []
        assert methods == ["dense", "rs", "rs+ag"]


def _idle(rank, world):
    import hhook.fsdp

    m = shard(model())
    state = hhook.fsdp.register(m, bits=4)
    with logged("hhook") as lines:
        state.warn_if_idle("the program")
    return lines


def test_the_idle_warning_of_an_fsdp_state_speaks_of_fsdp():
    for lines in run_world(_idle, 2):
        assert len(lines) == 1 and "hhook.fsdp.register on an FSDP2 model" in lines[0], lines
        assert "DDP" not in lines[0] and "hhook.register(ddp_model" not in lines[0], lines
