r"""``hhook-profile train``: time real DDP training, one method after another.

Users judge gradient compression by time to accuracy, not by bytes, so this trains a
bundled task (:mod:`hhook.profile.tasks`) with each method on the ranks it was launched
on and reports, per method: median and p90 step time after warm-up, time to a target
test accuracy, final accuracy, bytes per rank and step, and speedups against fp32 and
against the fp16 hook.

A hung collective cannot be cancelled in-process (PyTorch's PowerSGD hook waits inside
its callbacks, which hangs or aborts Gloo with 4 ranks), so every method runs in a
child process:

1. The launched ranks form a small *control* channel of their own (mpi4py under an MPI
   launcher, else a Gloo group from the launcher's variables). They exchange only a few
   objects, between methods.
2. For each method, rank 0 picks a free port and broadcasts it; every rank starts a
   child (``python -m hhook.profile.train SPEC``) that joins a fresh process group on
   that port, trains, and writes its result to a file. The child beats a heartbeat
   file after every step.
3. A parent kills its child when the heartbeat stood still for ``--timeout`` seconds
   (a hang), then waits for the other ranks without spinning and all ranks exchange
   verdicts: any hung rank makes the row "hung", any failed rank "failed" (the
   message of the rank that failed first in its own right), so every rank prints and
   returns the same thing. A hang costs at most ``--timeout`` seconds; the next method
   still runs.

Measurement conventions: a step is the wall time of forward, backward (DDP's hook
futures are waited on inside it) and the optimizer step, on rank 0; the first
``--warmup`` steps are left out of the step statistics (not out of the training clock).
Rank 0 evaluates the test accuracy every ``--eval-every`` steps and after the last
one while the others wait in a barrier; none of that is charged to the training clock
(the sum of the step times), against which time to accuracy is measured. Bytes are those
of the tensors handed to ``torch.distributed`` collectives (as in
``examples/ddp_train.py``); DDP without a hook reduces in C++, so fp32 is charged its
gradients, 4 bytes per parameter per step. THC's count is checked against its
``state.stats()``.

Example::

    torchrun --nproc-per-node 2 -m hhook.profile train --model wide-cnn \
        --methods fp32,fp16,bf16,powersgd,thc:4 --target-accuracy 0.95 --json t.json --plot t.png
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import json
import math
import os
import shutil
import signal
import statistics
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

TESTING_ENV = "HHOOK_PROFILE_TESTING"  # set to 1: the hidden method "_hang" may be selected
KINDS = ("fp32", "fp16", "bf16", "powersgd", "thc")
BASELINE_KINDS = ("sbc", "lgc")  # hhook.baselines (sbc[:p=P][:delay=H], lgc[:k=K][:dense=N][:topk=N][:ae=N])
SCALE_MODES = ("agreed", "predicted")
DEFAULT_METHODS = "fp32,fp16,bf16,powersgd,thc:4"
POLL_S = 0.05
STARTUP_S = 300.0  # allowance until the first step: imports and rendezvous are slow on a loaded machine


# -- methods ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Method:
    """One way of reducing gradients: ``kind`` and its options."""

    name: str
    kind: str
    bits: int | None = None
    scales: str | None = None
    rank: int | None = None  # PowerSGD's matrix approximation rank
    chunk_mb: float | None = None  # THC's piece size (None: hhook's default)
    options: dict | None = dataclasses.field(default=None, compare=False, hash=False)  # sbc/lgc (hhook.baselines)


def parse_methods(text: str, powersgd_rank: int = 2) -> list[Method]:
    r"""``fp32,fp16,bf16,powersgd[:R],thc[:BITS[:agreed|predicted]][:chunk=MB]`` -> methods.

    Raises ValueError naming the bad entry.
    """
    methods: list[Method] = []
    for raw in text.split(","):
        name = raw.strip().lower()
        if not name:
            continue
        kind, *opts = name.split(":")
        if kind == "_hang" and os.environ.get(TESTING_ENV) == "1" and not opts:
            m = Method(name, "_hang")
        elif kind in BASELINE_KINDS:  # SBC and LGC: benchmark baselines, hhook/baselines/
            from ..baselines.harness import parse as _parse_baseline

            bname, bopts = _parse_baseline(raw.strip(), kind, opts)
            m = Method(bname, kind, options=bopts)
        elif kind not in KINDS:
            raise ValueError(f"unknown method {raw.strip()!r} (known: fp32, fp16, bf16, powersgd[:RANK], "
                             f"thc[:BITS[:{'|'.join(SCALE_MODES)}]][:chunk=MB], sbc[:p=P][:delay=H], lgc[:k=K][:dense=N][:topk=N][:ae=N])")
        elif kind in ("fp32", "fp16", "bf16"):
            if opts:
                raise ValueError(f"method {raw.strip()!r}: {kind} takes no options")
            m = Method(name, kind)
        elif kind == "powersgd":
            if len(opts) > 1 or (opts and not opts[0].isdigit()) or (opts and int(opts[0]) < 1):
                raise ValueError(f"method {raw.strip()!r}: expected powersgd or powersgd:RANK with RANK >= 1")
            m = Method(name if opts else f"powersgd:{powersgd_rank}", kind, rank=int(opts[0]) if opts else powersgd_rank)
        else:
            m = _parse_thc(raw.strip(), opts)
        if any(old.name == m.name for old in methods):
            raise ValueError(f"method {m.name!r} is listed twice")
        methods.append(m)
    if not methods:
        raise ValueError("--methods is empty")
    return methods


def _parse_thc(raw: str, opts: list[str]) -> Method:
    """``thc[:BITS[:MODE]][:chunk=MB]`` (MODE and chunk= are passed to hhook as scales= and chunk_mb=)."""
    usage = f"expected thc[:BITS[:MODE]][:chunk=MB] (MODE: {', '.join(SCALE_MODES)})"
    chunk = None
    if opts and opts[-1].startswith("chunk="):
        try:
            chunk = float(opts.pop()[len("chunk="):])
        except ValueError:
            raise ValueError(f"method {raw!r}: chunk= takes a number of megabytes; {usage}") from None
    if len(opts) > 2 or (opts and not opts[0].isdigit()):
        raise ValueError(f"method {raw!r}: {usage}")
    bits = int(opts[0]) if opts else 4
    scales = opts[1] if len(opts) == 2 else None
    if scales is not None and scales not in SCALE_MODES:
        raise ValueError(f"method {raw!r}: unknown scale mode {scales!r} (known: {', '.join(SCALE_MODES)})")
    from ..state import THCState

    try:  # hhook's own checks of bits= and chunk_mb=, before any communication
        THCState(bits=bits, chunk_mb="auto" if chunk is None else chunk)
    except (ValueError, TypeError) as e:
        raise ValueError(f"method {raw!r}: {e}") from None
    name = f"thc:{bits}" + (f":{scales}" if scales else "") + (f":chunk={chunk:g}" if chunk is not None else "")
    return Method(name, "thc", bits=bits, scales=scales, chunk_mb=chunk)


# -- options (checked before any communication, identically on every rank) ------------
def add_parser(sub, common) -> None:
    from .tasks import TASKS

    tr = sub.add_parser(
        "train", help="time real DDP training per method: step time, time to accuracy, bytes",
        description="Train a bundled task on the digits (no download) with each method on the launched "
        "ranks (torchrun, mpirun, ci/netcluster.sh launch|mpirun); per method the median and p90 step time "
        "after warm-up, time to --target-accuracy, final accuracy, bytes per rank and step, and speedups "
        "against fp32 and fp16. Each method runs in child processes, so one that hangs costs --timeout "
        "seconds and is reported as hung.")
    tr.add_argument("--model", default="wide-cnn", metavar="NAME",
                    help="; ".join(f"{t.name}: {t.summary}" for t in TASKS.values()) + " (default wide-cnn)")
    tr.add_argument("--methods", default=DEFAULT_METHODS,
                    help="comma-separated: fp32 (DDP without a hook), fp16, bf16 (compression hooks), "
                    "powersgd[:RANK], thc[:BITS[:agreed|predicted]][:chunk=MB] (passed to hhook as scales= and chunk_mb=), "
                    "baselines sbc[:p=P][:delay=H] and lgc[:k=K][:dense=N][:topk=N][:ae=N] (hhook/baselines; LGC is "
                    "patented, benchmark only; see docs/baselines.md) "
                    f"(default {DEFAULT_METHODS})")
    tr.add_argument("--steps", type=int, default=200, help="training steps per method (default 200)")
    tr.add_argument("--warmup", type=int, default=5, help="first steps left out of the step-time figures (default 5)")
    tr.add_argument("--eval-every", type=int, default=10, metavar="K",
                    help="test accuracy every K steps and after the last (default 10; not charged to the clock)")
    tr.add_argument("--target-accuracy", type=float, default=0.95, metavar="A",
                    help="time to accuracy is the training time until the first evaluation >= A (default 0.95)")
    tr.add_argument("--batch-size", type=int, help="per rank (default: the model's, 32)")
    tr.add_argument("--lr", type=float, help="SGD learning rate, momentum 0.9 (default: the model's)")
    tr.add_argument("--powersgd-rank", type=int, default=2, help="PowerSGD rank for a bare 'powersgd' (default 2)")
    tr.add_argument("--seed", type=int, default=0, help="model initialisation and THC seed (default 0)")
    tr.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                    help="training backend (default gloo; nccl trains on the local GPU)")
    tr.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    tr.add_argument("--timeout", type=float, default=120.0, metavar="S",
                    help="a method whose ranks make no progress for S seconds once training started "
                    f"({STARTUP_S:g} s allowed before the first step) is killed and reported as hung (default 120)")
    tr.add_argument("--strict", action="store_true",
                    help="exit 1 if a method hung or failed, or missed the target accuracy")
    common(tr, comm=False)


def check(args, env) -> dict:
    """The run's configuration; raises ValueError with a line for the user."""
    from .tasks import TASKS

    if args.model not in TASKS:
        raise ValueError(f"unknown model {args.model!r} (known: {', '.join(TASKS)})")
    task = TASKS[args.model]
    methods = parse_methods(args.methods, args.powersgd_rank)
    if args.powersgd_rank < 1:
        raise ValueError(f"--powersgd-rank must be at least 1, got {args.powersgd_rank}")
    if args.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {args.steps}")
    if not 0 <= args.warmup < args.steps:
        raise ValueError(f"--warmup must be in 0..steps-1 (steps {args.steps}), got {args.warmup}")
    if args.eval_every < 1:
        raise ValueError(f"--eval-every must be at least 1, got {args.eval_every}")
    if not 0 < args.target_accuracy <= 1:
        raise ValueError(f"--target-accuracy must be in (0, 1], got {args.target_accuracy:g}")
    batch = task.batch_size if args.batch_size is None else args.batch_size
    if batch < 1:
        raise ValueError(f"--batch-size must be at least 1, got {batch}")
    lr = task.lr if args.lr is None else args.lr
    if not lr > 0:
        raise ValueError(f"--lr must be positive, got {lr:g}")
    if env.world_size < 2:
        raise ValueError("train needs at least 2 ranks (a world of 1 has no communication to measure); "
                         "launch with torchrun --nproc-per-node N, mpirun -np N or ci/netcluster.sh launch N")
    from .tasks import load

    digits = load(0, 1)[:4]
    shard = len(digits[0]) // env.world_size
    if batch > shard:
        raise ValueError(f"--batch-size {batch} exceeds a rank's shard of the training set ({shard} samples)")
    return {"task": task, "methods": methods, "batch_size": batch, "lr": lr, "digits": digits}


