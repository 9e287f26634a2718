"""The non-blocking transport: ordering, both scale modes, and the buckets DDP can hand over.

Workers return plain Python data only (tensors through a multiprocessing queue lose
their shared memory once the worker exits).
"""

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hhook
from hhook.schedule.allreduce import check_tensor

from tests.support.distributed import run_world, shared_worlds

MODES = ["agreed", "predicted", "gathered"]


def _many_tensors_worker(rank, world, scales, chunk_mb=0):
    """Launch many tensors of different lengths before waiting for any: a reordered
    collective would pair tensors of different lengths and fail or decode garbage."""
    state = hhook.THCState(bits=4, scales=scales, chunk_mb=chunk_mb)
    errors, sums = [], []
    for step in range(3):
        sizes = [17 + 997 * ((i * 7 + step) % 11) for i in range(24)]
        gen = torch.Generator().manual_seed(1000 * step + rank)
        tensors = [torch.randn(n, generator=gen) for n in sizes]
        exact = [t.clone() for t in tensors]
        futures = [hhook.thc_allreduce_async(t, state, key=i) for i, t in enumerate(tensors)]
        for e in exact:
            dist.all_reduce(e)
            e.div_(world)
        for f in futures:
            f.wait()
        errors.append(max(((t - e).norm() / e.norm()).item() for t, e in zip(tensors, exact)))
        sums.append([float(t.double().sum()) for t in tensors])
    return errors, sums


@pytest.fixture(scope="module")
def shared():
    """``world -> key -> [(ok, what the rank returned)]``: this module's scenarios that pass
    or fail on their own results (no rank raising), one world per world size (4 worlds, not
    16), each scenario with its own hook state (and model); a world is started by the first
    test that asks for it."""
    cases = {2: [*[(("many", scales), _many_tensors_worker, (scales,)) for scales in MODES],
                 *[(("mixed", hook, scales), _mixed_worker, (hook, scales))
                   for scales in MODES for hook in (False, True)]],
             3: [*[(("in_pieces", scales), _many_tensors_worker, (scales, 0.01)) for scales in MODES],
                 *[(("pieces", scales), _pieces_worker, (scales,)) for scales in MODES],
                 *[(("nonfinite", scales), _nonfinite_worker, (scales,)) for scales in MODES]],
             5: [(("many", scales), _many_tensors_worker, (scales,)) for scales in MODES],
             8: [(("many", scales), _many_tensors_worker, (scales,)) for scales in MODES]}
    return shared_worlds(cases)


@pytest.mark.parametrize("scales", MODES)
@pytest.mark.parametrize("world", [2, 5, 8])
def test_many_tensors_in_flight_neither_deadlock_nor_reorder(shared, world, scales):
    results = shared(world, "many", scales)
    for errors, sums in results:
        assert sums == results[0][1]  # every rank decodes the same sums
        assert max(errors) < 0.35  # 4 bits on Gaussian data; a mix-up gives errors near 1


@pytest.mark.parametrize("scales", MODES)
def test_tensors_in_pieces_neither_deadlock_nor_reorder(shared, scales):
    # 0.01 MB pieces: up to 5 pieces of each of the 24 tensors in flight at once
    results = shared(3, "in_pieces", scales)
    for errors, sums in results:
        assert sums == results[0][1]
        assert max(errors) < 0.35


def _pieces(state, numel, device):
    from hhook.schedule.flat import pieces

    return pieces(numel, device, state.options.piece_limit(), state.options.block_size)


