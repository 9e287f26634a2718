"""A checkpoint of other options loaded on one rank of an FSDP2 job at a fixed width (issue
58, item 5): every rank of the shard group raises ConfigMismatchError at the next
reduce-scatter, within seconds, naming the option and each rank's value
(hhook.schedule.load_check.reduce_scattered). Before, the loading rank waited in the
options handshake and the other in the reduce-scatter's MAX, for the group's whole
timeout (:data:`PG_TIMEOUT_S` here: a regression shows as that wait).

Ranks that all load go on as before: the verified call costs one marked round, then the
handshake, and the run continues bit for bit.
"""

import pytest
import torch
import torch.distributed as dist

from tests.reliability.test_one_sided_load import FAST_S, PG_TIMEOUT_S, _check, _said
from tests.support.distributed import run_outcomes

pytest.importorskip("torch.distributed.fsdp")

#: The option a checkpoint changes -> (the running value, the checkpoint's).
CHANGES = {"bits": (4, 2), "block_size": (1024, 256)}


def _model(seed=0):
    """Two sharded layers and the root: three FSDP2 modules, two of them with parameters."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 300), torch.nn.Tanh(), torch.nn.Linear(300, 5))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=_mesh())
    return fully_shard(model, mesh=_mesh())


_MESH: list = []


def _mesh():
    return _MESH[0] if _MESH else None


def _step(model, rank):
    """One backward on rank-dependent data (rank 1's gradient about 10x rank 0's)."""
    (model(torch.randn(8, 6)) * (1 + 9 * rank)).sum().backward()


def _one_sided(rank, option, steps, compiled=False, all_gather=None):
    """Train ``steps`` steps (0: the load comes right after register; ``compiled``: the
    model under ``torch.compile``, whose FSDP2 hooks run eagerly; ``all_gather``: the
    parameters' all-gather compressed too, at that width), then rank 1 alone
    loads a checkpoint whose ``option`` differs: what the next step raised, and in how many
    seconds from the load. FSDP2 leaves a model whose backward raised without its later
    reduce-scatters, so then every rank loads the checkpoint and registers a new model
    with the state: what its next two steps raised (nothing: training goes on), and the
    reduce-scatters they counted."""
    import time

    import hhook
    import hhook.fsdp

    running, other = CHANGES[option]
    saved = hhook.THCState(**{"bits": 4, option: other}).state_dict()
    model = _model()
    state = hhook.fsdp.register(model, bits=4, all_gather=all_gather)
    model = torch.compile(model) if compiled else model
    for _ in range(steps):
        _step(model, rank)
    dist.barrier(_group())
    start = time.monotonic()
    if rank == 1:
        state.load_state_dict(saved)
    first = _said(lambda: _step(model, rank))
    seconds = time.monotonic() - start
    state.load_state_dict(saved)
    model = _model()
    hhook.fsdp.register(model, state=state, all_gather=all_gather)
    calls = state.stats()["compressed_calls"]
    recovered = _said(lambda: _step(model, rank)) + _said(lambda: _step(model, rank))
    return first, seconds, recovered, state.stats()["compressed_calls"] - calls, state.options.as_dict()[option]


def _group():
    return _MESH[0].get_group() if _MESH else None


def trains(rank, subgroup) -> bool:
    """The mesh of the cases: WORLD (2 ranks), or (``subgroup``) ranks 0 and 1 beside
    WORLD's 3, where rank 2 trains nothing (False there)."""
    _MESH.clear()
    if subgroup:
        from torch.distributed.device_mesh import DeviceMesh

        pair = dist.new_group([0, 1])
        if rank == 2:
            return False
        _MESH.append(DeviceMesh.from_group(pair, "cpu"))
    return True


def trained(worker, subgroup) -> list:
    """``[(rank, what worker returned)]`` of the ranks that train on :func:`trains`' mesh,
    every rank having ended on its own (no hang, no signal), within the group's timeout."""
    outcomes = run_outcomes(worker, 3 if subgroup else 2, subgroup, pg_timeout_s=PG_TIMEOUT_S, timeout=400)
    for rank, o in enumerate(outcomes):
        assert o["error"] is None and o["exitcode"] == 0, (rank, o)
    return [(rank, o["value"]) for rank, o in enumerate(outcomes) if rank < 2]


def _worker(rank, world, subgroup):
    """Every case on :func:`trains`' mesh."""
    if not trains(rank, subgroup):
        return None
    cases = {(option, steps): _one_sided(rank, option, steps) for option in CHANGES for steps in (0, 2)}
    cases[("bits", "compiled")] = _one_sided(rank, "bits", 2, compiled=True)
    cases[("bits", "all_gather=8")] = _one_sided(rank, "bits", 2, all_gather=8)
    return cases


@pytest.mark.parametrize("subgroup", [False, True], ids=["world", "subgroup"])
def test_a_one_sided_load_raises_on_every_rank_at_the_next_reduce_scatter(subgroup):
    """Loaded right after register (no reduce-scatter yet) and after two steps."""
    for rank, cases in trained(_worker, subgroup):
        for (option, steps), (first, seconds, recovered, calls, now) in cases.items():
            running, loaded = CHANGES[option]
            _check(first, option, [(0, running), (1, loaded)])
            _check(first, "load_state_dict", [(0, False), (1, True)])
            assert seconds < FAST_S, (rank, option, steps, seconds)
            assert recovered == "" and now == loaded, (rank, option, steps, recovered)
            assert calls == 4, (rank, option, steps, calls)  # 2 steps of 2 modules, THC


def _grads(model):
    return [p.grad.full_tensor().detach().clone() for p in model.parameters()]


def _reload_worker(rank, world):
    """Two models alike; one state reloads its own checkpoint on every rank after two
    steps: the next steps' gradients and counted calls match the other's bit for bit."""
    import hhook
    import hhook.fsdp

    _MESH.clear()
    out = []
    for reload in (False, True):
        model = _model()
        state = hhook.fsdp.register(model, bits=4)
        torch.manual_seed(10 + rank)
        for _ in range(2):
            _step(model, rank)
        if reload:
            state.load_state_dict(state.state_dict())
        for p in model.parameters():
            p.grad = None
        _step(model, rank)
        out.append((_grads(model), state.stats()["compressed_calls"]))
    return out


def test_a_reload_on_every_rank_resumes_bit_for_bit():
    outcomes = run_outcomes(_reload_worker, 2, pg_timeout_s=PG_TIMEOUT_S, timeout=300)
    for rank, o in enumerate(outcomes):
        assert o["error"] is None, (rank, o)
        (plain, calls), (reloaded, reloaded_calls) = o["value"]
        assert calls == reloaded_calls == 6, (calls, reloaded_calls)  # 3 steps of 2 modules
        assert all(torch.equal(a, b) for a, b in zip(plain, reloaded))
