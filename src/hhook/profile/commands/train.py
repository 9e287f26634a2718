r"""``hhook-profile train``: time real DDP training, one method after another.

Users judge gradient compression by time to accuracy, not by bytes, so this trains a
bundled task (:mod:`hhook.profile.tasks`) with each method on the ranks it was launched
on and reports, per method: median and p90 step time after warm-up, time to a target
test accuracy, final accuracy, bytes per rank and step, and speedups against fp32 and
against the fp16 hook. How each method runs (child processes, heartbeats, verdicts) and
the measurement conventions are :mod:`hhook.profile.train`'s.

Example::

    torchrun --nproc-per-node 2 -m hhook.profile train --model wide-cnn \
        --methods fp32,fp16,bf16,powersgd,thc:4 --target-accuracy 0.95 --json t.json --plot t.png
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
import statistics
import sys
import tempfile
import traceback

from .. import train
from ..common import EXIT_FAILURE, EXIT_USAGE, UsageError, add_output_options, check_backend, check_outputs, device_of, \
    error, integer, number, options, say, set_threads
from ..methods import Method


def _task_name(text: str) -> str:
    from ..tasks import TASKS

    if text not in TASKS:
        raise argparse.ArgumentTypeError(f"unknown model {text!r} (known: {', '.join(TASKS)})")
    return text


# -- options (checked before any communication, identically on every rank) ------------
def add_parser(sub) -> None:
    from ..tasks import TASKS

    tr = sub.add_parser(
        "train", help="time real DDP training per method: step time, time to accuracy, bytes",
        description="Train a bundled task on the digits (no download) with each method on the launched "
        "ranks (torchrun, mpirun, ci/netcluster.sh launch|mpirun); per method the median and p90 step time "
        "after warm-up, time to --target-accuracy, final accuracy, bytes per rank and step, and speedups "
        "against fp32 and fp16. Each method runs in child processes, so one that hangs costs --timeout "
        "seconds and is reported as hung.")
    tr.add_argument("--model", type=_task_name, default="wide-cnn", metavar="NAME",
                    help="; ".join(f"{t.name}: {t.summary}" for t in TASKS.values()) + " (default wide-cnn)")
    tr.add_argument("--methods", default=train.DEFAULT_METHODS,
                    help="comma-separated: fp32 (DDP without a hook), fp16, bf16 (compression hooks), "
                    "powersgd[:RANK], thc[:BITS[:agreed|predicted|gathered|auto]][:chunk=MB][:topology=flat|auto|K] "
                    "(passed to hhook "
                    "as scales=, chunk_mb= and topology=; K ranks per node), "
                    "baselines sbc[:p=P][:delay=H] and lgc[:k=K][:dense=N][:topk=N][:ae=N] (hhook/baselines; LGC is "
                    "patented, benchmark only; see docs/baselines.md); with --parallel fsdp/hsdp, fp32, bf16 and thc "
                    "take :ag=BITS (hhook's compressed parameter all-gather, 2..8 bits) or :ag=bf16 (bfloat16 "
                    "parameters, MixedPrecisionPolicy(param_dtype=torch.bfloat16)) and :params=bf16 (bfloat16 parameters "
                    "for compute; with :ag=BITS quantized from them) "
                    f"(default {train.DEFAULT_METHODS})")
    tr.add_argument("--steps", type=integer(1), default=200, help="training steps per method (default 200)")
    tr.add_argument("--warmup", type=integer(0), default=5,
                    help="first steps left out of the step-time figures (default 5)")
    tr.add_argument("--eval-every", type=integer(1), default=10, metavar="K",
                    help="test accuracy every K steps and after the last (default 10; not charged to the clock)")
    tr.add_argument("--target-accuracy", type=number(0, hi=1), default=0.95, metavar="A",
                    help="time to accuracy is the training time until the first evaluation >= A (default 0.95)")
    tr.add_argument("--batch-size", type=integer(1), help="per rank (default: the model's, 32)")
    tr.add_argument("--lr", type=number(0), help="SGD learning rate, momentum 0.9 (default: the model's)")
    tr.add_argument("--powersgd-rank", type=integer(1), default=2,
                    help="PowerSGD rank for a bare 'powersgd' (default 2)")
    tr.add_argument("--seed", type=int, default=0, help="model initialisation and THC seed (default 0)")
    tr.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                    help="training backend (default gloo; nccl trains on the local GPU)")
    tr.add_argument("--device", choices=("cpu", "cuda"), default=None,
                    help="where the model trains (default: cuda with nccl, else cpu); cuda with gloo puts "
                    "every rank of a node on its local GPU (LOCAL_RANK modulo the GPUs), so ranks may share one")
    tr.add_argument("--threads", type=integer(1), default=1, help="torch threads per rank (default 1)")
    tr.add_argument("--timeout", type=number(0), default=120.0, metavar="S",
                    help="a method whose ranks make no progress for S seconds once training started "
                    f"({train.STARTUP_S:g} s allowed before the first step) is killed and reported as hung "
                    "(default 120)")
    tr.add_argument("--strict", action="store_true",
                    help="exit 1 if a method hung or failed, or missed the target accuracy")
    tr.add_argument("--parallel", choices=("ddp", "fsdp", "hsdp"), default="ddp",
                    help="data parallelism: ddp (DistributedDataParallel, default), fsdp (FSDP2 fully_shard per "
                    "top-level layer and the root; methods fp32 = plain FSDP2, bf16 = bfloat16 reduce, "
                    "thc[:BITS] = hhook.fsdp; reduce-scatter and all-gather bytes reported separately) or hsdp "
                    "(shard inside each node, replicate across nodes, nodes from LOCAL_WORLD_SIZE as torchrun "
                    "places ranks: fp32/bf16 = native 2-D HSDP, thc = hhook.fsdp.register_hsdp, THC on both)")
    tr.add_argument("--ranks-per-node", type=int, default=None, metavar="K",
                    help="--parallel hsdp: ranks per node (default: the launcher's LOCAL_WORLD_SIZE); diloco: ranks "
                    "per site (default: the launcher's nodes)")
    tr.add_argument("--diloco", type=integer(1), default=None, metavar="H",
                    help="H of the diloco methods (hhook.diloco: DDP inside each site, the outer synchronization "
                    "every H steps between sites, docs/diloco.md); without a diloco entry in --methods adds diloco:4 "
                    "(default H 50)")
    tr.add_argument("--fragments", type=integer(1), default=None, metavar="P",
                    help="P of the diloco methods: streamed in P fragments (default 1)")
    add_output_options(tr)


def check(args, env) -> dict:
    """The run's configuration: the methods, the model's batch size and learning rate, the data."""
    from ..tasks import TASKS

    check_backend(args.backend, device_of(args))
    task = TASKS[args.model]
    try:
        methods = train.parse_methods(args.methods, args.powersgd_rank, getattr(args, "diloco", None),
                                      getattr(args, "fragments", None))
    except ValueError as e:
        raise UsageError(str(e)) from None
    if getattr(args, "parallel", "ddp") in ("fsdp", "hsdp"):
        for method in methods:
            try:
                train.check_fsdp_method(method)
            except ValueError as e:
                raise UsageError(str(e)) from None
    elif any(m.kind == "diloco" and m.options["every"] >= args.steps for m in methods):
        raise UsageError(f"a diloco method's H must be below --steps ({args.steps}): no outer step would run")
    elif any(m.all_gather is not None or m.params is not None for m in methods):
        raise UsageError("ag= and params= choose FSDP2's parameter all-gather and dtype: they need --parallel fsdp "
                         "or hsdp")
    if args.warmup >= args.steps:
        raise UsageError(f"--warmup must be in 0..steps-1 (steps {args.steps}), got {args.warmup}")
    batch = task.batch_size if args.batch_size is None else args.batch_size
    lr = task.lr if args.lr is None else args.lr
    if env.world_size < 2:
        raise UsageError("train needs at least 2 ranks (a world of 1 has no communication to measure); "
                         "launch with torchrun --nproc-per-node N, mpirun -np N or ci/netcluster.sh launch N")
    digits = task.load()
    shard = len(digits[0]) // env.world_size
    if batch > shard:
        raise UsageError(f"--batch-size {batch} exceeds a rank's shard of the training set ({shard} samples)")
    return {"task": task, "methods": methods, "batch_size": batch, "lr": lr, "digits": digits}


# -- summaries, table, plot ---------------------------------------------------------------
def _percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0.5: median, 0.9: p90), interpolated between order statistics."""
    if len(values) < 2:
        return values[0] if values else math.nan
    return statistics.quantiles(values, n=10, method="inclusive")[round(q * 10) - 1]


