r"""A child of ``hhook-profile train`` (:mod:`hhook.profile.train`): one rank of one
method, trained and timed step by step, its result written for the parent."""

from __future__ import annotations

import datetime
import json
import os
import signal
import sys
import threading
import time
import traceback

from ..baselines.harness import KINDS as BASELINE_KINDS
from .train import ATTACH, STARTUP_S, attach_diloco, attach_fsdp, diloco_sync


def _split_bytes(state) -> tuple[int, int] | None:
    """A THC state's bytes so far inside and between nodes (0 until it is two-level); None without one."""
    if state is None:
        return None
    stats = state.stats()
    return stats.get("intra_wire_bytes", 0), stats.get("inter_wire_bytes", 0)


def watch_parent() -> None:
    """End this child if its parent dies (a killed launcher must not leave a hung child)."""
    parent = os.getppid()

    def watch():
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def _join(spec: dict, beat):
    """Load the parent's data split, join the process group, pick the device: ``(device,
    data)`` with data ``(x_train, y_train, x_test, y_test, this rank's indices)``."""
    import torch
    import torch.distributed as dist

    from .tasks import shard

    rank, world = spec["rank"], spec["world_size"]
    torch.set_num_threads(spec["threads"])
    x_train, y_train, x_test, y_test = torch.load(spec["data_path"])  # the parent's split: no sklearn import here
    data = (x_train, y_train, x_test, y_test, shard(len(x_train), rank, world))
    beat("data loaded")
    timeout = datetime.timedelta(seconds=spec["pg_timeout_s"])
    # The ranks meet within the start-up allowance, not the collectives' timeout: on a loaded
    # host a rank's imports can outlast the latter (a GPU-check dry run beside the test suite:
    # rank 0 gave up after 21 s with 1 of 2 ranks joined).
    joined = max(timeout, datetime.timedelta(seconds=STARTUP_S))
    store = dist.TCPStore(spec["master_addr"], spec["port"], world, is_master=rank == 0, timeout=joined)
    dist.init_process_group(spec["backend"], store=store, rank=rank, world_size=world, timeout=timeout)
    beat("process group")
    device = torch.device("cpu")
    if spec.get("device", "cuda" if spec["backend"] == "nccl" else "cpu") == "cuda":
        device = torch.device("cuda", spec["local_rank"] % torch.cuda.device_count())
        torch.cuda.set_device(device)
    return device, data


def _thc_stats(result: dict, stats: dict, spec: dict, step_bytes: list, kinds: dict, split: dict) -> None:
    """The THC state's stats into ``result``, and where they disagree with the bytes the
    collectives counted, ``bytes_mismatch``."""
    fsdp = spec.get("parallel", "ddp") in ("fsdp", "hsdp")
    result["thc_stats"] = stats
    if "inter_wire_bytes" in stats:  # two-level: the counter cannot tell the node's shared memory apart
        result["step_intra_bytes"], result["step_inter_bytes"] = split["intra"], split["inter"]
        if stats["inter_wire_bytes"] > sum(step_bytes):
            result["bytes_mismatch"] = (f"counted {sum(step_bytes)} B, fewer than the {stats['inter_wire_bytes']} B "
                                        "THC stats say crossed nodes")
    elif spec.get("parallel") == "hsdp":
        pass  # the replica allreduce's bytes are in the second state's stats: no single count to compare
    elif fsdp:  # THC's stats: its reduce-scatters, MAX rounds and handshakes; not FSDP's all-gathers
        counted = sum(step_bytes) - sum(kinds["all_gather"])
        if stats["wire_bytes"] != counted:
            result["bytes_mismatch"] = f"counted {counted} B besides all-gathers, THC stats say {stats['wire_bytes']} B"
    elif stats.get("decision", {}).get("phase") == "not measured":
        pass  # no hook: DDP reduced in C++, past THC's stats
    elif stats["wire_bytes"] != sum(step_bytes):
        result["bytes_mismatch"] = f"counted {sum(step_bytes)} B, THC stats say {stats['wire_bytes']} B"


