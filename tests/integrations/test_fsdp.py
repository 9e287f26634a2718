"""hhook.fsdp: THC reduce-scatter for FSDP2 and custom HSDP (Gloo on CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.support.distributed import run_world, shared_worlds

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


@pytest.fixture(scope="module")
def shared():
    """``world -> key -> [(ok, what the rank returned)]``: the scenarios of this module that
    pass or fail on their own results (no rank raising, no mismatch, nothing patched), one
    world per world size (3 worlds, not 14), each scenario with its own model, FSDP2
    sharding and hook state; a world is started by the first test that asks for it. The
    quick tier's case of test_matches_plain_fsdp keeps a world of its own."""
    cases = {2: [(("compare", torch.bfloat16, True), _compare, (torch.bfloat16, True)),
                 (("compare", torch.float16, True), _compare, (torch.float16, True)),
                 (("accumulate_and_train",), _accumulate_and_train, ()), (("user_factor",), _user_factor, ()),
                 (("clip_nonfinite",), _clip_nonfinite, ()), (("accumulation_grads",), _accumulation_grads, ()),
                 (("checkpoint",), _checkpoint, ())],
             3: [(("compare", None, False), _compare, (None, False)), (("nonfinite",), _nonfinite, ()),
                 (("direct",), _direct, ())],
             4: [(("hsdp",), _hsdp, ()), *[(("native_hsdp", f), _native_hsdp, (f,)) for f in (None, 0.5)],
                 (("hsdp_states",), _hsdp_states, ())]}
    return shared_worlds(cases)


SHARED = pytest.mark.xdist_group("tests/integrations/test_fsdp.py")  # the shared fixture's worker (tests/conftest.py)


@pytest.mark.parametrize("world,reduce_dtype,reshard", [pytest.param(2, None, True, marks=pytest.mark.quick),
                                                       pytest.param(3, None, False, marks=SHARED),
                                                       pytest.param(2, torch.bfloat16, True, marks=SHARED),
                                                       pytest.param(2, torch.float16, True, marks=SHARED)])
def test_matches_plain_fsdp(request, world, reduce_dtype, reshard):
    quick = (world, reduce_dtype, reshard) == (2, None, True)
    outs = run_world(_compare, world, reduce_dtype, reshard) if quick else \
        request.getfixturevalue("shared")(world, "compare", reduce_dtype, reshard)
    for out in outs:
        for a, b in zip(out["plain"], out["thc"]):
            assert a.shape == b.shape
            err = (a.float() - b.float()).norm() / a.float().norm()
            assert err < 0.05, err
        for a, b in zip(out["same"], out["ref"]):
            if reduce_dtype is None:
                assert torch.equal(a, b)
        s = out["stats"]
        assert s["compressed_calls"] == 2 and s["dense_bytes"] == 4 * sum(_rs_numels(world)) * world
        # the options handshake, once per shard group at registration (8 bytes), then each comm's call
        assert s["wire_bytes"] == 8 + sum(_wire_bytes(n, world, 8) for n in _rs_numels(world))


