"""Measure the scale model's inputs on this host (bench/topology-inputs.json).

The scale model (``hhook-profile model --layouts``, :mod:`hhook.profile.models`) predicts a
step from a few measured quantities. This script measures those that do not need the
emulated links; ``measure/measure_topology.sh`` runs it and merges the results with the
inter-node link fit of ``bench/profile-1gbit-link.json``. Two parts::

    python measure/measure_scale_inputs.py compute OUT.json
        compute_ms: a wide-cnn DDP step (batch 32, SGD with momentum, one thread) in a world
        of one; calls: the DDP buckets a step hands to its comm hook; model_bytes.
    torchrun --nproc-per-node 2 measure/measure_scale_inputs.py loopback OUT.json
        Two ranks of one host (Gloo on loopback, one thread each):
        alpha_intra/beta_intra: plain float32 allreduces of 4 KB..21 MB, fitted as
          t = 2 (n - 1) (alpha + S / (n beta));
        codec_GBps/codec_call_ms: thc_allreduce (bits 4, the defaults) of 1..21 MB minus
          what the fit says its words and its MAX round take on the wire, fitted as
          t = call + S / codec;
        cast_GBps: what the bf16 hook costs at the model's size beyond moving its half
          of the bytes as fast as the float32 fit says (its divide and casts, and Gloo's
          slower bfloat16 sum);
        copy_GBps: a torch copy of the model's bytes.

Each timing is the median of several runs after warm-up ones; every rank enters each
collective together (a barrier before each timed call).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

REPEATS = 15
WARMUP = 2


def median_s(fn, repeats: int = REPEATS, warmup: int = WARMUP, barrier: bool = True) -> float:
    times = []
    for i in range(warmup + repeats):
        if barrier:
            dist.barrier()
        t0 = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def compute(out: str) -> None:
    """A DDP step in a world of one, as hhook-profile train runs it (wide-cnn)."""
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hhook.profile.tasks import TASKS, batches, load

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29613")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    task = TASKS["wide-cnn"]
    x, y, _, _, shard = load(0, 1)
    torch.manual_seed(0)
    model = task.build()
    ddp = DDP(model)
    calls = [0]

    def counting_hook(_, bucket):
        calls[0] += 1
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    ddp.register_comm_hook(None, counting_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=task.lr, momentum=0.9)
    steps, warmup, times = 40, 5, []
    for i, idx in enumerate(batches(shard, task.batch_size, None)):
        if i == steps + warmup:
            break
        if i == warmup:
            calls[0] = 0
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(ddp(x[idx]), y[idx]).backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    result = {"compute_ms": round(statistics.median(times) * 1e3, 2), "model_bytes": model_bytes,
              "calls": calls[0] // steps}
    dist.destroy_process_group()
    write(out, result)


def loopback(out: str) -> None:
    """Intra-node path, codec, casts and copies between two ranks of this host."""
    import hhook
    from hhook.profile.link import fit_alpha_beta

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    n = dist.get_world_size()
    W = int(os.environ.get("MODEL_BYTES", "21103144"))

    def allreduce_s(nbytes: int, dtype=torch.float32) -> float:
        t = torch.ones(max(1, nbytes // torch.tensor([], dtype=dtype).element_size()), dtype=dtype)
        return median_s(lambda: dist.all_reduce(t))

    sizes = [4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 10 << 20, W]
    times = [allreduce_s(s) for s in sizes]
    rounds = 2 * (n - 1)
    link = fit_alpha_beta([s / n for s in sizes], [t / rounds for t in times])

    def wire_s(nbytes: float) -> float:
        return rounds * (link.alpha_s + nbytes / n / link.beta_Bps)

    state = hhook.THCState(bits=4)
    codec_sizes = [1 << 20, 4 << 20, 10 << 20, W]
    codec_times = []
    for i, s in enumerate(codec_sizes):
        g = torch.randn(s // 4, generator=torch.Generator().manual_seed(dist.get_rank()))
        buf = g.clone()
        before = state.stats()["wire_bytes"]

        def call():
            buf.copy_(g)
            hhook.thc_allreduce(buf, state, key=("size", i))

        t = median_s(call)
        words = (state.stats()["wire_bytes"] - before) / (REPEATS + WARMUP)
        codec_times.append(t - wire_s(words) - rounds * link.alpha_s)  # minus the words and the MAX round
    codec = fit_alpha_beta(codec_sizes, codec_times)

    g = torch.randn(W // 4)
    half = torch.empty(W // 4, dtype=torch.bfloat16)

    def bf16_hook():  # what torch's bf16_compress_hook does with a bucket
        g.div_(n)
        half.copy_(g)
        dist.all_reduce(half)
        g.copy_(half)

    cast_s = median_s(bf16_hook) - wire_s(W / 2)  # beyond moving its bytes as fast as float32 does
    dst = torch.empty_like(g)
    copy_s = median_s(lambda: dst.copy_(g), repeats=21, barrier=False)
    result = {
        "alpha_intra_us": round(link.alpha_s * 1e6, 1), "beta_intra_GBps": round(link.beta_Bps / 1e9, 3),
        "intra_fit_r2": round(link.r2, 4),
        "codec_GBps": round(codec.beta_Bps / 1e9, 3), "codec_call_ms": round(codec.alpha_s * 1e3, 2),
        "codec_fit_r2": round(codec.r2, 4),
        "cast_GBps": round(W / cast_s / 1e9, 3),
        "copy_GBps": round(W / copy_s / 1e9, 2),
        "raw": {"allreduce_ms": dict(zip(map(str, sizes), (round(t * 1e3, 3) for t in times))),
                "codec_ms": dict(zip(map(str, codec_sizes), (round(t * 1e3, 3) for t in codec_times))),
                "cast_ms": round(cast_s * 1e3, 3), "copy_ms": round(copy_s * 1e3, 3)},
    }
    if dist.get_rank() == 0:
        write(out, result)
    dist.destroy_process_group()


def write(out: str, result: dict) -> None:
    with open(out, "w") as fh:
        json.dump(result, fh, indent=1)
        fh.write("\n")
    print(json.dumps(result))


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("compute", "loopback"):
        sys.exit(__doc__)
    {"compute": compute, "loopback": loopback}[sys.argv[1]](sys.argv[2])
