"""hhook.fsdp's compressed parameter all-gather (src/hhook/fsdp/all_gather.py) on FSDP2, Gloo on CPU."""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

from tests.support.distributed import logged, run_world, shared_worlds

fsdp = pytest.importorskip("torch.distributed.fsdp")
from hhook.fsdp.modules import param_group  # noqa: E402

LOG = "hhook.fsdp.all_gather"


@pytest.mark.quick
@pytest.mark.parametrize("bits", [8, 7, 6, 5, 4, 3, 2])
def test_codes_pack_and_unpack_at_every_width(bits):
    from hhook.codec.weights import pack, unpack

    codes = torch.randint(0, 2 ** bits - 1, (8 * 37,), dtype=torch.uint8)
    out = torch.empty(37 * bits, dtype=torch.uint8)
    pack(codes, bits, out)
    assert torch.equal(unpack(out, bits, codes.numel()), codes)


@pytest.mark.quick
@pytest.mark.parametrize("rotate", [False, True, "auto"])
@pytest.mark.parametrize("bits", [8, 6, 4])
def test_weight_codec_bound_and_zeros(bits, rotate):
    from hhook.codec.weights import WeightCodec

    codec = WeightCodec(bits, 64, rotate, seed=3)
    x = torch.randn(5, 64) * torch.tensor([1.0, 1e-30, 0.0, 1e4, 1.0])[:, None]
    x[4, 7] = 50.0  # an outlier
    payload = torch.empty(codec.nbytes(5), dtype=torch.uint8)
    assert codec.encode(x.clone(), payload)
    y = codec.decode(payload, 5, torch.empty(5, 64))
    err = (y - x).norm(dim=1)
    assert (err <= codec.bound(codec.scales(payload, 5)) * (1 + 1e-5) + 1e-6 * x.norm(dim=1)).all()
    assert torch.equal(y[2], torch.zeros(64))  # a zero block decodes to exact zeros
    again = torch.empty_like(payload)
    codec.encode(x.clone(), again)
    assert torch.equal(payload, again)  # round to nearest: a pure function of the values
    x[0, 3] = float("nan")
    assert not codec.encode(x.clone(), again)  # said, for the comm's dense fallback


def test_auto_rotation_takes_the_better_domain_per_block():
    """Uniform blocks stay as they are, heavy-tailed ones are rotated; the error is the
    smaller of never and always rotating, block by block."""
    from hhook.codec.weights import WeightCodec

    g = torch.Generator().manual_seed(0)
    x = torch.cat((torch.rand(50, 256, generator=g) * 2 - 1, torch.randn(50, 256, generator=g) ** 5))
    errs = {}
    for mode in (False, True, "auto"):
        codec = WeightCodec(8, 256, mode)
        payload = torch.empty(codec.nbytes(100), dtype=torch.uint8)
        codec.encode(x.clone(), payload)
        errs[mode] = (codec.decode(payload, 100) - x).norm(dim=1)
        turned = torch.signbit(codec.scales(payload, 100))
    assert not turned[:50].any() and turned[50:].all()
    assert (errs["auto"] <= torch.minimum(errs[False], errs[True]) * 1.0001).all()
    assert errs[False][50:].mean() > 2 * errs[True][50:].mean() and errs[True][:50].mean() > 1.5 * errs[False][:50].mean()


def _model(seed=0):
    """Odd shapes: 131 and 67 rows divide by neither 2 nor 3 (FSDP pads dim 0). Layers 0
    and 2 are quantized (>= 4096 values, two dims), layer 4 (201 values), the biases and
    the norm stay dense."""
    torch.manual_seed(seed)
    nn = torch.nn
    return nn.Sequential(nn.Linear(37, 131), nn.Tanh(), nn.Linear(131, 67), nn.LayerNorm(67), nn.Linear(67, 3))


QUANTIZED = ("0.weight", "2.weight")


