r"""Data-parallel training that survives a killed rank: checkpoints as PyTorch recommends
(model, optimizer and the comm hook's state, every ``--every`` steps) and resumes from the
last complete one, so ``torchrun --max-restarts`` restarts it where it stopped::

    torchrun --nproc-per-node 2 --max-restarts 2 examples/resilient_train.py --ckpt /tmp/ckpt

Each rank writes its own file (error-feedback residuals differ between ranks) to a
temporary name and renames it, so a rank killed mid-save leaves the previous file whole;
rank 0 marks a step complete once every rank has saved it, and a restart resumes from the
newest complete step that every rank can read (the ranks agree on it: a file truncated or
corrupt on one rank makes every rank resume from the step before, instead of failing each
restart in turn). A restart with another number of ranks (an elastic job that lost a
node) takes rank 0's files where its own are missing; the hook state then starts its
per-rank part afresh with one log line. The task is a synthetic 10-class problem whose
batches depend only on the seed and the step, so a resumed run sees the data the
uninterrupted one would have.

The fault options (``--kill-at``, ``--stall-at``, ``--truncate-at``) inject faults into this script itself,
for the fault drill (``measure/fault_drill.sh``, docs/reliability.md) and the tests.
"""

import argparse
import glob
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import hhook


def task(seed: int, features: int = 32, classes: int = 10, train: int = 4096, test: int = 1024):
    """Gaussian classes around random centres: about 90% learnable, never 100%."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, features, generator=g) * 0.6
    y = torch.randint(0, classes, (train + test,), generator=g)
    x = centres[y] + torch.randn(train + test, features, generator=g)
    return (x[:train], y[:train]), (x[train:], y[train:])


def batch(data, seed: int, step: int, rank: int, world: int, size: int):
    """Rank ``rank``'s share of step ``step``'s batch: a function of the seed and the step only."""
    x, y = data
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    idx = torch.randperm(x.shape[0], generator=g)[: size * world].view(world, size)[rank]
    return x[idx], y[idx]


def model(features: int, width: int, classes: int = 10) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(features, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                               torch.nn.ReLU(), torch.nn.Linear(width, classes))


# -- checkpoints ---------------------------------------------------------------------
def ckpt_path(directory: str, step: int, rank: int) -> str:
    return os.path.join(directory, f"step{step:07d}-rank{rank}.pt")


def save_atomically(obj, path: str) -> None:
    """Write to a temporary file, flush it to disk and rename: readers see the old file or
    the whole new one, never a truncated one."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def complete_steps(directory: str) -> list[int]:
    """Steps every rank saved (rank 0 wrote ``stepN.done`` after a barrier), oldest first."""
    return sorted(int(m.group(1)) for m in (re.search(r"step(\d+)\.done$", p) for p in
                                            glob.glob(os.path.join(directory, "step*.done"))) if m)


def save(directory: str, step: int, rank: int, world: int, ddp, opt, hook_state) -> None:
    save_atomically({"step": step, "world_size": world, "model": ddp.module.state_dict(), "optimizer": opt.state_dict(),
                     "hook": hook_state.state_dict() if hook_state is not None else None},
                    ckpt_path(directory, step, rank))
    dist.barrier()  # every rank's file is whole before the step counts as complete
    if rank == 0:
        save_atomically({"step": step, "world_size": world}, os.path.join(directory, f"step{step:07d}.done"))
        for old in complete_steps(directory)[:-2]:  # keep the last two complete steps
            for path in glob.glob(os.path.join(directory, f"step{old:07d}*")):
                os.unlink(path)


