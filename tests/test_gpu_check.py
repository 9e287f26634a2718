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
                          timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["dry_run"] and list(report["stages"]) == gpu_check.DEFAULT_STAGES
    assert all(s["status"] == "ok" for s in report["stages"].values()), report["stages"]
    assert report["rerun"] is None and "targets" not in report
    env_result = report["stages"]["env"]["result"]
    assert env_result["source"]["sources_sha256"] and "usable" in env_result["network_namespaces"]
    parity = report["stages"]["parity"]["result"]
    assert parity["cases"] == parity["cases_planned"] > 0 and parity["differing_elements"] == 0
    cross = parity["cpu_vs_cuda"]  # CUDA (here its CPU emulator) against the CPU codec: the same bits (issue 50)
    assert cross["cases"] == cross["cases_planned"] > 0 and cross["decoded_coordinates"] > 0
    assert cross["cases_differing"] == cross["scales"] == cross["words"] == cross["decode"] == 0, cross
    from hhook.codec.kernels import cuda as cuda_kernels

    assert report["stages"]["sanitizer"]["result"]["kernels"] == len(cuda_kernels.KERNEL_NAMES + cuda_kernels.WEIGHT_KERNEL_NAMES)
    assert report["stages"]["tests"]["result"]["collected"] > 100
    fsdp = report["stages"]["fsdp"]["result"]
    for name in ("gloo_2_ranks_default", "gloo_2_ranks_bits4_ag8"):  # FSDP2 for real, on CPU tensors
        assert fsdp[name]["status"] == "pass" and fsdp[name]["all_gather_stats"]["compressed_calls"] > 0
    speed = report["stages"]["speed"]["result"]
    assert len(speed["rows"]) == len(gpu_check.SPEED_PLAN) and "THC ms" in speed["table"]
    weight = report["stages"]["throughput"]["result"]["weight_codec"]  # FSDP2's all-gather codec, timed
    assert len(weight) == 2 and all(r["encode_s"] > 0 and r["decode_s"] > 0 and r["vs_thc_codec"] > 0 for r in weight)
    step = report["stages"]["step"]["result"]  # the step stage's machinery: 2 ranks, every case, on loopback
    assert step["network"]["mode"] == "loopback" and "dry run" in step["network"]["why"]
    assert set(step["runs"]) == {"loopback", "nccl1"} and "would" in step["runs"]["nccl1"]
    rows = step["runs"]["loopback"]["rows"]
    assert {(r["model"], r["method"]) for r in rows} == {(m, k) for m in gpu_check.STEP_DRY["models"]
                                                         for k in gpu_check.STEP_METHODS}
    assert all(r["status"] == "ok" and r["ms_per_step"] > 0 and r["val_loss"] > 0 for r in rows), rows
    for model in gpu_check.STEP_DRY["models"]:
        sent = {r["method"]: r["bytes_per_step"] for r in rows if r["model"] == model}
        assert sent["thc:4"] < sent["fp16"] < sent["fp32"] and sent["fp16"] * 2 == sent["fp32"]
    assert "LOOPBACK" in step["table"]
    assert (tmp_path / "gpu-check.log").stat().st_size > 0


def test_only_takes_stages_and_presets_in_value_order_with_env_first():
    assert gpu_check.stages_of(None) == gpu_check.DEFAULT_STAGES and gpu_check.DEFAULT_STAGES[0] == "env"
    assert gpu_check.stages_of("nccl,speed") == ["env", "speed", "nccl"]
    assert gpu_check.stages_of("train") == ["env", "step", "fsdp", "nccl"]
    assert gpu_check.stages_of("kernels,ncu")[-1] == "ncu" and "step" not in gpu_check.stages_of("kernels")
    import pytest

    with pytest.raises(ValueError, match="unknown stage or preset 'bogus'"):
        gpu_check.stages_of("speed,bogus")


