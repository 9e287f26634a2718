"""Results do not depend on ``torch.get_default_dtype()``: every tensor hhook makes names
its dtype. ``thc_allreduce``, the DDP hook (fixed bits and ``bits="auto"``'s first steps)
and FSDP2 (THC reduce-scatter and the compressed all-gather) give the same bits under the
float32 and the bfloat16 default, with float32 parameters and inputs, when the default
changes between uses, and when the process's very first use of hhook is under bfloat16
(a fresh interpreter: no cache warmed under float32). Horovod's compressor:
tests/support/horovod_worker.py's ``default_dtype`` scenario."""

from __future__ import annotations

import pytest
import torch

from tests.support.distributed import run_world

F32, BF16 = torch.float32, torch.bfloat16


def _thc_allreduce(rank):
    import hhook

    state = hhook.THCState(bits=4)
    out = []
    for step in range(2):
        g = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randn(5000, generator=g, dtype=F32) * (10.0 if rank == 1 else 1.0)
        hhook.thc_allreduce(x, state, key="x")
        out.append(x)
    return torch.cat(out)


def _mlp():
    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(nn.Linear(37, 131, dtype=F32), nn.Tanh(), nn.Linear(131, 67, dtype=F32),
                         nn.LayerNorm(67, dtype=F32), nn.Linear(67, 3, dtype=F32))


def _train(model, rank, steps=3):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(8, 37, generator=g, dtype=F32) * (10.0 if rank == 1 else 1.0)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()


def _ddp(rank, bits):
    import hhook
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _mlp()
    ddp = DDP(model)
    state = hhook.register(ddp, bits=bits, start_iter=0)
    _train(ddp, rank, 4)
    assert state.stats()["compressed_calls"] > 0 or bits == "auto"
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _fsdp(rank):
    import hhook.fsdp
    from torch.distributed.fsdp import fully_shard

    model = _mlp()
    for i in (0, 2, 4):
        fully_shard(model[i])
    fully_shard(model)
    state = hhook.fsdp.register(model, bits=4, all_gather=8)
    _train(model, rank)
    assert state.stats()["compressed_calls"] > 0 and hhook.fsdp.all_gather_stats(model)["compressed_calls"] > 0
    return torch.cat([p.detach().to_local().reshape(-1) for p in model.parameters()])


CASES = {"thc_allreduce": _thc_allreduce, "ddp": lambda r: _ddp(r, 4), "ddp_auto": lambda r: _ddp(r, "auto"),
         "fsdp": _fsdp}


def _under(rank, world, defaults, cases):
    """Each case under each default in turn; the results' dtypes and bits."""
    out = {}
    for default in defaults:
        torch.set_default_dtype(default)
        try:
            for name in cases:
                result = CASES[name](rank)
                out.setdefault(name, []).append(result)
        finally:
            torch.set_default_dtype(F32)
    return {name: [(str(r.dtype), r) for r in results] for name, results in out.items()}


def _check(outs):
    for per_rank in outs:
        for name, results in per_rank.items():
            dtype0, first = results[0]
            assert dtype0 == "torch.float32", (name, dtype0)
            for dtype, r in results[1:]:
                assert dtype == dtype0 and torch.equal(r, first), (name, float((r - first).abs().max()))


def test_the_same_bits_whatever_the_default_dtype_and_its_changes():
    _check(run_world(_under, 2, [F32, BF16, F32, BF16], list(CASES)))


@pytest.mark.parametrize("case", ["thc_allreduce", "fsdp"])
def test_a_first_use_under_bfloat16_gives_float32_s_bits(case):
    """A fresh interpreter whose first use is under bfloat16 (every cache made then)."""
    _check(run_world(_under, 2, [BF16, F32], [case], fresh=True))
