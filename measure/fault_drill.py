r"""The fault drill: each fault of docs/reliability.md injected into a training job with
``hhook.register(model)`` (``examples/resilient_train.py``: checkpoints of the model, the
optimizer and the hook state every ``--every`` steps), one row per fault.

Run through ``measure/fault_drill.sh`` (root: it brings the emulated cluster up, 2 nodes of one
rank at 1 Gbit/s, and down again). Rows: what was injected, what happened, the time to
detect (from the fault to the first rank's error), the time to recover (from the fault to
the restarted job's first step), steps lost (redone after the restart), and the final
accuracy against a fault-free run of the same seed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYTHONPATH = f"{ROOT / 'src'}{os.pathsep}{ROOT}"  # src layout: the package, and tests/
NETCLUSTER = [str(ROOT / "ci" / "netcluster.sh")]
SCRIPT = str(ROOT / "examples" / "resilient_train.py")
MASTER = "10.77.0.1"
NODES = 2


def node_cmd(i: int, port: int, *argv: str, launcher: str = "plain", restarts: int = 0, k: int = 1) -> list[str]:
    """Rank ``i`` of a job (``k`` ranks per node; torchrun: the node's agent) in its node's namespace."""
    env = ["env", f"PYTHONPATH={PYTHONPATH}", "OMP_NUM_THREADS=1", "GLOO_SOCKET_IFNAME=eth0"]
    if launcher == "torchrun":
        run = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--nproc-per-node", "1",
               "--max-restarts", str(restarts), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{MASTER}:{port}",
               "--rdzv-id", f"drill{port}", SCRIPT]
    else:
        env += [f"RANK={i}", f"WORLD_SIZE={NODES * k}", f"LOCAL_RANK={i % k}", f"LOCAL_WORLD_SIZE={k}",
                f"MASTER_ADDR={MASTER}", f"MASTER_PORT={port}"]
        run = [sys.executable, SCRIPT]
    return [*NETCLUSTER, "exec", str(i // k), *env, *run, *argv]


def shm_files() -> set:
    """hhook's files in /dev/shm (the namespaces share it)."""
    return {n for n in os.listdir("/dev/shm") if n.startswith("hhook-")}


class Job:
    """One job over the nodes; ``wait`` bounds it (a hang is a row of its own) and notes
    the files of /dev/shm it left (``shm_left``)."""

    port = 29700

    def __init__(self, argv: list[str], launcher="plain", restarts=0, limit=600.0, ranks_per_node=1):
        Job.port += 1
        self.started = time.time()
        self.shm_before = shm_files()
        self.procs = [subprocess.Popen(node_cmd(i, Job.port, *argv, launcher=launcher, restarts=restarts,
                                                k=ranks_per_node),
                                       cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       start_new_session=True) for i in range(NODES * (
                                           ranks_per_node if launcher == "plain" else 1))]
        self.limit = limit

    def wait(self) -> tuple[list, bool]:
        out, hung = [], False
        for p in self.procs:
            try:
                stdout, stderr = p.communicate(timeout=max(1.0, self.started + self.limit - time.time()))
            except subprocess.TimeoutExpired:
                hung = True
                os.killpg(p.pid, 9)
                stdout, stderr = p.communicate()
            out.append((p.returncode, stdout + stderr))
        self.ended = time.time()
        self.shm_left = sorted(shm_files() - self.shm_before)
        return out, hung


def shm_verdict(job: Job) -> str:
    return "; /dev/shm: nothing left" if not job.shm_left else f"; /dev/shm: {len(job.shm_left)} FILES LEFT"


def result_of(text: str) -> dict | None:
    found = [json.loads(line) for line in text.splitlines() if line.startswith("{\"ranks\"")]
    return found[-1] if found else None


def times(pattern: str, text: str) -> list[float]:
    return [float(m.group(1)) for m in re.finditer(pattern, text)]


def row(fault, injected, outcome, detect=None, recover=None, lost=None, accuracy=None, reference=None):
    acc = "-" if accuracy is None else f"{accuracy:.4f}" + (f" ({reference:.4f})" if reference is not None else "")
    print(f"| {fault} | {injected} | {outcome} | {'-' if detect is None else f'{detect:.1f}'} | "
          f"{'-' if recover is None else f'{recover:.1f}'} | {'-' if lost is None else lost} | {acc} |", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--every", type=int, default=50)
    p.add_argument("--timeout", type=float, default=20.0, help="collective timeout of the jobs (s)")
    p.add_argument("--long-steps", type=int, default=2000, help="steps of the leak check")
    p.add_argument("--bits", default="auto", help="the hook's bits (auto: hhook.register's default, a timed choice "
                   "that differs between runs; 4: restarted runs end bit for bit as the reference)")
    p.add_argument("--exit-runs", type=int, default=50, help="runs of the thc_allreduce job of the exit row")
    p.add_argument("--ddp-runs", type=int, default=20, help="runs of DDP with and without hhook in the exit row")
    p.add_argument("--only", default="",
                   help="comma-separated rows: reference,kill,mpirun,stall,link,checkpoint,leak,exit")
    args = p.parse_args()
    only = set(filter(None, args.only.split(",")))
    want = lambda name: not only or name in only  # noqa: E731
    base = ["--steps", str(args.steps), "--every", str(args.every), "--timeout", str(args.timeout), "--bits", args.bits]
    kill_step = args.every * 2 + args.every // 2  # half an interval after a checkpoint
    print("| fault | injected | what happened | detect s | recover s | steps lost | accuracy (fault-free) |")
    print("|---|---|---|---|---|---|---|", flush=True)

    ref_acc = None
    with tempfile.TemporaryDirectory() as tmp:
        if want("reference") or want("kill"):
            job = Job([*base, "--ckpt", f"{tmp}/ref"], limit=900)
            out, hung = job.wait()
            res = result_of(out[0][1])
            ref_acc = res["accuracy"] if res else None
            row("none", "fault-free reference, same seed", ("hung" if hung else f"completed, {res['median_step_ms']:.1f} "
                "ms/step" if res else "failed") + shm_verdict(job), accuracy=ref_acc)
        if want("kill"):
            for where in ("step", "hook"):
                argv = [*base, "--ckpt", f"{tmp}/kill-{where}", "--kill-at", str(kill_step), "--kill-in", where]
                job = Job(argv, launcher="torchrun", restarts=2, limit=900)
                out, hung = job.wait()
                text = "".join(t for _, t in out)
                killed = times(r"fault: rank killed at t=([\d.]+)", text)
                errors = times(r"rank \d+: step \d+: t=([\d.]+)", text)
                # a resumed start (the surviving node's agent does not count a restart of its own)
                resumed = times(r"attempt \d+: [^\n]*start at step [1-9]\d*[^\n]* t=([\d.]+)", text)
                res = next((r for r in (result_of(t) for _, t in out) if r), None)
                ok = not hung and res is not None and all(code == 0 for code, _ in out)
                if not ok and os.environ.get("DRILL_VERBOSE"):
                    print(text[-6000:], file=sys.stderr)
                lost = kill_step - res["resumed_from"] if res else None
                good = ok and ref_acc is not None and abs(res["accuracy"] - ref_acc) <= 0.005 and lost <= args.every
                row(f"killed rank ({where})", f"SIGKILL to rank 1 at step {kill_step} "
                    f"({'mid-step' if where == 'step' else 'inside the hook collectives'}), torchrun --max-restarts 2",
                    ("recovered, accuracy within 0.5 point, at most one checkpoint interval lost" if good else
                     "hung" if hung else "NOT RECOVERED as promised") + shm_verdict(job),
                    detect=(min(errors) - killed[0]) if errors and killed else None,
                    recover=(resumed[0] - killed[0]) if resumed and killed else None, lost=lost,
                    accuracy=res["accuracy"] if res else None, reference=ref_acc)
            job = Job([*base, "--kill-at", str(kill_step), "--kill-in", "hook"], limit=600)
            out, hung = job.wait()
            row("killed rank, no restarts", f"SIGKILL to rank 1 at step {kill_step}, plain launch (as mpirun)",
                _stopped(out, hung, args.timeout, r"fault: rank killed at t=([\d.]+)") + shm_verdict(job),
                detect=_detect(out, r"fault: rank killed at t=([\d.]+)"))
        if want("mpirun"):
            _mpirun_kill(base, kill_step)
        if want("stall"):
            _stalls(base, kill_step, args.timeout)
        if want("link"):
            _links(base, ref_acc)
        if want("checkpoint"):
            _truncated(base, tmp, args.every, ref_acc)
            proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "tests/state/test_checkpoint_faults.py"], cwd=ROOT,
                                  text=True, capture_output=True, env=dict(os.environ, PYTHONPATH=PYTHONPATH))
            summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-200:]
            row("bad checkpoints", "truncated file; other world size, codec version, rank, bits, scale mode",
                ("clear error or fresh start with one log line, gradients the mean: " if proc.returncode == 0
                 else "FAILED: ") + summary)
        if want("leak"):
            _leaks(args.long_steps)
        if want("exit"):
            _exits(args.exit_runs, args.ddp_runs)
    return 0