def readable(directory: str, step: int, rank: int):
    """This rank's checkpoint of ``step`` (rank 0's where this rank has none: a restart
    with more ranks), or None where it cannot be read (truncated, corrupt, missing)."""
    path = ckpt_path(directory, step, rank)
    if not os.path.exists(path):
        path = ckpt_path(directory, step, 0)
    try:
        return torch.load(path, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - said, then an older step is tried
        print(f"rank {rank}: the checkpoint of step {step} cannot be read ({type(exc).__name__}: "
              f"{str(exc).splitlines()[0][:120]})", file=sys.stderr, flush=True)
        return None


def load(directory: str, rank: int):
    """The newest complete checkpoint that every rank can read, agreed across the ranks
    (collectives: call it on every rank), or None. A file that is truncated or corrupt on
    one rank makes every rank resume from the step before, instead of failing this
    attempt and every restart after it."""
    steps, bound = complete_steps(directory), None
    while True:
        mine, saved = -1, None
        for step in reversed(steps):
            if bound is None or step <= bound:
                saved = readable(directory, step, rank)
                if saved is not None:
                    mine = step
                    break
        seen = torch.tensor([mine, -mine])
        dist.all_reduce(seen, dist.ReduceOp.MIN)  # the oldest newest, and the newest
        low, high = int(seen[0]), -int(seen[1])
        if low == high:
            if rank == 0 and steps and low != steps[-1]:
                print(f"resuming from step {low}: a newer checkpoint cannot be read on every rank", flush=True)
            return saved if low >= 0 else None
        bound = low  # some rank cannot read a newer one: every rank looks at most there


# -- faults injected into this process -------------------------------------------------
def stall(seconds: float) -> None:
    """Stop this process (SIGSTOP) and have a helper continue it ``seconds`` later."""
    print(f"fault: rank stopped at t={time.time():.3f} for {seconds:g} s", file=sys.stderr, flush=True)
    subprocess.Popen(["sh", "-c", f"sleep {seconds}; kill -CONT {os.getpid()}"], start_new_session=True)
    os.kill(os.getpid(), signal.SIGSTOP)


def die() -> None:
    print(f"fault: rank killed at t={time.time():.3f}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def kill_in_collective() -> None:
    """SIGKILL this process right after its next torch.distributed all_reduce is launched
    (inside the comm hook: the peers are in the collective)."""
    launch = dist.all_reduce

    def then_die(*args, **kwargs):
        work = launch(*args, **kwargs)
        die()
        return work

    dist.all_reduce = then_die


def truncate_and_die(path: str) -> None:
    """A disk that lost the end of this rank's newest checkpoint, then the process."""
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    print(f"fault: checkpoint truncated to {size // 2} of {size} bytes: {path}", file=sys.stderr, flush=True)
    die()


def arguments() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=50, help="checkpoint interval in steps (0: never)")
    p.add_argument("--ckpt", default=None, help="checkpoint directory (resumes from it)")
    p.add_argument("--hook", choices=["thc", "fp16", "fp32"], default="thc")
    p.add_argument("--bits", default="auto", help="THC bits, or auto (hhook.register's default)")
    p.add_argument("--scales", choices=["agreed", "predicted"], default="agreed")
    p.add_argument("--topology", default="flat", help="flat, auto or ranks per node")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--batch", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout in seconds")
    p.add_argument("--kill-at", type=int, default=None, help="SIGKILL --fault-rank at this step (first attempt)")
    p.add_argument("--kill-in", choices=["step", "hook"], default="step",
                   help="step: between forward and backward; hook: inside the hook's collectives")
    p.add_argument("--stall-at", type=int, default=None, help="SIGSTOP --fault-rank at this step")
    p.add_argument("--stall-s", type=float, default=30.0, help="seconds before the SIGCONT")
    p.add_argument("--truncate-at", type=int, default=None,
                   help="--fault-rank truncates its checkpoint of this step once saved, then is killed (once)")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--json", default=None, help="rank 0 writes the result here")
    return p.parse_args()


def hook(args, ddp, saved):
    """The comm hook: hhook's (its state from the checkpoint where there is one), torch's
    fp16 hook, or none (fp32)."""
    if args.hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    if args.hook != "thc":
        return None
    options = dict(bits=args.bits if args.bits == "auto" else int(args.bits), scales=args.scales,
                   topology=args.topology if args.topology in ("flat", "auto") else int(args.topology))
    if saved is not None and saved["hook"] is not None:
        state = hhook.THCState(**options)
        state.load_state_dict(saved["hook"])
        return hhook.register(ddp, state=state)
    return hhook.register(ddp, **options)


def train(args, ddp, opt, hook_state, data, start: int, rank: int, world: int, attempt: int) -> list[float]:
    """Steps ``start`` to ``args.steps``; returns each step's seconds. A failure raises
    :class:`StepFailed` saying which step."""
    times = []
    for step in range(start, args.steps):
        try:
            times.append(one_step(args, ddp, opt, hook_state, data, step, rank, world, attempt))
        except Exception as exc:  # noqa: BLE001 - the caller says which step
            raise StepFailed(step, exc) from exc
    return times