def summarize(method: Method, status: str, message: str, results: list[dict], warmup: int, target: float) -> dict:
    """The row of ``method``: figures from rank 0's timings and evaluations."""
    row = {"method": method.name, "kind": method.kind, "bits": method.bits, "scales": method.scales,
           "all_gather": method.all_gather, "param_dtype": method.params,
           "topology": method.topology, "rounding": method.rounding, "powersgd_rank": method.rank,
           "status": status, "message": message,
           "wall_s": max((r.get("wall_s", 0.0) for r in results), default=None)}
    if status != "ok":
        return row
    r0 = results[0]
    timed = r0["step_s"][warmup:]
    reached = next((e for e in r0["evals"] if e["accuracy"] >= target), None)

    def per_step(key):  # rank by rank, the mean over the timed steps
        return [sum(r[key][warmup:]) / len(r[key][warmup:]) for r in results] if key in r0 else None

    per_rank_bytes = per_step("step_bytes")
    rs, ag = per_step("step_rs_bytes"), per_step("step_ag_bytes")  # --parallel fsdp
    intra, inter = per_step("step_intra_bytes"), per_step("step_inter_bytes")
    row.update(
        params=r0["params"], steps=len(r0["step_s"]), warmup=warmup,
        median_ms=_percentile(timed, 0.5) * 1e3, p90_ms=_percentile(timed, 0.9) * 1e3,
        mean_ms=sum(timed) / len(timed) * 1e3, train_s=r0["train_s"],
        bytes_per_step=per_rank_bytes[0], bytes_per_step_per_rank=per_rank_bytes,
        bytes_counted=r0["bytes_counted"], target_accuracy=target,
        intra_bytes_per_step=intra[0] if intra else None, inter_bytes_per_step=inter[0] if inter else None,
        intra_bytes_per_step_per_rank=intra, inter_bytes_per_step_per_rank=inter,
        time_to_target_s=reached["time_s"] if reached else None, step_to_target=reached["step"] if reached else None,
        final_accuracy=r0["final_accuracy"], final_loss=r0["final_loss"], final_val_loss=r0.get("final_val_loss"),
        step_ms=[t * 1e3 for t in r0["step_s"]], step_ms_per_rank=[[t * 1e3 for t in r["step_s"]] for r in results],
        evals=r0["evals"], thc_stats=[r.get("thc_stats") for r in results] if "thc_stats" in r0 else None,
        baseline_stats=[r.get("baseline_stats") for r in results] if "baseline_stats" in r0 else None,
        bytes_mismatch=[r["bytes_mismatch"] for r in results if "bytes_mismatch" in r] or None,
        decision=(r0.get("thc_stats") or {}).get("decision"),
        rs_bytes_per_step=rs[0] if rs else None, ag_bytes_per_step=ag[0] if ag else None,
        rs_bytes_per_step_per_rank=rs, ag_bytes_per_step_per_rank=ag,
        peak_rss_mb=[r.get("peak_rss_mb") for r in results], setup_rss_mb=[r.get("setup_rss_mb") for r in results],
        peak_cuda_mb=[r.get("peak_cuda_mb") for r in results] if "peak_cuda_mb" in r0 else None,
    )
    if "diloco_stats" in r0:
        row.update(diloco_summary(r0, results, warmup))
    return row


