"""A checkpoint of other options loaded on some ranks of a two-level DDP hook and not on
others (issue 58, item 5): every rank of every node raises ConfigMismatchError at the next
exchange, within seconds, naming the option and each rank's value. The loading rank's
shard goes between nodes as filler marked CHANGED; its ring's count of such ranks travels
with the shard through the node's gather, so the ranks of its node and of the other nodes
learn the total (hhook.schedule.two_level). Before, the loading rank waited in the options
handshake and the others in their exchange for the group's whole timeout.

4 ranks as 2 nodes of 2 (``topology=2``): nodes {0, 1} and {2, 3}; rings between nodes
{0, 2} and {1, 3}. Node memory on (the gather's statuses summed in an int64 barrier) and
off (``HHOOK_SHM_MB=0``: they travel in each shard's row). Eager and under
``torch.compile``. (A two-level layout needs the default group: no subgroup case.)
"""

import os

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import hhook
from hhook.decision import Decision
from tests.reliability.test_one_sided_load import FAST_S, PG_TIMEOUT_S, _net, _step, loaded_on_one, trained
from tests.support.distributed import run_outcomes, run_world

#: (scales, node memory): each two-level scale mode between nodes, each gather.
SETUPS = [("agreed", "shm"), ("predicted", "collectives")]
#: Loading ranks: one; two of different rings and nodes; two of one ring.
LOADERS = [(1,), (1, 2), (1, 3)]


def _memory(kind: str) -> None:
    if kind == "collectives":
        os.environ["HHOOK_SHM_MB"] = "0"  # no node shared memory: every stage a collective


def _one_sided(rank, scales, loaders, steps, compiled=False):
    """Train ``steps`` steps of a two-level DDP hook (3: past start_iter, THC; 0: DDP's
    plain iterations; ``compiled``: under torch.compile), then ``loaders`` alone load a checkpoint of 2 bits: what
    :func:`loaded_on_one` saw, and the bits every rank runs at the end."""
    saved = hhook.THCState(bits=2, scales=scales, topology=2, start_iter=2).state_dict()
    # several buckets, one error each (compiled: DDP's optimizer wants the first bucket the smallest)
    ddp = DDP(_net(), bucket_cap_mb=1 if compiled else 0.01)
    state = hhook.register(ddp, bits=4, scales=scales, topology=2, start_iter=2)
    assert state.node_layout().two_level
    model = torch.compile(ddp) if compiled else ddp
    for _ in range(steps):
        _step(model, rank)
    return loaded_on_one(rank, loaders, model, state, saved) + (state.options.bits,)


def _worker(rank, world, scales, memory):
    _memory(memory)
    out = {("eager", loaders, steps): _one_sided(rank, scales, loaders, steps) for loaders in LOADERS
           for steps in (3, 0)}
    out[("compiled", (2,), 3)] = _one_sided(rank, scales, (2,), 3, compiled=True)
    return out


def _check_outcomes(outcomes, members) -> None:
    """Every rank of ``members`` raised the named error twice within :data:`FAST_S` of the
    load, naming each rank's bits and whether it loaded, then trained on at 2 bits."""
    for rank, o in enumerate(outcomes):
        assert o["error"] is None and o["exitcode"] == 0, (rank, o)
        assert (rank in members) == bool(o["value"]), (rank, o)
        for case, (first, seconds, again, recovered, now) in o["value"].items():
            loaders = case[1]
            others = [r for r in members if r not in loaders]

            def values(mine, theirs):  # "v on ranks [..]", as the error groups them
                return [(others if len(others) > 1 else others[0], mine),
                        (list(loaders) if len(loaders) > 1 else loaders[0], theirs)]
            for said in (first, again):
                _check_grouped(said, "bits", values(4, 2))
                _check_grouped(said, "load_state_dict", values(False, True))
            assert seconds < FAST_S, (rank, case, seconds)
            assert recovered == "" and now == 2, (rank, case, recovered)


@pytest.mark.parametrize("scales, memory", SETUPS)
def test_a_one_sided_load_on_a_two_level_layout_raises_on_every_rank_at_the_next_exchange(scales, memory):
    _check_outcomes(run_outcomes(_worker, 4, scales, memory, pg_timeout_s=PG_TIMEOUT_S, timeout=600), [0, 1, 2, 3])



