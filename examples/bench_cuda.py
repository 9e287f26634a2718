"""The GPU codec's targets (issue 10):

1. encode + decode (prepare, quantize, decode) of 25 and 100 MB buckets, fp32 and bf16,
   against a device-to-device copy of the same bytes (target >= 50%) and the reference
   codec on the same GPU (target >= 10x);
2. host time per compressed bucket: what issuing the three stages costs the CPU thread
   that queues the backward pass (target <= 50 us);
3. a DDP step on NCCL with the hook against plain DDP, for a model of 25M parameters
   (target: at most 10% slower). It needs two ranks, one GPU each: in a world of one the
   hook hands every gradient back as it is, so there is no codec work to time.

    python examples/bench_cuda.py                      # 1 and 2, on one GPU
    python examples/bench_cuda.py --sizes 25 --bits 8 --world-size 16
    torchrun --nproc-per-node 2 examples/bench_cuda.py # 3, on two GPUs

One rank, no communication in 1 and 2: ``quantize`` gets this rank's scales with a foreign
digest (so it really quantizes) and ``decode`` reads its own words as the sum. GB/s is the
bucket's size in bytes over the time (the copy counts its bytes once). GPU times are
medians of CUDA-event timings; host times are minima of wall-clock time around the calls.
3 counts the hook's compressed calls and reports no verdict when there were none.
"""

from __future__ import annotations

import argparse
import copy
import os

import torch

from hhook.codec.kernels import cuda as cuda_kernels
from hhook.codec import THCCodec
from hhook.profile.codec_bench import host_time_per_bucket, stage_times  # noqa: F401 - the timers, shared
from hhook.profile.codec_bench import median_seconds as _median_seconds, roundtrip as _roundtrip


class _Reference:
    def __enter__(self):
        self.saved = os.environ.get(cuda_kernels.FORCE_REFERENCE_ENV)
        os.environ[cuda_kernels.FORCE_REFERENCE_ENV] = "1"

    def __exit__(self, *exc):
        if self.saved is None:
            del os.environ[cuda_kernels.FORCE_REFERENCE_ENV]
        else:
            os.environ[cuda_kernels.FORCE_REFERENCE_ENV] = self.saved


def codec_throughput(codec: THCCodec, sizes_mb, dtypes, iters: int) -> list[dict]:
    rows = []
    for dtype in dtypes:
        for mb in sizes_mb:
            nbytes = int(mb * 1e6)
            x = torch.randn(nbytes // dtype.itemsize, device="cuda").to(dtype)
            dst, out = torch.empty_like(x), torch.empty_like(x)
            copy = _median_seconds(lambda: dst.copy_(x), iters)
            fused = _median_seconds(_roundtrip(codec, x, out), iters)
            with _Reference():
                ref = _median_seconds(_roundtrip(codec, x, out), max(3, iters // 4), 1)
            rows.append(
                {"dtype": str(dtype).replace("torch.", ""), "mb": mb, "copy_s": copy, "fused_s": fused, "ref_s": ref,
                 "of_copy": copy / fused, "vs_ref": ref / fused, "gbps": nbytes / fused / 1e9}
            )
    return rows


def ddp_overhead(params_m: float, steps: int) -> tuple[float, float, int]:
    """(plain, hooked) median seconds per DDP step on this rank, and the hook's compressed
    calls while timed, in a process group of at least two ranks (one GPU each)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hhook

    if dist.get_world_size() < 2:
        raise SystemExit("bench_cuda: the DDP step needs at least two ranks (a world of one does no codec work)")
    width = int((params_m * 1e6 / 4) ** 0.5)  # four square layers
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).cuda()
    data = torch.randn(256, width, device="cuda")
    results, calls = [], 0
    for hooked in (False, True):
        net = DDP(copy.deepcopy(model))  # DDP starts every rank from rank 0's weights
        state = hhook.register(net, bits=4, start_iter=2) if hooked else None

        def step():
            net.zero_grad(set_to_none=False)
            net(data).square().mean().backward()

        for _ in range(2):  # DDP's first iterations (bucket rebuild); the hook's dense ones
            step()
        before = state.stats()["compressed_calls"] if hooked else 0
        results.append(_median_seconds(step, steps, warmup=3))
        if hooked:
            calls = state.stats()["compressed_calls"] - before
    return results[0], results[1], calls


def ddp_verdict(slower: float, compressed_calls: int) -> str:
    """The target's verdict, only for a measurement in which the hook compressed."""
    if compressed_calls <= 0:
        return "NOT MEASURED (the hook made no compressed call)"
    return "met" if slower <= 0.10 else "MISSED"


def _ddp_main(args) -> None:
    """Target 3 under torchrun: NCCL, rank r on local GPU r; rank 0 prints."""
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.device_count() <= local:
        raise SystemExit(f"bench_cuda: rank {local} has no GPU of its own (NCCL refuses two ranks on one GPU)")
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    try:
        plain, hooked, calls = ddp_overhead(args.params_m, args.iters)
        if dist.get_rank() == 0:
            slower = hooked / plain - 1
            print(
                f"DDP step, {dist.get_world_size()} ranks, NCCL, {args.params_m:g}M parameters: plain {plain * 1e3:.2f} ms, "
                f"THC hook {hooked * 1e3:.2f} ms ({slower:+.1%}, {calls} compressed calls)  "
                f"{ddp_verdict(slower, calls)} (<= +10%)"
            )
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="+", default=[25, 100], help="bucket sizes in MB")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--world-size", type=int, default=4, help="sets the lane layout")
    parser.add_argument("--block-size", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--params-m", type=float, default=25.0, help="DDP model size, millions of parameters")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_cuda: no CUDA device: nothing to measure")
    if not cuda_kernels.warm_up("cuda"):
        raise SystemExit(f"bench_cuda: the CUDA kernels are unavailable (CuPy, NVRTC, {cuda_kernels.FORCE_REFERENCE_ENV})")
    torch.backends.cuda.matmul.allow_tf32 = False
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        _ddp_main(args)
        return
    codec = THCCodec(bits=args.bits, block_size=args.block_size, seed=1, world_size=args.world_size)
    print(f"# {torch.cuda.get_device_name()}  {codec}")
    print(f"{'dtype':>8} {'MB':>5} {'copy ms':>8} {'fused ms':>9} {'ref ms':>8} {'GB/s':>7} {'of copy':>8} {'vs ref':>7}  target")
    for r in codec_throughput(codec, args.sizes, (torch.float32, torch.bfloat16), args.iters):
        ok = "met" if r["of_copy"] >= 0.5 and r["vs_ref"] >= 10 else "MISSED"
        print(
            f"{r['dtype']:>8} {r['mb']:>5g} {r['copy_s'] * 1e3:>8.3f} {r['fused_s'] * 1e3:>9.3f} {r['ref_s'] * 1e3:>8.2f} "
            f"{r['gbps']:>7.1f} {r['of_copy']:>7.0%} {r['vs_ref']:>6.1f}x  {ok} (>= 50% of copy, >= 10x ref)"
        )
    host = host_time_per_bucket(codec, torch.randn(int(args.sizes[0] * 1e6) // 4, dtype=torch.float32, device="cuda"), 50)
    print(f"host time per {args.sizes[0]:g} MB bucket: {host * 1e6:.1f} us  {'met' if host <= 50e-6 else 'MISSED'} (<= 50 us)")
    print(
        "DDP step: not measured in one process (a world of one hands gradients back as they are); "
        "run `torchrun --nproc-per-node 2 examples/bench_cuda.py` on two GPUs"
    )


if __name__ == "__main__":
    main()
