"""Encode + decode throughput of the CUDA kernels on one GPU, beside a device-to-device copy
of the same bytes and the reference (pure-torch) codec, all timed in the same run.

    python examples/bench_cuda.py                  # 25 and 100 MiB fp32 buckets
    python examples/bench_cuda.py --sizes 25 --bits 8 --world-size 16 --dtype bfloat16

One rank, no communication: ``quantize`` gets this rank's own scales as the agreed ones
and ``decode`` reads its own words as the sum, which is the codec's full local work per
bucket (the two ``.item()`` header checks in ``quantize`` included). GB/s is the bucket's
size in bytes over the time; for the copy that counts the bytes once (it reads and writes
them). Times are medians over ``--iters`` runs measured with CUDA events.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from hhook import cuda_kernels
from hhook.codec import THCCodec


def _median_seconds(fn, iters: int, warmup: int) -> float:
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


def _paths(codec: THCCodec, x: torch.Tensor) -> dict:
    """What is timed for one bucket ``x``: the codec's stages and a copy of the same bytes."""
    dst, out = torch.empty_like(x), torch.empty_like(x)
    p = codec.prepare(x)
    words = codec.quantize(p, p.scales, 7)

    def roundtrip():
        q = codec.prepare(x)
        codec.decode(q, q.scales, codec.quantize(q, q.scales, 7), out)

    return {
        "d2d copy": lambda: dst.copy_(x),
        "prepare": lambda: codec.prepare(x),
        "quantize": lambda: codec.quantize(p, p.scales, 7),
        "decode": lambda: codec.decode(p, p.scales, words, out),
        "encode+decode": roundtrip,
    }


def benchmark(
    sizes_mib=(25, 100),
    bits: int = 4,
    world_size: int = 4,
    block_size: int = 1024,
    dtype: torch.dtype = torch.float32,
    iters: int = 20,
    warmup: int = 3,
) -> list[dict]:
    """Rows of ``{size_mib, path, seconds, gbps}`` for the copy, each kernel stage, the
    kernels' encode + decode and the reference's encode + decode."""
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: nothing to measure")
    if not cuda_kernels.available():
        raise RuntimeError(f"CuPy is missing or {cuda_kernels.FORCE_REFERENCE_ENV}=1: pip install 'hhook[cuda]'")
    codec = THCCodec(bits=bits, block_size=block_size, seed=1, world_size=world_size)
    rows = []
    for mib in sizes_mib:
        nbytes = mib << 20
        x = torch.randn(nbytes // dtype.itemsize, device="cuda").to(dtype)
        measured = {}
        for name, fn in _paths(codec, x).items():
            measured[name if name == "d2d copy" else f"kernels: {name}"] = _median_seconds(fn, iters, warmup)
        saved = os.environ.get(cuda_kernels.FORCE_REFERENCE_ENV)
        os.environ[cuda_kernels.FORCE_REFERENCE_ENV] = "1"
        try:
            roundtrip = _paths(codec, x)["encode+decode"]
            measured["reference: encode+decode"] = _median_seconds(roundtrip, max(3, iters // 4), 1)
        finally:
            if saved is None:
                del os.environ[cuda_kernels.FORCE_REFERENCE_ENV]
            else:
                os.environ[cuda_kernels.FORCE_REFERENCE_ENV] = saved
        for name, seconds in measured.items():
            rows.append({"size_mib": mib, "path": name, "seconds": seconds, "gbps": nbytes / seconds / 1e9})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[25, 100], help="bucket sizes in MiB")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--world-size", type=int, default=4, help="sets the lane layout")
    parser.add_argument("--block-size", type=int, default=1024)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    try:
        rows = benchmark(
            args.sizes, args.bits, args.world_size, args.block_size, getattr(torch, args.dtype), args.iters
        )
    except RuntimeError as err:
        raise SystemExit(f"bench_cuda: {err}") from None
    print(
        f"# {torch.cuda.get_device_name()}  bits={args.bits} world_size={args.world_size} "
        f"block_size={args.block_size} dtype={args.dtype}"
    )
    print(f"{'MiB':>5}  {'path':<26} {'ms':>9} {'GB/s':>9}")
    for r in rows:
        print(f"{r['size_mib']:>5}  {r['path']:<26} {r['seconds'] * 1e3:>9.3f} {r['gbps']:>9.1f}")


if __name__ == "__main__":
    main()
