r"""Codec throughput and quality beside a copy of the same tensor (``hhook-profile codec``).

Encode is :meth:`THCCodec.prepare` + :meth:`THCCodec.quantize` (rotation, block maxima,
stochastic rounding, packing); decode is :meth:`THCCodec.decode`. No communication:
``world_size`` ranks' gradients are simulated (:mod:`hhook.simulation`) and the scale
vector that every rank agrees on is the MAX over the simulated ranks, as after a real
allreduce (one rank's own vector would read as "every rank identical" and make decode a
copy). Each timed repeat is one prepare -> quantize -> decode cycle into a reused output,
as in training; the best of the repeats is reported. Throughput counts float32 input
bytes of one rank's encode + decode; the copy column is ``clone()`` of the same tensor,
timed in the same run. ``impl`` A/Bs the fused backend (:mod:`hhook.codec.kernels.cpu` on CPU,
:mod:`hhook.codec.kernels.cuda` on CUDA) against the torch reference (``HHOOK_FORCE_REFERENCE``);
``rounding`` A/Bs correlated against independent rounding (:data:`hhook.codec.ROUNDINGS`),
time and vNMSE of the mean alike.

The per-bucket timers that ``ci/gpu_check.py`` and ``examples/bench_cuda.py`` share are here
too, on any device (:func:`median_seconds`: CUDA events on a CUDA tensor's device, the wall
clock elsewhere): :func:`stage_times` (each codec stage alone, encode, decode, a copy),
:func:`roundtrip_seconds` (one bucket's whole local codec work, allocations included),
:func:`fp16_hook_seconds` (torch's ``fp16_compress_hook``'s two casts),
:func:`host_time_per_bucket` (what the CPU thread spends issuing a bucket) and
:func:`weight_codec_times` (FSDP2's all-gather codec, :class:`hhook.codec.weights.WeightCodec`).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import statistics
import time

import torch

from ..codec.kernels import cpu as cpu_kernels
from ..codec import ROUNDINGS, THCCodec, fused_backend
from ..simulation import heavy_tailed, simulate_allreduce, vnmse
from .units import format_size as _size

IMPLS = ("fused", "reference")


@contextlib.contextmanager
def implementation(impl: str):
    """Force the reference codec (``impl="reference"``) or let it choose (``"fused"``)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    env = cpu_kernels.FORCE_REFERENCE_ENV
    old = os.environ.get(env)
    os.environ[env] = "1" if impl == "reference" else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ[env]
        else:
            os.environ[env] = old


def fused_available(device) -> bool:
    """Whether a fused backend serves tensors on ``device`` (compiles the CPU one if needed)."""
    with implementation("fused"):
        return fused_backend(torch.empty(1, device=device), 1) is not None


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _cycle_times(codec, x, agreed, out, repeats: int, device) -> tuple[float, float]:
    """Best encode and decode seconds over ``repeats`` prepare -> quantize -> decode cycles."""
    enc = dec = float("inf")
    for i in range(repeats + 1):  # the first cycle warms caches and allocations
        _sync(device)
        t0 = time.perf_counter()
        prepared = codec.prepare(x)
        words = codec.quantize(prepared, agreed, codec.stream(0, i))
        _sync(device)
        t1 = time.perf_counter()
        codec.decode(prepared, agreed, words, out)
        _sync(device)
        t2 = time.perf_counter()
        if i:
            enc, dec = min(enc, t1 - t0), min(dec, t2 - t1)
    return enc, dec


def _copy_time(x, repeats: int, device) -> float:
    best = float("inf")
    for i in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        x.clone()
        _sync(device)
        if i:
            best = min(best, time.perf_counter() - t0)
    return best


def codec_rows(sizes, bits, block_sizes, world_size: int = 4, repeats: int = 5, device="cpu",
               threads=(None,), impls=IMPLS, progress=None, roundings=ROUNDINGS[:1]) -> list[dict]:
    """One row per (size, bits, block, threads, impl, rounding); ``threads=None`` keeps torch's own."""
    rows = []
    for size in sizes:
        numel = size // 4
        inputs = heavy_tailed(numel, world_size, device=device)
        x = inputs[0]
        out = torch.empty_like(x)
        for b in bits:
            for block in block_sizes:
                agreed = torch.stack([THCCodec(b, block, 0, world_size).prepare(v).scales for v in inputs]).amax(0)
                for n_threads, impl, rounding in itertools.product(threads, impls, roundings):
                    codec = THCCodec(b, block, 0, world_size, rounding)
                    previous = torch.get_num_threads()
                    if n_threads is not None:
                        torch.set_num_threads(n_threads)
                    try:
                        copy_s = _copy_time(x, repeats, device)
                        with implementation(impl):
                            enc, dec = _cycle_times(codec, x, agreed, out, repeats, device)
                            error = vnmse(simulate_allreduce(codec, inputs), inputs)
                        rows.append({
                            "size_bytes": size, "bits": b, "block_size": block, "world_size": world_size,
                            "impl": impl, "rounding": rounding, "threads": torch.get_num_threads(),
                            "encode_ms": enc * 1e3, "decode_ms": dec * 1e3,
                            "GBps": size / (enc + dec) / 1e9, "copy_GBps": size / copy_s / 1e9,
                            "wire_ratio": 4 * numel / codec.wire_bytes(numel), "vnmse": error,
                        })
                        if progress is not None:
                            progress.advance(1, f"{_size(size)} bits {b} block {block} {impl} {rounding}")
                    finally:
                        torch.set_num_threads(previous)
    return rows