def test_budget_keeps_later_stages_needs_and_fits_one_call():
    """A stage's limit never eats the needs of the stages after it (a hang costs its own
    slice), never passes its cap, and the default run's needs fit the default budget."""
    names = gpu_check.DEFAULT_STAGES
    assert sum(gpu_check.STAGES[n][1] for n in names) <= gpu_check.DEFAULT_BUDGET <= 300
    for i, name in enumerate(names):
        need, cap = gpu_check.STAGES[name][1:]
        later = sum(gpu_check.STAGES[n][1] for n in names[i + 1:])
        for left in (need + later, need + later + 30, 1000.0):
            limit = gpu_check.stage_limit(name, names[i + 1:], left)
            assert need <= limit <= cap and left - limit >= later, (name, left, limit)
    assert gpu_check.stage_limit("step", ["nccl"], 20.0) == 20.0  # short of time: what is left, for the earlier one


def test_rerun_hint_names_what_did_not_end_well():
    report = {"stages": {"env": {"status": "ok"}, "speed": {"status": "ok"}, "step": {"status": "timeout"},
                         "nccl": {"status": "skipped"}}}
    assert gpu_check.rerun_hint(report) == "bash ci/gpu_check.sh --only step,nccl --budget 270"
    assert gpu_check.rerun_hint({"stages": {"env": {"status": "ok"}}}) is None
    short = {"stages": {"env": {"status": "ok"}, "parity": {"status": "ok", "result": {"incomplete": True}},
                        "step": {"status": "ok", "result": {"incomplete": ["1gbit", "nccl1"]}}}}
    assert gpu_check.rerun_hint(short) == "bash ci/gpu_check.sh --only parity,step --budget 270 --step-runs 1gbit,nccl1"


def test_step_stage_verdict_wants_every_model_at_both_links_or_loopback():
    def run(models, methods=("fp32", "fp16", "thc:4", "thc:auto"), status="ok"):
        return {"rows": [{"model": m, "method": k, "status": status, "val_loss": 1.0} for m in models for k in methods]}

    key = "step stage: THC 4 bits and the default beside the fp16 hook at 10 and 1 Gbit/s (or loopback, said)"
    both = {"10gbit": run(["gpt", "resnet18"]), "1gbit": run(["gpt", "resnet18"])}
    assert gpu_check.verdicts({"step": {"result": {"runs": both}}})[key] is True
    assert gpu_check.verdicts({"step": {"result": {"runs": {"loopback": run(["gpt"])}}}})[key] is True
    assert gpu_check.verdicts({"step": {"result": {"runs": {"10gbit": run(["gpt"])}}}})[key] is False  # 1 Gbit/s?
    late = {**both, "1gbit": run(["gpt"], ("fp16", "thc:4"))}  # the default not reached at 1 Gbit/s
    assert gpu_check.verdicts({"step": {"result": {"runs": late}}})[key] is False
    fell_back = {"10gbit": run(["gpt"], status="failed"), "loopback": run(["gpt", "resnet18"])}  # said, and trained
    assert gpu_check.verdicts({"step": {"result": {"runs": fell_back}}})[key] is True
    assert gpu_check.verdicts({})[key] is None


def test_a_failing_step_case_costs_its_own_pair_not_the_cases_after_it(tmp_path):
    """run_step_cases: the ranks run the cases in one process each; a case that raises
    ends that pair, and the cases after it run in a fresh one."""
    import time

    data, _ = gpu_check.task_data(["mlp"], tmp_path)
    good = gpu_check.step_cases(["mlp"], ["fp16"], data)
    bad = [{**good[0], "name": "mlp/broken", "spec": {**good[0]["spec"], "data_path": str(tmp_path / "missing.pt")}}]
    common = dict(world_size=2, backend="gloo", device="cpu", threads=1, seed=0, steps=2, eval_every=2,
                  pg_timeout_s=20, parallel="ddp", ranks_per_node=None)
    outcomes, pairs = gpu_check.run_step_cases(gpu_check.StepRun("t", 2, "gloo"), bad + good, common, tmp_path,
                                               time.monotonic() + 240)
    assert pairs == 2
    assert {r["status"] for r in outcomes["mlp/broken"]} == {"raised"}
    assert "missing.pt" in outcomes["mlp/broken"][0]["error"]
    assert [r["status"] for r in outcomes["mlp/fp16"]] == ["ok", "ok"]
    rows = gpu_check.step_rows(bad + good, outcomes, 2)
    assert [r["status"] for r in rows] == ["failed", "ok"] and "missing.pt" in rows[0]["message"]


