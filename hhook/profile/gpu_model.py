r"""``model --gpu-cluster``: a model (not a measurement) of one training step's gradient
exchange on a GPU cluster, THC against the bf16/fp16 hook and fp32, for 8 to 512 GPUs on
links of 10 to 400 Gbit/s.

Assumptions, printed with the table:

* one GPU per rank, one link of ``Gbit/s`` per GPU, flat ring allreduce, alpha-beta cost
  (:func:`hhook.profile.models.ring_allreduce_s`): ``2 (n - 1) alpha + 2 (n - 1) / n *
  bytes / beta``;
* the step's float32 gradients (``step_bytes``) travel in buckets of ``bucket_bytes``,
  one after the other, with no overlap with compute or with each other (the exchange's
  own time, an upper bound on what it adds to a step);
* fp32: the bucket as it is; bf16/fp16 hook: half the bytes, plus one cast each way
  (``cast_s`` per bucket); THC: the MAX allreduce of the scale vector (its own round,
  latency included), then the SUM of the lane words at the lane width for ``n`` ranks
  (:class:`hhook.codec.THCCodec`'s layout: it grows with ``log2 n``), plus the codec's
  encode + decode (``codec_s`` per bucket, taken as independent of ``n``);
* nothing else: no congestion, no hierarchy (nodes of several GPUs would use the
  two-level scheme, ``model --layouts``), no stragglers.
"""

from __future__ import annotations

from ..codec import THCCodec
from .models import ring_allreduce_s
from .units import format_size

GPU_COUNTS = (8, 16, 32, 64, 128, 256, 512)
LINKS_GBIT = (10.0, 25.0, 100.0, 400.0)


def exchange_rows(codec_s: float, cast_s: float, bucket_bytes: int, step_bytes: int, alpha: float,
                  gpus=GPU_COUNTS, links_gbit=LINKS_GBIT, bits: int = 4, block_size: int = 1024) -> list[dict]:
    """One row per (GPUs, link): the exchange's ms per step of fp32, the half-precision
    hook and THC, and THC's speedup against each (the module docstring's model)."""
    numel = bucket_bytes // 4
    buckets = -(-step_bytes // bucket_bytes)
    rows = []
    for n in gpus:
        codec = THCCodec(bits, block_size, 0, n)
        scales_bytes = 4 * codec.scales_numel(numel)
        words_bytes = codec.wire_bytes(numel) - scales_bytes
        for gbit in links_gbit:
            beta = gbit * 1e9 / 8
            fp32 = ring_allreduce_s(n, 4 * numel, alpha, beta)
            half = ring_allreduce_s(n, 2 * numel, alpha, beta) + cast_s
            thc = ring_allreduce_s(n, scales_bytes, alpha, beta) + ring_allreduce_s(n, words_bytes, alpha, beta) + codec_s
            rows.append({"op": "gpu_model", "gpus": n, "link_gbit": gbit, "buckets": buckets,
                         "lane_bits": codec.layout.width, "thc_wire_bytes": scales_bytes + words_bytes,
                         "fp32_ms": buckets * fp32 * 1e3, "half_ms": buckets * half * 1e3,
                         "thc_ms": buckets * thc * 1e3, "thc_vs_half": half / thc, "thc_vs_fp32": fp32 / thc})
    return rows


def assumptions(codec_s: float, cast_s: float, bucket_bytes: int, step_bytes: int, alpha: float, bits: int,
                codec_source: str) -> str:
    return "\n".join([
        "# A MODEL, not a measurement: flat ring allreduce, alpha-beta, one link per GPU, buckets one after",
        "# the other with no overlap (the exchange's own time per step); no congestion, hierarchy or stragglers.",
        f"# step: {format_size(step_bytes)} of float32 gradients in buckets of {format_size(bucket_bytes)}; "
        f"alpha = {alpha * 1e6:g} us per message",
        f"# THC {bits} bits: MAX round of the scales + SUM of the lane words (lane width for n ranks) + codec "
        f"{codec_s * 1e3:.3f} ms per bucket ({codec_source})",
        f"# bf16/fp16 hook: half the bytes + {cast_s * 1e3:.3f} ms of casts per bucket; fp32: the bucket as it is",
        "# speedup = the other's exchange time / THC's (> 1: THC faster)",
    ])


def table(rows: list[dict]) -> str:
    head = (f"{'GPUs':>5} {'Gbit/s':>7} {'lane':>5} {'fp32 ms':>9} {'bf16 ms':>9} {'THC ms':>9} "
            f"{'vs bf16':>8} {'vs fp32':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['gpus']:>5} {r['link_gbit']:>7g} {r['lane_bits']:>5} {r['fp32_ms']:>9.2f} "
                     f"{r['half_ms']:>9.2f} {r['thc_ms']:>9.2f} {r['thc_vs_half']:>7.2f}x {r['thc_vs_fp32']:>7.2f}x")
    return "\n".join(lines)


def measured_seconds(bucket_bytes: int, bits: int, block_size: int, world: int = 16) -> tuple[float, float]:
    """THC's encode + decode (:func:`hhook.profile.codec_bench.roundtrip_seconds`, lanes for
    ``world`` ranks) and the fp16 hook's casts of one float32 bucket on the current GPU."""
    import torch

    from . import codec_bench

    x = torch.randn(bucket_bytes // 4, dtype=torch.float32, device="cuda")
    codec = THCCodec(bits, block_size, 1, world)
    return codec_bench.roundtrip_seconds(codec, x, 20), codec_bench.fp16_hook_seconds(x, 20, world)