# -- the control channel between the launched ranks ------------------------------------------
def _control(timeout_s: float):
    """mpi4py under an MPI launcher (its rendezvous needs no MASTER_ADDR), else a Gloo group."""
    from ..launch import detect_env
    from .comm import MPIComm, TorchComm

    env = detect_env()
    if env.launcher in ("openmpi", "pmi") and importlib.util.find_spec("mpi4py") is not None:
        return MPIComm()
    return TorchComm("gloo", timeout_s)


def _quiet_barrier(control) -> None:
    """A barrier that sleeps while waiting (MPI would spin, stealing the children's cores)."""
    if control.backend == "mpi":
        req = control.comm.Ibarrier()
        while not req.Test():
            time.sleep(POLL_S)
    else:
        control.barrier()


def _master_addr(control) -> str:
    """Where the children's store lives: MASTER_ADDR, else rank 0's address."""
    if "MASTER_ADDR" in os.environ:
        return os.environ["MASTER_ADDR"]
    if control.backend != "mpi":
        return control.env.master_addr
    hosts = control.allgather_object(socket.gethostname())
    if len(set(hosts)) == 1:
        return "127.0.0.1"
    return control.bcast_object(socket.gethostbyname(socket.gethostname()) if control.rank == 0 else None)


# -- one method on one rank: the parent's side ------------------------------------------
def _run_child(spec: dict, workdir: str, timeout_s: float) -> dict:
    """Start the child, watch its heartbeat, return its result (or why there is none)."""
    import hhook

    paths = {k: os.path.join(workdir, f"{k}.{spec['method']['name'].replace(':', '_')}")
             for k in ("spec", "result", "beat", "log")}
    spec = {**spec, "result_path": paths["result"], "beat_path": paths["beat"]}
    with open(paths["spec"], "w") as f:
        json.dump(spec, f)
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(hhook.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    env["OMP_NUM_THREADS"] = str(spec["threads"])
    started = time.monotonic()
    with open(paths["log"], "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "hhook.profile.train", paths["spec"]],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
        last_beat, last_change, hung = None, time.monotonic(), False
        while proc.poll() is None:
            time.sleep(POLL_S)
            try:
                with open(paths["beat"]) as f:
                    beat = f.read().strip()
            except OSError:
                beat = None
            now = time.monotonic()
            if beat != last_beat:
                last_beat, last_change = beat, now
            elif now - last_change > (timeout_s if (beat or "").startswith("step") else max(timeout_s, STARTUP_S)):
                hung = True
                proc.kill()
                proc.wait()
                break
    wall = time.monotonic() - started
    if hung:
        waited = timeout_s if (last_beat or "").startswith("step") else max(timeout_s, STARTUP_S)
        return {"status": "hung", "message": f"no progress for {waited:g} s after {last_beat or 'start'}",
                "wall_s": wall}
    try:
        with open(paths["result"]) as f:
            result = json.load(f)
    except (OSError, ValueError):
        with open(paths["log"]) as f:
            lines = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
        code = proc.returncode
        ended = f"killed by signal {_signal_name(-code)}" if code < 0 else f"exited with status {code}"
        result = {"status": "failed", "message": f"child {ended}" + (f": {lines[-1]}" if lines else "")}
    result["wall_s"] = wall
    if result["status"] != "ok" and os.environ.get("HHOOK_DEBUG"):
        with open(paths["log"]) as f:
            sys.stderr.write(f.read())
    return result


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _verdict(results: list[dict]) -> tuple[str, str]:
    """One status and message for the row, the same on every rank."""
    statuses = [r["status"] for r in results]
    if all(s == "ok" for s in statuses):
        return "ok", ""
    if "hung" in statuses:
        ranks = [i for i, s in enumerate(statuses) if s == "hung"]
        return "hung", f"hung (timeout): {results[ranks[0]]['message']} on rank{'s' if len(ranks) > 1 else ''} " \
                       f"{','.join(map(str, ranks))}"
    failed = [(i, r) for i, r in enumerate(results) if r["status"] != "ok"]
    # A rank whose peer died reports a connection error: prefer the rank that failed on its own.
    own = [(i, r) for i, r in failed if not _peer_error(r.get("message", ""))] or failed
    i, r = own[0]
    return "failed", f"failed on rank {i}: {r.get('message', '')}"


def _peer_error(message: str) -> bool:
    text = message.lower()
    return any(w in text for w in ("connection closed", "connection reset", "broken pipe", "peer", "timed out"))


# -- the child: one rank of one method ----------------------------------------------------
def _hang_hook(state, bucket):
    """Test-only: a hook whose future never completes from the third step on, as a hung collective."""
    import torch
    import torch.distributed as dist

    state["iter"] += bucket.is_last()
    if state["iter"] <= 2:
        return dist.all_reduce(bucket.buffer().div_(dist.get_world_size()), async_op=True).get_future().then(
            lambda f: f.value()[0])
    return torch.futures.Future()


def bf16_gloo_hook(process_group, bucket):
    r"""torch's ``bf16_compress_hook`` for Gloo: DDP refuses torch's own without CUDA and NCCL
    2.10+, though Gloo sums bfloat16. Same steps: cast, divide by the world size, SUM, copy back."""
    import torch
    import torch.distributed as dist

    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(group.size())

    def decompress(fut):
        return buffer.copy_(fut.value()[0])

    return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)


def _attach(method: dict, ddp, seed: int):
    """Register the method's hook on ``ddp``; the THC state or None."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    import hhook

    kind = method["kind"]
    if kind == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif kind == "bf16":
        hook = default_hooks.bf16_compress_hook if dist.get_backend() == "nccl" else bf16_gloo_hook
        ddp.register_comm_hook(None, hook)
    elif kind == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=method["rank"],
                                            start_powerSGD_iter=2, random_seed=seed)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif kind == "thc":
        options = {"bits": method["bits"], "seed": seed}
        if method["scales"] is not None:
            options["scales"] = method["scales"]
        if method.get("chunk_mb") is not None:
            options["chunk_mb"] = method["chunk_mb"]
        return hhook.register(ddp, **options)
    elif kind == "_hang":
        ddp.register_comm_hook({"iter": 0}, _hang_hook)
    return None


def _watch_parent() -> None:
    """End this child if its parent dies (a killed launcher must not leave a hung child)."""
    parent = os.getppid()

    def watch():
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def worker(spec: dict) -> dict:
    r"""Train one method on one rank; the result dict the parent reads.

    1. Join a fresh process group through a TCPStore on rank 0 at the port it was given.
    2. Build the same model on every rank (seeded), wrap it in DDP, attach the method.
    3. Time each step; beat the heartbeat; evaluate on rank 0 every K steps with the
       clock stopped, the other ranks waiting in a barrier.
    """
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .counting import collective_bytes
    from .tasks import TASKS, batches, shard

    rank, world = spec["rank"], spec["world_size"]
    beat_fd = os.open(spec["beat_path"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def beat(text: str) -> None:
        data = text.encode().ljust(32)
        os.pwrite(beat_fd, data, 0)  # fixed width: no truncation, the parent never reads half a beat

    beat("starting")
    torch.set_num_threads(spec["threads"])
    task = TASKS[spec["task"]]
    x_train, y_train, x_test, y_test = torch.load(spec["data_path"])  # the parent's split: no sklearn import here
    data = (x_train, y_train, x_test, y_test, shard(len(x_train), rank, world))
    beat("data loaded")
    timeout = datetime.timedelta(seconds=spec["pg_timeout_s"])
    store = dist.TCPStore(spec["master_addr"], spec["port"], world, is_master=rank == 0, timeout=timeout)
    dist.init_process_group(spec["backend"], store=store, rank=rank, world_size=world, timeout=timeout)
    beat("process group")
    device = torch.device("cpu")
    if spec["backend"] == "nccl":
        device = torch.device("cuda", spec["local_rank"] % torch.cuda.device_count())
        torch.cuda.set_device(device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    x_train, y_train, x_test, y_test, mine = (t.to(device) for t in data)
    mine = mine.cpu()
    torch.manual_seed(spec["seed"])
    model = task.build().to(device)
    n_params = sum(p.numel() for p in model.parameters())
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    method = spec["method"]
    state = _attach(method, ddp, spec["seed"])
    beat("model")
    opt = torch.optim.SGD(ddp.parameters(), lr=spec["lr"], momentum=0.9)
    baseline = None
    if method["kind"] in BASELINE_KINDS:  # no_sync steps, the baseline's own exchange
        from ..baselines.harness import Runner

        baseline = Runner(method["kind"], method["options"], ddp, opt, spec["seed"])

    def evaluate() -> float:
        with torch.no_grad():
            return (model(x_test).argmax(1) == y_test).float().mean().item()

    step_s, step_bytes, evals = [], [], []
    counter = {"bytes": 0}
    clock = 0.0
    beat("step 0")
    with collective_bytes(counter):
        for step, idx in enumerate(batches(mine, spec["batch_size"], None), start=1):
            before = counter["bytes"]
            sync()
            t0 = time.perf_counter()
            if baseline is not None:
                loss = baseline.step(lambda: F.cross_entropy(ddp(x_train[idx]), y_train[idx]))
            else:
                opt.zero_grad()
                loss = F.cross_entropy(ddp(x_train[idx]), y_train[idx])
                loss.backward()
                opt.step()
            sync()
            dt = time.perf_counter() - t0
            clock += dt
            step_s.append(dt)
            step_bytes.append(counter["bytes"] - before)
            beat(f"step {step}")
            if step % spec["eval_every"] == 0 or step == spec["steps"]:
                if rank == 0:
                    evals.append({"step": step, "time_s": clock, "accuracy": evaluate(), "loss": loss.item()})
                dist.barrier()
            if step == spec["steps"]:
                break
    if method["kind"] == "fp32":
        step_bytes = [4 * n_params] * len(step_s)  # DDP reduces in C++, past the Python collectives
    result = {"status": "ok", "rank": rank, "params": n_params, "step_s": step_s, "step_bytes": step_bytes,
              "bytes_counted": method["kind"] != "fp32", "evals": evals, "train_s": clock,
              "final_accuracy": evals[-1]["accuracy"] if evals else None, "final_loss": loss.item()}
    if baseline is not None:
        result["baseline_stats"] = baseline.stats()
        if baseline.step_bytes != step_bytes:  # the counter misses broadcasts (LGC's mask): the method's own count
            result["baseline_stats"]["counter_bytes"] = sum(step_bytes)
            result["step_bytes"] = step_bytes = list(baseline.step_bytes)
    if state is not None:
        stats = state.stats()
        result["thc_stats"] = stats
        if stats["wire_bytes"] != sum(step_bytes):
            result["bytes_mismatch"] = f"counted {sum(step_bytes)} B, THC stats say {stats['wire_bytes']} B"
    dist.barrier()  # destroying the group under a peer still talking aborts Gloo at random
    dist.destroy_process_group()
    return result


def _worker_main(spec_path: str) -> int:
    with open(spec_path) as f:
        spec = json.load(f)
    _watch_parent()
    try:
        result = worker(spec)
        code = 0
    except Exception as e:  # noqa: BLE001 - the parent reports one line; the log keeps the traceback
        traceback.print_exc()
        result = {"status": "failed", "message": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        code = 1
    tmp = spec["result_path"] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, spec["result_path"])
    sys.stdout.flush()
    os._exit(code)  # skip interpreter teardown: a failed process group may hang in its destructor


# -- summaries, table, plot ---------------------------------------------------------------
def _percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0.5: median, 0.9: p90), interpolated between order statistics."""
    if len(values) < 2:
        return values[0] if values else math.nan
    return statistics.quantiles(values, n=10, method="inclusive")[round(q * 10) - 1]


def summarize(method: Method, status: str, message: str, results: list[dict], warmup: int, target: float) -> dict:
    """The row of ``method``: figures from rank 0's timings and evaluations."""
    row = {"method": method.name, "kind": method.kind, "bits": method.bits, "scales": method.scales,
           "powersgd_rank": method.rank, "status": status, "message": message,
           "wall_s": max((r.get("wall_s", 0.0) for r in results), default=None)}
    if status != "ok":
        return row
    r0 = results[0]
    timed = r0["step_s"][warmup:]
    reached = next((e for e in r0["evals"] if e["accuracy"] >= target), None)
    per_rank_bytes = [sum(r["step_bytes"][warmup:]) / len(r["step_bytes"][warmup:]) for r in results]
    row.update(
        params=r0["params"], steps=len(r0["step_s"]), warmup=warmup,
        median_ms=_percentile(timed, 0.5) * 1e3, p90_ms=_percentile(timed, 0.9) * 1e3,
        mean_ms=sum(timed) / len(timed) * 1e3, train_s=r0["train_s"],
        bytes_per_step=per_rank_bytes[0], bytes_per_step_per_rank=per_rank_bytes,
        bytes_counted=r0["bytes_counted"], target_accuracy=target,
        time_to_target_s=reached["time_s"] if reached else None, step_to_target=reached["step"] if reached else None,
        final_accuracy=r0["final_accuracy"], final_loss=r0["final_loss"],
        step_ms=[t * 1e3 for t in r0["step_s"]], step_ms_per_rank=[[t * 1e3 for t in r["step_s"]] for r in results],
        evals=r0["evals"], thc_stats=[r.get("thc_stats") for r in results] if "thc_stats" in r0 else None,
        baseline_stats=[r.get("baseline_stats") for r in results] if "baseline_stats" in r0 else None,
        bytes_mismatch=[r["bytes_mismatch"] for r in results if "bytes_mismatch" in r] or None,
    )
    return row


def add_speedups(rows: list[dict]) -> None:
    """Speedups against fp32 and fp16, from the median step and from time to accuracy."""
    ok = {r["kind"]: r for r in rows if r["status"] == "ok" and r["kind"] in ("fp32", "fp16")}
    for r in rows:
        for ref in ("fp32", "fp16"):
            base = ok.get(ref)
            good = r["status"] == "ok" and base is not None
            r[f"speedup_vs_{ref}"] = base["median_ms"] / r["median_ms"] if good else None
            both = good and base["time_to_target_s"] is not None and r["time_to_target_s"] is not None
            r[f"tta_speedup_vs_{ref}"] = base["time_to_target_s"] / r["time_to_target_s"] if both else None


def _x(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def table(rows: list[dict], target: float) -> str:
    """One line per method, about 110 columns; a method that did not run says why."""
    from .report import Column, sig
    from .report import table as fixed_table

    pct = f"{target * 100:g}%"
    cols = [
        Column("", "method".ljust(15), 16, lambda r: r["method"].ljust(16)),
        Column("step ms", "median", 8, lambda r: sig(r["median_ms"], 4)),
        Column("step ms", "p90", 8, lambda r: sig(r["p90_ms"], 4)),
        Column("", "MB/rank/step", 12, lambda r: sig(r["bytes_per_step"] / 1e6, 4)),
        Column("", f"s to {pct}", 9, lambda r: "not reached" if r["time_to_target_s"] is None
               else f"{r['time_to_target_s']:.2f}"),
        Column("", "final acc", 9, lambda r: f"{r['final_accuracy']:.4f}"),
        Column("speedup (step)", "vs fp32", 7, lambda r: _x(r["speedup_vs_fp32"])),
        Column("speedup (step)", "vs fp16", 7, lambda r: _x(r["speedup_vs_fp16"])),
        Column("speedup (to acc)", "vs fp32", 7, lambda r: _x(r["tta_speedup_vs_fp32"])),
        Column("speedup (to acc)", "vs fp16", 7, lambda r: _x(r["tta_speedup_vs_fp16"])),
    ]
    lines = fixed_table(cols, [r for r in rows if r["status"] == "ok"]).splitlines()
    head, body = lines[:2], iter(lines[2:])
    out = list(head)
    for r in rows:
        message = r["message"] if len(r["message"]) <= 100 else r["message"][:97] + "..."  # whole in --json
        out.append(next(body) if r["status"] == "ok" else f"{r['method']:<16s}  {message}")
    return "\n".join(out)


def footer(rows: list[dict], args) -> list[str]:
    lines = [f"# step = forward + backward + optimizer step on rank 0, median and p90 after {args.warmup} "
             f"warm-up steps; s to {args.target_accuracy * 100:g}% = training time (eval excluded) until the "
             f"first evaluation (every {args.eval_every} steps) reaching it"]
    lines.append("# MB/rank/step: tensors handed to torch.distributed collectives (fp32: 4 B per parameter, "
                 "reduced in C++)")
    for r in rows:
        if r.get("bytes_mismatch"):
            lines.append(f"# WARNING {r['method']}: bytes counted disagree with THC's stats: {r['bytes_mismatch'][0]}")
    missed = [r["method"] for r in rows if r["status"] == "ok" and r["time_to_target_s"] is None]
    if missed:
        lines.append(f"# target accuracy {args.target_accuracy:g} not reached in {args.steps} steps by: "
                     f"{', '.join(missed)}")
    return lines


def accuracy_panel(ax, rows: list[dict], target: float) -> None:
    """Test accuracy against training wall-clock time, one line per method."""
    from .plot import method_color

    for i, r in enumerate(r for r in rows if r["status"] == "ok"):
        ax.plot([0.0] + [e["time_s"] for e in r["evals"]], [None] + [e["accuracy"] for e in r["evals"]], "o-",
                ms=3, color=method_color(r["method"]), label=r["method"])
    ax.axhline(target, color="gray", ls=":", label=f"target {target:g}")
    ax.set_xlabel("training time, s (evaluation excluded)")
    ax.set_ylabel("test accuracy")
    ax.set_title("time to accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def step_panel(ax, rows: list[dict]) -> None:
    """Median step time per method, with the p90 as a whisker."""
    from .plot import method_color

    ok = [r for r in rows if r["status"] == "ok"]
    xs = range(len(ok))
    ax.bar(xs, [r["median_ms"] for r in ok], color=[method_color(r["method"]) for r in ok],
           yerr=[[0] * len(ok), [r["p90_ms"] - r["median_ms"] for r in ok]], capsize=3)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r["method"] for r in ok], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("ms per step (median, whisker to p90)")
    ax.set_title("step time")
    ax.grid(axis="y", alpha=0.3)


# -- the subcommand -------------------------------------------------------------------------
def run(args, cfg) -> int:
    """``hhook-profile train``: every rank runs this; returns the exit status."""
    from ..launch import free_port
    from . import plot, report
    from .common import EXIT_FAILURE, EXIT_USAGE, UsageError, _check_outputs, _error, _options, _say

    try:
        control = _control(max(3600.0, 10 * args.timeout))
    except Exception as e:  # noqa: BLE001
        _error(f"cannot connect the launched ranks: {type(e).__name__}: {e}", True)
        return EXIT_FAILURE
    rank0 = control.rank == 0
    workdir = tempfile.mkdtemp(prefix=f"hhook-train-r{control.rank}-")
    data_path = os.path.join(workdir, "digits.pt")
    try:
        import torch

        torch.save(cfg["digits"], data_path)
        problem = control.bcast_object(_check_outputs(args) if rank0 else None)
        if problem:
            raise UsageError(problem)
        hosts = control.allgather_object({**control.host_info(), "torch_threads": args.threads})
        master_addr = _master_addr(control)
        options = {**_options(args), "batch_size": cfg["batch_size"], "lr": cfg["lr"]}
        options.pop("env", None)
        m = report.meta("train", control, hosts, options)
        task, methods = cfg["task"], cfg["methods"]
        if rank0:
            _say(report.header(m))
            _say(f"# command: hhook-profile {' '.join(sys.argv[1:])}")
            _say(f"# model {task.name}: {task.summary}; digits, batch {cfg['batch_size']} per rank, SGD lr "
                 f"{cfg['lr']:g} momentum 0.9, {args.steps} steps, {args.backend}, {args.threads} thread(s) per rank")
            _say(f"# methods run one at a time in child processes (rendezvous {master_addr}); "
                 f"a method without progress for {args.timeout:g} s is killed")
        rows = []
        for method in methods:
            port = control.bcast_object(free_port() if rank0 else None)
            spec = {"method": dataclasses.asdict(method), "rank": control.rank, "world_size": control.size,
                    "local_rank": getattr(getattr(control, "env", None), "local_rank", 0),
                    "master_addr": master_addr, "port": port, "backend": args.backend,
                    "threads": args.threads, "seed": args.seed, "task": task.name, "lr": cfg["lr"],
                    "batch_size": cfg["batch_size"], "steps": args.steps, "eval_every": args.eval_every,
                    "pg_timeout_s": args.timeout, "data_path": data_path}
            mine = _run_child(spec, workdir, args.timeout)
            _quiet_barrier(control)
            results = control.allgather_object(mine)
            status, message = _verdict(results)
            row = summarize(method, status, message, results, args.warmup, args.target_accuracy)
            rows.append(row)
            if rank0 and not args.quiet:
                done = (f"median {row['median_ms']:.1f} ms/step, final accuracy {row['final_accuracy']:.4f}"
                        if status == "ok" else message)
                print(f"# {method.name}: {done}", file=sys.stderr, flush=True)
        add_speedups(rows)
        if rank0:
            _say(table(rows, args.target_accuracy))
            for line in footer(rows, args):
                _say(line)
            if args.json:
                report.write_json(args.json, m, rows)
            if args.plot:
                plot.save(args.plot, [lambda ax: accuracy_panel(ax, rows, args.target_accuracy),
                                      lambda ax: step_panel(ax, rows)])
        control.barrier()
    except UsageError as e:
        _error(str(e), rank0)
        control.finalize()
        return EXIT_USAGE
    except BaseException:  # noqa: BLE001 - never leave other ranks waiting
        sys.stderr.write(f"hhook-profile: rank {control.rank} failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        control.abort(EXIT_FAILURE)
        return EXIT_FAILURE
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    control.finalize()
    bad = [r for r in rows if r["status"] != "ok" or r.get("time_to_target_s") is None]
    return EXIT_FAILURE if args.strict and bad else 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if len(sys.argv) != 2:
        sys.exit("usage: python -m hhook.profile.train SPEC.json (started by hhook-profile train)")
    _worker_main(sys.argv[1])