def test_verdicts_say_met_missed_or_not_measured():
    stages = {
        "tests": {"result": {"passed": 40, "failed": 1, "errors": 0}},
        "parity": {"result": {"differing_elements": 0, "cpu_vs_cuda": {"cases": 3, "cases_planned": 9,
                                                                        "cases_differing": 1}}},
        "throughput": {"result": {"weight_codec": [{"mb": 25.0, "vs_thc_codec": 3.0}, {"mb": 99.99, "vs_thc_codec": 1.4}]}},
    }
    v = gpu_check.verdicts(stages)
    assert v["every CUDA test passes"] is False and v["zero bit differences from the reference in the kernels' order"]
    assert v["CUDA and CPU codecs bit-identical (issue 50's cases)"] is False
    assert v["all-gather codec of a 100 MB shard within 1.5x THC's codec time"] is True
    assert v["zero sanitizer errors"] is None and v["zero host syncs from hhook (NCCL, mode 'error')"] is None
    clean = {"parity": {"result": {"differing_elements": 0, "cpu_vs_cuda": {"cases": 3, "cases_planned": 9,
                                                                             "cases_differing": 0}}}}
    assert gpu_check.verdicts(clean)["CUDA and CPU codecs bit-identical (issue 50's cases)"] is None  # not all run


def test_parity_plan_spans_the_lengths_and_inputs_the_issue_names():
    import torch

    cases = gpu_check.parity_cases(dry=False)
    assert min(c["numel"] for c in cases) <= 1000 and max(c["numel"] for c in cases) >= 100_000_000
    assert {c["bits"] for c in cases} >= set(range(2, 9)) and {c["rounding"] for c in cases} == {"correlated", "independent"}
    assert {c["dtype"] for c in cases} == {torch.float32, torch.bfloat16, torch.float16}
    assert {c["kind"] for c in cases} == {"random", "zeros", "nonfinite", "subnormal", "outlier"}
    assert all(c["numel"] % 1024 for c in cases if c["numel"] > 1024)  # lengths off the block


def _fake_rank(tmp_path, group, rank, script):
    """A stand-in rank process running ``script`` (its result file: ``RESULT``), for the
    parent's side of the FSDP stage: waiting, killing, reporting."""
    result, log = tmp_path / f"{group}-{rank}.json", tmp_path / f"{group}-{rank}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-c", f"RESULT = {str(result)!r}\n" + script], stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return gpu_check.RankProc(group, rank, proc, result, log)


RAISES = """
import json, sys
json.dump({"c": {"ok": False, "error": "Traceback (most recent call last):\\n  File ...\\nAttributeError: module "
                 "'torch.distributed' has no attribute 'all_gather_single'"}}, open(RESULT, "w"))
sys.exit(1)
"""
HANGS = """
import faulthandler, signal, time
faulthandler.register(signal.SIGUSR1, all_threads=True)
def blocked_in_a_collective():
    time.sleep(600)
blocked_in_a_collective()
"""
DIES = "import os; os._exit(7)\n"


def test_fsdp_stage_reports_each_ranks_exception_or_where_it_hung(tmp_path):
    """Issue 42: two ranks that failed read as 'timed out; ranks that answered: []'. Now a
    rank that raised is reported with its traceback, its hung peer is killed a grace
    period later with its stack in the report, and a rank that died says its exit code."""
    import time

    case = dict(name="c", world=2, backend="gloo", device="cpu", register="default", must_compress=True)
    procs = [_fake_rank(tmp_path, "c", 0, RAISES), _fake_rank(tmp_path, "c", 1, HANGS)]
    start = time.monotonic()
    gpu_check.wait_ranks(procs, time.monotonic() + 60, grace=1.0)
    assert time.monotonic() - start < 30  # not the deadline: the grace after rank 0's failure
    entry = gpu_check.judge_case(case, [gpu_check.rank_report(p, "c") for p in procs])
    assert entry["status"] == "fail"
    r0, r1 = entry["ranks"]
    assert r0["status"] == "raised" and "all_gather_single" in r0["error"]
    assert "rank 1 killed 1 s after rank 0" in " ".join(entry["reasons"])
    assert "blocked_in_a_collective" in r1["log_tail"]  # its stack, dumped before the kill
    assert any("rank 0 raised AttributeError" in reason for reason in entry["reasons"])

    procs = [_fake_rank(tmp_path, "d", 0, HANGS), _fake_rank(tmp_path, "d", 1, DIES)]
    gpu_check.wait_ranks(procs, time.monotonic() + 60, grace=1.0)
    r0, r1 = (gpu_check.rank_report(p, "d") for p in procs)
    assert r1["status"] == "exited with code 7 before writing a result" and "after rank 1" in r0["status"]

    procs = [_fake_rank(tmp_path, "e", 0, HANGS)]
    gpu_check.wait_ranks(procs, time.monotonic() + 1.5)
    assert gpu_check.rank_report(procs[0], "e")["status"] == "killed: the stage's time ran out"


