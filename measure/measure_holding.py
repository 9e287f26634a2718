r"""What holding a choice costs: ``bits="auto"`` after its decision against the same method
fixed, in one job on wide-cnn's gradients, the kinds taking turns of ``STEPS`` steps (default
20), rank 0 printing per kind the median ms per step, its ratio to the fixed method, the
median over rounds of the per-round ratio (``paired``: a host whose speed drifts moves
both alike), the process's CPU ms, minor page faults and garbage-collection ms per step.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 measure/measure_holding.py [ROUNDS] [METHOD ...]

``METHOD``: ``thc:4`` (default), ``thc:3``..., ``fp32`` (fixed: DDP's native allreduce; also
torch's Python ``allreduce_hook``, the floor of any Python hook), ``bf16`` (fixed: the
profiler's bf16 hook). Each auto kind explores first as a real run does (every candidate's
turn, on a fake clock that makes METHOD the fastest, so the widths it tried leave their
state behind), then holds METHOD (the clock stays fake: no drift re-decides).
Environment: ``PERSTEP=1`` adds auto with the periods reduced every step (as before
``EXPLOIT_BATCH``), ``UNREDUCED=1`` auto with no reduction once held (unsafe: an upper
bound), ``SINGLE=1`` auto with one candidate (no other width ever ran), ``ONLY=PREFIX``
keeps the kinds whose name starts so (one kind per process: the allocator's state is the
process's), ``HHOOK_PROFILE=DIR`` writes each rank's cProfile of each kind's held steps.
Run it with ``PYTHONPATH=.`` so that torchrun's ranks import this checkout's hhook.
"""

from __future__ import annotations

import cProfile
import gc
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hhook
from hhook.decision import Decision, Prober
from hhook.profile.tasks import wide_cnn

# Its "auto" kinds time the hook holding a choice, so they measure on this one host too
# (where hhook.register's bits="auto" would install nothing: hhook.decision.hook.one_host).
os.environ.setdefault("HHOOK_AUTO_ONE_HOST", "measure")
STEPS = int(os.environ.get("STEPS", 20))
STATES: dict = {}
PATCH: list = []


class FakeClock:
    """Each step costs ``costs[method]`` seconds: ``best`` the least, the others more."""

    def __init__(self, best: str):
        self.now, self.best, self.prober = 0.0, best, None

    def __call__(self) -> float:
        self.now += 0.05 if self.prober is not None and self.prober.method == self.best else 0.08
        return self.now


def build(kind: str):
    torch.manual_seed(0)
    model = DDP(wide_cnn())
    method = kind.split(" ")[-1]
    if kind.startswith("fixed thc"):
        hhook.register(model, bits=int(method.split(":")[1]))
    elif kind.startswith("auto"):
        state = STATES[kind] = hhook.register(model)  # bits="auto", hhook.register's default
        clock = FakeClock(method)
        state.prober = clock.prober = Prober(clock)
        if "unreduced" in kind:  # an experiment (unsafe: no period reaches the decision once it holds)
            PATCH.append(state.prober)
        if "per-step" in kind:  # as before batching: the periods reduced every iteration
            state.prober.batch = 1
        if "single" in kind:  # one candidate: it holds from the start, no other width ever ran
            state.decision = Decision([method])
    elif kind == "torch-hook fp32":  # the Python floor of a dense exchange: torch's own allreduce_hook
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.allreduce_hook)
    elif kind == "fixed bf16":
        from hhook.profile.train import bf16_gloo_hook

        model.register_comm_hook(None, bf16_gloo_hook)
    return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


GC = {"seconds": 0.0, "runs": 0, "start": 0.0}


def _gc_timer(phase: str, info: dict) -> None:
    if phase == "start":
        GC["start"] = time.perf_counter()
    else:
        GC["seconds"] += time.perf_counter() - GC["start"]
        GC["runs"] += info["generation"] == 2


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
    chosen = sys.argv[2:] or ["thc:4"]
    kinds = []
    for method in chosen:
        kinds += [f"fixed {method}", f"auto held {method}"]
        if method == "fp32":
            kinds.insert(-1, "torch-hook fp32")
        if os.environ.get("UNREDUCED"):
            kinds.append(f"auto unreduced {method}")
        if os.environ.get("PERSTEP"):
            kinds.append(f"auto per-step {method}")
        if os.environ.get("SINGLE"):
            kinds.append(f"auto single {method}")
    if os.environ.get("ONLY"):  # one kind per process (the allocator's state is the process's)
        kinds = [k for k in kinds if k.startswith(os.environ["ONLY"])]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    gen = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)
    jobs = {kind: build(kind) for kind in kinds}
    for kind, (model, opt) in jobs.items():
        steps(model, opt, x, y, 60)  # warm-up; auto: its whole exploration, then the decision
    for prober in PATCH:
        prober.launch = lambda *args, **kwargs: None
    held = {kind: STATES[kind].stats()["decision"] for kind in kinds if kind in STATES}
    profiles = {kind: cProfile.Profile() for kind in kinds} if os.environ.get("HHOOK_PROFILE") else None
    times = {kind: [] for kind in kinds}
    faults = {kind: 0 for kind in kinds}
    cpu = {kind: 0.0 for kind in kinds}
    rounds_of = {kind: [] for kind in kinds}
    collected = {kind: [0.0, 0] for kind in kinds}
    gc.callbacks.append(_gc_timer)
    for _ in range(rounds):
        for kind, (model, opt) in jobs.items():
            if profiles:
                profiles[kind].enable()
            usage = resource.getrusage(resource.RUSAGE_SELF)
            gc_before = (GC["seconds"], GC["runs"])
            turn = steps(model, opt, x, y, STEPS)
            times[kind] += turn
            rounds_of[kind].append(statistics.median(turn))
            after = resource.getrusage(resource.RUSAGE_SELF)
            faults[kind] += after.ru_minflt - usage.ru_minflt
            cpu[kind] += after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime
            collected[kind][0] += GC["seconds"] - gc_before[0]
            collected[kind][1] += GC["runs"] - gc_before[1]
            if profiles:
                profiles[kind].disable()
    if profiles:
        for kind, prof in profiles.items():
            prof.dump_stats(os.path.join(os.environ["HHOOK_PROFILE"],
                                         f"{kind.replace(' ', '_').replace(':', '')}-rank{dist.get_rank()}.pstats"))
    if dist.get_rank() == 0:
        print(f"world {dist.get_world_size()}, wide-cnn, {rounds} rounds of {STEPS} steps per kind, median ms per step")
        for kind, decision in held.items():
            print(f"{kind}: phase {decision['phase']}, holds {decision['method']}")
        for method in chosen:
            base = f"fixed {method}" if f"fixed {method}" in times else kinds[0]
            fixed = statistics.median(times[base])
            for kind in [k for k in kinds if k.endswith(" " + method)]:
                med = statistics.median(times[kind])
                paired = statistics.median(a / b for a, b in zip(rounds_of[kind], rounds_of[base]))
                print(f"{kind:22s} {1e3 * med:8.2f} ms   {med / fixed:5.3f}x fixed   paired {paired:5.3f}x   "
                      f"cpu {1e3 * cpu[kind] / len(times[kind]):6.1f} ms a step   "
                      f"{faults[kind] / len(times[kind]):5.0f} page faults a step   "
                      f"gc {1e3 * collected[kind][0] / len(times[kind]):.2f} ms ({collected[kind][1]} full)")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