def diloco_summary(r0: dict, results: list[dict], warmup: int) -> dict:
    """A diloco row's extras: its options and stats, bytes between sites per inner step and
    per outer step, and rank 0's step times split into steps that launched or merged an
    exchange, steps that computed while one was in flight, and steps with none."""
    stats = r0["diloco_stats"]
    kinds = {"sync": [], "in_flight": [], "quiet": []}
    for i, t in enumerate(r0["step_s"]):
        if i >= warmup:
            kind = "sync" if r0["step_sync"][i] else "in_flight" if r0["step_in_flight"][i] else "quiet"
            kinds[kind].append(t * 1e3)
    out = {"diloco_stats": [r["diloco_stats"] for r in results],
           "outer_bytes_per_step": sum(r0["step_outer_bytes"]) / len(r0["step_outer_bytes"]),
           "outer_bytes_per_sync": stats["wire_bytes"] / max(1, stats["syncs"]),
           "outer_bytes_per_outer_step": stats["wire_bytes"] / max(1e-9, stats["outer_steps"])}
    # One site (the launcher's nodes: one host is one site) or no outer step: nothing was
    # exchanged between sites, so the row is local training, not a method to compare.
    out["synchronized"] = stats["sites"] > 1 and stats["outer_steps"] > 0
    for kind, times in kinds.items():
        out[f"{kind}_step_ms"] = _percentile(times, 0.5) if times else None
        out[f"{kind}_steps"] = len(times)
    if out["in_flight_step_ms"] and out["quiet_step_ms"]:
        out["in_flight_vs_quiet"] = out["in_flight_step_ms"] / out["quiet_step_ms"]
    return out