def test_fsdp_case_fails_without_compressed_calls_or_a_falling_loss():
    case = dict(name="c", world=1, backend="gloo", device="cpu", register="default", must_compress=True)
    good = {"losses": [1.0, 0.5], "all_gather_stats": {"compressed_calls": 3}, "reduce_scatter": {"compressed_calls": 2},
            "decision": None}
    assert gpu_check.judge_case(case, [{"rank": 0, "status": "ok", "result": good}])["status"] == "pass"
    for change, reason in (({"all_gather_stats": None}, "is None"),
                           ({"all_gather_stats": {"compressed_calls": 0}}, "no compressed all-gather call"),
                           ({"reduce_scatter": {"compressed_calls": 0}}, "no compressed reduce-scatter call"),
                           ({"losses": [1.0, 1.5]}, "did not fall"), ({"losses": [1.0, float("nan")]}, "not finite")):
        entry = gpu_check.judge_case(case, [{"rank": 0, "status": "ok", "result": {**good, **change}}])
        assert entry["status"] == "fail" and reason in " ".join(entry["reasons"]), (change, entry["reasons"])
    # a world of one on NCCL: FSDP2 calls no comm, so only training is asked of it
    lone = {**case, "must_compress": False}
    assert gpu_check.judge_case(lone, [{"rank": 0, "status": "ok", "result": {**good, "all_gather_stats": None}}]
                                )["status"] == "pass"


