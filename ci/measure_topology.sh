#!/usr/bin/env bash
# Measure real DDP training (wide-cnn, hhook-profile train) on the emulated cluster at
# the layouts the scale model is checked against, and write the median step times into
# the "measured" field of docs/topology-inputs.json (tests/test_topology.py compares the
# model with them; `hhook-profile model --layouts ... --scale-inputs` prints both):
#
#   1x2, 1x4  one node (one network namespace, its ranks on its loopback, unshaped)
#   2x1, 2x2  two nodes joined by 1 Gbit/s links (ci/netcluster.sh)
#
# At 2x2 also the fp16 hook and two-level THC (topology=auto) in both scale modes: the
# figures of docs/topology.md. Needs root, ip netns and tc (as ci/netcluster.sh); takes
# 5-8 minutes on 2 cores. Usage: bash ci/measure_topology.sh [OUTDIR] (default docs);
# STEPS=N sets the steps per method (default 35, 5 of them warm-up).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-docs}"
STEPS="${STEPS:-35}"
PY="${PYTHON:-python3}"
trap 'bash ci/netcluster.sh down >/dev/null 2>&1 || true' EXIT

run() {  # LAYOUT NODES RANKS_PER_NODE RATE METHODS
    bash ci/netcluster.sh up "$2" "$4" --ranks-per-node "$3"
    bash ci/netcluster.sh launch "$2" "$PY" -m hhook.profile train --quiet --model wide-cnn --methods "$5" \
        --steps "$STEPS" --warmup 5 --eval-every "$STEPS" --target-accuracy 0.5 --timeout 300 \
        --json "$OUT/topology-train-$1.json"
}

run 1x2 1 2 none fp32,bf16,thc:4
run 1x4 1 4 none fp32,bf16,thc:4
run 2x1 2 1 1gbit fp32,bf16,thc:4
run 2x2 2 2 1gbit fp32,fp16,bf16,thc:4,thc:4:topology=auto,thc:4:predicted:topology=auto

"$PY" - "$OUT" <<'EOF'
"""Median step times of the runs above into docs/topology-inputs.json's "measured"."""
import datetime
import json
import pathlib
import sys

out = pathlib.Path(sys.argv[1])
names = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16", "thc:4": "thc", "thc:4:topology=auto": "thc2",
         "thc:4:predicted:topology=auto": "thc2:scales=predicted"}
measured = {}
for layout in ("1x2", "1x4", "2x1", "2x2"):
    rows = json.loads((out / f"topology-train-{layout}.json").read_text())["results"]
    measured[layout] = {names[r["method"]]: round(r["median_ms"], 1) for r in rows if r["status"] == "ok"}
path = pathlib.Path("docs/topology-inputs.json")
doc = json.loads(path.read_text())
doc["measured"] = measured
doc["commands"] = (f"bash ci/measure_topology.sh ({datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC): "
                   "hhook-profile train --model wide-cnn, median step after 5 warm-up steps; "
                   f"per-layout JSON in {out}/topology-train-*.json")
path.write_text(json.dumps(doc, indent=2) + "\n")
print(json.dumps(measured, indent=1))
EOF