def _rs_numels(world, out=5):
    """Per FSDP module of ``_model``: the reduce-scatter output's numel (dim 0 padded)."""
    return [sum(-(-p.shape[0] // world) * (p.numel() // p.shape[0]) for p in layer.parameters())
            for layer in (_model(out=out)[0], _model(out=out)[2])]


def _wire_bytes(n, world, bits):
    """What one comm hands to collectives for one call with output numel ``n``: every
    chunk's scale vector, every chunk's message."""
    from hhook.codec import THCCodec
    from hhook.codec.layout import HEADER
    from hhook.scales.message import PREFIX

    codec = THCCodec(bits, 1024, 0, world)
    word = codec.layout.word_bits // 8
    return world * (4 * (HEADER + codec.n_blocks(n)) + word * (PREFIX + codec.words_numel(n)))


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


def test_nonfinite_everywhere(shared):
    for flags in shared(3, "nonfinite"):
        assert flags == [True, True]


def _mismatch(rank, world):
    import hhook.fsdp
    from hhook.errors import ConfigMismatchError

    model = _shard(_model())
    try:
        hhook.fsdp.register(model, bits=4 if rank == 0 else 5)  # the handshake, per shard group
        _step(model, torch.randn(8, 6), torch.randn(8, 5))
    except ConfigMismatchError as e:
        return "raised" if "bits: 4 on rank 0, 5 on rank 1" in str(e) else str(e)
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
    m = _model()
    m[2].weight = torch.nn.Parameter(m[2].weight.detach().to(torch.complex64))
    m[2].bias = torch.nn.Parameter(m[2].bias.detach().to(torch.complex64))
    try:
        hhook.fsdp.register(_shard(m))
    except TypeError as e:
        errors.append("complex64" in str(e) and "'2.weight'" in str(e))
    try:
        hhook.fsdp.register(_shard(_model()), scales="predicted")
    except ValueError as e:
        errors.append("only rank j holds chunk j's sums" in str(e))
    return errors


def test_bad_input():
    assert run_world(_bad_input, 1) == [[True] * 5]


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


def test_accumulation_converges_like_plain(shared):
    for r in shared(2, "accumulate_and_train"):
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
    return [p.grad.full_tensor() for p in model.parameters()], _exact_mean_grads(x, y, world), local


def _exact_mean_grads(x, y, world):
    """The gradients of the unsharded model on this rank's batch, averaged exactly over the world."""
    ref = _model()
    _step(ref, x, y)
    full = [p.grad.clone() for p in ref.parameters()]
    for g in full:
        dist.all_reduce(g)
        g.div_(world)
    return full


def test_custom_hsdp(shared):
    outs = shared(4, "hsdp")
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


def test_direct_comm_nonfinite_and_fallback(shared):
    for err, all_nan, exact64, stats in shared(3, "direct"):
        assert err < 0.02
        assert all_nan  # one rank's inf in one chunk: every rank's output is NaN
        assert exact64  # float64: exact dense fallback ...
        assert stats["dense_calls"] == 1 and stats["compressed_calls"] == 2  # ... counted
        assert stats["nonfinite_calls"] == 1


def test_example_runs():
    import os
    import subprocess
    import sys

    from tests.support.distributed import ROOT, free_port, subprocess_env

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
def test_user_divide_factor_respected(shared, world):
    for errs in (shared(2, "user_factor") if world == 2 else run_world(_user_factor, world)):
        assert max(errs) < 0.05, errs


# -- native 2-D HSDP and custom HSDP layouts (issue 18) -------------------------------------
def _native_hsdp(rank, world, factor):
    import hhook.fsdp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(100 + rank)
    x, y = torch.randn(32, 6), torch.randn(32, 5)
    out = []
    for mode in ("plain", "thc"):
        model = _shard(_model(), mesh=mesh)  # native HSDP: FSDP's own replica all-reduce
        if factor is not None:
            for m in (model[0], model[2], model):
                m.set_gradient_divide_factor(factor)
                m.set_force_sum_reduction_for_comms(True)  # Gloo has no PREMUL_SUM: SUM, then FSDP divides
        state = hhook.fsdp.register(model, bits=8) if mode == "thc" else None
        _step(model, x, y)
        out.append(_grads(model))
    return [((a - b).norm() / b.norm()).item() for a, b in zip(*out)], state.stats()["compressed_calls"]


@pytest.mark.parametrize("factor", [None, 0.5])
def test_native_hsdp_matches_plain_hsdp(shared, factor):
    # Before the fix, register forced FSDP's divide factor to 1 under native HSDP: the
    # replica all-reduce then summed replica means, gradients 2x plain HSDP's at 2x2.
    for errs, calls in shared(4, "native_hsdp", factor):
        assert calls == 2 and max(errs) < 0.05, errs


def _hsdp_states(rank, world):
    """register_hsdp with a replica_state built by the user, and bits="auto" sized for the
    groups the messages cross (2 ranks each on a 2 x 2 grid), not for the WORLD of 4."""
    import hhook.fsdp
    from hhook.codec.error_model import auto_bits
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out = {}
    torch.manual_seed(100 + rank)
    x, y = torch.randn(32, 6), torch.randn(32, 5) * (10.0 if rank == 1 else 0.0 if rank == 2 else 1.0)
    full = _exact_mean_grads(x, y, world)
    for bits in (8, "auto"):
        model = _shard(_model(), mesh=mesh["shard"])
        state, replica = hhook.fsdp.register_hsdp(model, mesh["replicate"].get_group(), bits=bits,
                                                  replica_state=hhook.THCState(bits=bits))
        _step(model, x, y)
        grads = [p.grad.full_tensor() for p in model.parameters()]
        out[f"errors_{bits}"] = [((a - b).norm() / b.norm()).item() for a, b in zip(grads, full)]
        out[f"bits_{bits}"] = sorted({p.bits for p in state.keys.policies.values()} | {p.bits for p in replica.keys.policies.values()})
        out["auto_bits_2"] = auto_bits(2)
    try:
        hhook.fsdp.register_hsdp(_shard(_model(), mesh=mesh["shard"]), mesh["replicate"].get_group(), bits=8,
                                 replica_state=hhook.THCState(process_group=dist.group.WORLD, bits=8))
        out["world_replica_state"] = "accepted"
    except ValueError as e:
        out["world_replica_state"] = str(e)
    return out


def test_register_hsdp_replica_state_and_auto_bits_follow_their_groups(shared):
    for r in shared(4, "hsdp_states"):
        assert max(r["errors_8"]) < 0.05, r["errors_8"]  # 0.78-1.0 when the replica state averaged over WORLD
        assert max(r["errors_auto"]) < 0.15, r["errors_auto"]
        assert r["bits_8"] == [8] and r["bits_auto"] == [r["auto_bits_2"]] == [5], r
        assert "replica_state reduces over ranks [0, 1, 2, 3], not over replica_group" in r["world_replica_state"]


def _bad_hsdp_layout(rank, world):
    import hhook.fsdp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    found = []
    try:  # WORLD holds every shard: not a replica group
        hhook.fsdp.register_hsdp(_shard(_model(), mesh=mesh["shard"]), dist.group.WORLD, bits=8)
    except ValueError as e:
        found.append("replica_group must join the ranks that hold the same shard" in str(e)
                     and "shard ranks [0, 1, 0, 1]" in str(e))
    try:  # the shard group itself
        hhook.fsdp.register_hsdp(_shard(_model(), mesh=mesh["shard"]), mesh["shard"].get_group(), bits=8)
    except ValueError as e:
        found.append("replica_group must join" in str(e))
    try:  # a 2-D mesh: FSDP would all-reduce across replicas itself, then the hook again
        hhook.fsdp.register_hsdp(_shard(_model(), mesh=mesh), mesh["replicate"].get_group(), bits=8)
    except ValueError as e:
        found.append("mesh with a replicate dimension" in str(e))
    # and the right layout still works after the refusals
    model = _shard(_model(), mesh=mesh["shard"])
    hhook.fsdp.register_hsdp(model, mesh["replicate"].get_group(), bits=8)
    _step(model, torch.randn(8, 6), torch.randn(8, 5))
    return found


def test_register_hsdp_refuses_wrong_layouts_on_every_rank():
    assert run_world(_bad_hsdp_layout, 4) == [[True, True, True]] * 4


# -- the shared message format (hhook.scales.message) through the reduce-scatter ---------------------
def _messages(rank, world):
    import weakref

    import hhook.codec
    from hhook.fsdp import THCReduceScatter
    from hhook.scales.message import PREFIX
    from hhook.schedule import reduce_scatter as schedule
    from hhook.state import THCState

    state = THCState(bits=4)
    comm = THCReduceScatter(state, "m", None)
    group = dist.group.WORLD
    n = 5000
    torch.manual_seed(rank)
    seen, alive = [], []  # the schedule's reduce-scatter, whichever name torch gives it
    real_rs, real_prepare = schedule.reduce_scatter_flat, hhook.codec.THCCodec.prepare

    def capture(output, input, *args, **kwargs):
        work = real_rs(output, input, *args, **kwargs)
        seen.append(output[:PREFIX].clone())
        return work

    def tracked(self, x, *residual):  # how many chunks' rotated blocks are alive at each prepare
        alive[:] = [r for r in alive if r() is not None]
        prepared = real_prepare(self, x, *residual)
        alive.append(weakref.ref(prepared.blocks))
        seen_alive.append(len(alive))
        return prepared

    seen_alive = []
    schedule.reduce_scatter_flat, hhook.codec.THCCodec.prepare = capture, tracked
    try:
        out = torch.empty(n)
        for _ in range(3):
            comm(out, torch.randn(world * n), group, dist.ReduceOp.SUM)
    finally:
        schedule.reduce_scatter_flat, hhook.codec.THCCodec.prepare = real_rs, real_prepare
    keys = sorted(state.policy("agreed").keys)
    return [p[:2].tolist() for p in seen], max(seen_alive), keys


def test_reduce_scatter_messages_use_the_shared_format():
    for rank, (prefixes, alive, keys) in enumerate(run_world(_messages, 3)):
        # the summed prefix of this rank's chunk: count word = world size, status 0
        assert prefixes == [[3, 0]] * 3
        # at most this rank's chunk and the one being encoded hold rotated blocks
        assert alive <= 2, alive
        # per-key state under (param-group name, chunk index), the same keys every step
        assert keys == [("m", 0), ("m", 1), ("m", 2)]


def _failure(rank, world):
    import hhook.codec
    from hhook.fsdp import THCReduceScatter
    from hhook.errors import RankFailedError
    from hhook.state import THCState

    comm = THCReduceScatter(THCState(bits=4), "f", None)
    real = hhook.codec.THCCodec.quantize
    calls = []

    def failing(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:  # rank 1 fails on chunk 0 only: a chunk rank 0 owns
            raise RuntimeError("injected failure")
        return real(self, *args, **kwargs)

    if rank == 1:
        hhook.codec.THCCodec.quantize = failing
    out = torch.empty(3000)
    try:
        comm(out, torch.randn(world * 3000), dist.group.WORLD, dist.ReduceOp.SUM)
    except RankFailedError:
        result = "RankFailedError"
    except RuntimeError as e:
        result = str(e)
    else:
        result = "no error"
    hhook.codec.THCCodec.quantize = real
    comm(out, torch.randn(world * 3000), dist.group.WORLD, dist.ReduceOp.SUM)  # the next call works
    return result, bool(torch.isfinite(out).all())


def test_rank_local_failure_raises_on_every_rank():
    assert run_world(_failure, 3) == [("RankFailedError", True), ("injected failure", True),
                                      ("RankFailedError", True)]


def _message_mismatch(rank, world):
    from hhook.fsdp import THCReduceScatter
    from hhook.errors import ConfigMismatchError
    from hhook.state import THCState

    from hhook.schedule.context import GroupRuntime

    state = THCState(bits=4, seed=rank)  # differing rotation seeds
    comm = THCReduceScatter(state, "x", None)
    state.runtimes[dist.group.WORLD] = GroupRuntime()
    state.runtimes[dist.group.WORLD].agreed = True  # skip the handshake: the messages must catch it
    try:
        comm(torch.empty(3000), torch.randn(world * 3000), dist.group.WORLD, dist.ReduceOp.SUM)
    except ConfigMismatchError:
        return "raised"
    return "ok"


def test_message_fingerprint_mismatch_raises_everywhere():
    assert run_world(_message_mismatch, 2) == ["raised", "raised"]


# -- guarantees through FSDP2 ------------------------------------------------------------------
def _clip_nonfinite(rank, world):
    import hhook.fsdp

    model = _shard(_model())
    hhook.fsdp.register(model, bits=4)
    x = torch.randn(8, 6)
    if rank == 1:
        x[2, 3] = float("nan")  # one rank, one sample
    _step(model, x, torch.randn(8, 5))
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    return bool(torch.isfinite(norm))


def test_clip_grad_norm_sees_nonfinite_on_every_rank(shared):
    assert shared(2, "clip_nonfinite") == [False, False]


def _accumulation_grads(rank, world):
    import hhook.fsdp

    torch.manual_seed(40 + rank)
    micro = [(torch.randn(16, 6), torch.randn(16, 5)) for _ in range(3)]
    out = {}
    for mode in ("plain", "thc"):
        model = _shard(_model())
        state = hhook.fsdp.register(model, bits=8) if mode == "thc" else None
        for i, (x, y) in enumerate(micro):
            model.set_requires_gradient_sync(i == len(micro) - 1)
            _step(model, x, y)
        out[mode] = _grads(model)
    errs = [((a - b).norm() / b.norm()).item() for a, b in zip(out["plain"], out["thc"])]
    return errs, state.stats()["compressed_calls"]


def test_accumulation_matches_plain_gradient(shared):
    for errs, calls in shared(2, "accumulation_grads"):
        assert calls == 2  # one reduce-scatter per module, at the synchronising micro-batch
        assert max(errs) < 0.05, errs


def _checkpoint(rank, world):
    import io

    import hhook.fsdp

    torch.manual_seed(60 + rank)
    x, y = torch.randn(32, 6), torch.randn(32, 5)
    model = _shard(_model())
    state = hhook.fsdp.register(model, bits=8)
    _step(model, x, y)
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    keys = sorted(loaded.policy("agreed").keys)
    # training continues with the loaded state on a fresh model
    model2 = _shard(_model())
    hhook.fsdp.register(model2, state=loaded)
    opt = torch.optim.SGD(model2.parameters(), lr=0.1)
    plain = _shard(_model())
    popt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for m, o in ((model2, opt), (plain, popt)):
        for _ in range(2):
            o.zero_grad()
            _step(m, x, y)
            o.step()
    errs = [((a.full_tensor() - b.full_tensor()).norm() / b.full_tensor().norm()).item()
            for a, b in zip(model2.parameters(), plain.parameters())]
    return keys, loaded.stats()["compressed_calls"], max(errs)


def test_state_checkpoint_and_training_continues(shared):
    for keys, calls, err in shared(2, "checkpoint"):
        assert keys == [("0", 0), ("0", 1), ("2", 0), ("2", 1)]
        assert calls == 2 + 4  # counters carried over, then two more steps of two modules
        assert err < 0.01, err
