"""A DiLoCo job of two sites on loopback, launched as a launcher would (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT): ``--die-at N`` makes rank 1 die (os._exit) before its inner step
N, in the middle of the run. Every rank prints ``rank R: step S: ERROR_CLASS: MESSAGE`` for
the error that ended it, or ``rank R: done``; tests/integrations/test_diloco.py reads it."""

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist

import hhook
import hhook.diloco


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--die-at", type=int, default=0)
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = hhook.diloco.DiLoCo(model, opt, hhook.diloco.find_sites(1), every=3, bits=4)
    step = 0
    try:
        for step in range(1, args.steps + 1):
            if rank == 1 and step == args.die_at:
                os._exit(9)  # a site dies: its connections close
            loss = model(torch.randn(4, 16)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            outer.step()
    except Exception as e:  # noqa: BLE001 - reported for the test
        print(f"rank {rank}: step {step}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(1)
    print(f"rank {rank}: done", file=sys.stderr, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
