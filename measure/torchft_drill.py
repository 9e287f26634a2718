r"""torchft's DiLoCo with hhook.torchft's THC outer exchange against torchft's own (fp32):
fault-free runs, a replica SIGKILLed between syncs and restarted, one SIGKILLed inside a
THC exchange, one SIGSTOPped between syncs for 3 s; 3 one-rank replica groups on Gloo, CPU, one host (tests/support/torchft_world.py).

    PYTHONPATH=src:. python measure/torchft_drill.py --runs 3

Prints, per exchange and scenario, averaged over the runs: the final loss (mean of the last
3 outer steps of replica 0, equal steps, so equal tokens per replica), the payload bytes of
one outer exchange against fp32's (4 bytes an element), the survivors' time from the kill to
their next commit, whether the restarted (or resumed) replica held the survivors' parameters
bit for bit at every commit, and hhook's rebuild of its state per quorum (handshake and second
communicator of the new quorum, the wait for its members included).
"""

from __future__ import annotations

import argparse
import signal
import statistics
import tempfile
import time
from pathlib import Path

from tests.support.torchft_world import REPLICAS, World, digests


def run(kind: str, exchange: str, steps: int, bits: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        extra = ("--exchange", exchange, "--bits", str(bits))
        world = World(Path(tmp), steps, extra)
        try:
            first_pid, killed = None, None
            hold = ("--hold-at", "3") if kind == "in-flight" else ()
            for replica in range(REPLICAS):
                world.start(replica, *(hold if replica == 2 else ()))
            if kind == "between":
                world.wait_for(lambda: any(r["step"] >= 3 for r in world.commits(2)), 120, "step 3")
                first_pid = world.records(2)[0]["pid"]
                killed = world.kill(2)
                time.sleep(0.5)
                world.start(2)
            elif kind == "stopped":
                world.wait_for(lambda: any(r["step"] >= 3 for r in world.commits(2)), 120, "step 3")
                killed = world.signal(2, signal.SIGSTOP)  # "killed": the fault's time
                time.sleep(3.0)
                resumed = world.signal(2, signal.SIGCONT)
            elif kind == "in-flight":
                world.wait_for(lambda: any(r["event"] == "holding" for r in world.records(2)), 120, "the hold")
                time.sleep(0.5)
                killed = world.kill(2)
            wanted = range(REPLICAS) if kind != "in-flight" else (0, 1)
            world.wait_for(lambda: all(world.done(r) for r in wanted), 180, "the last step")
            out = {}
            commits = world.commits(0)
            out["loss"] = statistics.mean(r["loss"] for r in commits[-3:])
            full = [r for r in commits if r["participants"] == REPLICAS and (killed is None or r["t"] < killed)]
            if exchange == "thc" and len(full) >= 2:
                a, b = full[-2], full[-1]
                out["ratio"] = (b["dense"] - a["dense"]) / (b["wire"] - a["wire"])
                out["rebuild_s"] = max(s for replica in wanted for s in world.commits(replica)[-1]["rebuilds"])
            if killed is not None:
                out["recover_s"] = max(next(r["t"] for r in world.commits(x) if r["t"] > killed) - killed
                                       for x in (0, 1))
            if kind in ("between", "stopped"):
                by_step = digests(world)
                mine = [r for r in world.commits(2) if (r["pid"] != first_pid if kind == "between" else r["t"] > resumed)]
                out["identical"] = all(by_step[r["step"]].get(0) == by_step[r["step"]].get(1) == r["digest"]
                                       for r in mine)
            else:
                out["identical"] = all(len(set(d.values())) == 1 for d in digests(world).values())
            return out
        finally:
            world.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--exchanges", default="thc,fp32", help="which of thc and fp32 to run")
    ap.add_argument("--faults", default="none,between,in-flight,stopped", help="which faults to inject")
    args = ap.parse_args()
    rows = [(e, k) for e, k in (("thc", "none"), ("thc", "between"), ("thc", "in-flight"), ("thc", "stopped"),
                                ("fp32", "none"), ("fp32", "between"), ("fp32", "stopped"))
            if e in args.exchanges.split(",") and k in args.faults.split(",")]
    print(f"{'exchange':9} {'fault':10} {'loss':>8} {'bytes x':>8} {'recover s':>10} {'rebuild s':>10} identical")
    for exchange, kind in rows:
        results = [run(kind, exchange, args.steps, args.bits) for _ in range(args.runs)]

        def mean(key):
            values = [r[key] for r in results if key in r]
            return f"{statistics.mean(values):.3f}" if values else "-"

        print(f"{exchange + (str(args.bits) if exchange == 'thc' else ''):9} {kind:10} {mean('loss'):>8} "
              f"{mean('ratio'):>8} {mean('recover_s'):>10} {mean('rebuild_s'):>10} "
              f"{sum(r['identical'] for r in results)}/{len(results)}", flush=True)


if __name__ == "__main__":
    main()
