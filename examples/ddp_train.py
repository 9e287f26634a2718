r"""Train a classifier on scikit-learn's bundled handwritten digits with DDP.

Runs the same under torchrun and mpirun (hhook.init_distributed reads either)::

    torchrun --nproc-per-node 4 examples/ddp_train.py --hook thc --bits 4
    mpirun -np 4 python examples/ddp_train.py --hook thc --bits 4

Prints test accuracy and the bytes each rank handed to collectives. For the hooks,
bytes are counted from the tensors passed to torch.distributed (THC's own stats()
must agree); DDP without a hook reduces in C++, so its bytes are the fp32 gradients.
"""

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import digits  # the shared task, beside this script
import hhook
from hhook.profile.counting import collective_bytes


def register_hook(ddp: DDP, args):
    """Attach the chosen hook; return the THC state (or None)."""
    if args.hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif args.hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=args.rank, start_powerSGD_iter=2)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif args.hook == "thc":
        return hhook.register(ddp, bits=args.bits, error_feedback=args.error_feedback)
    return None


RESULT_HEADER = """\
# One line per run, printed by rank 0:
#   hook           gradient exchange: none (plain fp32 DDP), fp16, powersgd (rank 2), thc (bits)
#   ranks          processes in the job; launcher: what started them (torchrun, openmpi, ...)
#   steps          optimizer steps, one gradient exchange each
#   test_accuracy  on the held-out 25% of the digits; final_loss: training loss of the last batch
#   wire           MiB each rank handed to collectives over the training (after registration)
#   dense          MiB the same steps would send as fp32 (4 bytes x parameters x steps)
#   ratio          dense / wire: how many times fewer bytes than fp32
#   time           training wall time. On one machine the ranks talk over loopback (memory copies, no
#                  network to save on), so compression only adds codec work there: see the README."""


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hook", choices=["none", "fp16", "powersgd", "thc"], default="thc")
    p.add_argument("--bits", type=int, default=4, help="THC bits per coordinate (1..8)")
    p.add_argument("--error-feedback", action="store_true", help="THC error feedback")
    p.add_argument("--rank", type=int, default=2, help="PowerSGD matrix approximation rank")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--json", help="rank 0 writes its results here")
    p.add_argument("--result-header", action="store_true", help="print what each field of the result line means, and exit")
    args = p.parse_args()
    if args.result_header:
        print(RESULT_HEADER)
        return

    env = hhook.init_distributed(backend="gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()

    x_train, y_train, x_test, y_test, shard = digits.load(rank, world)

    torch.manual_seed(0)
    model = digits.make_model(args.hidden)
    ddp = DDP(model)
    state = register_hook(ddp, args)
    if state is not None:
        state.reset_stats()  # the training's bytes, as counted below (registration's handshake left out)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)

    steps, counter = 0, {"bytes": 0}
    start = time.perf_counter()
    with collective_bytes(counter):
        for idx in digits.batches(shard, args.batch_size, args.epochs):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(ddp(x_train[idx]), y_train[idx])
            loss.backward()
            opt.step()
            steps += 1
    elapsed = time.perf_counter() - start

    result = digits.result_of(model, x_test, y_test, steps, loss, elapsed, None if args.hook == "none" else counter["bytes"],
                              hook=args.hook, bits=args.bits if args.hook == "thc" else None, world_size=world,
                              launcher=env.launcher)
    if state is not None:
        result["thc_stats"] = state.stats()
        assert state.stats()["wire_bytes"] == result["wire_bytes"], "THC stats disagree with the bytes counted"
    if rank == 0:
        label = args.hook + (f" ({args.bits} bits)" if args.hook == "thc" else "")
        print(digits.result_line(label, result, f"launcher={env.launcher} "))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    dist.barrier()  # every rank done with the group: destroying it under a peer still talking aborts Gloo at random
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
