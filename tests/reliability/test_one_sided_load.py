"""A checkpoint of other options loaded on one rank and not the other (issue 58, item 5):
every rank raises ConfigMismatchError at the next exchange, within seconds, naming the
option and each rank's value (hhook.schedule.load_check). Before, the loading rank waited
in the options handshake and the other in its exchange, for the group's whole timeout
(:data:`PG_TIMEOUT_S` here: a regression shows as that wait), and each named a wrong cause.

Ranks that all load go on as before: the same options train, other options raise
together at the handshake (tests/reliability/test_mismatch.py's checkpoint rows). The
steady state takes no collective more than before.
"""

import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hhook
from hhook.decision import Decision
from hhook.state.checkpoint import saved_layouts
from tests.schedule.test_rounds import counted
from tests.support.distributed import run_outcomes, run_world

MODES = ("agreed", "predicted", "gathered")
PG_TIMEOUT_S = 60.0
#: Far below the group's timeout, far above the milliseconds it takes (2 shared cores).
FAST_S = 10.0
#: The option a checkpoint changes -> its value there, per scale mode of the running state.
CHANGES = {"bits": lambda scales: 2, "scales": lambda scales: "predicted" if scales == "agreed" else "agreed",
           "block_size": lambda scales: 256}
#: What a thc_allreduce call's error names.
CALL = "this thc_allreduce call"
#: The running value of each option of CHANGES.
RUNNING = {"bits": lambda scales: 4, "scales": lambda scales: scales, "block_size": lambda scales: 1024}


def _net(buckets: str = "several"):
    """1.3 MB of gradients, several DDP buckets once rebuilt (DDP's first holds 1 MB); or
    (``"one"``) 31 kB in one bucket, where a test counts collectives per step."""
    torch.manual_seed(0)
    if buckets == "one":
        return torch.nn.Sequential(torch.nn.Linear(20, 300), torch.nn.Tanh(), torch.nn.Linear(300, 5))
    return torch.nn.Sequential(torch.nn.Linear(20, 1000), torch.nn.Tanh(), torch.nn.Linear(1000, 300), torch.nn.Tanh(),
                               torch.nn.Linear(300, 5))


def _step(ddp, rank):
    """One step on rank-dependent data (rank 1's gradient about 10x rank 0's)."""
    (ddp(torch.randn(8, 20)) * (1 + 9 * rank)).sum().backward()


def _said(fn) -> str:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the subject
        return f"{type(exc).__name__}: {exc}"
    return ""


def _one_sided(rank, loader, scales, option, group=None, steps=3, start_iter=2):
    """Train ``steps`` steps (3: past start_iter, THC; 0 or 1: DDP's plain iterations),
    then ``loader`` alone loads a checkpoint whose ``option`` differs; two more steps: what
    each raised, and in how many seconds from the load. Then every rank loads that
    checkpoint: what the next two steps raised (nothing: training goes on)."""
    saved = hhook.THCState(**{"bits": 4, "scales": scales, option: CHANGES[option](scales)}).state_dict()
    ddp = DDP(_net(), process_group=group, bucket_cap_mb=0.01)  # several buckets: one error each, paired
    state = hhook.register(ddp, bits=4, scales=scales, start_iter=start_iter)
    for _ in range(steps):
        _step(ddp, rank)
    return loaded_on_one(rank, loader, ddp, state, saved, group) + (state.options.as_dict()[option],)


def loaded_on_one(rank, loader, model, state, saved, group=None) -> tuple:
    """``loader`` alone (a rank, or a tuple of ranks) loads ``saved`` into ``state``: what
    the next two steps of ``model`` raised, and in how many seconds from the load the first
    did; then every rank loads it: what the next two steps raised (nothing: training goes on)."""
    dist.barrier(group)
    start = time.monotonic()
    if rank in (loader if isinstance(loader, tuple) else (loader,)):
        state.load_state_dict(saved)
    first = _said(lambda: _step(model, rank))
    seconds = time.monotonic() - start
    again = _said(lambda: _step(model, rank))  # the next exchange raises again, paired
    state.load_state_dict(saved)
    recovered = _said(lambda: _step(model, rank)) + _said(lambda: _step(model, rank))
    return first, seconds, again, recovered


def _case_worker(rank, world, scales):
    return {option: _one_sided(rank, 1, scales, option) for option in CHANGES}


def _check(said: str, option: str, values: list, what: str = "the THC options after load_state_dict") -> None:
    assert f"ConfigMismatchError: hhook: the ranks differ in {what}" in said, said
    assert f"{option}: " + ", ".join(f"{v!r} on rank {r}" for r, v in values) in said, said