def _stalls(base, kill_step, timeout) -> None:
    """SIGSTOP to rank 1 past the timeout, flat (2 nodes x 1) and two-level (2 nodes x 2):
    every other rank must name rank 1."""
    stall = 2 * timeout
    for k, name, extra in ((1, "stalled rank", []), (2, "stalled rank, two-level 2 nodes x 2", ["--topology", "2"])):
        job = Job([*base, *extra, "--stall-at", str(kill_step), "--stall-s", str(stall)], limit=600, ranks_per_node=k)
        out, hung = job.wait()
        row(name, f"SIGSTOP to rank 1 at step {kill_step} for {stall:g} s (timeout {timeout:g} s), then SIGCONT",
            _stopped(out, hung, timeout, r"fault: rank stopped at t=([\d.]+)", stalled=1) + shm_verdict(job),
            detect=_detect(out, r"fault: rank stopped at t=([\d.]+)"))


def _truncated(base, tmp, every, ref_acc) -> None:
    """Rank 1's newest checkpoint loses its second half (then rank 1 is killed), under
    torchrun --max-restarts 2: the ranks agree on the newest step every rank can read."""
    at = 2 * every
    job = Job([*base, "--ckpt", f"{tmp}/truncated", "--truncate-at", str(at)], launcher="torchrun", restarts=2,
              limit=900)
    out, hung = job.wait()
    res = next((r for r in (result_of(t) for _, t in out) if r), None)
    ok = not hung and res is not None and all(code == 0 for code, _ in out)
    good = ok and res["resumed_from"] == at - every and ref_acc is not None and abs(res["accuracy"] - ref_acc) <= 0.005
    row("truncated checkpoint", f"rank 1's checkpoint of step {at} truncated to half, then rank 1 killed, torchrun "
        "--max-restarts 2", ("resumed from the older intact checkpoint, accuracy within 0.5 point" if good else
                            "hung" if hung else f"NOT RECOVERED as promised (resumed from "
                            f"{res['resumed_from'] if res else '-'})") + shm_verdict(job),
        lost=at - res["resumed_from"] if res else None, accuracy=res["accuracy"] if res else None, reference=ref_acc)


