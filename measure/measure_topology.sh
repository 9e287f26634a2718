#!/usr/bin/env bash
# Measure the scale model's inputs (measure/measure_scale_inputs.py: compute per step in a
# world of one, the intra-node path, codec, casts and copies between two ranks of this
# host; the inter-node link from bench/profile-1gbit-link.json, which
# `bash measure/measure_profiler.sh 1gbit` writes), then real DDP training (wide-cnn,
# hhook-profile train) on the emulated cluster at the layouts the model is checked
# against, and write both into bench/topology-inputs.json (inputs and "measured") and
# bench/topology-inputs-cluster.json (the same inputs, every rank on its own core).
# tests/schedule/test_topology.py compares the model with the measured steps;
# `hhook-profile model --layouts ... --scale-inputs` prints both:
#
#   1x2, 1x4  one node (one network namespace, its ranks on its loopback, unshaped)
#   2x1, 2x2  two nodes joined by 1 Gbit/s links (ci/netcluster.sh)
#
# At 2x2 also the fp16 hook and two-level THC (topology=auto) in both scale modes, and
# hhook-profile allreduce alone: the figures of docs/topology.md. Needs root, ip netns
# and tc (as ci/netcluster.sh); takes 7-10 minutes on 2 cores. Usage: bash measure/measure_topology.sh [OUTDIR] (default bench);
# STEPS=N sets the steps per method (default 35, 5 of them warm-up).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-bench}"
STEPS="${STEPS:-35}"
PY="${PYTHON:-python3}"
trap 'bash ci/netcluster.sh down >/dev/null 2>&1 || true' EXIT

run() {  # LAYOUT NODES RANKS_PER_NODE RATE METHODS
    bash ci/netcluster.sh up "$2" "$4" --ranks-per-node "$3"
    bash ci/netcluster.sh launch "$2" "$PY" -m hhook.profile train --quiet --model wide-cnn --methods "$5" \
        --steps "$STEPS" --warmup 5 --eval-every "$STEPS" --target-accuracy 0.5 --timeout 300 \
        --json "$OUT/topology-train-$1.json"
}

"$PY" measure/measure_scale_inputs.py compute "$OUT/topology-inputs-compute.json"
"$PY" -m torch.distributed.run --nproc-per-node 2 --master-port 29653 measure/measure_scale_inputs.py loopback \
    "$OUT/topology-inputs-loopback.json"

run 1x2 1 2 none fp32,bf16,thc:4
run 1x4 1 4 none fp32,bf16,thc:4
run 2x1 2 1 1gbit fp32,bf16,thc:4
run 2x2 2 2 1gbit fp32,fp16,bf16,thc:4,thc:4:topology=auto,thc:4:predicted:topology=auto
# The allreduce alone on the same 2x2 cluster: the codec, flat thc_allreduce, two-level.
bash ci/netcluster.sh launch 2 "$PY" -m hhook.profile allreduce --backend gloo --threads 1 --quiet \
    --methods fp32,thc,thc:4:topology=flat,thc:4:topology=auto --sizes 4M,21M -n 5 -w 2 \
    --json "$OUT/topology-allreduce-2x2.json"

"$PY" - "$OUT" <<'EOF'
"""The inputs and the median step times of the runs above into bench/topology-inputs*.json."""
import datetime
import json
import os
import pathlib
import sys

from hhook.profile.models import fit_from_link

out = pathlib.Path(sys.argv[1])
inputs = json.loads((out / "topology-inputs-compute.json").read_text())
inputs.update({k: v for k, v in json.loads((out / "topology-inputs-loopback.json").read_text()).items()
               if not k.endswith("_r2") and k != "raw"})
alpha, beta = fit_from_link(json.loads(pathlib.Path("bench/profile-1gbit-link.json").read_text()))
inputs.update({"alpha_inter_us": round(alpha * 1e6, 2), "beta_inter_GBps": round(beta / 1e9, 4),
               "host_cores": os.cpu_count(), "intra": "shm"})
names = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16", "thc:4": "thc", "thc:4:topology=auto": "thc2",
         "thc:4:predicted:topology=auto": "thc2:scales=predicted"}
measured = {}
for layout in ("1x2", "1x4", "2x1", "2x2"):
    rows = json.loads((out / f"topology-train-{layout}.json").read_text())["results"]
    measured[layout] = {names[r["method"]]: round(r["median_ms"], 1) for r in rows if r["status"] == "ok"}
when = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC"
notes = ("Inputs of the scale model (hhook-profile model --layouts ... --scale-inputs FILE), measured by "
         f"bash measure/measure_topology.sh ({when}) on a 2-core VM, Gloo, wide-cnn (21.1 MB of gradients): compute, "
         "calls: a DDP step in a world of one; intra, codec, cast, copy: two ranks of this host on loopback "
         f"(measure/measure_scale_inputs.py; raw figures in {out}/topology-inputs-*.json); inter: the fit of "
         "bench/profile-1gbit-link.json (emulated 1 Gbit/s).")
doc = {"notes": notes + " All ranks share the host's cores (host_cores).", **inputs, "measured": measured,
       "commands": f"bash measure/measure_topology.sh ({when}): hhook-profile train --model wide-cnn, median step after "
                   f"5 warm-up steps; per-layout JSON in {out}/topology-train-*.json"}
pathlib.Path("bench/topology-inputs.json").write_text(json.dumps(doc, indent=2) + "\n")
cluster = {"notes": notes + " Here every rank has its own core (host_cores null): a cluster of CPU nodes, shared "
                            "memory inside a node, 1 Gbit/s between nodes.", **inputs, "host_cores": None}
pathlib.Path("bench/topology-inputs-cluster.json").write_text(json.dumps(cluster, indent=2) + "\n")
print(json.dumps(doc, indent=1))
EOF
