"""A checkpoint loaded on one rank and not the other under ``bits="auto"`` (hhook.register's
default; issue 58, item 5): every rank raises ConfigMismatchError at the next exchange,
naming the option and each rank's value, whichever method the decision runs then. The
loading rank makes the others' exchange on the state as it was (its decision, clock and
widths: hhook.state.checkpoint.shadow_of), marked: THC's filler carries the mark, and an
iteration's first dense exchange (fp32, bf16, DDP's plain iterations) the count of ranks
that loaded. Before, the loading rank waited in the options handshake and the other in its
exchange for the group's whole timeout, and each named a wrong cause ("a peer stalled",
"rank 0 runs no hhook here").
"""

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hhook
from hhook.decision import Decision, hook
from tests.reliability.test_one_sided_load import FAST_S, PG_TIMEOUT_S, _check, _net, _step, loaded_on_one, trained
from tests.support.distributed import run_outcomes, run_world

#: None: the decision as it runs (plain iterations at steps 0 and 1, its first THC turn at
#: 3); else one candidate, its turn (step 3) and held (step 12, past its decision).
CASES = [(None, 0), (None, 1), (None, 3)] + [(m, s) for m in ("fp32", "bf16", "thc:4", "thc:4:gathered")
                                             for s in (3, 12)]
#: The option a checkpoint changes -> (the running value, the checkpoint's).
CHANGES = {"bits": ("auto", 2), "block_size": (1024, 256)}


def _one_sided(rank, loader, scales, method, steps, option, group=None, compiled=False):
    """``steps`` steps, then ``loader`` alone loads a checkpoint whose ``option`` differs
    (:func:`loaded_on_one`)."""
    saved = hhook.THCState(**{"bits": "auto", "scales": scales, option: CHANGES[option][1]}).state_dict()
    # several buckets, one error each, paired (compiled: DDP's optimizer wants the first bucket the smallest)
    ddp = DDP(_net(), process_group=group, bucket_cap_mb=1 if compiled else 0.01)
    state = hhook.register(ddp, scales=scales)  # bits="auto"
    if method is not None:
        state.decision = Decision([method])  # one candidate: the method of every iteration is known
    model = torch.compile(ddp) if compiled else ddp
    for _ in range(steps):
        _step(model, rank)
    return loaded_on_one(rank, loader, model, state, saved, group) + (state.options.as_dict()[option],)


def _cases_worker(rank, world, scales):
    return {(method, steps, option): _one_sided(rank, 1, scales, method, steps, option)
            for method, steps in CASES for option in CHANGES}


def _checked(outcomes, ranks=(0, 1), what="the THC options after load_state_dict"):
    for rank, o in zip(ranks, outcomes):
        assert o["error"] is None and o["exitcode"] == 0, (rank, o)  # no hang, no process ended by a signal
        for case, (first, seconds, again, recovered, now) in o["value"].items():
            option = case[-1]
            running, loaded = CHANGES[option]
            for said in (first, again):
                _check(said, option, [(ranks[0], running), (ranks[1], loaded)], what)
                _check(said, "load_state_dict", [(ranks[0], False), (ranks[1], True)], what)
            assert seconds < FAST_S, (rank, case, seconds)
            assert recovered == "" and now == loaded, (rank, case, recovered)


@pytest.mark.parametrize("scales", ["auto", "agreed"])
def test_a_one_sided_load_under_bits_auto_raises_on_every_rank_at_the_next_exchange(scales):
    """Whichever method runs: DDP's plain iterations, each dense candidate and each THC
    form, in its turn and held; rank 1's gradient 10x rank 0's."""
    _checked(run_outcomes(_cases_worker, 2, scales, pg_timeout_s=PG_TIMEOUT_S, timeout=600))


def _compiled_worker(rank, world):
    return {(None, 3, "bits"): _one_sided(rank, 1, "auto", None, 3, "bits", compiled=True)}


def test_a_one_sided_load_under_bits_auto_raises_under_torch_compile():
    _checked(run_outcomes(_compiled_worker, 2, pg_timeout_s=PG_TIMEOUT_S, timeout=600))


def _subgroup_worker(rank, world):
    """Ranks 1 and 2 of 3 in a subgroup, rank 2 loading."""
    sub = dist.new_group([1, 2])  # every rank, as PyTorch requires
    said = None
    if rank > 0:
        said = {(m, s, "bits"): _one_sided(rank, 2, "auto", m, s, "bits", sub) for m, s in ((None, 3), ("fp32", 3))}
    dist.barrier()  # rank 0, outside the subgroup, holds the store until the others are done
    return said


def test_a_one_sided_load_under_bits_auto_on_a_subgroup_beside_world_names_the_global_ranks():
    outcomes = run_outcomes(_subgroup_worker, 3, pg_timeout_s=PG_TIMEOUT_S, timeout=300)
    assert outcomes[0]["value"] is None and outcomes[0]["exitcode"] == 0, outcomes[0]
    _checked(outcomes[1:], ranks=(1, 2))


def _reload_worker(rank, world, method, device=False):
    """Train 6 steps, save (model and hook state), train 3 more: the uninterrupted run. Then
    every rank loads the save into the live state and trains the 3 steps again; and a
    fresh DDP registered with the save; and, from the start, every rank registering and
    then loading a checkpoint (a resume's order) against loading before registering.
    ``device``: dense exchanges carry no count, as on a GPU (the handshake runs again)."""
    if device:
        hook._on_host = lambda buffer: False

    def train(ddp, first, n=3):
        return trained(ddp, rank, first, n)

    def registered(saved=None, load_after=False):
        torch.manual_seed(0)
        ddp = DDP(_net())
        state = hhook.THCState(bits="auto", error_feedback=True)
        if saved is not None and not load_after:
            state.load_state_dict(saved, announce=False)
        hhook.register(ddp, state=state)
        if saved is None:
            state.decision = Decision([method])
        elif load_after:
            state.load_state_dict(saved, announce=False)
        return ddp, state

    ddp, state = registered()
    train(ddp, 0, 6)
    model, saved = {k: v.clone() for k, v in ddp.module.state_dict().items()}, state.state_dict()
    whole = train(ddp, 6)
    ddp.module.load_state_dict(model)
    state.load_state_dict(saved)
    live = train(ddp, 6)
    fresh, _ = registered(saved)
    fresh.module.load_state_dict(model)
    out = [torch.equal(live, whole), torch.equal(train(fresh, 6), whole)]
    # a resume's order: register, then load (the first exchange finds every rank loaded)
    after, before = (train(registered(saved, load_after)[0], 0, 4) for load_after in (True, False))
    return out + [torch.equal(after, before), state.pending_load is None]


@pytest.mark.parametrize("method, device", [("thc:3", False), ("thc:5:gathered", False), ("bf16", False),
                                            ("fp32", False), ("fp32", True)],
                         ids=["thc:3", "thc:5:gathered", "bf16", "fp32", "fp32 as on a GPU"])
def test_every_rank_reloading_under_bits_auto_resumes_bit_for_bit(method, device):
    """The marked exchange that finds every rank loaded draws no call number of the loaded
    state's and changes none of its keys; where the exchange can carry no mark, nothing
    is launched and the handshake runs again."""
    assert run_world(_reload_worker, 2, method, device, timeout=300) == [[True] * 4] * 2
