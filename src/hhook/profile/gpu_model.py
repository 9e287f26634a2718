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
  encode + decode per bucket, taken as independent of ``n``: the larger of its time on
  the GPU (``codec_s``) and the host's time to issue it (``host_s``; the bucket's kernels
  cannot finish before they are issued);
* the host's time per step (``host_s`` per bucket) is reported apart: the hook runs on
  the autograd thread, so that time is taken from the backward unless the GPU has as
  much work queued;
* nothing else: no congestion, no hierarchy (nodes of several GPUs would use the
  two-level scheme, ``model --layouts``), no stragglers.

The per-bucket times come from a ``ci/gpu_check.sh`` JSON (:func:`from_check`), are given,
or are measured on this GPU (:func:`measured_seconds`).
"""

from __future__ import annotations

import json
import math

from ..codec import THCCodec
from .models import ring_allreduce_s
from .units import format_size

GPU_COUNTS = (8, 16, 32, 64, 128, 256, 512)
LINKS_GBIT = (10.0, 25.0, 100.0, 400.0)


def exchange_rows(codec_s: float, cast_s: float, bucket_bytes: int, step_bytes: int, alpha: float,
                  gpus=GPU_COUNTS, links_gbit=LINKS_GBIT, bits: int = 4, block_size: int = 1024,
                  host_s: float = 0.0) -> list[dict]:
    """One row per (GPUs, link): the exchange's ms per step of fp32, the half-precision
    hook and THC, THC's speedup against each, and the host's ms per step (the module
    docstring's model)."""
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
            thc = (ring_allreduce_s(n, scales_bytes, alpha, beta) + ring_allreduce_s(n, words_bytes, alpha, beta)
                   + max(codec_s, host_s))
            rows.append({"op": "gpu_model", "gpus": n, "link_gbit": gbit, "buckets": buckets,
                         "lane_bits": codec.layout.width, "thc_wire_bytes": scales_bytes + words_bytes,
                         "fp32_ms": buckets * fp32 * 1e3, "half_ms": buckets * half * 1e3,
                         "thc_ms": buckets * thc * 1e3, "thc_vs_half": half / thc, "thc_vs_fp32": fp32 / thc,
                         "thc_host_ms": buckets * host_s * 1e3})
    return rows


def assumptions(codec_s: float, cast_s: float, bucket_bytes: int, step_bytes: int, alpha: float, bits: int,
                codec_source: str, host_s: float = 0.0) -> str:
    return "\n".join([
        "# A MODEL, not a measurement: flat ring allreduce, alpha-beta, one link per GPU, buckets one after",
        "# the other with no overlap (the exchange's own time per step); no congestion, hierarchy or stragglers.",
        f"# step: {format_size(step_bytes)} of float32 gradients in buckets of {format_size(bucket_bytes)}; "
        f"alpha = {alpha * 1e6:g} us per message",
        f"# THC {bits} bits: MAX round of the scales + SUM of the lane words (lane width for n ranks) + codec per "
        f"bucket: the larger of {codec_s * 1e3:.3f} ms on the GPU and {host_s * 1e6:.0f} us for the host to issue it",
        f"# times per bucket: {codec_source}",
        f"# bf16/fp16 hook: half the bytes + {cast_s * 1e3:.3f} ms of casts per bucket; fp32: the bucket as it is",
        "# host ms: THC's host time per step, taken from the backward's thread (the hook runs there)",
        "# speedup = the other's exchange time / THC's (> 1: THC faster)",
    ])


def table(rows: list[dict]) -> str:
    head = (f"{'GPUs':>5} {'Gbit/s':>7} {'lane':>5} {'fp32 ms':>9} {'bf16 ms':>9} {'THC ms':>9} "
            f"{'vs bf16':>8} {'vs fp32':>8} {'host ms':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['gpus']:>5} {r['link_gbit']:>7g} {r['lane_bits']:>5} {r['fp32_ms']:>9.2f} "
                     f"{r['half_ms']:>9.2f} {r['thc_ms']:>9.2f} {r['thc_vs_half']:>7.2f}x {r['thc_vs_fp32']:>7.2f}x "
                     f"{r['thc_host_ms']:>8.2f}")
    return "\n".join(lines)


def measured_seconds(bucket_bytes: int, bits: int, block_size: int, world: int = 16) -> dict:
    """THC's encode + decode (:func:`hhook.profile.codec_bench.roundtrip_seconds`, lanes for
    ``world`` ranks), the fp16 hook's casts and the host's time to issue THC's bucket
    (:func:`~hhook.profile.codec_bench.host_time_per_bucket`) of one float32 bucket on the
    current GPU: ``codec_s``, ``cast_s``, ``host_s``."""
    import torch

    from . import codec_bench

    x = torch.randn(bucket_bytes // 4, dtype=torch.float32, device="cuda")
    codec = THCCodec(bits, block_size, 1, world)
    return {"codec_s": codec_bench.roundtrip_seconds(codec, x, 20),
            "cast_s": codec_bench.fp16_hook_seconds(x, 20, world),
            "host_s": codec_bench.host_time_per_bucket(codec, x, 50)}


def from_check(path: str, bucket_bytes: int) -> dict:
    """The per-bucket times of a ``ci/gpu_check.sh`` JSON, from the float32 row nearest
    ``bucket_bytes`` (not rescaled: a bucket's time is not proportional to its bytes while
    the host bounds it): its speed stage's THC encode + decode (``thc_ms``), fp16 hook's
    casts and host time; else its throughput stage's encode + decode and host time (no
    casts there: ``cast_s`` None). ``codec_s``, ``cast_s``, ``host_s`` and ``source`` (the
    file, the GPU, the row); ValueError if the file holds neither, or is a dry run's."""
    with open(path) as f:
        doc = json.load(f)
    if doc.get("dry_run"):
        raise ValueError("the JSON of a dry run: its times are the CPU's on small tensors, not a GPU's")
    stages = doc.get("stages", {})

    def result(name):
        return (stages.get(name) or {}).get("result") or {}

    def nearest(rows):
        return min(rows, key=lambda r: abs(math.log(r["mb"] * 1e6 / bucket_bytes)))

    gpu = result("env").get("gpu") or result("speed").get("device") or result("throughput").get("device") or "a GPU"
    speed = [r for r in result("speed").get("rows", []) if r.get("dtype") == "float32"]
    if speed:
        r = nearest(speed)
        times = {"codec_s": r["thc_ms"] * 1e-3, "cast_s": r["fp16_hook_ms"] * 1e-3, "host_s": r["host_us"] * 1e-6}
        stage = "speed"
    else:
        rows = [r for r in result("throughput").get("rows", []) if r.get("dtype") == "float32"]
        host = next((v for k, v in result("throughput").items() if k.startswith("host_us_per_")), None)
        if not rows or host is None:
            raise ValueError(f"{path} holds no float32 rows of ci/gpu_check.sh's speed or throughput stage")
        r = nearest(rows)  # its *_s columns are milliseconds
        times = {"codec_s": (r["encode_s"] + r["decode_s"]) * 1e-3, "cast_s": None, "host_s": host * 1e-6}
        stage = "throughput"
    other = "" if round(r["mb"] * 1e6) == bucket_bytes else f", used for buckets of {format_size(bucket_bytes)}"
    return {**times, "source": f"{path}'s {stage} stage on {gpu}, its {r['mb']:g} MB float32 row{other}"}
