r"""A job that finishes, then ends as PyTorch documents or simply returns: it must exit 0.

    python -m torch.distributed.run --nproc-per-node 4 tests/support/exit_job.py [options]

``--what thc``: one ``hhook.thc_allreduce`` of ``--numel`` elements (the script of issue
36); ``--what ddp``: a few DDP steps of a small MLP, with ``hhook.register`` unless
``--plain`` (plain DDP, the baseline: torch's own exit). ``--chained-s``: the program
chains a callback on hhook's future that takes that long, so the thread completing the
future is still busy when the main thread goes on (it reaches the exit first, every time).
``--end destroy`` (default) calls ``dist.destroy_process_group()``, ``--end return`` does
not. ``--late-s``: rank r ends that many seconds after rank r - 1 (rank 0, the store's
host where the job is launched without torchrun, first). Each rank prints ``rank R: ok
<relative error>``.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist


def _thc(args, rank: int, world: int) -> float:
    import hhook

    torch.manual_seed(rank)
    x = torch.randn(args.numel)
    ref = x.clone()
    dist.all_reduce(ref)
    ref /= world
    state = hhook.THCState(bits=4, scales=args.scales, topology=args.topology)
    if args.chained_s:
        fut = hhook.thc_allreduce_async(x, state)
        fut.then(lambda f: time.sleep(args.chained_s))  # the program's own continuation
        y = fut.wait()
    else:
        y = hhook.thc_allreduce(x, state)
    return float((y - ref).norm() / ref.norm())


def _ddp(args, rank: int, world: int) -> float:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if not args.plain:  # plain DDP does not even import hhook
        import hhook

        hhook.register(ddp, bits=args.bits, scales=args.scales, topology=args.topology)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    loss = torch.zeros(())
    for _ in range(args.steps):
        x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return float(loss)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--what", choices=("thc", "ddp"), default="thc")
    p.add_argument("--numel", type=int, default=1 << 20)
    p.add_argument("--scales", default="agreed")
    p.add_argument("--topology", default="flat", type=lambda v: int(v) if v.isdigit() else v)
    p.add_argument("--chained-s", type=float, default=0.0)
    p.add_argument("--plain", action="store_true", help="DDP without hhook")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--bits", default="auto", type=lambda v: int(v) if v.isdigit() else v, help="DDP: the hook's bits")
    p.add_argument("--end", choices=("destroy", "return"), default="destroy")
    p.add_argument("--late-s", type=float, default=0.0)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    value = (_thc if args.what == "thc" else _ddp)(args, rank, world)
    print(f"rank {rank}: ok {value:.4f}", flush=True)
    time.sleep(args.late_s * rank)
    if args.end == "destroy":
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
