"""The GPU codec's targets (issue 10), measured in one run on one GPU:

1. encode + decode (prepare, quantize, decode) of 25 and 100 MB buckets, fp32 and bf16,
   against a device-to-device copy of the same bytes (target >= 50%) and the reference
   codec on the same GPU (target >= 10x);
2. host time per compressed bucket: what issuing the three stages costs the CPU thread
   that queues the backward pass (target <= 50 us);
3. a DDP step at world size 1 on NCCL with the hook against plain DDP, for a model of 25M
   parameters (target: at most 10% slower).

    python examples/bench_cuda.py                 # everything, default settings
    python examples/bench_cuda.py --sizes 25 --bits 8 --world-size 16 --skip-ddp

One rank, no communication in 1 and 2: ``quantize`` gets this rank's scales with a foreign
digest (so it really quantizes) and ``decode`` reads its own words as the sum. GB/s is the
bucket's size in bytes over the time (the copy counts its bytes once). GPU times are
medians of CUDA-event timings; host times are minima of wall-clock time around the calls.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from hhook import cuda_kernels
from hhook.codec import THCCodec


def _median_seconds(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _roundtrip(codec: THCCodec, x: torch.Tensor, out: torch.Tensor):
    """One bucket's full local codec work, as the transport runs it."""

    def run():
        p = codec.prepare(x)
        agreed = p.scales.clone()
        agreed[3] += 1  # another rank's digest: not "identical", so quantize and decode work
        codec.decode(p, agreed, codec.quantize(p, agreed, 7), out)

    return run


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


def host_time_per_bucket(codec: THCCodec, mb: float, iters: int) -> float:
    """Wall-clock seconds the CPU spends issuing prepare + quantize + decode (minimum)."""
    x = torch.randn(int(mb * 1e6) // 4, device="cuda")
    out = torch.empty_like(x)
    run = _roundtrip(codec, x, out)
    for _ in range(3):
        run()
    best = float("inf")
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()  # includes the clone and the += of the fake MAX result: two tiny torch ops
        best = min(best, time.perf_counter() - start)
    torch.cuda.synchronize()
    return best


def ddp_overhead(params_m: float, steps: int) -> tuple[float, float]:
    """(plain, hooked) median seconds per DDP step at world size 1 on NCCL."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hhook

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl", rank=0, world_size=1)
    width = int((params_m * 1e6 / 4) ** 0.5)  # four square layers
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers).cuda()
    data = torch.randn(256, width, device="cuda")
    results = []
    for hooked in (False, True):
        net = DDP(torch.nn.Sequential(*[type(m)(width, width) if isinstance(m, torch.nn.Linear) else m for m in model]).cuda())
        if hooked:
            hhook.register(net, bits=4, start_iter=2)

        def step():
            net.zero_grad(set_to_none=False)
            net(data).square().mean().backward()

        results.append(_median_seconds(step, steps, warmup=5))
    return results[0], results[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=float, nargs="+", default=[25, 100], help="bucket sizes in MB")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--world-size", type=int, default=4, help="sets the lane layout")
    parser.add_argument("--block-size", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--params-m", type=float, default=25.0, help="DDP model size, millions of parameters")
    parser.add_argument("--skip-ddp", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_cuda: no CUDA device: nothing to measure")
    if not cuda_kernels.warm_up("cuda"):
        raise SystemExit(f"bench_cuda: the CUDA kernels are unavailable (CuPy, NVRTC, {cuda_kernels.FORCE_REFERENCE_ENV})")
    torch.backends.cuda.matmul.allow_tf32 = False
    codec = THCCodec(bits=args.bits, block_size=args.block_size, seed=1, world_size=args.world_size)
    print(f"# {torch.cuda.get_device_name()}  {codec}")
    print(f"{'dtype':>8} {'MB':>5} {'copy ms':>8} {'fused ms':>9} {'ref ms':>8} {'GB/s':>7} {'of copy':>8} {'vs ref':>7}  target")
    for r in codec_throughput(codec, args.sizes, (torch.float32, torch.bfloat16), args.iters):
        ok = "met" if r["of_copy"] >= 0.5 and r["vs_ref"] >= 10 else "MISSED"
        print(
            f"{r['dtype']:>8} {r['mb']:>5g} {r['copy_s'] * 1e3:>8.3f} {r['fused_s'] * 1e3:>9.3f} {r['ref_s'] * 1e3:>8.2f} "
            f"{r['gbps']:>7.1f} {r['of_copy']:>7.0%} {r['vs_ref']:>6.1f}x  {ok} (>= 50% of copy, >= 10x ref)"
        )
    host = host_time_per_bucket(codec, args.sizes[0], 50)
    print(f"host time per {args.sizes[0]:g} MB bucket: {host * 1e6:.1f} us  {'met' if host <= 50e-6 else 'MISSED'} (<= 50 us)")
    if not args.skip_ddp:
        plain, hooked = ddp_overhead(args.params_m, args.iters)
        slower = hooked / plain - 1
        print(
            f"DDP step, world size 1, NCCL, {args.params_m:g}M parameters: plain {plain * 1e3:.2f} ms, "
            f"THC hook {hooked * 1e3:.2f} ms ({slower:+.1%})  {'met' if slower <= 0.10 else 'MISSED'} (<= +10%)"
        )


if __name__ == "__main__":
    main()