def test_a_rank_job_writes_its_traceback(tmp_path):
    """rank_main itself: what a rank raises lands in its result file, and it exits 1."""
    from tests.support.distributed import free_port

    job = dict(kind="fsdp", rank=0, world=1, backend="gloo", device="cpu", port=free_port(), steps=1,
               cases=[{"name": "bad", "register": "no such case"}], result=str(tmp_path / "r.json"), pg_timeout=30)
    done = subprocess.run([sys.executable, str(ROOT / "ci" / "gpu_check.py"), "--rank-job", json.dumps(job)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    out = json.loads((tmp_path / "r.json").read_text())
    assert not out["bad"]["ok"] and "KeyError: 'no such case'" in out["bad"]["error"]


def test_fsdp_verdict():
    passed = {"status": "pass"}
    key = "FSDP2 trains on CUDA, both collectives compressed (2 ranks)"
    assert gpu_check.verdicts({"fsdp": {"result": {"a": passed, "b": passed}}})[key] is True
    assert gpu_check.verdicts({"fsdp": {"result": {"a": passed, "b": {"status": "fail"}}}})[key] is False
    assert gpu_check.verdicts({})[key] is None


def test_the_shared_timers_run_on_cpu():
    """hhook.profile.codec_bench's per-bucket timers (the throughput and speed stages, and
    examples/bench_cuda.py) on CPU tensors: times, the input left as it was."""
    import pytest
    import torch

    from hhook.codec import THCCodec
    from hhook.codec.weights import WeightCodec
    from hhook.profile import codec_bench as bench

    x = torch.randn(4096, dtype=torch.float32)
    kept = x.clone()
    assert bench.fp16_hook_seconds(x, 2) > 0 and bench.copy_seconds(x, 2) > 0
    assert bench.roundtrip_seconds(THCCodec(4, 1024, 1, 16), x, 2) > 0
    assert bench.host_time_per_bucket(THCCodec(4, 1024, 1, 16), x, 2) > 0
    assert torch.equal(x, kept)
    t = bench.weight_codec_times(WeightCodec(8, 256), x, 2)
    assert t["payload_bytes"] == WeightCodec(8, 256).nbytes(16) and min(t["encode_s"], t["decode_s"]) > 0
    with pytest.raises(ValueError, match="whole blocks"):
        bench.weight_codec_times(WeightCodec(8, 256), x[:1000], 2)


def test_speed_rows_and_table_on_cpu():
    """Issue 44's speed stage on CPU tensors: every bucket of the plan, each column
    measured, the ratios computed from the times, the device named in the table."""
    rows = gpu_check.speed_rows("cpu", 1e-4, iters=1, host_iters=1)
    assert [(r["mb"] / 1e-4, r["dtype"]) for r in rows] == [(mb, d) for mb, d in gpu_check.SPEED_PLAN]
    for r in rows:
        assert min(r["thc_ms"], r["fp16_hook_ms"], r["copy_ms"], r["host_us"]) > 0
        assert abs(r["thc_vs_fp16"] - r["thc_ms"] / r["fp16_hook_ms"]) < 1e-9
        assert abs(r["thc_of_copy"] - r["copy_ms"] / r["thc_ms"]) < 1e-9
    table = gpu_check.speed_table(rows, "Some GPU")
    assert table.startswith("# Some GPU") and len(table.splitlines()) == 3 + len(rows)


def test_speed_verdicts():
    """Issue 50's kernel targets, from the speed stage's rows."""
    rows = [{"mb": 25, "dtype": "float32", "thc_vs_fp16": 5.1, "host_us": 19.0},
            {"mb": 100, "dtype": "float32", "thc_of_copy": 0.45}, {"mb": 100, "dtype": "bfloat16", "thc_of_copy": 0.12}]
    v = gpu_check.verdicts({"speed": {"result": {"rows": rows}}})
    assert v["THC encode + decode <= 2x the fp16 hook's casts (25 MB fp32)"] is False
    assert v["host <= 20 us to issue a 25 MB fp32 bucket"] is True
    assert v["THC >= 0.4x a copy's GB/s at 100 MB fp32"] is True
    assert v["THC >= 0.3x a copy's GB/s at 100 MB bf16"] is False


def test_gpu_cluster_model_follows_the_ring_and_the_lane_width():
    """hhook-profile model --gpu-cluster (hhook.profile.gpu_model): the rows are the ring
    alpha-beta sums the docstring states, and their trends hold."""
    from hhook.codec import THCCodec
    from hhook.profile import gpu_model
    from hhook.profile.models import ring_allreduce_s

    rows = gpu_model.exchange_rows(codec_s=0.3e-3, cast_s=0.06e-3, bucket_bytes=25_000_000, step_bytes=100_000_000,
                                   alpha=10e-6)
    assert len(rows) == len(gpu_model.GPU_COUNTS) * len(gpu_model.LINKS_GBIT)
    r = next(r for r in rows if r["gpus"] == 8 and r["link_gbit"] == 100)
    beta, codec = 100e9 / 8, THCCodec(4, 1024, 0, 8)
    scales = 4 * codec.scales_numel(6_250_000)
    thc = (ring_allreduce_s(8, scales, 10e-6, beta) + ring_allreduce_s(8, codec.wire_bytes(6_250_000) - scales,
                                                                          10e-6, beta) + 0.3e-3)
    assert abs(r["thc_ms"] - 4 * thc * 1e3) < 1e-9 and r["buckets"] == 4
    assert abs(r["half_ms"] - 4 * (ring_allreduce_s(8, 12_500_000, 10e-6, beta) + 0.06e-3) * 1e3) < 1e-9
    lanes = [next(r["lane_bits"] for r in rows if r["gpus"] == n) for n in gpu_model.GPU_COUNTS]
    assert lanes == sorted(lanes) and lanes[0] < lanes[-1]  # wider lanes for more ranks
    for n in gpu_model.GPU_COUNTS:  # a faster link leaves less for compression to save
        gains = [r["thc_vs_half"] for r in rows if r["gpus"] == n]
        assert gains == sorted(gains, reverse=True)


def test_gpu_cluster_model_command(tmp_path):
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    done = subprocess.run([sys.executable, "-m", "hhook.profile", "model", "--gpu-cluster", "--thc-ms", "0.33",
                           "--cast-ms", "0.064", "--json", str(tmp_path / "m.json")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "A MODEL, not a measurement" in done.stdout and "vs bf16" in done.stdout
    doc = json.loads((tmp_path / "m.json").read_text())
    assert doc["meta"]["codec_source"] == "given" and len(doc["results"]) == 28
    import torch

    if not torch.cuda.is_available():  # nothing to measure the codec on: a usage error, not a made-up time
        done = subprocess.run([sys.executable, "-m", "hhook.profile", "model", "--gpu-cluster"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode != 0 and "--thc-ms" in done.stdout + done.stderr


H200 = {"stages": {"env": {"result": {"gpu": "NVIDIA H200"}}, "speed": {"result": {"rows": [  # issue 50's figures
    {"mb": 25, "dtype": "float32", "thc_ms": 0.332, "fp16_hook_ms": 0.064, "host_us": 290.0},
    {"mb": 100, "dtype": "float32", "thc_ms": 0.336, "fp16_hook_ms": 0.162, "host_us": 310.0},
    {"mb": 100, "dtype": "bfloat16", "thc_ms": 0.315, "fp16_hook_ms": 0.190, "host_us": 290.0}]}}}}


def test_gpu_cluster_model_takes_its_times_from_a_check_json(tmp_path):
    """model --gpu-cluster --from: the speed stage's float32 row nearest the bucket (not
    rescaled), its host time bounding THC's codec per bucket; the committed H100 run's
    throughput stage (no casts there: --cast-ms); a file without rows is refused."""
    import pytest

    from hhook.profile import gpu_model

    path = tmp_path / "h200.json"
    path.write_text(json.dumps(H200))
    t = gpu_model.from_check(str(path), 25_000_000)
    assert (t["codec_s"], t["cast_s"], t["host_s"]) == pytest.approx((0.332e-3, 0.064e-3, 290e-6))
    assert "NVIDIA H200" in t["source"]
    assert gpu_model.from_check(str(path), 80_000_000)["codec_s"] == pytest.approx(0.336e-3)  # nearest: as measured
    run1 = gpu_model.from_check(str(ROOT / "bench" / "gpu" / "gpu-check-run1.json"), 25_000_000)
    assert run1["cast_s"] is None and (run1["codec_s"], run1["host_s"]) == pytest.approx(((0.131 + 0.0597) * 1e-3,
                                                                                        150.3e-6))
    assert "H100" in run1["source"] and "throughput" in run1["source"]
    (tmp_path / "empty.json").write_text(json.dumps({"stages": {"env": {"result": {}}}}))
    with pytest.raises(ValueError, match="no float32 rows"):
        gpu_model.from_check(str(tmp_path / "empty.json"), 25_000_000)
    (tmp_path / "dry.json").write_text(json.dumps({**H200, "dry_run": True}))
    with pytest.raises(ValueError, match="dry run"):
        gpu_model.from_check(str(tmp_path / "dry.json"), 25_000_000)
    slow_host = gpu_model.exchange_rows(0.1e-3, 0.06e-3, 25_000_000, 100_000_000, 10e-6, host_s=0.3e-3)
    fast_host = gpu_model.exchange_rows(0.3e-3, 0.06e-3, 25_000_000, 100_000_000, 10e-6)
    assert [r["thc_ms"] for r in slow_host] == [r["thc_ms"] for r in fast_host]  # the larger of the two bounds
    assert all(r["thc_host_ms"] == pytest.approx(4 * 0.3) for r in slow_host)

    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
    done = subprocess.run([sys.executable, "-m", "hhook.profile", "model", "--gpu-cluster", "--from", str(path),
                           "--json", str(tmp_path / "m.json")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "A MODEL, not a measurement" in done.stdout and "NVIDIA H200" in done.stdout
    doc = json.loads((tmp_path / "m.json").read_text())
    assert (doc["meta"]["thc_ms_per_bucket"], doc["meta"]["host_us_per_bucket"]) == pytest.approx((0.332, 290.0))
    want = gpu_model.exchange_rows(0.332e-3, 0.064e-3, 25_000_000, 100_000_000, 10e-6, host_s=290e-6)
    assert [r["thc_vs_half"] for r in doc["results"]] == pytest.approx([r["thc_vs_half"] for r in want])
    if not __import__("torch").cuda.is_available():  # the H100 run has no casts: they must be given
        done = subprocess.run([sys.executable, "-m", "hhook.profile", "model", "--gpu-cluster", "--from",
                               str(ROOT / "bench" / "gpu" / "gpu-check-run1.json")], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode != 0 and "no fp16 casts" in done.stdout + done.stderr