@pytest.mark.parametrize("scales", MODES)
def test_a_one_sided_load_raises_on_every_rank_at_the_next_exchange(scales):
    """And every rank loading the same checkpoint afterwards trains on."""
    outcomes = run_outcomes(_case_worker, 2, scales, pg_timeout_s=PG_TIMEOUT_S, timeout=300)
    for rank, o in enumerate(outcomes):
        assert o["error"] is None and o["exitcode"] == 0, (rank, o)  # no hang, no process ended by a signal
        for option, (first, seconds, again, recovered, now) in o["value"].items():
            running, loaded = RUNNING[option](scales), CHANGES[option](scales)
            for said in (first, again):
                _check(said, option, [(0, running), (1, loaded)])
                _check(said, "load_state_dict", [(0, False), (1, True)])
            assert seconds < FAST_S, (rank, option, seconds)
            assert recovered == "" and now == loaded, (rank, option, recovered)


def _plain_case_worker(rank, world, scales):
    cases = {(steps, option): _one_sided(rank, 1, scales, option, steps=steps) for steps in (0, 1)
             for option in ("bits", "scales")}
    # start_iter=0: THC from DDP's first iteration, whose buckets are not rebuilt yet (a fresh run's: none to split)
    cases.update({("start_iter=0", option): _one_sided(rank, 1, scales, option, steps=0, start_iter=0)
                  for option in ("bits", "scales")})
    return cases


@pytest.mark.parametrize("scales", MODES)
def test_a_one_sided_load_before_start_iter_raises_on_every_rank_at_the_next_exchange(scales):
    """The common case: hhook.register, then one rank loads (steps 0), or a load inside
    DDP's plain iterations (steps 1): the plain allreduce carries the count of ranks that
    loaded. Before, the loading rank waited in the handshake while the other ran its plain
    allreduce (the group's timeout). With start_iter=0, right after hhook.register: THC's
    marked filler at DDP's first iteration."""
    outcomes = run_outcomes(_plain_case_worker, 2, scales, pg_timeout_s=PG_TIMEOUT_S, timeout=300)
    for rank, o in enumerate(outcomes):
        assert o["error"] is None and o["exitcode"] == 0, (rank, o)
        for (steps, option), (first, seconds, again, recovered, now) in o["value"].items():
            running, loaded = 4 if option == "bits" else scales, CHANGES[option](scales)
            for said in (first, again):
                _check(said, option, [(0, running), (1, loaded)])
                _check(said, "load_state_dict", [(0, False), (1, True)])
            assert seconds < FAST_S, (rank, steps, option, seconds)
            assert recovered == "" and now == loaded, (rank, steps, option, recovered)


def _plain_both_load_worker(rank, world, scales):
    """Every rank registers, then loads its checkpoint (a resume's order): the first plain
    allreduce finds every rank loaded, and the run goes on bit for bit with the one that
    loaded before registering."""
    saving = hhook.THCState(bits=2, scales=scales)
    saved = saving.state_dict()
    params = []
    for order in ("register, then load", "load, then register"):
        torch.manual_seed(1)
        ddp = DDP(_net())
        if order == "register, then load":
            state = hhook.register(ddp, bits=4, scales=scales)
            state.load_state_dict(saved)
        else:
            state = hhook.THCState(bits=4, scales=scales)
            state.load_state_dict(saved)
            hhook.register(ddp, state=state)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(4):
            torch.manual_seed(100 * rank + step)
            opt.zero_grad()
            _step(ddp, rank)
            opt.step()
        params.append(torch.cat([p.detach().flatten() for p in ddp.parameters()]))
        assert state.options.bits == 2 and state.pending_load is None
    return torch.equal(params[0], params[1])


@pytest.mark.parametrize("scales", MODES)
def test_every_rank_loading_right_after_register_trains_on_bit_for_bit(scales):
    assert run_world(_plain_both_load_worker, 2, scales, timeout=180) == [True, True]


def _subgroup_worker(rank, world, entry):
    """Ranks 1 and 2 of 3 in a subgroup, rank 2 loading: ``entry`` "ddp" (the hook, in
    each scale mode, before start_iter and after) or "thc_allreduce" (a keyed call's state)."""
    sub = dist.new_group([1, 2])  # every rank, as PyTorch requires
    if rank == 0:
        said = None
    elif entry == "ddp":
        said = {(scales, steps): _one_sided(rank, 2, scales, "bits", sub, steps) for scales in MODES
                for steps in (0, 3)}  # before start_iter (plain) and after (THC)
    else:
        said = {("agreed", "keyed"): _call_worker(rank, world, "agreed", "w", sub, loader=2)["bits"]}
    dist.barrier()  # rank 0, outside the subgroup, holds the store until the others are done
    return said