def _exits(runs: int, ddp_runs: int) -> None:
    """A job that finished exits 0 (loopback, 4 ranks under torchrun, tests/support/exit_job.py):
    one thc_allreduce of 1M elements then destroy_process_group, ``runs`` times; and DDP
    with and without hhook.register, ``ddp_runs`` times each, in turns (plain DDP has its
    own abort at exit on torch 2.13)."""
    def run(*argv: str) -> int:
        Job.port += 1
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                               "--master-port", str(Job.port), str(ROOT / "tests" / "support" / "exit_job.py"), *argv],
                              cwd=ROOT, text=True, capture_output=True, timeout=300,
                              env=dict(os.environ, PYTHONPATH=PYTHONPATH, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo"))
        return int(proc.returncode == 0 and (proc.stdout + proc.stderr).count(": ok ") == 4)

    before = shm_files()
    thc = sum(run() for _ in range(runs))
    ddp = plain = 0
    for _ in range(ddp_runs):
        ddp += run("--what", "ddp")
        plain += run("--what", "ddp", "--plain")
    row("a finished job (loopback)", f"4 ranks under torchrun: thc_allreduce of 1M elements then "
        f"destroy_process_group ({runs} runs); DDP + hhook.register and plain DDP, in turns ({ddp_runs} runs each)",
        f"exit 0: thc_allreduce {thc} of {runs}, DDP + hhook {ddp} of {ddp_runs}, plain DDP {plain} of {ddp_runs}"
        + ("; /dev/shm: nothing left" if shm_files() <= before else "; /dev/shm: FILES LEFT"))


def _mpirun_kill(base, kill_step) -> None:
    """SIGKILL to rank 1 inside the hook's collectives of an Open MPI job (ci/netcluster.sh
    mpirun): mpirun is expected to end the whole job and name the killed rank."""
    Job.port += 1
    env = dict(os.environ, PYTHONPATH=PYTHONPATH, GLOO_SOCKET_IFNAME="eth0", MASTER_ADDR=MASTER,
               MASTER_PORT=str(Job.port))
    started = time.time()
    try:
        proc = subprocess.run([*NETCLUSTER, "mpirun", str(NODES), sys.executable, SCRIPT, *base, "--kill-at",
                               str(kill_step), "--kill-in", "hook"], cwd=ROOT, env=env, text=True,
                              capture_output=True, timeout=600)
    except subprocess.TimeoutExpired:
        row("killed rank under mpirun", f"SIGKILL to rank 1 at step {kill_step}", "HUNG (600 s)")
        return
    ended = time.time()
    text = proc.stdout + proc.stderr
    killed = times(r"fault: rank killed at t=([\d.]+)", text)
    named = re.search(r"(process rank 1 .*?signal 9[^\n]*|rank 1[^\n]*(?:Killed|signal 9)[^\n]*)", text, re.S)
    survivor = re.search(r"rank 0: step \d+: t=[\d.]+: ([^\n]*)", text)
    outcome = ("stopped" if proc.returncode != 0 else "EXITED 0") + f" (exit {proc.returncode}); "
    outcome += (f"mpirun: \"{' '.join(named.group(1).split())[:120]}\"" if named else "mpirun named no rank")
    if survivor:
        outcome += f"; rank 0: {survivor.group(1)[:120]}"
    row("killed rank under mpirun", f"SIGKILL to rank 1 at step {kill_step} (inside the hook's collectives), "
        "Open MPI mpirun", outcome, detect=(ended - killed[0]) if killed else ended - started)


def _detect(out, fault_pattern):
    text = "".join(t for _, t in out)
    fault = times(fault_pattern, text)
    errors = times(r"rank \d+: step \d+: t=([\d.]+)", text)
    return min(errors) - fault[0] if fault and errors else None


def _stopped(out, hung, timeout, fault_pattern, stalled: int | None = None) -> str:
    """The row's verdict for a job that must stop: every other rank with hhook's error
    within the timeout + 10 s of the fault (naming rank ``stalled`` as the one that
    stalled, where given); the faulty rank (stalled, then continued) ends too, and what it
    said is reported."""
    if hung:
        return "HUNG"
    text = "".join(t for _, t in out)
    fault = times(fault_pattern, text)
    verdicts, late, kinds, misnamed = [], [], set(), []
    for code, t in out:
        said = re.search(r"rank (\d+): step \d+: t=([\d.]+): \w+: .*?hhook: ", t)
        if "fault: rank" in t:  # the faulty rank itself
            if "fault: rank stopped" in t:
                verdicts.append("the stalled rank, continued, " + ("raised hhook's error" if said else
                                                                   f"exited with {code}"))
            continue
        if not said:
            if os.environ.get("DRILL_VERBOSE"):
                print(t[-6000:], file=sys.stderr)
            return "a rank stopped without hhook's error"
        kinds.add("timeout" if "PeerTimeoutError" in t else "peer lost")
        if stalled is not None and f"a peer (rank {stalled}) stalled" not in t:
            misnamed.append(said.group(1))
        if fault and float(said.group(2)) - fault[0] > timeout + 10:
            late.append(float(said.group(2)) - fault[0])
    if late:
        return f"stopped, but {max(late):.1f} s after the fault"
    named = "" if stalled is None else (f", naming rank {stalled} on every other rank" if not misnamed else
                                        f", but ranks {misnamed} did NOT NAME rank {stalled}")
    return ("stopped with a clear error on every rank within timeout + 10 s (" + ", ".join(sorted(kinds)) + ")"
            + named + "".join("; " + v for v in verdicts))


def _links(base, ref_acc) -> None:
    """Loss and delay on every node's link: step time and accuracy of fp32, the fp16 hook,
    THC 4 bits (agreed scales, and predicted: one collective a bucket, not two) and
    ``bits="auto"`` under each. Loss: ``ci/netcluster.sh loss`` (nftables drops a random
    share of what each node receives). Delay with reordering: ``ci/netcluster.sh delay``
    (a user-space link holds each packet 5 ms +- 2 ms). Neither needs netem."""
    settings = [("none (the same jobs on the clean link)", ["loss", "0"],
                 "the clean 1 Gbit/s link"),
                ("1% loss", ["loss", "1"], "nftables: each node drops that share of the packets it receives"),
                ("5% loss", ["loss", "5"], "nftables: each node drops that share of the packets it receives"),
                ("5 ms +- 2 ms, reordering", ["delay", "5", "2"],
                 "user-space link (measure/delaylink.py): each packet held 5 ms +- 2 ms, uniform, so packets overtake")]
    for name, spec, how in settings:
        subprocess.run([*NETCLUSTER, *spec], check=True)
        cells = []
        for hook, extra in (("fp32", ["--hook", "fp32"]), ("fp16", ["--hook", "fp16"]), ("THC", ["--bits", "4"]),
                            ("THC predicted", ["--bits", "4", "--scales", "predicted"]), ("auto", ["--bits", "auto"])):
            out, hung = Job([*base, "--width", "1024", *extra], limit=900).wait()
            res = result_of(out[0][1])
            cells.append(f"{hook} {res['median_step_ms']:.1f} ms acc {res['accuracy']:.4f}" if res else f"{hook} failed")
        row(f"bad link: {name}", how, "; ".join(cells))
        subprocess.run([*NETCLUSTER, "loss", "0"], check=True)
        subprocess.run([*NETCLUSTER, "delay", "0"], check=True)
    subprocess.run([*NETCLUSTER, "reshape", "1gbit"], check=False)


def _leaks(steps: int) -> None:
    sys.path[:0] = [str(ROOT / "src"), str(ROOT)]
    from tests.support.distributed import run_world
    from tests.reliability.test_faults import _long_run_worker

    first = steps // 4
    for world, topology in ((2, "flat"), (4, 2)):
        res = run_world(_long_run_worker, world, topology, steps, (first, steps), timeout=3600)
        growth = max(u[steps][0] / u[first][0] - 1 for u, _ in res)
        fds = max(u[steps][1] - u[first][1] for u, _ in res)
        shm = max(u[steps][2] - u[first][2] for u, _ in res)
        row(f"long run ({'flat' if topology == 'flat' else 'two-level 2x2'}, loopback)",
            f"{steps} steps of thc_allreduce, {world} ranks",
            f"resident memory {100 * growth:+.2f}% from step {first} to {steps}, descriptors {fds:+d}, "
            f"/dev/shm files {shm:+d}")


if __name__ == "__main__":
    sys.exit(main())
