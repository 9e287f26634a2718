"""The figures of issue 49's targets from the runs of ``measure/measure_diloco.sh`` (the
JSON of ``hhook-profile train``), one layout (sites x rate x delay) at a time, printed and
written as one JSON with the host's load beside every run.

* time to the loss DDP fp32 reaches after 80% of its tokens (its evaluation at 80% of its
  steps, interpolated between evaluations), per method, on each method's training clock;
  the ratios of DDP with hhook's per-step hook and of DDP fp32 to the outer synchronizer's;
* validation loss at equal tokens (the last evaluation) against DDP fp32's;
* THC's outer exchange against an fp32 one: the last validation loss over the seeds
  (mean, spread), bytes per outer step; bytes per inner step against DDP fp32's;
* streaming: median inner step with an exchange in flight over one with none, and its
  loss against the non-streamed method with the same H.

Usage: python measure/diloco_summary.py [--loads FILE] [--out JSON] RUN.json... (the output holds
the figures, the loads and every run's document, by name).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics


def loss_at(evals: list[dict], step: float) -> float:
    """The validation loss at ``step``, linear between the evaluations around it."""
    points = [(e["step"], e["val_loss"]) for e in evals]
    for (s0, l0), (s1, l1) in zip(points, points[1:]):
        if s0 <= step <= s1:
            return l0 + (l1 - l0) * (step - s0) / (s1 - s0)
    return points[-1][1]


def time_to(evals: list[dict], loss: float) -> float | None:
    """Training time (s) when the validation loss first reaches ``loss``, linear between
    the evaluations around it; None if it never does."""
    prev_t, prev_l = 0.0, None
    for e in evals:
        if e["val_loss"] <= loss:
            if prev_l is None or prev_l == e["val_loss"]:
                return e["time_s"]
            return prev_t + (e["time_s"] - prev_t) * (prev_l - loss) / (prev_l - e["val_loss"])
        prev_t, prev_l = e["time_s"], e["val_loss"]
    return None


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def layout_figures(name: str, runs: list[dict]) -> dict:
    """The targets' figures of one layout from its runs (the first holds every method)."""
    main = {r["method"]: r for r in runs[0]["results"] if r["status"] == "ok"}
    fp32 = main.get("fp32")
    out = {"layout": name, "steps": fp32["steps"] if fp32 else None, "methods": {}}
    target = loss_at(fp32["evals"], 0.8 * fp32["steps"]) if fp32 else None
    out["target_val_loss"] = target
    for method, r in main.items():
        t = time_to(r["evals"], target) if target is not None else None
        out["methods"][method] = {
            "median_step_ms": r["median_ms"], "train_s": r["train_s"], "final_val_loss": r["final_val_loss"],
            "time_to_target_s": t, "bytes_per_step": r["bytes_per_step"],
            "outer_bytes_per_step": r.get("outer_bytes_per_step"),
            "outer_bytes_per_outer_step": r.get("outer_bytes_per_outer_step"),
            "in_flight_vs_quiet": r.get("in_flight_vs_quiet"), "quiet_step_ms": r.get("quiet_step_ms"),
            "in_flight_step_ms": r.get("in_flight_step_ms"), "sync_step_ms": r.get("sync_step_ms")}
    ms = out["methods"]
    for method, m in ms.items():
        if method.startswith("diloco"):
            m["tta_vs_hook"] = _ratio(ms.get("thc:4", {}).get("time_to_target_s"), m["time_to_target_s"])
            m["tta_vs_fp32"] = _ratio(ms.get("fp32", {}).get("time_to_target_s"), m["time_to_target_s"])
            m["val_loss_vs_fp32"] = _ratio(m["final_val_loss"], fp32["final_val_loss"]) if fp32 else None
            if fp32 and m["outer_bytes_per_step"]:
                m["inner_step_bytes_fewer_than_fp32"] = fp32["bytes_per_step"] / m["outer_bytes_per_step"]
    thc = next((m for m in main if re.fullmatch(r"diloco:4:h=\d+", m)), None)
    dense = next((m for m in main if m.startswith("diloco:fp32")), None)
    if thc and dense:  # over every seed of this layout
        losses = collections.defaultdict(list)
        for run in runs:
            for r in run["results"]:
                if r["status"] == "ok" and r["method"] in (thc, dense):
                    losses[r["method"]].append(r["final_val_loss"])
        spread = {m: (statistics.mean(v), statistics.stdev(v) if len(v) > 1 else None, v) for m, v in losses.items()}
        out["outer_exchange"] = {
            "thc": thc, "fp32": dense, "val_losses": {m: s[2] for m, s in spread.items()},
            "mean": {m: s[0] for m, s in spread.items()}, "stdev": {m: s[1] for m, s in spread.items()},
            "bytes_fewer": _ratio(ms[dense]["outer_bytes_per_outer_step"], ms[thc]["outer_bytes_per_outer_step"])}
    out["streaming"] = [
        {"method": m, "in_flight_vs_quiet": ms[m]["in_flight_vs_quiet"],
         "val_loss_vs_blocking": _ratio(ms[m]["final_val_loss"], ms.get(re.sub(r":p=\d+.*", "", m), {}).get("final_val_loss"))}
        for m in main if ":p=" in m]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+")
    p.add_argument("--loads", help="lines 'NAME before|after LOADAVG' (measure_diloco.sh)")
    p.add_argument("--out", help="write the figures here (JSON)")
    args = p.parse_args()
    loads = collections.defaultdict(dict)
    if args.loads:
        with open(args.loads) as f:
            for line in f:
                name, when, *avg = line.split()
                loads[name][when] = " ".join(avg[:3])
    layouts, docs = collections.defaultdict(list), {}
    for path in sorted(args.runs):
        name = re.sub(r"^.*/|\.json$", "", path)
        with open(path) as f:
            docs[name] = json.load(f)
        layouts[re.sub(r"-seed\d+$", "", name)].append(docs[name])
    summary = {"layouts": [], "loads": loads, "runs": docs}
    for name, runs in sorted(layouts.items()):
        runs.sort(key=lambda r: len(r["results"]), reverse=True)  # the run of every method first
        figures = layout_figures(name, runs)
        summary["layouts"].append(figures)
        print(json.dumps(figures, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
