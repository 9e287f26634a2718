"""The DDP hook against plain fp32 DDP on the same model, data and seeds."""

import contextlib
import io

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hhook

from tests.support.distributed import run_world

STEPS = 40

# name -> (DDP options, THCState options, parameter dtype, micro-batches per step)
CASES = {
    "default": ({}, {}, torch.float32, 1),
    "gradient_as_bucket_view": ({"gradient_as_bucket_view": True}, {}, torch.float32, 1),
    "static_graph": ({"static_graph": True}, {}, torch.float32, 1),
    "no_sync": ({}, {}, torch.float32, 2),
    "find_unused_parameters": ({"find_unused_parameters": True}, {}, torch.float32, 1),
    "many_buckets": ({"bucket_cap_mb": 0.01}, {}, torch.float32, 1),
    "predicted": ({}, {"scales": "predicted"}, torch.float32, 1),
    "predicted_many_buckets": ({"bucket_cap_mb": 0.01}, {"scales": "predicted"}, torch.float32, 1),
    "predicted_error_feedback": ({}, {"scales": "predicted", "error_feedback": True, "bits": 2}, torch.float32, 1),
    "error_feedback": ({}, {"error_feedback": True, "bits": 2}, torch.float32, 1),
    "fp16": ({}, {}, torch.float16, 1),
    "bf16": ({}, {}, torch.bfloat16, 1),
}


class Net(torch.nn.Module):
    def __init__(self, with_unused=False):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh())
        self.head = torch.nn.Linear(64, 4)
        if with_unused:
            self.unused = torch.nn.Linear(64, 4)  # never called: exercises find_unused_parameters

    def forward(self, x):
        return self.head(self.body(x))


def _data(rank, dtype):
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own shard
    teacher = torch.Generator().manual_seed(7)
    w = torch.randn(32, 4, generator=teacher)
    x = torch.randn(512, 32, generator=g)
    return x.to(dtype), (x @ w).argmax(1)


def _train(rank, case, hook_state=None, model_state=None, steps=STEPS):
    ddp_opts, _, dtype, micro = CASES[case]
    torch.manual_seed(0)
    model = Net(with_unused=ddp_opts.get("find_unused_parameters", False)).to(dtype)
    if model_state is not None:
        model.load_state_dict(model_state)
    ddp = DDP(model, **ddp_opts)
    if hook_state is not None:
        ddp.register_comm_hook(hook_state, hhook.thc_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    x, y = _data(rank, dtype)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        batch = torch.arange(step * 32, step * 32 + 32 * micro) % 512
        for m in range(micro):
            idx = batch[m * 32 : (m + 1) * 32]
            # accumulate locally (forward and backward inside no_sync) until the last micro-batch
            sync = contextlib.nullcontext() if m == micro - 1 else ddp.no_sync()
            with sync:
                loss = torch.nn.functional.cross_entropy(ddp(x[idx]).float(), y[idx]) / micro
                loss.backward()
        opt.step()
        losses.append(loss.item() * micro)
    with torch.no_grad():
        full = torch.nn.functional.cross_entropy(model(x).float(), y)
    total = torch.tensor([full.item()])
    dist.all_reduce(total)
    return total.item() / dist.get_world_size(), model


def _case_worker(rank, world, cases):
    results = {}
    for case in cases:
        fp32_loss, _ = _train(rank, case)
        state = hhook.THCState(**CASES[case][1])
        thc_loss, model = _train(rank, case, state)
        params = torch.cat([p.detach().float().reshape(-1) for p in model.parameters()])
        gathered = [torch.empty_like(params) for _ in range(world)]
        dist.all_gather(gathered, params)
        results[case] = {
            "fp32": fp32_loss,
            "thc": thc_loss,
            "stats": state.stats(),
            "in_sync": all(torch.equal(g, params) for g in gathered),
        }
    return results


@pytest.fixture(scope="module")
def world2():
    return run_world(_case_worker, 2, list(CASES), timeout=600)


@pytest.mark.parametrize("case", list(CASES))
def test_ddp_with_thc_trains_like_fp32(world2, case):
    initial = 1.386  # log(4): an untrained 4-class head
    for r in world2:
        res = r[case]
        assert res["fp32"] < 0.5 * initial, "the fp32 baseline itself must learn"
        assert abs(res["thc"] - res["fp32"]) < 0.1, res
        assert res["in_sync"], "ranks must hold identical parameters"
        s = res["stats"]
        assert s["compressed_calls"] > 0 and s["dense_calls"] > 0 and s["ratio"] > 2


def test_no_sync_steps_skip_the_hook(world2):
    one, two = world2[0]["default"]["stats"], world2[0]["no_sync"]["stats"]
    calls = lambda s: s["compressed_calls"] + s["dense_calls"]
    assert calls(one) == calls(two) == STEPS  # one bucket, one call per optimizer step


def test_small_buckets_make_several_calls_per_step(world2):
    assert world2[0]["many_buckets"]["stats"]["compressed_calls"] >= 2 * (STEPS - 2)


def test_plain_allreduce_before_start_iter(world2):
    assert world2[0]["default"]["stats"]["dense_calls"] == 2  # start_iter = 2, one bucket


@pytest.mark.parametrize("world", [3, 4])
def test_ddp_other_world_sizes(world):
    # Many tiny buckets in flight in both scale modes: the chain neither deadlocks nor
    # pairs the wrong collectives at more than two ranks.
    cases = ["default", "many_buckets", "predicted_many_buckets"]
    for r in run_world(_case_worker, world, cases, timeout=600):
        for case in cases:
            assert abs(r[case]["thc"] - r[case]["fp32"]) < 0.1 and r[case]["in_sync"], (case, r[case])


def _carried(state):
    """Everything a state carries per key: residuals and predicted scales, per policy."""
    out = {}
    for mode, policy in state.keys.policies.items():
        for key, ks in policy.keys.items():
            out[(mode, key)] = (ks.residual, ks.scales, ks.digest, ks.steps)
    return out


def _same_carried(a, b):
    if a.keys() != b.keys():
        return False
    for key in a:
        for x, y in zip(a[key], b[key]):
            if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
                if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)):
                    return False
            elif x != y:
                return False
    return True