def _check_grouped(said: str, option: str, values: list) -> None:
    """As the flat tests' check, ranks grouped by value (a list: "on ranks [..]")."""
    assert "ConfigMismatchError: hhook: the ranks differ in the THC options after load_state_dict" in said, said
    text = ", ".join(f"{v!r} on {'ranks' if isinstance(r, list) else 'rank'} {r}" for r, v in values)
    assert f"{option}: {text}" in said, said


def _reload_worker(rank, world, scales, memory, method=None):
    """Train 6 steps, save, train 3 more: the uninterrupted run. Then every rank loads the
    save into the live state (the marked filler finds every rank loaded) and trains the 3
    steps again: the same parameters, bit for bit, and the same calls counted in ``stats()``
    (the filler counted nowhere). ``method``: ``bits="auto"`` held on it."""
    _memory(memory)
    ddp = DDP(_net())
    if method is None:
        state = hhook.register(ddp, bits=3, scales=scales, topology=2, error_feedback=True)
    else:  # (bits="auto" on two levels takes no error feedback)
        state = hhook.register(ddp, scales=scales, topology=2)
        state.decision = Decision([method])
    assert state.node_layout().two_level
    trained(ddp, rank, 0, 6)
    model, saved = {k: v.clone() for k, v in ddp.module.state_dict().items()}, state.state_dict()
    whole = trained(ddp, rank, 6)
    calls = ("compressed_calls", "dense_calls", "inter_calls", "iter")  # (bytes: the handshake runs again)
    counted = {k: state.stats()[k] for k in calls}
    ddp.module.load_state_dict(model)
    state.load_state_dict(saved)
    live = trained(ddp, rank, 6)
    return torch.equal(live, whole), {k: state.stats()[k] for k in calls} == counted, state.pending_load is None


@pytest.mark.parametrize("scales, memory", SETUPS)
def test_every_rank_reloading_a_live_two_level_state_resumes_bit_for_bit(scales, memory):
    assert run_world(_reload_worker, 4, scales, memory, timeout=300) == [(True, True, True)] * 4


@pytest.mark.parametrize("method", ["thc:3", "fp32"])
def test_every_rank_reloading_a_live_two_level_state_under_bits_auto_resumes_bit_for_bit(method):
    assert run_world(_reload_worker, 4, "auto", "shm", method, timeout=300) == [(True, True, True)] * 4


#: bits="auto": None, the decision as it runs (DDP's plain iterations at step 0, its first
#: THC turn at 3); else one candidate, its turn (step 3) and held (step 12).
AUTO_CASES = [(None, 0), (None, 3), ("fp32", 3), ("bf16", 3), ("thc:4", 3), ("thc:4", 12)]


def _auto_worker(rank, world, scales):
    out = {}
    for method, steps in AUTO_CASES:
        saved = hhook.THCState(bits="auto", scales=scales, topology=2, block_size=256).state_dict()
        ddp = DDP(_net(), bucket_cap_mb=0.01)
        state = hhook.register(ddp, scales=scales, topology=2)  # bits="auto"
        assert state.node_layout().two_level
        if method is not None:
            state.decision = Decision([method])  # one candidate: the method of every iteration is known
        for _ in range(steps):
            _step(ddp, rank)
        out[(method, steps)] = loaded_on_one(rank, (1,), ddp, state, saved) + (state.options.block_size,)
    return out


@pytest.mark.parametrize("scales", ["auto", "predicted"])
def test_a_two_level_one_sided_load_under_bits_auto_raises_on_every_rank_at_the_next_exchange(scales):
    """Whichever method runs between nodes: DDP's plain iterations, each dense candidate,
    THC in its turn and held; the checkpoint's block size differs."""
    outcomes = run_outcomes(_auto_worker, 4, scales, pg_timeout_s=PG_TIMEOUT_S, timeout=600)
    for rank, o in enumerate(outcomes):
        assert o["error"] is None and o["exitcode"] == 0, (rank, o)
        for case, (first, seconds, again, recovered, now) in o["value"].items():
            for said in (first, again):
                _check_grouped(said, "block_size", [([0, 2, 3], 1024), (1, 256)])
                _check_grouped(said, "load_state_dict", [([0, 2, 3], False), (1, True)])
            assert seconds < FAST_S, (rank, case, seconds)
            assert recovered == "" and now == 256, (rank, case, recovered)
