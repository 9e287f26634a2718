"""The CUDA transport against the reference: the DDP hook and ``thc_allreduce`` with two
ranks on CPU tensors, on one GPU shared over Gloo and on NCCL (side streams, allocator
pressure, sums launched from another continuation, no host syncs from hhook). The kernels
themselves, stage by stage: tests/codec/test_cuda.py. On a GPU, ci/gpu_check.sh runs both."""

from __future__ import annotations

import collections
import contextlib
import copy
import hashlib
import importlib.util
import os
import warnings
from pathlib import Path

import pytest
import torch

import hhook
from hhook.codec.kernels import cuda as cuda_kernels

from tests.support.distributed import run_world

ROOT = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("no_tf32")  # tests/conftest.py


def _cuda_ready() -> bool:
    return torch.cuda.is_available() and cuda_kernels._cupy_importable()


needs_gpu = pytest.mark.skipif(not _cuda_ready(), reason="needs a CUDA device and CuPy")


# -- the transport: two ranks ------------------------------------------------------------------
# A world of one rank sends a tensor as it is, so these run two ranks: on one GPU both
# share it over Gloo (NCCL refuses two ranks on one device), with two GPUs also on NCCL,
# and everywhere on CPU tensors, the same bodies.
WORLDS = ["cpu", "cuda-gloo", "cuda-nccl"]


def world_options(world: str) -> dict:
    """run_world's options for ``world``; skips where this machine cannot run it."""
    if world == "cpu":
        return {"backend": "gloo"}
    if not _cuda_ready():
        pytest.skip("needs a CUDA device and CuPy")
    if world == "cuda-nccl" and (not torch.distributed.is_nccl_available() or torch.cuda.device_count() < 2):
        pytest.skip("needs NCCL and two GPUs (NCCL refuses two ranks on one GPU)")
    return {"backend": world.split("-")[1], "cuda": True}


def _count_stages(device_type: str) -> collections.Counter:
    """Count, in this process, the calls of the fused backend's three stages for
    ``device_type``: the codec dispatches to them through the module's attributes (on the
    CPU, gathered scales' decode, the default's there, counts as the decode)."""
    from hhook.codec.kernels import cpu as cpu_kernels

    kernels = cuda_kernels if device_type == "cuda" else cpu_kernels
    ran = collections.Counter()
    stages = {"prepare": "prepare", "quantize": "quantize", "decode": "decode"}
    if device_type != "cuda":
        stages["decode_gathered"] = "decode"
    for name, stage in stages.items():

        def counted(*args, _stage=stage, _run=getattr(kernels, name), **kwargs):
            ran[_stage] += 1
            return _run(*args, **kwargs)

        setattr(kernels, name, counted)
    return ran


@contextlib.contextmanager
def _host_syncs(device_type: str):
    """The synchronising CUDA calls issued from Python inside the block, as
    ``file:line: message`` (torch's sync debug mode "warn": any Python thread's, the
    autograd engine's and continuations' included; Gloo's own waits in its C++ worker
    threads only log)."""
    caught: list = []
    if device_type != "cuda":
        yield caught
        return
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode(0)
    caught += [f"{w.filename}:{w.lineno}: {w.message}" for w in seen if "synchroniz" in str(w.message)]


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().numpy().tobytes()).hexdigest()


DDP_STEPS, DDP_START = 6, 2
HHOOK_DIR = os.path.dirname(os.path.abspath(hhook.__file__)) + os.sep