class StepFailed(Exception):
    def __init__(self, step: int, exc: Exception):
        super().__init__(step, exc)
        self.step, self.exc = step, exc


def one_step(args, ddp, opt, hook_state, data, step: int, rank: int, world: int, attempt: int) -> float:
    """Step ``step``, its checkpoint and its faults; returns its seconds."""
    faulty = rank == args.fault_rank and attempt == 0
    tic = time.perf_counter()
    x, y = batch(data, args.seed, step, rank, world, args.batch)
    loss = torch.nn.functional.cross_entropy(ddp(x), y)
    if faulty and step == args.kill_at and args.kill_in == "hook":
        kill_in_collective()
    elif faulty and step == args.kill_at:
        die()
    if faulty and step == args.stall_at:
        stall(args.stall_s)
    opt.zero_grad()
    loss.backward()
    opt.step()
    seconds = time.perf_counter() - tic
    if args.ckpt and args.every and (step + 1) % args.every == 0:
        save(args.ckpt, step + 1, rank, world, ddp, opt, hook_state)
        # once per directory, not per attempt: torchrun counts restarts per node, so a rank
        # moved to a node whose agent did not restart would see attempt 0 again
        once = os.path.join(args.ckpt, "fault-truncated")
        if step + 1 == args.truncate_at and not os.path.exists(once):
            dist.barrier()  # every rank has looked; rank 0 has marked the step complete
            if rank == args.fault_rank:
                open(once, "w").close()
                truncate_and_die(ckpt_path(args.ckpt, step + 1, rank))
    return seconds


def main() -> int:
    args = arguments()
    env = hhook.init_distributed(backend="gloo", timeout_s=args.timeout)
    rank, world = env.rank, env.world_size
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.set_num_threads(1)
    train_data, test = task(args.seed)
    ddp = DDP(model(train_data[0].shape[1], args.width), bucket_cap_mb=0.25)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)

    if args.ckpt:
        os.makedirs(args.ckpt, exist_ok=True)
    saved = load(args.ckpt, rank) if args.ckpt else None
    start = 0
    if saved is not None:
        ddp.module.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        start = saved["step"]
    hook_state = hook(args, ddp, saved)
    layout = hook_state.node_layout() if hook_state is not None else None
    if layout is not None and layout.node_memory is not None and layout.local_rank == 0:
        print(f"shared memory: {layout.node_memory.directory}/{layout.node_memory.prefix}*", flush=True)
    if rank == 0:
        print(f"attempt {attempt}: {world} ranks, start at step {start}"
              + (f" (checkpoint of {saved['world_size']} ranks)" if saved is not None else "")
              + f" t={time.time():.3f}", flush=True)
    try:
        times = train(args, ddp, opt, hook_state, train_data, start, rank, world, attempt)
    except StepFailed as failed:  # said plainly, then a non-zero exit
        print(f"rank {rank}: step {failed.step}: t={time.time():.3f}: {type(failed.exc).__name__}: {failed.exc}",
              file=sys.stderr, flush=True)
        return 1
    report(args, ddp, hook_state, test, times, rank, world, attempt, start)
    dist.destroy_process_group()
    return 0


def report(args, ddp, hook_state, test, times, rank, world, attempt, start) -> None:
    """Rank 0 prints (and writes to ``--json``) the run's result."""
    with torch.no_grad():
        accuracy = (ddp.module(test[0]).argmax(1) == test[1]).float().mean().item()
    weights = torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()])
    result = {"ranks": world, "attempt": attempt, "resumed_from": start, "steps": args.steps, "accuracy": accuracy,
              "median_step_ms": 1e3 * sorted(times)[len(times) // 2] if times else None,
              "weights_sha1": hashlib.sha1(weights.numpy().tobytes()).hexdigest(),
              "hook": hook_state.stats() if hook_state is not None else None}
    if rank == 0:
        print(json.dumps({k: v for k, v in result.items() if k != "hook"}), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, default=str)


if __name__ == "__main__":
    sys.exit(main())
