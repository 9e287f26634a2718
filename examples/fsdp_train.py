"""FSDP2 with THC-compressed gradient reduce-scatter: a small worked example.

    torchrun --nproc-per-node 2 examples/fsdp_train.py                 # hhook, 4 bits
    torchrun --nproc-per-node 2 examples/fsdp_train.py --mode plain    # plain FSDP2, fp32 reduce
    torchrun --nproc-per-node 2 examples/fsdp_train.py --mode bf16     # plain FSDP2, bf16 reduce

Runs on CPU with Gloo. Trains an MLP on a synthetic teacher task and prints the final
loss, the mean step time (after warm-up) and the bytes this rank handed per step to the
gradient reduce-scatters (their input: FSDP's padded buffer, or hhook's messages; plus
hhook's MAX round of the scales) and to the parameter all-gathers (their output), counted
at the collectives (:func:`hhook.profile.counting.collective_bytes`, NCCL's semantics:
Gloo's emulated reduce-scatter moves about twice as much).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import hhook
import hhook.fsdp
from hhook.profile.counting import collective_bytes


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
    mp = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16) if args.mode == "bf16" else MixedPrecisionPolicy()
    for layer in model:
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    state = hhook.fsdp.register(model, bits=args.bits) if args.mode == "thc" else None

    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1 + rank)
    times = []
    counter = {"bytes": 0, "reduce_scatter": 0, "all_gather": 0}
    counting = collective_bytes(counter)
    for step in range(args.steps):
        if step == args.warmup:
            counting.__enter__()  # count the timed steps only
        x = torch.randn(64, 256, generator=g)
        y = teacher(x).detach()
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    counting.__exit__(None, None, None)
    x = torch.randn(1024, 256, generator=torch.Generator().manual_seed(99))
    with torch.no_grad():
        final = torch.nn.functional.mse_loss(model(x), teacher(x)).item()
    measured = args.steps - args.warmup
    rs_bytes = (counter["bytes"] - counter["all_gather"]) / measured  # reduce-scatters + hhook's MAX rounds
    ag_bytes = counter["all_gather"] / measured
    step_ms = 1000 * sum(times[args.warmup:]) / measured
    if rank == 0:
        print(f"mode={args.mode} world={world} steps={args.steps} final_loss={final:.5f} "
              f"step_ms={step_ms:.1f} reduce_scatter_bytes_per_step={rs_bytes:.0f} "
              f"all_gather_bytes_per_step={ag_bytes:.0f}")
    dist.barrier()  # plain FSDP2 on Gloo sometimes aborts at exit without it (torch 2.13)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