def _checkpoint_worker(rank, world, scales):
    state = hhook.THCState(bits=4, error_feedback=True, scales=scales)
    _, model = _train(rank, "default", state, steps=10)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "hook": state}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    loaded = saved["hook"]
    carried = _carried(state)
    residuals = sum(v[0] is not None for v in carried.values())
    predicted = sum(v[1] is not None for v in carried.values())
    restored = loaded.iter == state.iter and loaded.counters.calls == state.counters.calls and _same_carried(carried, _carried(loaded))
    # Both continue from the same point: the saved state must go on bit for bit like the live one.
    _, live = _train(rank, "default", state, model_state=saved["model"], steps=5)
    loss, resumed = _train(rank, "default", loaded, model_state=saved["model"], steps=5)
    identical = all(torch.equal(a, b) for a, b in zip(live.state_dict().values(), resumed.state_dict().values()))
    return restored, residuals, predicted, identical, loss, loaded.stats()["compressed_calls"]


@pytest.mark.parametrize("scales", ["agreed", "predicted"])
def test_hook_state_checkpoint_round_trip(scales):
    for restored, residuals, predicted, identical, loss, calls in run_world(_checkpoint_worker, 2, scales):
        assert residuals >= 1  # there is something to compare (a residual per bucket)
        assert predicted >= (1 if scales == "predicted" else 0)
        assert restored and identical
        assert loss < 1.0 and calls == 13  # 8 + 5 compressed iterations; ln 4 = 1.39 untrained


def _register_worker(rank, world):
    out = []
    for scales in ("agreed", "predicted"):
        ddp = DDP(Net())
        state = hhook.register(ddp, bits=3, start_iter=0, scales=scales)
        for _ in range(2):
            ddp(torch.randn(8, 32)).sum().backward()
        s = state.stats()
        out.append((state.options.bits, s["compressed_calls"], s["dense_calls"]))
    return out


def test_register_is_the_one_call_form():
    # Both compress from the first call (a predicted bucket's first call is an agreed round).
    assert run_world(_register_worker, 2) == [[(3, 2, 0), (3, 2, 0)]] * 2


def _resume_worker(rank, world, scales, bucket_cap_mb, topology="flat"):
    """Train 12 steps in one go, and 7 + 5 with a checkpoint (model, optimizer, hook state)
    and a new model, optimizer and DDP in between, as a restarted job does."""

    def build(model_state=None, opt_state=None):
        torch.manual_seed(0)
        model = Net()
        if model_state is not None:
            model.load_state_dict(model_state)
        ddp = DDP(model, bucket_cap_mb=bucket_cap_mb)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
        if opt_state is not None:
            opt.load_state_dict(opt_state)
        return ddp, opt

    x, y = _data(rank, torch.float32)
    x = x * (10.0 if rank == 1 else 1.0)  # heterogeneous ranks

    def steps(ddp, opt, first, last):
        for step in range(first, last):
            opt.zero_grad()
            idx = torch.arange(step * 32, step * 32 + 32) % 512
            torch.nn.functional.cross_entropy(ddp(x[idx]), y[idx]).backward()
            opt.step()

    options = dict(bits=4, scales=scales, error_feedback=True, topology=topology)
    ddp, opt = build()
    state = hhook.register(ddp, **options)
    steps(ddp, opt, 0, 12)
    whole = [p.detach().clone() for p in ddp.module.parameters()]

    ddp, opt = build()
    state = hhook.register(ddp, **options)
    steps(ddp, opt, 0, 7)
    buf = io.BytesIO()
    torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict(), "hook": state}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    holder = saved["hook"].inter or saved["hook"]
    keys = len(holder.policy(scales).keys)
    ddp, opt = build(saved["model"], saved["opt"])
    resumed = hhook.register(ddp, state=saved["hook"])
    steps(ddp, opt, 7, 12)
    return {
        "identical": all(torch.equal(a, b) for a, b in zip(whole, ddp.module.parameters())),
        "max_diff": max((a - b).abs().max().item() for a, b in zip(whole, ddp.module.parameters())),
        "keys": keys,
        "calls": resumed.stats()["compressed_calls"],
    }


@pytest.mark.parametrize("scales", ["agreed", "predicted"])
@pytest.mark.parametrize("bucket_cap_mb", [None, 0.01], ids=["one-bucket", "several-buckets"])
def test_resume_is_bit_for_bit_against_an_uninterrupted_run(scales, bucket_cap_mb):
    for r in run_world(_resume_worker, 2, scales, bucket_cap_mb):
        assert r["identical"], r  # max difference 3.8e-4 to 5.1e-4 when the first iteration reset key 0
        assert r["keys"] >= (2 if bucket_cap_mb else 1)


@pytest.mark.parametrize("scales", ["agreed", "predicted"])
def test_two_level_resume_is_bit_for_bit_against_an_uninterrupted_run(scales):
    for r in run_world(_resume_worker, 4, scales, 0.01, 2, timeout=300):  # 2 nodes x 2
        assert r["identical"], r
        assert r["keys"] >= 2