def add_speedups(rows: list[dict]) -> None:
    """Speedups against fp32 and fp16, from the median step and from time to accuracy."""
    ok = {r["method"]: r for r in rows if r["status"] == "ok" and r["method"] in ("fp32", "fp16")}
    for r in rows:
        for ref in ("fp32", "fp16"):
            base = ok.get(ref)
            good = r["status"] == "ok" and base is not None and r.get("synchronized") is not False
            r[f"speedup_vs_{ref}"] = base["median_ms"] / r["median_ms"] if good else None
            both = good and base["time_to_target_s"] is not None and r["time_to_target_s"] is not None
            r[f"tta_speedup_vs_{ref}"] = base["time_to_target_s"] / r["time_to_target_s"] if both else None


def _x(value) -> str:
    return "-" if value is None else f"{value:.2f}x"


def table(rows: list[dict], target: float) -> str:
    """One line per method, about 110 columns; a method that did not run says why."""
    from ..report import Column, sig
    from ..report import table as fixed_table

    pct = f"{target * 100:g}%"
    wide = max([16] + [len(r["method"]) for r in rows])
    cols = [
        Column("", "method".ljust(wide - 1), wide, lambda r: r["method"].ljust(wide)),
        Column("step ms", "median", 8, lambda r: sig(r["median_ms"], 4)),
        Column("step ms", "p90", 8, lambda r: sig(r["p90_ms"], 4)),
        Column("", "MB/rank/step", 12, lambda r: sig(r["bytes_per_step"] / 1e6, 4)),
        Column("", f"s to {pct}", 9, lambda r: "not reached" if r["time_to_target_s"] is None
               else f"{r['time_to_target_s']:.2f}"),
        Column("", "final acc", 9, lambda r: f"{r['final_accuracy']:.4f}"),
        Column("", "val loss", 8, lambda r: "-" if r.get("final_val_loss") is None else f"{r['final_val_loss']:.4f}"),
        Column("speedup (step)", "vs fp32", 7, lambda r: _x(r["speedup_vs_fp32"])),
        Column("speedup (step)", "vs fp16", 7, lambda r: _x(r["speedup_vs_fp16"])),
        Column("speedup (to acc)", "vs fp32", 7, lambda r: _x(r["tta_speedup_vs_fp32"])),
        Column("speedup (to acc)", "vs fp16", 7, lambda r: _x(r["tta_speedup_vs_fp16"])),
    ]
    compared = [r for r in rows if r["status"] == "ok" and r.get("synchronized") is not False]
    lines = fixed_table(cols, compared).splitlines()
    head, body = lines[:2], iter(lines[2:])
    out = list(head)
    for r in rows:
        message = r["message"] if len(r["message"]) <= 100 else r["message"][:97] + "..."  # whole in --json
        if r["status"] == "ok" and r.get("synchronized") is False:
            message = unsynchronized(r)
        out.append(next(body) if r in compared else f"{r['method']:<{wide}s}  {message}")
    return "\n".join(out)


def unsynchronized(row: dict) -> str:
    """What a diloco row that never synchronized says instead of figures to compare."""
    s = row["diloco_stats"][0]
    return (f"did not synchronize: {s['sites']} site(s), {s['outer_steps']:g} outer steps (local training, "
            f"{row['median_ms']:.1f} ms/step: no bytes or speed-up to compare; sites = the launcher's nodes, or "
            "--ranks-per-node K)")


