"""thc_allreduce across real processes joined by Gloo."""

import io
import math

import pytest
import torch
import torch.distributed as dist

import hhook
from hhook.codec import lanes
from hhook.simulation import heavy_tailed, vnmse

from tests.support.distributed import run_world


def _allreduce_worker(rank, world):
    inputs = heavy_tailed(50_000, world, seed=3)
    state = hhook.THCState(bits=4, scales="agreed")
    out = {}
    y = inputs[rank].clone()
    hhook.thc_allreduce(y, state)
    out["vnmse"] = vnmse(y, inputs)
    out["result"] = y.tolist()
    # fp16 and bf16 tensors come back averaged in their own dtype; 8 bits keep errors small
    fine = hhook.THCState(bits=8, scales="agreed")
    gauss = torch.randn(world, 4000, generator=torch.Generator().manual_seed(4))
    for dtype in (torch.float16, torch.bfloat16):
        h = gauss[rank, :3001].to(dtype)
        hhook.thc_allreduce(h, fine)
        out[str(dtype)] = (str(h.dtype), (h.float() - gauss[:, :3001].mean(0)).abs().max().item())
    # a non-contiguous tensor is averaged in place too
    m = gauss[rank].clone().view(40, 100).t()
    hhook.thc_allreduce(m, fine)
    out["strided"] = (m.t().reshape(-1) - gauss.mean(0)).abs().max().item()
    # every rank sends the largest code everywhere through the real collective
    exact = []
    for bits in range(1, 9):
        levels = 1 << bits
        layout = lanes.choose_layout(world, levels)
        codes = lanes.code_buffer(999, layout)
        codes[:999] = levels - 1
        words = lanes.pack(codes, layout)
        dist.all_reduce(words)
        exact.append(lanes.unpack(words, layout, 999, torch.int64).eq(world * (levels - 1)).all().item())
    out["lanes_exact"] = exact
    return out


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.quick), 3, 4, 8])
def test_thc_allreduce_averages_across_ranks(world):
    results = run_world(_allreduce_worker, world)
    for r in results:
        assert r["result"] == results[0]["result"]  # every rank decodes the same sum
        # the bound is for n = 4; fewer ranks average away less rounding noise
        assert r["vnmse"] < (2e-2 if world >= 4 else 5e-2)
        assert all(r["lanes_exact"])
        assert r["strided"] < 0.05
        for dtype in (torch.float16, torch.bfloat16):
            got_dtype, err = r[str(dtype)]
            assert got_dtype == str(dtype) and err < 0.06


def _stats_worker(rank, world):
    out = []
    for chunk_mb in (0, "auto"):
        state = hhook.THCState(bits=4, scales="agreed", chunk_mb=chunk_mb)
        x = torch.randn(4 << 20)
        hhook.thc_allreduce(x, state)
        out.append(state.stats())
    return out


def test_wire_bytes_at_four_bits_four_ranks():
    for whole, pieces in run_world(_stats_worker, 4):
        for s in (whole, pieces):
            assert s["dense_bytes"] == 16 << 20
            assert s["dense_bytes"] / s["wire_bytes"] >= 4.9
        assert whole["compressed_calls"] == 1 and pieces["compressed_calls"] == 2  # 16 MB: two pieces of 8 MB


def _nonfinite_worker(rank, world, bad_rank, bad):
    state = hhook.THCState(bits=4, scales="agreed")
    x = torch.randn(10_000)
    if rank == bad_rank:
        x[1234] = bad
    hhook.thc_allreduce(x, state)
    follow_up = torch.full((100,), float(rank))
    hhook.thc_allreduce(follow_up, state)  # the group is still usable afterwards
    return x.isnan().all().item(), follow_up.tolist(), state.stats()["compressed_calls"]


@pytest.mark.quick
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_on_one_rank_reaches_every_rank(bad):
    for all_nan, follow_up, count in run_world(_nonfinite_worker, 3, 2, bad):
        assert all_nan and count == 2
        assert all(math.isfinite(v) for v in follow_up) and abs(sum(follow_up) / len(follow_up) - 1) < 0.1


def _mismatch_worker(rank, world, option, values):
    state = hhook.THCState(scales="agreed", **{option: values[rank]})
    try:
        hhook.thc_allreduce(torch.randn(5000), state)
    except hhook.ConfigMismatchError as e:
        return str(e)
    return None


@pytest.mark.quick
@pytest.mark.parametrize("option,values", [("bits", (4, 8)), ("block_size", (1024, 256)), ("seed", (0, 1)),
                                           ("rounding", ("correlated", "independent"))])
def test_mismatched_configuration_fails_on_every_rank(option, values):
    for message in run_world(_mismatch_worker, 2, option, values, timeout=60):
        assert message is not None and f"{option}: {values[0]!r} on rank 0, {values[1]!r} on rank 1" in message


def _length_mismatch_worker(rank, world):
    try:
        hhook.thc_allreduce(torch.randn(5000 + rank), hhook.THCState(scales="agreed"))
    except hhook.ConfigMismatchError as e:
        return str(e)


@pytest.mark.quick
def test_tensors_of_different_lengths_fail_on_every_rank():
    for message in run_world(_length_mismatch_worker, 2, timeout=60):
        assert message is not None and "length" in message


def _checkpoint_worker(rank, world):
    state = hhook.THCState(bits=3, error_feedback=True, seed=9, scales="agreed")
    hhook.thc_allreduce(torch.randn(3000), state, key="w")
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    same = (
        loaded.process_group is None
        and (loaded.options.bits, loaded.options.seed, loaded.options.error_feedback, loaded.counters.calls) == (3, 9, True, 1)
        and torch.equal(loaded.policy("agreed").keys["w"].residual, state.policy("agreed").keys["w"].residual)
        and loaded.stats() == state.stats()
    )
    x = torch.full((3000,), float(rank))
    hhook.thc_allreduce(x, loaded, key="w")  # the loaded state works on the default group
    return same, x.mean().item()


def test_state_survives_torch_save_and_load():
    for same, mean in run_world(_checkpoint_worker, 2):
        assert same and abs(mean - 0.5) < 0.05


def _error_feedback_worker(rank, world, error_feedback):
    """Send the same gradient 50 times: error feedback makes the running sum exact."""
    torch.manual_seed(rank)
    g = torch.randn(2048)
    state = hhook.THCState(bits=1, error_feedback=error_feedback)
    total = torch.zeros(2048)
    for _ in range(50):
        x = g.clone()
        hhook.thc_allreduce(x, state, key=0)
        total += x
    mean = torch.stack([torch.randn(2048, generator=torch.Generator().manual_seed(r)) for r in range(world)])
    return ((total / 50 - mean.mean(0)).norm() / mean.mean(0).norm()).item()


def test_error_feedback_reduces_accumulated_error():
    with_ef = run_world(_error_feedback_worker, 2, True)[0]
    without = run_world(_error_feedback_worker, 2, False)[0]
    assert with_ef < without / 3