def _ddp_ranks(rank, world_size, device_type):
    """The bare module, plain DDP and DDP with the hook, from the same weights, on this
    rank's own batches. Per step: how far the hook's gradients are from plain DDP's exact
    mean, and how far this rank's own gradients are (what a hook that reduced nothing
    would leave), compressed calls so far, fused-stage calls so far, a digest of the
    hook's gradients (equal on every rank), and the host syncs of each DDP backward."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    ran = _count_stages(device_type)
    torch.manual_seed(0)
    bare = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512)).to(device)
    plain = DDP(copy.deepcopy(bare), bucket_cap_mb=1)
    hooked = DDP(copy.deepcopy(bare), bucket_cap_mb=1)
    state = hhook.register(hooked, bits=8, start_iter=DDP_START, error_feedback=True)
    batches = torch.Generator().manual_seed(rank)
    steps = []
    for _ in range(DDP_STEPS):
        data, target = (torch.randn(64, 512, generator=batches).to(device) for _ in range(2))
        grads, syncs = {}, {}
        for name, net in (("own", bare), ("mean", plain), ("thc", hooked)):
            net.zero_grad()
            with _host_syncs(device_type) as syncs[name]:
                (net(data) - target).square().mean().backward()
            grads[name] = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
        norm = grads["mean"].norm()
        steps.append(
            {
                "thc_error": float((grads["thc"] - grads["mean"]).norm() / norm),
                "own_error": float((grads["own"] - grads["mean"]).norm() / norm),
                "compressed_calls": state.stats()["compressed_calls"],
                "stages": dict(ran),
                "digest": _digest(grads["thc"]),
                "syncs": syncs["thc"],
                "plain_syncs": syncs["mean"],
            }
        )
    return steps


@pytest.mark.parametrize("world", WORLDS)
def test_ddp_hook_compresses_at_world_size_2(world):
    """Through the fused kernels (every stage, every compressed step), close to the exact
    mean and far from the rank's own gradient, identical on both ranks; on a GPU, from the
    handshake's step on, no more host syncs than plain DDP and none from hhook."""
    ranks = run_world(_ddp_ranks, 2, "cpu" if world == "cpu" else "cuda", timeout=300, **world_options(world))
    for steps in ranks:
        for step, s in enumerate(steps):
            if step < DDP_START:  # DDP's own allreduce: exact up to the order of float sums
                assert s["compressed_calls"] == 0 and s["thc_error"] < 1e-6, (step, s)
                continue
            before = steps[step - 1]
            assert s["compressed_calls"] > before["compressed_calls"], (step, s)
            for stage in ("prepare", "quantize", "decode"):
                assert s["stages"].get(stage, 0) > before["stages"].get(stage, 0), (step, stage, s)
            assert 0 < s["thc_error"] < min(0.05, s["own_error"] / 10), (step, s)  # 8 bits: about 0.015
            if step > DDP_START:  # the handshake reads its verdict once, at the first call
                ours = sorted({line.split(": ")[0] for line in s["syncs"] if line.startswith(HHOOK_DIR)})
                assert not ours and len(s["syncs"]) <= len(s["plain_syncs"]), (step, ours, s["syncs"][:3])
    assert [s["digest"] for s in ranks[0]] == [s["digest"] for s in ranks[1]]


