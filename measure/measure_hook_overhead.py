r"""What a Python comm hook costs where the wire is free: DDP's native fp32 allreduce against
``hhook.register(model)`` as a user calls it (on one host with CPU tensors it installs
nothing: :func:`hhook.decision.hook.one_host`), torch's own Python ``allreduce_hook``,
``bits="auto"`` held on fp32 and on bf16 (measuring forced, ``HHOOK_AUTO_ONE_HOST=measure``),
and the bf16 hook of ``hhook-profile`` (torch's, for Gloo), all in one job on wide-cnn's
gradients, the kinds taking turns of 20 steps (median ms per step, rank 0 prints).

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 measure/measure_hook_overhead.py [ROUNDS [STEPS]]

``KINDS="native fp32,hhook.register default"`` times only those (comma-separated; the
first is the reference). Each kind's figure: its median step, and ``paired``, the median
over rounds of its round's median against the reference's in the same round.

``bits="auto"`` cannot beat the fastest dense exchange by more than this: every exchange it
runs, fp32 included, goes through DDP's Python hook path (a callback in Gloo's thread).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import hhook
from hhook.decision import Decision
from hhook.profile.tasks import wide_cnn
from hhook.profile.train import bf16_gloo_hook

KINDS = ("native fp32", "hhook.register default", "torch allreduce_hook", "auto held on fp32", "profile bf16 hook", "auto held on bf16")


def build(kind: str):
    torch.manual_seed(0)
    model = DDP(wide_cnn())
    if kind == "torch allreduce_hook":
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    elif kind == "profile bf16 hook":
        model.register_comm_hook(None, bf16_gloo_hook)
    elif kind == "hhook.register default":
        hhook.register(model)  # bits="auto" as the user's environment says (unset: installs nothing on one host)
    elif kind.startswith("auto"):
        with mock.patch.dict(os.environ, {"HHOOK_AUTO_ONE_HOST": "measure"}):  # the hook, as on several hosts
            state = hhook.register(model)  # bits="auto", hhook.register's default
        state.decision = Decision([kind.rsplit(" ", 1)[1]])  # one candidate: the choice is known
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def steps(model, opt, x, y, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    per_turn = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    kinds = tuple(os.environ["KINDS"].split(",")) if os.environ.get("KINDS") else KINDS
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    gen = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
    jobs = {kind: build(kind) for kind in kinds}
    for model, opt in jobs.values():
        steps(model, opt, x, y, 15)  # warm-up, the plain iterations and the one-candidate "exploration"
    times = {kind: [] for kind in kinds}
    ratios = {kind: [] for kind in kinds}
    for _ in range(rounds):
        turn = {}
        for kind, (model, opt) in jobs.items():
            turn[kind] = steps(model, opt, x, y, per_turn)
            times[kind] += turn[kind]
        for kind in kinds:
            ratios[kind].append(statistics.median(turn[kind]) / statistics.median(turn[kinds[0]]))
    if dist.get_rank() == 0:
        native = statistics.median(times[kinds[0]])
        print(f"world {dist.get_world_size()}, wide-cnn, {rounds} rounds of {per_turn} steps per kind, median ms per step")
        for kind in kinds:
            med = statistics.median(times[kind])
            print(f"{kind:22s} {1e3 * med:8.2f}   {med / native:5.3f}x {kinds[0]}   paired {statistics.median(ratios[kind]):5.3f}x")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