def _shard(model, reshard=True, param_dtype=None, mesh=None):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = {"reshard_after_forward": reshard, "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype)}
    if mesh is not None:
        kw["mesh"] = mesh
    for i in (0, 2, 4):
        fully_shard(model[i], **kw)
    return fully_shard(model, **kw)


def _capture(model) -> dict:
    """name -> the unsharded parameters each forward computed with (a list per name)."""
    seen: dict = {}
    for i in (0, 2, 4):
        def hook(module, args, i=i):
            for n, p in module.named_parameters(recurse=False):
                seen.setdefault(f"{i}.{n}", []).append(p.detach().clone())
        model[i].register_forward_pre_hook(hook)
    return seen


def _block_ratios(exact, decoded, world, codec, dtype):
    """Per block of each rank's shard (FSDP's dim-0 padding, then blocks of B): the
    error's L2 norm over the codec's bound (:meth:`WeightCodec.bound`, from the exact
    shard's scales) plus the rounding to ``dtype``. At most 1 when the bound holds."""
    rows = -(-exact.shape[0] // world)
    pad = torch.zeros(rows * world, *exact.shape[1:])
    ratios = []
    for src in (exact, decoded):
        p = pad.clone()
        p[: exact.shape[0]] = src.float()
        ratios.append(p)
    B = codec.block_size
    out = []
    for r in range(world):
        shards = []
        for p in ratios:
            flat = p[r * rows:(r + 1) * rows].reshape(-1)
            blocks = torch.zeros(-(-flat.numel() // B) * B)
            blocks[: flat.numel()] = flat
            shards.append(blocks.view(-1, B))
        x, y = shards
        payload = torch.empty(codec.nbytes(x.shape[0]), dtype=torch.uint8)
        codec.encode(x.clone(), payload)  # the comm's CPU path
        bound = codec.bound(codec.scales(payload, x.shape[0]))
        err = (y - x).norm(dim=1)
        slack = y.norm(dim=1) * (2.0 ** -8 if dtype == torch.bfloat16 else 1e-6) + 1e-12
        out.append((err / (bound * (1 + 1e-5) + slack)).max().item())
    return max(out)


def _gather(rank, world, bits, param_dtype, reshard):
    import hhook.fsdp
    from hhook.codec.weights import WeightCodec

    exact = dict(_model().named_parameters())
    model = _shard(_model(), reshard, param_dtype)
    state = hhook.fsdp.compress_all_gather(model, bits=bits)
    seen = _capture(model)
    torch.manual_seed(5)  # the same batch on every rank
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(2):
        model(torch.randn(8, 37)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    codec = WeightCodec(bits)  # the default options: blocks of 256, rotation where it pays
    dtype = param_dtype or torch.float32
    first = {n: v[0] for n, v in seen.items()}
    return {"first": first, "stats": state.stats(),
            "ratio": {n: _block_ratios(exact[n].detach(), first[n], world, codec, dtype) for n in QUANTIZED},
            "err": {n: (first[n].float() - exact[n].detach().to(dtype).float()).norm().item() for n in first},
            "dtype": {n: first[n].dtype for n in first}}


GATHER_CASES = [(2, 8, None, True), (3, 8, None, False), (2, 6, None, True), (3, 4, torch.bfloat16, True),
                (2, 8, torch.bfloat16, False)]


@pytest.fixture(scope="module")
def shared():
    """``world -> key -> [(ok, what the rank returned)]``: the scenarios below that pass or
    fail on their own results (no rank raising, no mismatch), one world per world size (2
    worlds, not 14), each scenario with its own model and hook state; a world is started
    by the first test that asks for it."""
    cases = {2: [(("gather", *c[1:]), _gather, c[1:]) for c in GATHER_CASES if c[0] == 2]
             + [(("bytes", dtype), _bytes, (dtype,)) for dtype in (None, torch.bfloat16)]
             + [(("heterogeneous",), _heterogeneous, ()), (("hsdp",), _hsdp, ())],
             3: [(("gather", *c[1:]), _gather, c[1:]) for c in GATHER_CASES if c[0] == 3]
             + [(("optimizer", dtype), _optimizer_exact, (dtype,)) for dtype in (None, torch.bfloat16)]
             + [(("nonfinite", dtype), _nonfinite, (dtype,)) for dtype in (None, torch.bfloat16)]
             + [(("subgroup",), _subgroup, ())]}
    return shared_worlds(cases)


@pytest.mark.parametrize("world,bits,param_dtype,reshard", GATHER_CASES)
def test_gathered_params_within_the_bound_and_identical_on_every_rank(shared, world, bits, param_dtype, reshard):
    outs = shared(world, "gather", bits, param_dtype, reshard)
    for out in outs:
        for name in QUANTIZED:
            assert out["ratio"][name] <= 1.0, (name, out["ratio"][name])
            assert out["err"][name] > 0, name  # quantized, not passed through
        for name, err in out["err"].items():
            if name not in QUANTIZED:  # biases and the small layer: exactly FSDP2's
                assert err == 0, name
            assert out["dtype"][name] == (param_dtype or torch.float32)
        for name, t in out["first"].items():  # every rank decodes every shard to the same bits
            assert torch.equal(t, outs[0]["first"][name]), name
        # 2 quantized modules, 2 steps; with resharding each all-gathers again for the backward
        assert out["stats"]["compressed_calls"] == 2 * 2 * (2 if reshard else 1)
        assert out["stats"]["dense_calls"] == out["stats"]["nonfinite_calls"] == 0


class _Parallel(torch.nn.Module):
    """Two FSDP modules side by side: ``sum(out * g)`` has the weight gradient ``g^T x``,
    whatever the weights are, so the gradient path is exact under a quantized all-gather."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(37, 131), torch.nn.Linear(37, 67)

    def forward(self, x):
        return torch.cat((self.a(x), self.b(x)), dim=1)


def _optimizer_exact(rank, world, param_dtype):
    import hhook.fsdp
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    out = {}
    for mode in ("plain", "ag4"):
        model = _Parallel()
        mp = MixedPrecisionPolicy(param_dtype=param_dtype)
        for m in (model.a, model.b, model):
            fully_shard(m, mp_policy=mp)
        if mode == "ag4":
            hhook.fsdp.compress_all_gather(model, bits=4)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        torch.manual_seed(11 + rank)
        losses = []
        for _ in range(3):
            x, g = torch.randn(16, 37), torch.randn(16, 198)
            y = model(x)
            losses.append(y.float().square().sum().item())
            (y.float() * g).sum().backward()
            opt.step()
            opt.zero_grad()
        out[mode] = ([p.to_local().detach().clone() for p in model.parameters()], losses)
    return out


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_sharded_params_the_optimizer_updates_stay_exact(shared, param_dtype):
    for out in shared(3, "optimizer", param_dtype):
        (plain, plain_losses), (ag, ag_losses) = out["plain"], out["ag4"]
        assert plain_losses != ag_losses  # the forward did compute with 4-bit weights
        for a, b in zip(plain, ag):
            assert torch.equal(a, b)  # ... and the sharded fp32 parameters are plain FSDP2's, bit for bit


def _train(rank, world, rs_bits, ag_bits):
    import hhook.fsdp

    torch.manual_seed(3)
    teacher = _model(seed=9)
    data = [torch.randn(32, 37) for _ in range(60)]
    model = _shard(_model())
    state = None
    if ag_bits is not None:
        state = hhook.fsdp.register(model, bits=rs_bits, all_gather=ag_bits) if rs_bits else \
            hhook.fsdp.compress_all_gather(model, bits=ag_bits)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for i, x in enumerate(data):
        x = x[rank::world]
        loss = torch.nn.functional.mse_loss(model(x), teacher(x).detach())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    x = torch.randn(512, 37)
    final = torch.nn.functional.mse_loss(model(x), teacher(x).detach()).item()
    return {"first": losses[0], "final": final, "ag": hhook.fsdp.all_gather_stats(model),
            "rs": state.stats() if rs_bits else None}


def test_training_matches_plain_fsdp():
    plain = run_world(_train, 2, None, None)[0]
    assert plain["final"] < 0.2 * plain["first"]
    for rs_bits, ag_bits, tol in ((None, 8, 0.005), (8, 8, 0.05), (None, 4, 0.2)):  # measured: 6e-6, 0.004, 0.06
        out = run_world(_train, 2, rs_bits, ag_bits)[0]
        assert abs(out["final"] - plain["final"]) <= tol * plain["final"], (rs_bits, ag_bits, out, plain)
        assert out["ag"]["compressed_calls"] > 0
        if rs_bits:  # the reduce-scatter's counters hold none of the all-gathers' bytes
            assert out["rs"]["compressed_calls"] == 4 * 60 and out["rs"]["wire_bytes"] < out["ag"]["wire_bytes"]


def _nonfinite(rank, world, param_dtype):
    import hhook.fsdp

    exact = dict(_model().named_parameters())
    model = _shard(_model(), param_dtype=param_dtype)
    hhook.fsdp.compress_all_gather(model, bits=8)
    seen = _capture(model)
    if rank == 1:  # rank 1's shard of layer 0 (rows 44.. of 131 with 3 ranks)
        local = model[0].weight.to_local()
        with torch.no_grad():
            local[0, 0] = float("inf")
            local[1, 2] = float("nan")
    model(torch.randn(4, 37)).sum().backward()
    return seen["0.weight"][0], seen["2.weight"][0], exact["0.weight"].detach(), exact["2.weight"].detach(), \
        hhook.fsdp.all_gather_stats(model)


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_nonfinite_shard_reaches_every_rank_where_it_was(shared, param_dtype):
    dtype = param_dtype or torch.float32
    for w0, w2, exact0, exact2, stats in shared(3, "nonfinite", param_dtype):
        expected = exact0.to(dtype).clone()
        expected[44, 0], expected[45, 2] = float("inf"), float("nan")
        # the call with the inf/NaN is plain FSDP2's all-gather: the same bits, inf and NaN where they were
        assert torch.equal(w0.isinf(), expected.isinf()) and torch.equal(w0.isnan(), expected.isnan())
        finite = expected.isfinite()
        assert torch.equal(w0[finite], expected[finite])
        assert 0 < (w2.float() - exact2.to(dtype).float()).norm() < 0.02 * exact2.norm()  # the other module: quantized
        assert stats["nonfinite_calls"] == 2 and stats["compressed_calls"] == 4  # forward and backward of layer 0


def _mismatch(rank, world, what):
    import hhook.fsdp
    from hhook.fsdp import AllGatherOptions
    from hhook.errors import ConfigMismatchError

    values = {"bits": (8, 6), "rotate": (True, False), "min_numel": (5000, 4096), "seed": (0, 1)}[what]
    model = _shard(_model())
    try:  # at registration: a blocking handshake on every shard group
        hhook.fsdp.register(model, bits=8, all_gather=AllGatherOptions(**{what: values[rank]}))
    except ConfigMismatchError as e:
        changed = type(param_group(model[0])._reduce_scatter_comm).__name__
        # the all-gather's option (ag_...) with each rank's value; registration left FSDP's comms alone
        named = f"ag_{what}: {values[0]} on rank 0, {values[1]} on rank 1" in str(e)
        return "raised" if named and changed == "DefaultReduceScatter" else str(e)
    return "ok"


@pytest.mark.parametrize("what", ["bits", "rotate", "min_numel", "seed"])
def test_options_mismatch_raises_on_every_rank(what):
    assert run_world(_mismatch, 2, what) == ["raised", "raised"]


def _late_mismatch_and_failure(rank, world):
    """After the handshake: a payload of other options (the header's fingerprint), then a
    rank whose encoding fails (its own exception there, RankFailedError elsewhere)."""
    import hhook.fsdp
    from hhook.errors import ConfigMismatchError, RankFailedError
    from hhook.codec.weights import WeightCodec

    model = _shard(_model())
    hhook.fsdp.compress_all_gather(model)
    model(torch.randn(4, 37)).sum().backward()
    comm = param_group(model[0])._all_gather_comm
    out = []
    if rank == 1:
        comm.codec = WeightCodec(8, 256, False)  # same payload length, other fingerprint
    try:
        model(torch.randn(4, 37))
    except ConfigMismatchError:
        out.append("mismatch")
    comm.codec = WeightCodec(8)

    class Broken(WeightCodec):
        def encode(self, blocks, out):
            raise ArithmeticError("rank 1's encoder broke")

    model = _shard(_model())  # fresh FSDP state after the raise
    hhook.fsdp.compress_all_gather(model)
    comm = param_group(model[0])._all_gather_comm
    if rank == 1:
        comm.codec = Broken(8)
    try:
        model(torch.randn(4, 37))
    except ArithmeticError:
        out.append("own")
    except RankFailedError as e:
        out.append("peer" if "[1]" in str(e) else str(e))
    return out


def test_late_mismatch_and_failed_rank_raise_on_every_rank():
    assert run_world(_late_mismatch_and_failure, 2) == [["mismatch", "peer"], ["mismatch", "own"]]


def _compiled(rank, world):
    import hhook.fsdp
    from torch._dynamo.utils import counters

    model = _shard(_model())
    hhook.fsdp.compress_all_gather(model, bits=8)
    compiled = torch.compile(model)
    torch.manual_seed(1)
    x = torch.randn(8, 37)
    compiled(x).sum().backward()
    eager = model(x)
    return torch.equal(compiled(x), eager), counters["frames"]["ok"], hhook.fsdp.all_gather_stats(model)


def test_under_torch_compile():
    """FSDP2 compiles on CPU here; its hooks (and so the comm) run eagerly, outside the graph."""
    for same, frames, stats in run_world(_compiled, 2):
        assert same and frames > 0
        assert stats["compressed_calls"] == 2 * 4 and stats["dense_calls"] == 0


def _subgroup(rank, world):
    """Ranks 0 and 1 shard over a group of their own beside WORLD; rank 2 trains alone."""
    import hhook.fsdp
    from torch.distributed.device_mesh import DeviceMesh

    pair = dist.new_group([0, 1])
    if rank == 2:
        return None
    mesh = DeviceMesh.from_group(pair, "cpu")
    exact = dict(_model().named_parameters())
    model = _shard(_model(), mesh=mesh)
    hhook.fsdp.register(model, bits=8, all_gather=8)
    seen = _capture(model)
    model(torch.randn(4, 37)).sum().backward()
    return {n: ((seen[n][0] - exact[n].detach()).norm() / exact[n].norm()).item() for n in QUANTIZED}, \
        hhook.fsdp.all_gather_stats(model)


def test_subgroup_mesh_beside_world(shared):
    outs = shared(3, "subgroup")
    assert outs[2] is None
    for errs, stats in outs[:2]:
        assert all(0 < e < 0.01 for e in errs.values()), errs
        assert stats["compressed_calls"] == 4
    assert outs[0][0] == outs[1][0]


def _heterogeneous(rank, world):
    """Shards of very different magnitudes: rank 0's rows of layer 0 times 1e3, rank 1's
    times 1e-3. Each shard keeps its own block scales, so each keeps its relative error."""
    import hhook.fsdp

    def scaled():
        m = _model()
        with torch.no_grad():
            m[0].weight[:66] *= 1e3  # rank 0's shard of 131 rows over 2 ranks
            m[0].weight[66:] *= 1e-3
        return m

    exact = scaled()[0].weight.detach()
    model = _shard(scaled())
    hhook.fsdp.compress_all_gather(model, bits=8)
    seen = _capture(model)
    model(torch.randn(4, 37)).sum().backward()
    w = seen["0.weight"][0]
    return [((w[r] - exact[r]).norm() / exact[r].norm()).item() for r in (slice(0, 66), slice(66, None))]


def test_heterogeneous_shards_keep_their_relative_error(shared):
    for errs in shared(2, "heterogeneous"):
        assert all(0 < e < 0.012 for e in errs), errs  # int8 with rotation: about 0.007 on each


def _hsdp(rank, world):
    """Native HSDP on a (1, 2) mesh: the all-gather runs inside the shard dimension."""
    import hhook.fsdp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
    exact = dict(_model().named_parameters())
    model = _shard(_model(), mesh=mesh)
    hhook.fsdp.register(model, bits=8, all_gather=8)
    seen = _capture(model)
    model(torch.randn(4, 37)).sum().backward()
    return {n: ((seen[n][0] - exact[n].detach()).norm() / exact[n].norm()).item() for n in QUANTIZED}


def test_native_hsdp_mesh(shared):
    for errs in shared(2, "hsdp"):
        assert all(0 < e < 0.01 for e in errs.values()), errs


def _refusals(rank, world):
    """Errors raised before anything changes (the reduce-scatter comm stays FSDP's)."""
    import hhook.fsdp
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    def untouched(model):
        group = param_group(model[0])
        return type(group._reduce_scatter_comm).__name__ == "DefaultReduceScatter" and \
            type(group._all_gather_comm).__name__ == "DefaultAllGather"

    out = []
    for bad, error in ((9, ValueError), (True, TypeError), ("8", TypeError), (0, ValueError)):
        model = _shard(_model())
        try:
            hhook.fsdp.register(model, bits=8, all_gather=bad)
        except error as e:
            out.append(untouched(model) and ("bits" in str(e) or "all_gather" in str(e)))
    model = _shard(_model())

    class Mine(DefaultAllGather):
        pass

    model[2].set_custom_all_gather(Mine())
    try:
        hhook.fsdp.register(model, bits=8, all_gather=8)
    except ValueError as e:
        out.append(untouched(model) and "already has a custom all-gather (Mine)" in str(e))
    saved = FSDPModule.set_custom_all_gather
    del FSDPModule.set_custom_all_gather  # a torch without the extension point
    try:
        model = _shard(_model())
        hhook.fsdp.compress_all_gather(model)
    except RuntimeError as e:
        out.append(untouched(model) and "no FSDPModule.set_custom_all_gather" in str(e))
    finally:
        FSDPModule.set_custom_all_gather = saved
    return out


def test_bad_options_and_torch_raise_before_any_change():
    assert run_world(_refusals, 2) == [[True] * 6] * 2


#: torch 2.11's fully_shard raises on an integer parameter ("only Tensors of floating point
#: dtype can require gradients"); 2.13's shards it.
INTEGER_PARAMS = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)


def _fallbacks(rank, world):
    """Modules the comm cannot serve stay plain, said in one log line at registration;
    a buffer of mixed dtypes at run time is all-gathered dense, logged once."""
    import hhook.fsdp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    model = _model()
    if INTEGER_PARAMS:
        model[2].register_parameter("steps", torch.nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False))
    # a frozen bfloat16 parameter beside trainable float32 ones: FSDP all-gathers them as bytes (uint8)
    model[0].register_parameter("frozen", torch.nn.Parameter(torch.ones(5, dtype=torch.bfloat16), requires_grad=False))
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    side = model[1].side = torch.nn.Linear(5, 5)  # not in the forward; its own FSDP module
    with torch.no_grad():  # tensor parallelism's DTensors (a tp dimension of 1)
        side.weight = torch.nn.Parameter(distribute_tensor(side.weight.detach(), mesh["tp"], [Replicate()]))
    from torch.distributed.fsdp import fully_shard

    fully_shard(side, mesh=mesh["dp"])
    _shard(model, mesh=mesh["dp"])
    with logged(LOG) as lines:
        state = hhook.fsdp.compress_all_gather(model, min_numel=100)
        exact0 = model[0].weight.full_tensor()
        seen = _capture(model)
        for _ in range(2):
            model(torch.randn(4, 37)).sum().backward()
    return lines, state.stats(), torch.equal(seen["0.weight"][0], exact0)


def test_unservable_modules_fall_back_to_dense_with_one_log_line():
    for lines, stats, exact in run_world(_fallbacks, 2):
        assert len(lines) == 2, lines
        assert "1.side (parameter 'weight' is a DTensor" in lines[0]
        assert ("2 (parameter 'steps' is torch.int64)" in lines[0]) == INTEGER_PARAMS
        assert "<root> (no parameter with two dimensions" in lines[0]
        assert "0: all-gathered dense (its all-gather buffer is torch.uint8" in lines[1]
        # layer 0 dense (2 steps, forward and backward); layer 4 (201 values >= min_numel) compressed,
        # and layer 2 too where it holds no integer parameter
        assert exact and stats["dense_calls"] == 4 and stats["compressed_calls"] == (4 if INTEGER_PARAMS else 8)


def _int_reshard(rank, world):
    import hhook.fsdp

    model = _shard(_model(), reshard=2)  # 4 ranks: reshard to groups of 2 after the forward
    with logged(LOG) as lines:
        hhook.fsdp.register(model, bits=8, all_gather=8)
    model(torch.randn(4, 37)).sum().backward()
    return lines, hhook.fsdp.all_gather_stats(model)


def test_int_reshard_after_forward_stays_dense():
    for lines, stats in run_world(_int_reshard, 4):
        assert len(lines) == 1 and "0 (reshard_after_forward is an int" in lines[0], lines
        assert stats is None  # no module took the compressed comm


def _bytes(rank, world, param_dtype):
    import hhook.fsdp

    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(511, 1023))
    fully_shard(model[0], mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype))
    state = hhook.fsdp.compress_all_gather(model, bits=8)
    model(torch.randn(2, 511)).sum().backward()
    return state.stats()


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_bytes_at_8_bits(shared, param_dtype):
    itemsize = 2 if param_dtype else 4
    rows = -(-1023 // 2)
    weight, bias = rows * 511, rows  # one rank's padded shards
    blocks = -(-weight // 256)
    payload = -(-(16 + -(-bias * itemsize // 4) * 4 + 4 * blocks + 256 * blocks) // 16) * 16
    for stats in shared(2, "bytes", param_dtype):
        calls = stats["compressed_calls"]
        assert calls == 1 and stats["wire_bytes"] == 8 + calls * 2 * payload  # handshake + payloads (a root keeps its params)
        assert stats["dense_bytes"] == calls * 2 * (weight + bias) * itemsize
        assert stats["ratio"] >= (3.9 if param_dtype is None else 1.95), stats


def test_profiler_methods_take_ag():
    from hhook.profile.train import parse_methods

    names = {m.name: (m.all_gather, m.params) for m in parse_methods(
        "fp32,bf16:ag=bf16,thc:4,thc:4:ag=8,fp32:ag=6,thc:4:ag=bf16,thc:4:params=bf16:ag=8")}
    assert names == {"fp32": (None, None), "bf16:ag=bf16": ("bf16", None), "thc:4": (None, None),
                     "thc:4:ag=8": (8, None), "fp32:ag=6": (6, None), "thc:4:ag=bf16": ("bf16", None),
                     "thc:4:ag=8:params=bf16": (8, "bf16")}
    for bad in ("thc:4:ag=9", "fp32:ag=fp8", "fp16:ag=8", "thc:4:params=fp16"):
        with pytest.raises(ValueError, match="ag=|params=|takes no options"):
            parse_methods(bad)
