"""ci/gpu_check.sh --dry-run: the prepared GPU check cannot rot while no GPU runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "ci"))

import gpu_check  # noqa: E402


def test_dry_run_runs_every_stage_without_a_gpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    done = subprocess.run(["bash", "ci/gpu_check.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["dry_run"] and list(report["stages"]) == gpu_check.DEFAULT_STAGES
    assert all(s["status"] == "ok" for s in report["stages"].values()), report["stages"]
    parity = report["stages"]["parity"]["result"]
    assert parity["cases"] == parity["cases_planned"] > 0 and parity["differing_elements"] == 0
    from hhook.codec.kernels import cuda as cuda_kernels

    assert report["stages"]["sanitizer"]["result"]["kernels"] == len(cuda_kernels.KERNEL_NAMES)
    assert report["stages"]["tests"]["result"]["collected"] > 100
    assert (tmp_path / "gpu-check.log").stat().st_size > 0


def test_verdicts_say_met_missed_or_not_measured():
    stages = {
        "tests": {"result": {"passed": 40, "failed": 1, "errors": 0}},
        "parity": {"result": {"differing_elements": 0}},
        "throughput": {"result": {"rows": [{"mb": 100, "dtype": "float32", "of_copy": 0.52}]}},
        "train": {"result": {"gpt": {"methods": [{"method": "thc:4", "loss_vs_fp32": 0.004},
                                                 {"method": "fp16", "loss_vs_fp32": 0.5}]}}},
    }
    v = gpu_check.verdicts(stages)
    assert v["every CUDA test passes"] is False and v["zero bit differences"] is True
    assert v["encode + decode >= 0.5x a copy at 100 MB"] is True
    assert v["THC's training loss within 1% of fp32's"] is True
    assert v["zero sanitizer errors"] is None and v["zero host syncs from hhook (NCCL, mode 'error')"] is None


def test_parity_plan_spans_the_lengths_and_inputs_the_issue_names():
    import torch

    cases = gpu_check.parity_cases(dry=False)
    assert min(c["numel"] for c in cases) <= 1000 and max(c["numel"] for c in cases) >= 100_000_000
    assert {c["bits"] for c in cases} >= set(range(2, 9)) and {c["rounding"] for c in cases} == {"correlated", "independent"}
    assert {c["dtype"] for c in cases} == {torch.float32, torch.bfloat16, torch.float16}
    assert {c["kind"] for c in cases} == {"random", "zeros", "nonfinite", "subnormal", "outlier"}
    assert all(c["numel"] % 1024 for c in cases if c["numel"] > 1024)  # lengths off the block