def decision_line(decision: dict) -> str:
    """``bits="auto"``'s decisions (hhook.decision) in one line: each one's candidates,
    their median steps, those dropped early, and the choice."""
    if decision.get("phase") == "not measured":  # hhook.decision.hook.one_host
        return f"{decision['reason']} (DDP's plain allreduce ran)"
    parts = []
    for d in decision["decisions"]:
        periods = ", ".join(f"{m} {v:.1f}" for m, v in sorted(d["periods_ms"].items(), key=lambda kv: kv[1]))
        dropped = ", ".join(f"{m} {v:.1f}" for m, v in d["dropped_ms"].items())
        parts.append(f"at step {d['iter']} ({d['reason']}) chose {d['choice']}; median step ms {periods}"
                     + (f"; dropped early {dropped}" if dropped else ""))
    if not parts:
        return f"bits='auto' still measuring ({decision['phase']}, running {decision['method']})"
    return "bits='auto' " + "; then ".join(parts)


def footer(rows: list[dict], args) -> list[str]:
    from ..report import sig

    lines = [f"# step = forward + backward + optimizer step on rank 0, median and p90 after {args.warmup} "
             f"warm-up steps; s to {args.target_accuracy * 100:g}% = training time (eval excluded) until the "
             f"first evaluation (every {args.eval_every} steps) reaching it",
             "# val loss = cross-entropy on the held-out test set at the last evaluation (the same data for every "
             "method; lower is better)"]
    if getattr(args, "parallel", "ddp") in ("fsdp", "hsdp"):
        lines.append("# MB/rank/step: tensors handed to torch.distributed collectives (FSDP2: every one counted; "
                     "reduce-scatter input and all-gather output, NCCL's semantics: Gloo's emulated reduce-scatter "
                     "moves about twice that)")
    else:
        lines.append("# MB/rank/step: tensors handed to torch.distributed collectives (fp32: 4 B per parameter, "
                     "reduced in C++)")
    for r in rows:
        if r.get("inter_bytes_per_step") is not None:
            lines.append(f"# {r['method']}: two-level, per rank and step {sig(r['intra_bytes_per_step'] / 1e6, 4)} MB "
                         f"inside the node, {sig(r['inter_bytes_per_step'] / 1e6, 4)} MB between nodes (THC's stats)")
    for r in rows:
        if r.get("rs_bytes_per_step") is not None:
            peak = max(r["peak_rss_mb"]) if r.get("peak_rss_mb") and None not in r["peak_rss_mb"] else None
            lines.append(f"# {r['method']}: FSDP2, per rank and step {sig(r['rs_bytes_per_step'] / 1e6, 4)} MB "
                         f"reduce-scatter input, {sig(r['ag_bytes_per_step'] / 1e6, 4)} MB all-gather output"
                         + ("" if peak is None else f"; peak RSS {peak:.0f} MiB (max over ranks)"))
    for r in rows:
        if r.get("diloco_stats"):
            s = r["diloco_stats"][0]
            flight = "" if not r.get("in_flight_step_ms") else (
                f"; median step {r['quiet_step_ms']:.1f} ms with no exchange, {r['in_flight_step_ms']:.1f} ms with one "
                f"in flight ({r['in_flight_vs_quiet']:.3f}x), {r['sync_step_ms']:.1f} ms launching or merging")
            if not r["synchronized"]:
                lines.append(f"# WARNING {r['method']}: {unsynchronized(r)}")
                continue
            lines.append(f"# {r['method']}: {s['sites']} sites x {s['ranks_per_site']} rank(s), {s['outer_steps']:g} outer "
                         f"steps; between sites {sig(r['outer_bytes_per_outer_step'] / 1e6, 4)} MB per outer step, "
                         f"{sig(r['outer_bytes_per_step'] / 1e3, 4)} kB per inner step (rank 0){flight}; MB/rank/step "
                         "counts these and the site's all-gathers, not DDP inside a site")
    for r in rows:
        if r.get("decision"):
            lines.append(f"# {r['method']}: {decision_line(r['decision'])}")
    for r in rows:
        if r.get("bytes_mismatch"):
            lines.append(f"# WARNING {r['method']}: bytes counted disagree with THC's stats: {r['bytes_mismatch'][0]}")
    from ...baselines.harness import phase_line  # LGC's phases (steps per phase), not only in --json

    lines += [line for line in map(phase_line, rows) if line]
    missed = [r["method"] for r in rows if r["status"] == "ok" and r["time_to_target_s"] is None]
    if missed:
        lines.append(f"# target accuracy {args.target_accuracy:g} not reached in {args.steps} steps by: "
                     f"{', '.join(missed)}")
    return lines