def _peak_rss_mb() -> float:
    """This child's peak resident memory so far, MiB (one child per method and rank)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


_KEPT: list = []  # each method's model and states, never freed (worker)


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
    from .tasks import TASKS, batches

    rank = spec["rank"]
    task = TASKS[spec["task"]]
    beat_fd = os.open(spec["beat_path"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)

    def beat(text: str) -> None:
        data = text.encode().ljust(32)
        os.pwrite(beat_fd, data, 0)  # fixed width: no truncation, the parent never reads half a beat

    beat("starting")
    device, data = _join(spec, beat)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    x_train, y_train, x_test, y_test, mine = (t.to(device) for t in data)
    mine = mine.cpu()
    torch.manual_seed(spec["seed"])
    model = task.build().to(device)
    n_params = sum(p.numel() for p in model.parameters())
    method = spec["method"]
    fsdp = spec.get("parallel", "ddp") in ("fsdp", "hsdp")
    if fsdp:  # the FSDPModule is the model itself: its forward all-gathers, its backward reduce-scatters
        state = attach_fsdp(method, model, spec["seed"], device, hsdp=spec.get("parallel") == "hsdp",
                            ranks_per_node=spec.get("ranks_per_node"))
        ddp = model
    elif method["kind"] == "diloco":  # DDP inside each site (sites of one rank: the model alone)
        sites, ddp = attach_diloco(model, spec.get("ranks_per_node"))
        state = None
    else:
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        state = ATTACH[method["kind"]](method, ddp, spec["seed"])
    if hasattr(state, "reset_stats"):
        state.reset_stats()  # the steps' bytes, as counted below: not the options handshake of registration
    beat("model")
    opt = torch.optim.SGD(ddp.parameters(), lr=spec["lr"], momentum=0.9)
    outer = diloco_sync(method, ddp, opt, sites, spec["seed"]) if method["kind"] == "diloco" else None
    flight = {"in_flight": [], "sync": [], "inter": []}  # diloco: per step, exchanges running, a launch or merge
    baseline = None
    if method["kind"] in BASELINE_KINDS:  # no_sync steps, the baseline's own exchange
        from ..baselines.harness import Runner

        baseline = Runner(method["kind"], method["options"], ddp, opt, spec["seed"])

    def loss_of(out, y):  # classes on the last dimension: digits (B, 10), gpt (B, T, 256)
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    val_losses = []

    def evaluate() -> float:
        """Test accuracy (gpt: next-byte accuracy); the test loss goes to ``val_losses``."""
        with torch.no_grad():
            out = model(x_test)
            val_losses.append(loss_of(out, y_test).item())
            return (out.argmax(-1) == y_test).float().mean().item()

    step_s, step_bytes, evals = [], [], []
    split = {"intra": [], "inter": []}  # two-level THC: each step's bytes inside and between nodes (its stats)
    kinds = {"reduce_scatter": [], "all_gather": []}  # FSDP2: each step's reduce-scatter and all-gather bytes
    counter = {"bytes": 0, "reduce_scatter": 0, "all_gather": 0}
    clock = 0.0
    setup_rss_mb = _peak_rss_mb()  # the model, its shards and the data, before the first step
    beat("step 0")
    with collective_bytes(counter):
        for step, idx in enumerate(batches(mine, spec["batch_size"], None), start=1):
            before = counter["bytes"]
            kinds_before = {k: counter[k] for k in kinds}
            split_before = _split_bytes(state)
            if outer is not None:
                outer_before = (outer.syncs, sorted(outer.pending), outer.stats()["wire_bytes"])
            sync()
            t0 = time.perf_counter()
            if baseline is not None:
                loss = baseline.step(lambda: loss_of(ddp(x_train[idx]), y_train[idx]))
            else:
                opt.zero_grad()
                loss = loss_of(ddp(x_train[idx]), y_train[idx])
                loss.backward()
                opt.step()
                if outer is not None:
                    outer.step()
            sync()
            dt = time.perf_counter() - t0
            clock += dt
            step_s.append(dt)
            step_bytes.append(counter["bytes"] - before)
            for k in kinds:
                kinds[k].append(counter[k] - kinds_before[k])
            if state is not None:
                for where, after, then in zip(("intra", "inter"), _split_bytes(state), split_before):
                    split[where].append(after - then)
            if outer is not None:
                flight["in_flight"].append(len(outer_before[1]))
                flight["sync"].append((outer.syncs, sorted(outer.pending)) != outer_before[:2])
                flight["inter"].append(outer.stats()["wire_bytes"] - outer_before[2])
            beat(f"step {step}")
            if step % spec["eval_every"] == 0 or step == spec["steps"]:
                if fsdp:  # every rank takes part in the forward's all-gathers; rank 0 records
                    accuracy = evaluate()
                    if rank == 0:
                        evals.append({"step": step, "time_s": clock, "accuracy": accuracy, "loss": loss.item(),
                                      "val_loss": val_losses[-1]})
                elif rank == 0:
                    accuracy = evaluate()
                    evals.append({"step": step, "time_s": clock, "accuracy": accuracy, "loss": loss.item(),
                                  "val_loss": val_losses[-1]})
                dist.barrier()
            if step == spec["steps"]:
                break
    # bits="auto" on one host with CPU tensors installs no hook (hhook.decision.hook.one_host): plain DDP
    native = method["kind"] == "fp32" or (state is not None and not fsdp
                                          and state.stats().get("decision", {}).get("phase") == "not measured")
    if native and not fsdp:
        step_bytes = [4 * n_params] * len(step_s)  # DDP reduces in C++, past the Python collectives
    result = {"status": "ok", "rank": rank, "params": n_params, "step_s": step_s, "step_bytes": step_bytes,
              "bytes_counted": fsdp or not native, "evals": evals, "train_s": clock,
              "final_accuracy": evals[-1]["accuracy"] if evals else None, "final_loss": loss.item(),
              "final_val_loss": evals[-1]["val_loss"] if evals else None}
    if fsdp:
        import hhook.fsdp

        result["step_rs_bytes"], result["step_ag_bytes"] = kinds["reduce_scatter"], kinds["all_gather"]
        result["all_gather_stats"] = hhook.fsdp.all_gather_stats(model)  # ag=BITS; evaluations included
    result["setup_rss_mb"], result["peak_rss_mb"] = setup_rss_mb, _peak_rss_mb()
    if device.type == "cuda":
        result["peak_cuda_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
    if baseline is not None:
        result["baseline_stats"] = baseline.stats()
        if baseline.step_bytes != step_bytes:  # the counter misses broadcasts (LGC's mask): the method's own count
            result["baseline_stats"]["counter_bytes"] = sum(step_bytes)
            result["step_bytes"] = step_bytes = list(baseline.step_bytes)
    if state is not None:
        _thc_stats(result, state.stats(), spec, step_bytes, kinds, split)
    if outer is not None:
        outer.wait()
        result["diloco_stats"] = outer.stats()
        result["step_in_flight"], result["step_sync"] = flight["in_flight"], flight["sync"]
        result["step_outer_bytes"] = flight["inter"]  # handed to collectives between sites
    dist.barrier()  # destroying the group under a peer still talking aborts Gloo at random
    # Kept until this process's os._exit: the DDP reducer (or FSDP module) holds the group, and
    # freeing it from Python would run Gloo's destructor with the GIL held, joining its worker
    # threads while one may still be releasing a finished work's Python thread-local state
    # (which needs the GIL): a deadlock seen in the GPU check's dry run (2026-12-03, plain fp32 DDP).
    _KEPT.extend((ddp, state, outer))
    dist.destroy_process_group()
    return result


def child_main(spec_path: str) -> None:
    """The child: train the method of the spec file, write the result file, exit."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    with open(spec_path) as f:
        spec = json.load(f)
    watch_parent()
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