def test_pieces_are_whole_blocks_and_cover_the_tensor():
    state = hhook.THCState(block_size=1024, chunk_mb=0.02)  # at most 5242 floats a piece
    cpu = torch.device("cpu")
    for numel in (1, 1024, 5242, 5243, 30000, 1 << 20):
        pieces = _pieces(state, numel, cpu)
        assert pieces[0][0] == 0 and pieces[-1][1] == numel
        assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))
        assert all(stop - start <= 5242 and start % 1024 == 0 for start, stop in pieces)
        assert len(pieces) == (1 if numel <= 5242 else -(-numel // 5120))  # as few as whole blocks allow
    assert _pieces(hhook.THCState(chunk_mb=0), 1 << 30, cpu) == [(0, 1 << 30)]
    auto = hhook.THCState()
    assert len(_pieces(auto, 25 * 2**20 // 4, cpu)) == 3 and len(_pieces(auto, 5_000_000, cpu)) == 2
    assert _pieces(auto, 25 * 2**20 // 4, torch.device("cuda", 0)) == [(0, 25 * 2**20 // 4)]


def _pieces_worker(rank, world, scales):
    """A tensor in 6 pieces: identical inputs stay exact, one rank's inf in one piece
    makes the whole tensor NaN on every rank, and the next step is normal again."""
    state = hhook.THCState(bits=4, scales=scales, chunk_mb=0.02)
    gen = torch.Generator().manual_seed(7)
    out = []
    for step in range(4):
        shared = torch.randn(30000, generator=gen)
        x = shared + (0 if step == 1 else rank)  # step 1: every rank holds the same tensor
        if step == 2 and rank == 1:
            x[29000] = float("inf")  # in the last piece only
        expected = shared + (0 if step == 1 else (world - 1) / 2)
        hhook.thc_allreduce(x, state)
        out.append((torch.equal(x, expected), bool(x.isnan().all()), ((x - expected).norm() / expected.norm()).item()))
    return out, state.stats()["compressed_calls"] + state.stats()["dense_calls"]


@pytest.mark.parametrize("scales", MODES)
def test_pieces_keep_every_guarantee(shared, scales):
    for steps, calls in shared(3, "pieces", scales):
        exact, nan, error = zip(*steps)
        assert exact[1] and not any(nan[:2]) and not nan[3]  # identical step: exact
        assert nan[2]  # one piece's inf: all of it NaN, not only that piece
        assert error[3] < 0.35
        assert calls == 4 * 6


class Mixed(torch.nn.Module):
    """float32 layers, a float64 layer, a sparse embedding and a parameter that gets a
    gradient only once (then DDP reduces its stale, identical gradient again)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.EmbeddingBag(50, 16, mode="sum", sparse=True)
        self.body = torch.nn.Linear(16, 32)
        self.wide = torch.nn.Linear(32, 32).double()
        self.head = torch.nn.Linear(32, 4)
        self.unused = torch.nn.Linear(32, 4)

    def forward(self, idx, first=False):
        h = torch.tanh(self.body(self.embed(idx)))
        h = torch.tanh(self.wide(h.double())).float()
        out = self.head(h)
        return out + self.unused(h) if first else out


def _mixed_worker(rank, world, hook, scales):
    torch.manual_seed(0)
    model = Mixed()
    ddp = DDP(model, find_unused_parameters=True, bucket_cap_mb=0.001)
    state = None
    if hook:
        state = hhook.register(ddp, bits=4, scales=scales, start_iter=1)
    opt_dense = torch.optim.SGD([p for n, p in model.named_parameters() if not n.startswith("embed")], lr=0.05)
    opt_sparse = torch.optim.SGD(model.embed.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(rank)
    unused_grads = []
    for step in range(6):
        # No zero_grad for `unused`: its stale gradient is reduced again every step.
        for p in model.parameters():
            if p is not model.unused.weight and p is not model.unused.bias:
                p.grad = None
        idx = torch.randint(0, 50, (8, 3), generator=gen)
        y = torch.randint(0, 4, (8,), generator=gen)
        loss = torch.nn.functional.cross_entropy(ddp(idx, first=step == 0), y)
        loss.backward()
        opt_dense.step()
        opt_sparse.step()
        unused_grads.append(model.unused.weight.grad.clone())
    drift = max((g - unused_grads[0]).abs().max().item() for g in unused_grads)
    params = torch.cat([p.detach().double().reshape(-1) for p in model.parameters()])
    return {"drift": drift, "params": params.tolist(), "stats": state.stats() if state else None}


@pytest.mark.parametrize("scales", MODES)
def test_float64_sparse_and_stale_gradients(shared, scales):
    plain = shared(2, "mixed", False, scales)
    thc = shared(2, "mixed", True, scales)
    for r in thc:
        assert r["params"] == thc[0]["params"]  # replicas stay identical
        # The stale gradient is identical on every rank: it must come back exactly, not
        # random-walk with fresh rounding noise each step.
        assert r["drift"] == 0.0
        assert r["stats"]["dense_calls"] > 0 and r["stats"]["compressed_calls"] > 0
    assert plain[0]["drift"] == 0.0
    # Compressed float32 buckets differ a little from plain DDP, but not wildly.
    diff = max(abs(a - b) for a, b in zip(thc[0]["params"], plain[0]["params"]))
    assert diff < 0.05


def _world_of_one_worker(rank, world):
    out = {}
    for scales in MODES:
        state = hhook.THCState(bits=2, scales=scales)
        x = torch.randn(5000)
        y = x.clone()
        hhook.thc_allreduce(y, state)
        out[scales] = (torch.equal(x, y), state.stats())
    return out


def test_world_of_one_is_exact_and_saves_nothing():
    for exact, stats in run_world(_world_of_one_worker, 1)[0].values():
        assert exact
        assert stats["wire_bytes"] == stats["dense_bytes"] == 0 and stats["local_calls"] == 1


@pytest.mark.parametrize(
    "option, value",
    [("bits", True), ("bits", 4.0), ("block_size", True), ("seed", False), ("start_iter", True),
     ("error_feedback", 1), ("scales", "max"), ("process_group", "world"), ("chunk_mb", "big"),
     ("chunk_mb", -1), ("chunk_mb", True), ("chunk_mb", float("inf")), ("chunk_mb", float("nan"))],
)
def test_bad_options_fail_at_construction(option, value):
    with pytest.raises((ValueError, TypeError), match=option):
        hhook.THCState(**{option: value})


def test_the_default_scales_are_gathered_on_small_cpu_groups_and_agreed_elsewhere():
    options = hhook.THCState().options
    assert options.scales == "auto"
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert [options.scale_mode(n, cpu) for n in (1, 2, 3, 4, 5, 8)] == ["agreed"] + ["gathered"] * 3 + ["agreed"] * 2
    assert options.scale_mode(2, cuda) == options.scale_mode(2, None) == "agreed"  # GPUs; a device not known
    assert options.scale_mode(2, cpu, two_level=True) == "agreed"  # between the nodes of a two-level layout
    for mode in ("agreed", "predicted", "gathered"):  # a mode given is the mode run, everywhere
        given = hhook.THCState(scales=mode).options
        assert {given.scale_mode(n, d, t) for n in (2, 8) for d in (cpu, cuda) for t in (False, True)} == {mode}


def test_tensors_hhook_cannot_average_in_place_are_refused_plainly():
    with pytest.raises(ValueError, match="requires grad"):
        check_tensor(torch.zeros(3, requires_grad=True))
    with pytest.raises(ValueError, match="meta"):
        check_tensor(torch.empty(3, device="meta"))
    check_tensor(torch.zeros(3, requires_grad=True).detach())


def _mismatch_worker(rank, world, scales):
    state = hhook.THCState(bits=4, scales=scales)
    x = torch.randn(5000 + rank)  # one rank reduces a longer tensor (same number of blocks)
    try:
        for _ in range(2):  # predicted: the warm-up step already catches it
            hhook.thc_allreduce(x, state)
    except hhook.ConfigMismatchError as e:
        return str(e)
    return None


@pytest.mark.parametrize("scales", MODES)
def test_length_mismatch_raises_on_every_rank(scales):
    """Found by the call's check before any payload (the messages' fingerprints would, too)."""
    assert all(msg and "numel: 5000 on rank 0, 5001 on rank 1" in msg for msg in run_world(_mismatch_worker, 2, scales))


def _nonfinite_worker(rank, world, scales):
    state = hhook.THCState(bits=4, scales=scales, error_feedback=True)
    out = []
    for step in range(3):
        x = torch.randn(3000)
        if step == 2 and rank == world - 1:
            x[123] = float("inf")
        hhook.thc_allreduce(x, state)
        out.append(bool(x.isnan().all()))
    return out


@pytest.mark.parametrize("scales", MODES)
def test_nonfinite_on_one_rank_makes_every_rank_nan(shared, scales):
    assert shared(3, "nonfinite", scales) == [[False, False, True]] * 3
