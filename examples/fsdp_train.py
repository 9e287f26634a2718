"""FSDP2 with THC-compressed gradient reduce-scatter: a small worked example.

    torchrun --nproc-per-node 2 examples/fsdp_train.py                 # hhook, 4 bits
    torchrun --nproc-per-node 2 examples/fsdp_train.py --mode plain    # plain FSDP2, fp32 reduce
    torchrun --nproc-per-node 2 examples/fsdp_train.py --mode bf16     # plain FSDP2, bf16 reduce

Runs on CPU with Gloo. Trains an MLP on a synthetic teacher task and prints the final
loss, the mean step time (after warm-up) and the bytes this rank handed to the gradient
reduce-scatter (THC: codes + scales from ``state.stats()``; plain: the padded dense
buffer FSDP reduces, counted from the parameter shapes, NCCL's semantics: one
reduce-scatter input per call).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import hhook
import hhook.fsdp


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("thc", "plain", "bf16"), default="thc")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=5)
    args = ap.parse_args()

    hhook.init_distributed("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    teacher = torch.nn.Sequential(torch.nn.Linear(256, 64), torch.nn.Tanh(), torch.nn.Linear(64, 10))
    model = torch.nn.Sequential(
        torch.nn.Linear(256, args.width), torch.nn.ReLU(),
        torch.nn.Linear(args.width, args.width), torch.nn.ReLU(),
        torch.nn.Linear(args.width, 10),
    )
    dense_rs_bytes = 0
    mp = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) if args.mode == "bf16" else MixedPrecisionPolicy()
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mp_policy=mp)
            for p in layer.parameters():
                rows = -(-p.shape[0] // world) * world
                dense_rs_bytes += rows * (p.numel() // p.shape[0]) * (2 if args.mode == "bf16" else 4)
    fully_shard(model, mp_policy=mp)
    state = hhook.fsdp.register(model, bits=args.bits) if args.mode == "thc" else None

    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1 + rank)
    times = []
    for step in range(args.steps):
        x = torch.randn(64, 256, generator=g)
        y = teacher(x).detach()
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        if step == args.warmup - 1 and state is not None:
            state.reset_stats()
    x = torch.randn(1024, 256, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        final = torch.nn.functional.mse_loss(model(x), teacher(x)).item()
    measured = args.steps - args.warmup
    if state is not None:
        rs_bytes = state.stats()["wire_bytes"] / measured
    else:
        rs_bytes = dense_rs_bytes
    step_ms = 1000 * sum(times[args.warmup:]) / measured
    if rank == 0:
        print(f"mode={args.mode} world={world} steps={args.steps} final_loss={final:.5f} "
              f"step_ms={step_ms:.1f} reduce_scatter_bytes_per_step={rs_bytes:.0f}")
    dist.barrier()  # plain FSDP2 on Gloo sometimes aborts at exit without it (torch 2.13)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