# -- the subcommand -------------------------------------------------------------------------
def run(args, cfg) -> int:
    """``hhook-profile train``: every rank runs this; returns the exit status."""
    from ...launch import free_port
    from .. import plot, report
    from ..progress import Stages

    set_threads(args.threads)
    try:
        control = train.control_channel(max(3600.0, 10 * args.timeout))
    except Exception as e:  # noqa: BLE001
        error(f"cannot connect the launched ranks: {type(e).__name__}: {e}", True)
        return EXIT_FAILURE
    rank0 = control.rank == 0
    workdir = tempfile.mkdtemp(prefix=f"hhook-train-r{control.rank}-")
    data_path = os.path.join(workdir, "digits.pt")
    try:
        import torch

        torch.save(cfg["digits"], data_path)
        problem = control.bcast_object(check_outputs(args) if rank0 else None)
        if problem:
            raise UsageError(problem)
        hosts = control.allgather_object({**control.host_info(), "torch_threads": args.threads})
        master_addr = train.master_addr(control)
        m = report.meta("train", control, hosts, {**options(args), "batch_size": cfg["batch_size"], "lr": cfg["lr"]})
        task, methods = cfg["task"], cfg["methods"]
        if rank0:
            say(report.header(m))
            say(f"# command: hhook-profile {' '.join(sys.argv[1:])}")
            say(f"# model {task.name}: {task.summary}; {'text' if task.name == 'gpt' else 'digits'}, batch {cfg['batch_size']} per rank, SGD lr "
                f"{cfg['lr']:g} momentum 0.9, {args.steps} steps, {args.backend} on {device_of(args)}, {args.threads} thread(s) per rank, "
                f"{ {'fsdp': 'FSDP2', 'hsdp': 'HSDP (FSDP2)'}.get(args.parallel, 'DDP') }")
            say(f"# methods run one at a time in child processes (rendezvous {master_addr}); "
                f"a method without progress for {args.timeout:g} s is killed")
        rows = []
        for method in methods:
            port = control.bcast_object(free_port() if rank0 else None)
            spec = {"method": dataclasses.asdict(method), "rank": control.rank, "world_size": control.size,
                    "local_rank": getattr(getattr(control, "env", None), "local_rank", 0),
                    "master_addr": master_addr, "port": port, "backend": args.backend,
                    "device": device_of(args),
                    "threads": args.threads, "seed": args.seed, "task": task.name, "lr": cfg["lr"],
                    "batch_size": cfg["batch_size"], "steps": args.steps, "eval_every": args.eval_every,
                    "pg_timeout_s": args.timeout, "data_path": data_path, "parallel": args.parallel,
                    "ranks_per_node": args.ranks_per_node}
            stages = Stages(method.name, args.steps, enabled=rank0 and not args.quiet)
            try:
                mine = train.run_child(spec, workdir, args.timeout, stages.beat)
            finally:
                stages.close()
            train.quiet_barrier(control)
            results = control.allgather_object(mine)
            status, message = train.verdict(results)
            row = summarize(method, status, message, results, args.warmup, args.target_accuracy)
            rows.append(row)
            if rank0 and not args.quiet:
                done = (f"median {row['median_ms']:.1f} ms/step, final accuracy {row['final_accuracy']:.4f}"
                        if status == "ok" else message)
                if status == "ok" and row.get("synchronized") is False:
                    done = unsynchronized(row)
                print(f"# {method.name}: {done}", file=sys.stderr, flush=True)
        add_speedups(rows)
        if rank0:
            say(table(rows, args.target_accuracy))
            for line in footer(rows, args):
                say(line)
            if args.json:
                report.write_json(args.json, m, rows)
            if args.plot:
                plot.save(args.plot, [lambda ax: plot.accuracy_panel(ax, rows, args.target_accuracy),
                                      lambda ax: plot.step_panel(ax, rows)], link=m["link"])
        control.barrier()
    except UsageError as e:
        error(str(e), rank0)
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

