r"""Codec throughput and quality, beside a plain copy of the same tensor.

Encode is :meth:`THCCodec.prepare` + :meth:`THCCodec.quantize` (rotation, block maxima,
stochastic rounding, packing); decode is :meth:`THCCodec.decode`. No communication:
``world_size`` ranks' gradients are simulated, the MAX of their scale vectors and the
SUM of their words computed locally, so the vNMSE is the one a real allreduce gives.
Throughput counts float32 input bytes of one rank's encode + decode.

Run ``python -m hhook.benchmark`` (``--help`` for the sweep).
"""

from __future__ import annotations

import argparse
import time

import torch

from . import rng
from .codec import THCCodec

MB = 1 << 20


def heavy_tailed(numel: int, world_size: int, seed: int = 0, device="cpu") -> torch.Tensor:
    """``world_size`` gradient-like vectors: a shared Student-t (df=3) signal with rare
    large outliers, plus independent per-rank noise."""
    g = torch.Generator().manual_seed(seed)
    common = _t_sample(g, numel)
    spikes = torch.rand(numel, generator=g) < 1e-4
    common = common + spikes * torch.randn(numel, generator=g) * 100
    noise = torch.randn(world_size, numel, generator=g) * common.abs().mean()
    return (common + noise).to(device)


def _t_sample(g: torch.Generator, numel: int, df: float = 3.0) -> torch.Tensor:
    z = torch.randn(numel, generator=g)
    chi2 = torch.randn(int(df), numel, generator=g).pow_(2).sum(0)
    return z / (chi2 / df).sqrt_()


def vnmse(estimate: torch.Tensor, inputs: torch.Tensor) -> float:
    """``||estimate - mean||^2 / mean_i ||x_i||^2`` (the DESIGN.md definition)."""
    mean = inputs.mean(0)
    return float((estimate - mean).pow(2).sum() / inputs.pow(2).sum(1).mean())


def simulate_allreduce(codec: THCCodec, inputs: torch.Tensor, step: int = 0) -> torch.Tensor:
    """The mean that THC allreduce of the rows of ``inputs`` decodes on every rank."""
    prepared = [codec.prepare(x) for x in inputs]
    agreed = torch.stack([p.scales for p in prepared]).amax(0)
    words = [codec.quantize(p, agreed, rng.stream_key(codec.seed, r, step)) for r, p in enumerate(prepared)]
    total = words[0].clone()
    for w in words[1:]:
        total.add_(w)
    return codec.decode(prepared[0], agreed, total, torch.empty_like(inputs[0]))


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _best(fn, repeats: int, device) -> float:
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def codec_benchmark(
    sizes=(MB, 25 * MB, 100 * MB),
    bits=(2, 4, 8),
    block_sizes=(256, 1024, 4096),
    world_size: int = 4,
    repeats: int = 3,
    device="cpu",
) -> list[dict]:
    """One row per (size, bits, block size): best-of-``repeats`` times and vNMSE."""
    rows = []
    for size in sizes:
        numel = size // 4
        inputs = heavy_tailed(numel, world_size, device=device)
        x = inputs[0]
        copy_s = _best(lambda: x.clone(), repeats, device)
        for b in bits:
            for block in block_sizes:
                codec = THCCodec(b, block, 0, world_size)
                prepared = codec.prepare(x)
                agreed = prepared.scales
                words = codec.quantize(prepared, agreed, 1)
                out = torch.empty_like(x)
                encode_s = _best(lambda: codec.quantize(codec.prepare(x), agreed, 1), repeats, device)
                decode_s = _best(lambda: codec.decode(prepared, agreed, words, out), repeats, device)
                rows.append(
                    {
                        "size_bytes": size,
                        "bits": b,
                        "block_size": block,
                        "world_size": world_size,
                        "encode_ms": encode_s * 1e3,
                        "decode_ms": decode_s * 1e3,
                        "GBps": size / (encode_s + decode_s) / 1e9,
                        "copy_GBps": size / copy_s / 1e9,
                        "wire_ratio": 4 * numel / codec.wire_bytes(numel),
                        "vnmse": vnmse(simulate_allreduce(codec, inputs), inputs),
                    }
                )
    return rows


def _size(nbytes: int) -> str:
    return f"{nbytes / MB:g}MB" if nbytes >= MB else f"{nbytes / 1024:g}KB"


def format_table(rows: list[dict]) -> str:
    head = f"{'size':>8} {'bits':>4} {'block':>6} {'encode ms':>10} {'decode ms':>10} {'GB/s':>7} {'copy GB/s':>10} {'ratio':>6} {'vNMSE':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{_size(r['size_bytes']):>8} {r['bits']:>4} {r['block_size']:>6} {r['encode_ms']:>10.1f} "
            f"{r['decode_ms']:>10.1f} {r['GBps']:>7.2f} {r['copy_GBps']:>10.2f} {r['wire_ratio']:>6.2f} {r['vnmse']:>9.2e}"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 25, 100])
    p.add_argument("--bits", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--block-sizes", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)
    if any(s <= 0 for s in a.sizes_mb):
        p.error("sizes must be positive")
    rows = codec_benchmark([int(s * MB) for s in a.sizes_mb], a.bits, a.block_sizes, a.world_size, a.repeats, a.device)
    print(f"# hhook codec benchmark: torch {torch.__version__}, {torch.get_num_threads()} threads, device {a.device}")
    print(format_table(rows))


if __name__ == "__main__":
    main()