@pytest.mark.parametrize("entry", ["ddp", "thc_allreduce"])
def test_a_one_sided_load_on_a_subgroup_beside_world_names_the_global_ranks(entry):
    what = CALL if entry == "thc_allreduce" else "the THC options after load_state_dict"
    outcomes = run_outcomes(_subgroup_worker, 3, entry, pg_timeout_s=PG_TIMEOUT_S, timeout=300)
    assert outcomes[0]["value"] is None and outcomes[0]["exitcode"] == 0, outcomes[0]
    for rank, o in list(enumerate(outcomes))[1:]:
        assert o["error"] is None and o["exitcode"] == 0, (rank, o)
        for case, (first, seconds, again, recovered, now) in o["value"].items():
            for said in (first, again):
                _check(said, "bits", [(1, 4), (2, 2)], what)
                _check(said, "load_state_dict", [(1, False), (2, True)], what)
            assert seconds < FAST_S, (rank, case, seconds)
            assert recovered == "" and now == 2, (rank, case, recovered)


def _both_load_worker(rank, world, scales):
    """Every rank loads a checkpoint of 2 bits (its own: residuals, counters): training goes
    on at 2 bits, in step on both ranks; the steady state's rounds are those before."""
    saving = hhook.THCState(bits=2, scales=scales)
    saving.iter = 10  # saved past start_iter: THC from the first step after the load
    saved = saving.state_dict()
    ddp = DDP(_net("one"))
    state = hhook.register(ddp, bits=4, scales=scales)
    rounds = []
    for _ in range(4):
        with counted() as seen:
            _step(ddp, rank)
        rounds.append(len(seen))
    state.load_state_dict(saved)
    before = state.stats()["compressed_calls"]
    for _ in range(4):
        with counted() as seen:
            _step(ddp, rank)
        rounds.append(len(seen))
    params = torch.cat([p.detach().flatten() for p in ddp.parameters()])
    return rounds, state.options.bits, state.stats()["compressed_calls"] - before, state.pending_load is None, params


@pytest.mark.parametrize("scales, steady", [("agreed", 2), ("predicted", 1), ("gathered", 1)])
def test_every_rank_loading_the_same_other_options_trains_on_with_no_round_more(scales, steady):
    results = run_world(_both_load_worker, 2, scales, timeout=180)
    for rounds, bits, compressed, settled, params in results:
        assert bits == 2 and compressed == 4 and settled
        # Before the load: 2 plain iterations (one allreduce each), then THC (predicted:
        # the key's first call is agreed). After it: the steady rounds again, from the
        # second step on (the first: the marked filler, the handshake, the exchange).
        assert rounds[:2] == [1, 1], rounds
        assert rounds[3] == steady and rounds[5:] == [steady] * 3, rounds
        assert rounds[4] > steady, rounds
        assert torch.equal(params, results[0][4])  # the ranks stay in step


def _reload_worker(rank, world, scales):
    """Train 4 steps, save (model and hook state), train 3 more: the uninterrupted run.
    Then every rank loads the save into the live state (past start_iter: the marked filler
    settles it) and trains the 3 steps again; and a fresh DDP registered with the save."""
    ddp = DDP(_net())
    state = hhook.register(ddp, bits=3, scales=scales, error_feedback=True)

    def train(ddp, first):
        return trained(ddp, rank, first)

    train(ddp, 0)
    train(ddp, 3)  # 6 steps: iter 6
    model, saved = {k: v.clone() for k, v in ddp.module.state_dict().items()}, state.state_dict()
    whole = train(ddp, 6)
    ddp.module.load_state_dict(model)
    state.load_state_dict(saved)
    live = train(ddp, 6)
    fresh = DDP(_net())
    fresh.module.load_state_dict(model)
    hhook.register(fresh, state=saved)
    return whole, live, train(fresh, 6)


def trained(ddp, rank, first, n=3):
    """``n`` SGD steps of ``ddp`` from step ``first`` (each step's data seeded by it and the
    rank): the parameters after, flat."""
    for step in range(first, first + n):
        torch.manual_seed(100 * rank + step)
        ddp.zero_grad()
        _step(ddp, rank)
        with torch.no_grad():
            for p in ddp.parameters():
                p -= 0.05 * p.grad
    return torch.cat([p.detach().flatten() for p in ddp.parameters()])


@pytest.mark.parametrize("scales", MODES)
def test_every_rank_reloading_a_live_state_resumes_bit_for_bit(scales):
    """The filler that finds every rank loaded draws no call number of the loaded state's
    and changes none of its keys: the resumed steps are those of the uninterrupted run."""
    for whole, live, fresh in run_world(_reload_worker, 2, scales, timeout=180):
        assert torch.equal(live, whole)
        assert torch.equal(fresh, whole)


