"""hhook.fsdp: THC reduce-scatter for FSDP2 and custom HSDP (Gloo on CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from distributed import run_world

fsdp = pytest.importorskip("torch.distributed.fsdp")


def _model(seed=0, out=5):
    torch.manual_seed(seed)
    # 7 and 5 rows: dim 0 not a multiple of 2 or 3.
    return torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, out))


def _shard(model, mesh=None, reshard=True, mp=None):
    from torch.distributed.fsdp import fully_shard

    kw = {"reshard_after_forward": reshard}
    if mesh is not None:
        kw["mesh"] = mesh
    if mp is not None:
        kw["mp_policy"] = mp
    for layer in (model[0], model[2]):
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def _grads(model):
    return [p.grad.full_tensor().detach().clone() for p in model.parameters()]


def _step(model, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()


def _compare(rank, world, reduce_dtype, reshard):
    import hhook.fsdp
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mp = None if reduce_dtype is None else MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    torch.manual_seed(100 + rank)
    x, y = torch.randn(64, 6), torch.randn(64, 5)
    plain = _shard(_model(), reshard=reshard, mp=mp)
    _step(plain, x, y)
    thc = _shard(_model(), reshard=reshard, mp=mp)
    state = hhook.fsdp.register(thc, bits=8)
    _step(thc, x, y)
    out = {"plain": _grads(plain), "thc": _grads(thc), "stats": state.stats()}
    # identical inputs on every rank: exact
    for p in thc.parameters():
        p.grad = None
    torch.manual_seed(7)
    xs, ys = torch.randn(64, 6), torch.randn(64, 5)
    _step(thc, xs, ys)
    ref = _model()
    _step(ref, xs, ys)
    out["same"] = _grads(thc)
    out["ref"] = [p.grad.clone() for p in ref.parameters()]
    return out


@pytest.mark.parametrize("world,reduce_dtype,reshard", [(2, None, True), (3, None, False), (2, torch.bfloat16, True)])
def test_matches_plain_fsdp(world, reduce_dtype, reshard):
    for out in run_world(_compare, world, reduce_dtype, reshard):
        for a, b in zip(out["plain"], out["thc"]):
            assert a.shape == b.shape
            err = (a.float() - b.float()).norm() / a.float().norm()
            assert err < 0.05, err
        for a, b in zip(out["same"], out["ref"]):
            if reduce_dtype is None:
                assert torch.equal(a, b)
        s = out["stats"]
        assert s["compressed_calls"] == 2 and 0 < s["wire_bytes"] < s["dense_bytes"]


def _nonfinite(rank, world):
    import hhook.fsdp

    model = _shard(_model())
    hhook.fsdp.register(model)
    x = torch.randn(8, 6)
    if rank == 1:
        x[0, 0] = float("inf")
    _step(model, x, torch.randn(8, 5))
    # the first layer's reduce-scatter: every element of every shard NaN on every rank
    return [bool(torch.isnan(p.grad.to_local()).all()) for p in list(model.parameters())[:2]]


def test_nonfinite_everywhere():
    for flags in run_world(_nonfinite, 3):
        assert flags == [True, True]


def _mismatch(rank, world):
    import hhook.fsdp
    from hhook.message import ConfigMismatchError

    model = _shard(_model())
    hhook.fsdp.register(model, bits=4 if rank == 0 else 5)
    try:
        _step(model, torch.randn(8, 6), torch.randn(8, 5))
    except ConfigMismatchError:
        return "raised"
    return "ok"


def test_mismatch_raises_everywhere():
    assert run_world(_mismatch, 2) == ["raised", "raised"]


def _bad_input(rank, world):
    import hhook.fsdp

    errors = []
    try:
        hhook.fsdp.register(_model())
    except ValueError as e:
        errors.append("no FSDPModule" in str(e))
    m = _model()
    m[0].double()
    try:
        hhook.fsdp.register(_shard(m))
    except TypeError as e:
        errors.append("float64" in str(e))
    m = _shard(_model())
    hhook.fsdp.register(m)
    try:
        hhook.fsdp.register(m)
    except ValueError as e:
        errors.append("already has a custom reduce-scatter" in str(e))
    return errors


def test_bad_input():
    assert run_world(_bad_input, 1) == [[True, True, True]]


def _accumulate_and_train(rank, world):
    import hhook.fsdp

    torch.manual_seed(3 + rank)
    data = [(torch.randn(32, 6), None) for _ in range(40)]
    teacher = torch.nn.Linear(6, 5)
    results = {}
    for mode in ("plain", "thc"):
        model = _shard(_model())
        if mode == "thc":
            hhook.fsdp.register(model, bits=4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i, (x, _) in enumerate(data):
            y = teacher(x).detach()
            last = i % 2 == 1
            model.set_requires_gradient_sync(last)
            _step(model, x, y)
            if last:
                opt.step()
                opt.zero_grad()
        x = torch.randn(256, 6)
        results[mode] = torch.nn.functional.mse_loss(model(x), teacher(x)).item()
    return results


def test_accumulation_converges_like_plain():
    for r in run_world(_accumulate_and_train, 2):
        assert r["thc"] < 1.3 * r["plain"] + 1e-3, r


def _world_one(rank, world):
    import hhook.fsdp

    model = _shard(_model())
    state = hhook.fsdp.register(model)
    ref = _model()
    x, y = torch.randn(8, 6), torch.randn(8, 5)
    _step(model, x, y)
    _step(ref, x, y)
    return all(torch.equal(a, b.grad) for a, b in zip(_grads(model), ref.parameters())), state.stats()["wire_bytes"]


def test_world_size_one():
    assert run_world(_world_one, 1) == [(True, 0)]


def _hsdp(rank, world):
    import hhook.fsdp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(100 + rank)
    x, y = torch.randn(32, 6), torch.randn(32, 5)
    model = _shard(_model(), mesh=mesh["shard"])
    hhook.fsdp.register_hsdp(model, mesh["replicate"].get_group(), bits=8)
    _step(model, x, y)
    local = [p.grad.to_local().clone() for p in model.parameters()]
    ref = _model()
    _step(ref, x, y)
    full = [p.grad.clone() for p in ref.parameters()]
    for g in full:
        dist.all_reduce(g)
        g.div_(world)
    return [p.grad.full_tensor() for p in model.parameters()], full, local


def test_custom_hsdp():
    outs = run_world(_hsdp, 4)
    for grads, full, _ in outs:
        for a, b in zip(grads, full):
            assert (a - b).norm() / b.norm() < 0.05
    # replicas (ranks 0 and 2; 1 and 3) hold bit-identical shards
    for r0, r1 in ((0, 2), (1, 3)):
        for a, b in zip(outs[r0][2], outs[r1][2]):
            assert torch.equal(a, b)


def _direct(rank, world):
    from hhook.fsdp import THCReduceScatter
    from hhook.state import THCState

    state = THCState(bits=8)
    comm = THCReduceScatter(state, "direct", None)
    group = dist.group.WORLD
    n = 3000  # not a multiple of the block size
    torch.manual_seed(rank)
    x = torch.randn(world * n)
    out = comm.allocate((n,), dtype=torch.float32, device=torch.device("cpu"))
    comm(out, x.clone(), group, dist.ReduceOp.SUM)
    ref = x.clone()
    dist.all_reduce(ref)
    ref = ref.view(world, n)[rank] / world
    err = ((out - ref).norm() / ref.norm()).item()
    bad = x.clone()
    if rank == 1:
        bad[5] = float("inf")  # in rank 0's chunk only
    comm(out, bad, group, dist.ReduceOp.SUM)
    all_nan = bool(torch.isnan(out).all())
    exact = x.double()
    out64 = torch.empty(n, dtype=torch.float64)
    comm(out64, exact.clone(), group, dist.ReduceOp.SUM)
    ref64 = exact.clone()
    dist.all_reduce(ref64)
    return err, all_nan, torch.equal(out64, ref64.view(world, n)[rank] / world), state.stats()


def test_direct_comm_nonfinite_and_fallback():
    for err, all_nan, exact64, stats in run_world(_direct, 3):
        assert err < 0.02
        assert all_nan  # one rank's inf in one chunk: every rank's output is NaN
        assert exact64  # float64: exact dense fallback ...
        assert stats["dense_calls"] == 1 and stats["compressed_calls"] == 2  # ... counted
        assert stats["nonfinite_calls"] == 1


def test_example_runs():
    import os
    import subprocess
    import sys

    from distributed import ROOT, free_port, subprocess_env

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           os.path.join(ROOT, "examples", "fsdp_train.py"), "--steps", "8", "--warmup", "2", "--width", "128"]
    done = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("mode=thc")]
    assert line and "reduce_scatter_bytes_per_step=" in line[0]


def _user_factor(rank, world):
    import hhook.fsdp

    torch.manual_seed(100 + rank)
    x, y = torch.randn(32, 6), torch.randn(32, 5)
    model = _shard(_model())
    for m in (model[0], model[2], model):
        m.set_gradient_divide_factor(0.5)  # the user wants twice the sum
    hhook.fsdp.register(model, bits=8)
    _step(model, x, y)
    ref = _model()
    _step(ref, x, y)
    full = [p.grad.clone() for p in ref.parameters()]
    for g in full:
        dist.all_reduce(g)
        g.mul_(2)
    return [((a - b).norm() / b.norm()).item() for a, b in zip(_grads(model), full)]


@pytest.mark.parametrize("world", [1, 2])
def test_user_divide_factor_respected(world):
    for errs in run_world(_user_factor, world):
        assert max(errs) < 0.05, errs