def _pressure_ranks(rank, world_size, device_type):
    """Two keys in flight, the allocator handed whatever the hook let go of (scribbled
    with NaN) before the decodes; NCCL runs continuations as soon as work is queued, so
    there the decode waits behind the SUM on another stream. Per step: each result's
    error against the exact mean, and a digest (equal on every rank)."""
    state = hhook.THCState(bits=8, block_size=1024)
    n = 2_000_003
    out = []
    for step in range(3):
        inputs = [torch.randn(n, generator=torch.Generator().manual_seed(10 * step + r)) for r in range(world_size)]
        want = sum(inputs) / world_size
        x = inputs[rank].to(device_type)
        x2 = x.clone()
        fut = hhook.thc_allreduce_async(x[::1], state, key="a")  # a view: the mean lands in x
        fut2 = hhook.thc_allreduce_async(x2, state, key="b")
        for size in (7 + n // 1024, n, 4_000_000):
            torch.full((size,), float("nan"), device=device_type)
        fut.wait(), fut2.wait()
        out.append({"errors": [float((t.cpu() - want).norm() / want.norm()) for t in (x, x2)], "digest": _digest(x)})
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_thc_allreduce_under_allocator_pressure(world):
    ranks = run_world(_pressure_ranks, 2, "cpu" if world == "cpu" else "cuda", timeout=300, **world_options(world))
    assert all(0 < e < 0.02 for steps in ranks for s in steps for e in s["errors"]), ranks
    assert [s["digest"] for s in ranks[0]] == [s["digest"] for s in ranks[1]]


def _second_backend(rank, world_size):
    from hhook.schedule.groups import SecondGroup

    return type(SecondGroup(None, "cuda").backend).__name__


def test_gloo_ranks_sharing_a_gpu_keep_gloo_for_the_agreed_sums():
    """NCCL refuses two ranks on one GPU: over a Gloo group, CUDA tensors' second
    communicator (the agreed-scale SUMs) is Gloo too (built here without a GPU)."""
    assert run_world(_second_backend, 2) == ["ProcessGroupGloo"] * 2


def _bench_cuda():
    spec = importlib.util.spec_from_file_location("bench_cuda", ROOT / "examples" / "bench_cuda.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench_ddp_in_a_world_of_one(rank, world_size):
    try:
        _bench_cuda().ddp_overhead(1.0, 3)
    except SystemExit as refused:
        return str(refused)
    return "timed"


def test_bench_cuda_gives_no_ddp_verdict_without_codec_work():
    """examples/bench_cuda.py: a world of one hands gradients back as they are, so the DDP
    step is not timed there, and a measurement without compressed calls gets no verdict."""
    (said,) = run_world(_bench_ddp_in_a_world_of_one, 1)
    assert "at least two ranks" in said
    verdict = _bench_cuda().ddp_verdict
    assert verdict(-0.5, 0).startswith("NOT MEASURED") and verdict(0.05, 12) == "met" and verdict(0.2, 12) == "MISSED"


def _shared_gpu_ranks(rank, world_size, stream_kind, pressure):
    """thc_allreduce on CUDA tensors over Gloo, ranks sharing one GPU; optionally on a side
    stream, and with the allocator handing freed memory to fresh tensors before the decode."""
    import hhook

    state = hhook.THCState(bits=8, block_size=1024)
    results = []
    stream = torch.cuda.Stream() if stream_kind == "side" else torch.cuda.current_stream()
    with torch.cuda.stream(stream):
        for step in range(3):
            g = torch.Generator(device="cpu").manual_seed(100 * step + rank)
            x = torch.randn(3, 700_001, generator=g).cuda()[:, ::2].clone()[:, :300_000].t()  # strided
            want = sum(torch.randn(3, 700_001, generator=torch.Generator().manual_seed(100 * step + r))[:, ::2][:, :300_000].t() for r in range(world_size)) / world_size
            fut = hhook.thc_allreduce_async(x, state, key="x")
            if pressure:  # reuse whatever the hook freed, and scribble on it
                for n in (7 + 300_000 // 1024, 900_000, 2**20):
                    torch.full((n,), float("nan"), device="cuda")
            out = fut.wait()
            torch.cuda.current_stream().synchronize()
            err = (out.cpu() - want).norm() / want.norm()
            results.append(float(err))
    return results


@needs_gpu
@pytest.mark.parametrize("stream_kind,pressure", [("default", False), ("side", False), ("default", True), ("side", True)])
def test_thc_allreduce_gloo_ranks_sharing_one_gpu(stream_kind, pressure):
    errors = run_world(_shared_gpu_ranks, 2, stream_kind, pressure, backend="gloo", cuda=True, timeout=300)
    assert all(0 < e < 0.02 for rank in errors for e in rank), errors


def _late_codes_ranks(rank, world_size):
    """Eight keys in flight, each one's codes written late on its continuation's stream
    (a sleep queued before quantize): a SUM that another continuation launches must still
    wait for them (the sequencer runs the launch under the stream that made the codes)."""
    from hhook.codec.kernels import cuda as kernels

    real = kernels.quantize

    def late(*args, **kwargs):
        torch.cuda._sleep(20_000_000)  # about 10 ms of this stream's time
        return real(*args, **kwargs)

    kernels.quantize = late
    state = hhook.THCState(bits=8, block_size=1024)
    errors = []
    for step in range(3):
        inputs = [[torch.randn(200_003, generator=torch.Generator().manual_seed(1000 * step + 10 * k + r))
                   for r in range(world_size)] for k in range(8)]
        xs = [rows[rank].cuda() for rows in inputs]
        futures = [hhook.thc_allreduce_async(x, state, key=k) for k, x in enumerate(xs)]
        for f in futures:
            f.wait()
        torch.cuda.current_stream().synchronize()
        for x, rows in zip(xs, inputs):
            want = sum(rows) / world_size
            errors.append(float((x.cpu() - want).norm() / want.norm()))
    return errors


@needs_gpu
def test_sums_launched_by_another_continuation_wait_for_their_codes():
    errors = run_world(_late_codes_ranks, 2, backend="gloo", cuda=True, timeout=300)
    assert all(0 < e < 0.02 for rank in errors for e in rank), errors


def _default_hook_ranks(rank, world_size):
    """``hhook.register(model)`` as a user writes it (bits="auto"), on a GPU: per step, the
    host syncs issued from hhook's files, and the method the step ran."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)).cuda()
    ddp = DDP(model, device_ids=[torch.cuda.current_device()], bucket_cap_mb=1)
    state = hhook.register(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    batches = torch.Generator().manual_seed(rank)
    steps = []
    for _ in range(40):
        x, y = (torch.randn(64, 256, generator=batches).cuda() for _ in range(2))
        opt.zero_grad()
        with _host_syncs("cuda") as syncs:
            (ddp(x) - y).square().mean().backward()
        opt.step()
        steps.append({"ours": [line for line in syncs if line.startswith(HHOOK_DIR)],
                      "compressed_calls": state.stats()["compressed_calls"]})
    torch.cuda.synchronize()
    return steps


@needs_gpu
def test_the_default_hook_issues_no_host_sync_on_a_gpu():
    """Past the first step (DDP's own, and the handshakes of the hook's first call), no
    step of the default hook issues a host sync from hhook, while it probes widths and
    after it decides."""
    for steps in run_world(_default_hook_ranks, 2, backend="gloo", cuda=True, timeout=300):
        assert steps[-1]["compressed_calls"] > 0, steps[-1]
        late = sorted({(i, line.split(": ")[0]) for i, s in enumerate(steps) if i >= 2 for line in s["ours"]})
        assert not late, late
