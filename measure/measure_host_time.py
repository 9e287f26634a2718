r"""Host time of the DDP hook's Python path, per bucket, two checkouts of hhook A/B in one run.

Two ranks over Gloo train a small MLP in many small buckets (``THCState(bits=4)`` on
``thc_hook``, agreed scales, or ``--scales predicted``); each rank times every call of the
hook on the autograd thread (``thc_hook``, wrapped): the CPU time of that thread
(``time.thread_time``, which other processes on a loaded host inflate least) and the wall
time, and the step around it. The checkouts take turns, one world each, ``--rounds``
times; each prints the median over its steps, per bucket, and the summary gives, per
round, head over base, and the median of those ratios.

    python3 measure/measure_host_time.py --base /tmp/base [--head .] [--rounds 6]

Timings on a shared machine are noisy: compare the ratio of the paired rounds, and say
the load (``uptime``) beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))


def package_root(root: str) -> str:
    """Where ``root``'s hhook package lives: ``src/`` (the src layout), else the root itself."""
    src = os.path.join(root, "src")
    return src if os.path.isdir(os.path.join(src, "hhook")) else root


def _timed_hook(state, bucket):
    """``thc_hook`` with its host time added to ``_TIMES`` (the hook's own call only: the
    continuations run on Gloo's threads): (thread CPU seconds, wall seconds)."""
    cpu, wall = time.thread_time(), time.perf_counter()
    fut = _HOOK(state, bucket)
    _TIMES.append((time.thread_time() - cpu, time.perf_counter() - wall))
    return fut


_HOOK = None
_TIMES: list = []


def _rank(rank, world, port, steps, scales, results):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hhook

    global _HOOK
    _HOOK = hhook.thc_hook
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    layers = []
    for _ in range(12):
        layers += [torch.nn.Linear(48, 48), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    ddp = DDP(model, bucket_cap_mb=0.01)  # a bucket of one or two layers: 12 or so buckets
    state = hhook.THCState(bits=4, scales=scales)
    ddp.register_comm_hook(state, _timed_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(16, 48, generator=g)
    hook_ms, wall_ms, step_ms, buckets = [], [], [], 0
    for step in range(steps):
        _TIMES.clear()
        start = time.perf_counter()
        opt.zero_grad()
        ddp(x).square().mean().backward()
        step_ms.append((time.perf_counter() - start) * 1e3)
        if step >= 10:  # after DDP's rebuild, the handshake and the first compiles
            hook_ms.extend(cpu * 1e3 for cpu, _ in _TIMES)
            wall_ms.extend(wall * 1e3 for _, wall in _TIMES)
            buckets = len(_TIMES)
        opt.step()
    results.put((rank, {"hook_ms_per_bucket": statistics.median(hook_ms), "wall_ms_per_bucket": statistics.median(wall_ms),
                        "step_ms": statistics.median(step_ms[10:]), "buckets": buckets, "hhook": hhook.__file__}))
    dist.destroy_process_group()


def run_world(root: str, steps: int, scales: str) -> dict:
    """One world of two ranks with the hhook of ``root``; rank 0's figures."""
    env = dict(os.environ, PYTHONPATH=package_root(root), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, HERE, "--world", root, "--steps", str(steps), "--scales", scales], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _world(root: str, steps: int, scales: str) -> None:
    import socket

    import torch.multiprocessing as mp

    sys.path.insert(0, package_root(root))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, 2, port, steps, scales, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert got[0]["hhook"].startswith(os.path.abspath(root)), (got[0]["hhook"], root)
    print(json.dumps(got[0]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="the checkout to compare with (e.g. main, unpacked by git archive)")
    parser.add_argument("--head", default=ROOT, help="the checkout under test (default: this one)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--scales", default="agreed", choices=("agreed", "predicted"))
    parser.add_argument("--world", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.world:
        _world(args.world, args.steps, args.scales)
        return
    rows = []
    for i in range(args.rounds):
        order = [("base", args.base), ("head", args.head)]
        if i % 2:
            order.reverse()  # neither always first
        row = {label: run_world(os.path.abspath(root), args.steps, args.scales) for label, root in order}
        for name in ("hook_ms_per_bucket", "wall_ms_per_bucket", "step_ms"):
            row[name] = row["head"][name] / row["base"][name]
        rows.append(row)
        print(f"round {i}: hook CPU ms/bucket base {row['base']['hook_ms_per_bucket']:.4f} head "
              f"{row['head']['hook_ms_per_bucket']:.4f} (x{row['hook_ms_per_bucket']:.3f}); wall x"
              f"{row['wall_ms_per_bucket']:.3f}; step x{row['step_ms']:.3f}; {row['head']['buckets']} buckets",
              flush=True)
    print(json.dumps({"scales": args.scales, "rounds": args.rounds, "steps": args.steps,
                      **{f"{name}_ratio_median": statistics.median(r[name] for r in rows)
                         for name in ("hook_ms_per_bucket", "wall_ms_per_bucket", "step_ms")},
                      "load": os.getloadavg()}))


if __name__ == "__main__":
    main()