def _call_worker(rank, world, scales, key, group=None, loader=1):
    """A ``thc_allreduce`` state (``key``: a keyed call, verified after its first; None:
    every call checked): three calls, then ``loader`` alone loads a checkpoint whose
    option differs; what the next two calls raised, and in how many seconds from the
    load. Then every rank loads it: the next two calls (rank 1's tensor 10x rank 0's)
    give the bits of a state that loaded it fresh (the filler drew none of its call
    numbers)."""
    members = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    me = members.index(rank)
    out = {}
    for option in CHANGES:
        saved = hhook.THCState(**{"bits": 4, "scales": scales, option: CHANGES[option](scales)}).state_dict()
        state = hhook.THCState(process_group=group, bits=4, scales=scales)
        tensor = lambda: torch.randn(3000) * (1 + 9 * me)  # noqa: E731
        for _ in range(3):
            hhook.thc_allreduce(tensor(), state, key=key)
        dist.barrier(group)
        start = time.monotonic()
        if rank == loader:
            state.load_state_dict(saved)
        first = _said(lambda: hhook.thc_allreduce(tensor(), state, key=key))
        seconds = time.monotonic() - start
        again = _said(lambda: hhook.thc_allreduce(tensor(), state, key=key))
        state.load_state_dict(saved)
        fresh = hhook.THCState(process_group=group)
        fresh.load_state_dict(saved, announce=False)
        inputs = [torch.randn(3000) * (1 + 9 * me) for _ in range(2)]
        means = [hhook.thc_allreduce(x.clone(), state, key=key) for x in inputs]
        same = all(torch.equal(m, hhook.thc_allreduce(x.clone(), fresh, key=key)) for m, x in zip(means, inputs))
        recovered = "" if same else "the means differ from those of a state that loaded the checkpoint fresh"
        out[option] = first, seconds, again, recovered, state.options.as_dict()[option]
    return out


@pytest.mark.parametrize("scales", MODES)
@pytest.mark.parametrize("key", ["w", None], ids=["keyed", "unkeyed"])
def test_a_one_sided_load_of_a_thc_allreduce_state_raises_on_every_rank_at_the_next_call(scales, key):
    """The loading rank makes the call every rank verified, filler marked in its prefix (a
    keyed call: the exchange alone; an unkeyed one: the check round, then the exchange).
    Before, it waited in the handshake while the other waited in its exchange, for the
    group's whole timeout."""
    outcomes = run_outcomes(_call_worker, 2, scales, key, pg_timeout_s=PG_TIMEOUT_S, timeout=300)
    for rank, o in enumerate(outcomes):
        assert o["error"] is None and o["exitcode"] == 0, (rank, o)
        for option, (first, seconds, again, recovered, now) in o["value"].items():
            for said in (first, again):
                _check(said, option, [(0, RUNNING[option](scales)), (1, CHANGES[option](scales))], CALL)
                _check(said, "load_state_dict", [(0, False), (1, True)], CALL)
            assert seconds < FAST_S, (rank, option, seconds)
            assert recovered == "" and now == CHANGES[option](scales), (rank, option, recovered)


def _resumed_worker(rank, world, scales, bits):
    """A resumed run: 4 steps (DDP's buckets rebuilt, several keys), saved; a new DDP
    registered with the save, whose first iteration splits its initial bucket into the
    saved keys; rank 1 alone loads a checkpoint of block size 256 before that iteration.
    ``bits="auto"`` is held on THC, so the save holds keys."""
    ddp = DDP(_net(), bucket_cap_mb=0.01)
    state = hhook.register(ddp, bits=bits, scales=scales)
    if bits == "auto":
        state.decision = Decision(["thc:4"])
    for _ in range(4):
        _step(ddp, rank)
    saved, keys = state.state_dict(), len(saved_layouts(state))
    other = hhook.THCState(bits=bits, scales=scales, block_size=256).state_dict()
    torch.manual_seed(0)
    resumed = DDP(_net(), bucket_cap_mb=0.01)
    again = hhook.register(resumed, state=saved)
    return loaded_on_one(rank, 1, resumed, again, other) + (again.options.block_size, keys)


@pytest.mark.parametrize("scales, bits", [("agreed", 4), ("gathered", 4), ("auto", "auto")])
def test_a_one_sided_load_before_a_resumed_run_s_first_iteration_raises_on_every_rank(scales, bits):
    """The loading rank splits DDP's initial bucket into the keys its state held before
    the load, as the others split theirs. Before, it waited in the handshake."""
    outcomes = run_outcomes(_resumed_worker, 2, scales, bits, pg_timeout_s=PG_TIMEOUT_S, timeout=300)
    for rank, o in enumerate(outcomes):
        assert o["error"] is None and o["exitcode"] == 0, (rank, o)
        first, seconds, again, recovered, now, keys = o["value"]
        assert keys > 1, keys  # the first iteration splits
        for said in (first, again):
            _check(said, "block_size", [(0, 1024), (1, 256)])
            _check(said, "load_state_dict", [(0, False), (1, True)])
        assert seconds < FAST_S, (rank, seconds)
        assert recovered == "" and now == 256, (rank, recovered)