def format_table(rows: list[dict]) -> str:
    head = (f"{'size':>8} {'bits':>4} {'block':>6} {'impl':>9} {'rounding':>11} {'threads':>7} {'encode ms':>10} "
            f"{'decode ms':>10} "
            f"{'GB/s':>7} {'copy GB/s':>10} {'fp32/wire':>9} {'vNMSE':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{_size(r['size_bytes']):>8} {r['bits']:>4} {r['block_size']:>6} {r['impl']:>9} "
            f"{r.get('rounding', 'independent'):>11} {r['threads']:>7} "
            f"{r['encode_ms']:>10.1f} {r['decode_ms']:>10.1f} {r['GBps']:>7.2f} {r['copy_GBps']:>10.2f} "
            f"{r['wire_ratio']:>9.2f} {r['vnmse']:>9.2e}"
        )
    return "\n".join(lines)


# -- per-bucket timers (ci/gpu_check.py, examples/bench_cuda.py) ---------------------------------
def median_seconds(fn, iters: int, warmup: int = 3, device="cuda") -> float:
    """Median seconds of ``fn()`` over ``iters`` calls after ``warmup``: CUDA-event timings
    on a CUDA ``device`` (GPU time, the host's issuing hidden when it is shorter), the
    wall clock elsewhere."""
    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def roundtrip(codec: THCCodec, x: torch.Tensor, out: torch.Tensor):
    """One bucket's full local codec work, as the transport runs it: prepare, quantize into
    new words, decode into ``out`` (allocations included). One rank, no communication:
    the agreed scales are this rank's with a foreign digest (a clone and an add: two tiny
    torch ops), so quantize and decode really work."""

    def run():
        p = codec.prepare(x)
        agreed = p.scales.clone()
        agreed[3] += 1  # another rank's digest: not "identical", so quantize and decode work
        codec.decode(p, agreed, codec.quantize(p, agreed, 7), out)

    return run


def roundtrip_seconds(codec: THCCodec, x: torch.Tensor, iters: int) -> float:
    """Median seconds of :func:`roundtrip` on ``x``."""
    return median_seconds(roundtrip(codec, x, torch.empty_like(x)), iters, device=x.device)


def stage_times(codec: THCCodec, x: torch.Tensor, iters: int) -> dict:
    """Median seconds of each stage alone on ``x`` (the others' outputs made beforehand),
    of encode (prepare + quantize) and of a device-to-device copy of the same bytes."""
    out, dst = torch.empty_like(x), torch.empty_like(x)
    p = codec.prepare(x)
    agreed = p.scales.clone()
    agreed[3] += 1  # another rank's digest: not "identical"
    words = codec.quantize(p, agreed, 7)
    d = x.device
    return {
        "copy_s": median_seconds(lambda: dst.copy_(x), iters, device=d),
        "prepare_s": median_seconds(lambda: codec.prepare(x), iters, device=d),
        "quantize_s": median_seconds(lambda: codec.quantize(p, agreed, 7, out=words), iters, device=d),
        "encode_s": median_seconds(lambda: codec.quantize(codec.prepare(x), agreed, 7, out=words), iters, device=d),
        "decode_s": median_seconds(lambda: codec.decode(p, agreed, words, out), iters, device=d),
    }


def fp16_hook_seconds(x: torch.Tensor, iters: int, world_size: int = 16) -> float:
    """Median seconds of torch's ``fp16_compress_hook`` on the bucket ``x`` without its
    allreduce: compress (``x.to(float16).div_(world_size)``) and decompress (the bucket's
    ``copy_`` from the fp16 result): one cast each way."""
    bucket = torch.empty_like(x)  # the bucket written back (x itself stays as it is)
    return median_seconds(lambda: bucket.copy_(x.to(torch.float16).div_(world_size)), iters, device=x.device)


def copy_seconds(x: torch.Tensor, iters: int) -> float:
    """Median seconds of a device-to-device copy of ``x`` into a buffer made beforehand."""
    dst = torch.empty_like(x)
    return median_seconds(lambda: dst.copy_(x), iters, device=x.device)


def host_time_per_bucket(codec: THCCodec, x: torch.Tensor, iters: int) -> float:
    """Wall-clock seconds the CPU thread spends issuing :func:`roundtrip` on ``x``
    (minimum over ``iters``, the device idle at each start). On a GPU that is the host's
    cost alone (the kernels run after it returns); on a CPU it is the whole codec."""
    run = roundtrip(codec, x, torch.empty_like(x))
    for _ in range(3):
        run()
    best = float("inf")
    for _ in range(iters):
        _sync(x.device)
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    _sync(x.device)
    return best


def weight_codec_times(codec, x: torch.Tensor, iters: int) -> dict:
    """Median seconds of FSDP2's all-gather codec (:class:`hhook.codec.weights.WeightCodec`)
    on the flat float32 shard ``x``, as :mod:`hhook.fsdp.all_gather` runs it: encode (the
    shard copied into the block workspace, then quantized into the payload) and decode
    (the payload into float32 blocks), and a copy of the same bytes. ``x.numel()`` must be
    a multiple of the block size."""
    n = x.numel() // codec.block_size
    if n * codec.block_size != x.numel():
        raise ValueError(f"{x.numel()} values are not whole blocks of {codec.block_size}")
    blocks = torch.empty(n, codec.block_size, dtype=torch.float32, device=x.device)
    payload = torch.empty(codec.nbytes(n), dtype=torch.uint8, device=x.device)
    out = torch.empty_like(blocks)

    def encode():
        blocks.view(-1).copy_(x)
        codec.encode(blocks, payload)

    encode()
    d = x.device
    return {"copy_s": median_seconds(lambda: out.view(-1).copy_(x), iters, device=d),
            "encode_s": median_seconds(encode, iters, device=d),
            "decode_s": median_seconds(lambda: codec.decode(payload, n, out), iters, device=d),
            "payload_bytes": payload.numel()}
