"""hhook's CUDA path on one GPU, in one prepared run (docs/gpu.md; ``bash ci/gpu_check.sh``).

Stages, most decisive first, so what matters most exists if time runs out. Each runs in a
child process of its own (a crash or a hang costs that stage only) under what is left
of the run's budget, and the JSON file is rewritten after every stage:

1. ``env``        versions, the GPU, the kernels' NVRTC compile (time, architecture);
2. ``fsdp``       FSDP2 training for real on CUDA: a 256-1024-1024-16 MLP sharded layer by
                  layer with ``fully_shard`` and then the root, 6 Adam steps, on 2 ranks
                  sharing the GPU over Gloo with ``hhook.fsdp.register(model)`` (the
                  default, ``bits="auto"``) and with ``register(model, bits=4,
                  all_gather=8)``, and in a world of one on NCCL (``bits=4,
                  all_gather=8``). Per case: pass/fail with the reasons, the loss, the
                  reduce-scatter's counters and ``hhook.fsdp.all_gather_stats(model)``.
                  The two-rank cases fail unless both collectives made compressed calls
                  and every rank's loss fell; the world of one (where FSDP2 calls no
                  comm) must train. Every rank is a process of its own: what it raised
                  is reported with its traceback, a rank still running after a peer
                  failed (or at the stage's end) is killed after its stack was dumped,
                  and the report says which and why (never a bare timeout);
3. ``speed``      issue 44's quick look (``--only speed``: under 2 minutes): per bucket of
                  25 and 100 MB, fp32 and bf16, THC encode + decode through ``THCCodec``
                  (4 bits, lanes for 16 ranks, allocations included), torch's fp16 hook's
                  compress + decompress of the same bucket (one cast each way), a
                  device-to-device copy, the host's time to issue one THC bucket, and the
                  ratios THC/fp16 and THC's GB/s over the copy's; a table on the console
                  with the device's name, the rows in the JSON (``hhook.profile.codec_bench``'s
                  timers; the dry run on CPU tensors of 1/1000 the size);
4. ``tests``      tests/codec/test_cuda.py and test_cuda_transport.py on the GPU (not the CPU emulator's cases): kernels,
                  two ranks sharing the GPU over Gloo, side streams, allocator pressure,
                  no host sync from hhook, the default ``bits="auto"`` hook;
5. ``parity``     the kernels against the reference codec, bit for bit: random and
                  adversarial inputs (zeros, inf/NaN, subnormals, an outlier, lengths off
                  the block), fp32/bf16/fp16, 2-8 bits, both roundings, 1 K to 100 M;
6. ``throughput`` encode, decode and each stage against a device-to-device copy of the
                  same bytes (25/100/400 MB), host time per bucket; FSDP2's all-gather
                  codec (``WeightCodec``, 8 bits, blocks of 256) encode and decode at 25
                  and 100 MB (``hhook.profile.codec_bench``'s timers; the dry run runs
                  them on CPU tensors of 1/100 the size);
7. ``sanitizer``  compute-sanitizer memcheck and racecheck over each kernel, small;
8. ``nccl``       a world of one on NCCL through the hook's real path (the second
                  communicator on NCCL, ``set_sync_debug_mode("error")`` after the first
                  call);
9. ``train``      DDP, 2 ranks sharing the GPU over Gloo: fp32, the fp16 hook, THC 4 bits
                  and ``hhook.register``'s default, on wide-cnn and gpt.

``--dry-run`` runs everything that needs no GPU (imports, arguments, the JSON writer, the
two-rank FSDP2 cases on CPU tensors over Gloo, the speed and throughput timers on small
CPU tensors, the parity sweep and the kernel smoke run
on the CPU emulator of the kernels, pytest's collection) and says what it would run on a
GPU; CI runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import faulthandler
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _path in (ROOT, ROOT / "tests" / "support"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))



@dataclasses.dataclass
class Context:
    dry: bool
    deadline: float  # time.monotonic() by which the stage must be done
    work: Path  # a scratch folder of this stage
    partial: dict = dataclasses.field(default_factory=dict)  # what a stage measured before it failed

    def left(self, reserve: float = 0.0) -> float:
        return self.deadline - time.monotonic() - reserve


def _run(cmd, timeout: float, env=None, cwd=ROOT) -> subprocess.CompletedProcess:
    """``cmd`` with its output captured, killed with its whole process group at ``timeout``."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        out += f"\n[gpu_check: killed after {timeout:.0f} s]"
        return subprocess.CompletedProcess(cmd, -9, out, None)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, None)


def _tail(text: str, n: int = 3000) -> str:
    return text if len(text) <= n else "..." + text[-n:]


# -- 1. env ---------------------------------------------------------------------------------
def _sanitizer_path() -> str | None:
    found = shutil.which("compute-sanitizer")
    for candidate in (found, "/usr/local/cuda/bin/compute-sanitizer", "/usr/local/cuda/compute-sanitizer/compute-sanitizer"):
        if candidate and os.path.exists(candidate):
            return candidate
    return None


def stage_env(ctx: Context) -> dict:
    import torch
    import torch.distributed as dist

    import hhook
    from hhook.codec.kernels import cuda as cuda_kernels

    info = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "hhook": os.path.dirname(hhook.__file__), "nccl_available": dist.is_nccl_available(),
            "cupy_cache_dir": os.environ.get("CUPY_CACHE_DIR"), "compute_sanitizer": _sanitizer_path()}
    nvcc = shutil.which("nvcc")
    if nvcc:
        info["nvcc"] = _run([nvcc, "--version"], 30).stdout.strip().splitlines()[-1]
    try:
        import cupy

        info["cupy"] = cupy.__version__
    except Exception as err:  # noqa: BLE001 - reported
        info["cupy"] = f"not importable: {type(err).__name__}: {err}"
    if ctx.dry:
        info["would"] = "read the GPU's name and capability, compile the kernels with NVRTC and time it"
        return info
    props = torch.cuda.get_device_properties(0)
    info.update(gpu=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                memory_gib=round(props.total_memory / 2**30, 1), device_count=torch.cuda.device_count())
    smi = shutil.which("nvidia-smi")
    if smi:
        info["nvidia_smi"] = _run([smi, "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                                   "--format=csv,noheader"], 30).stdout.strip()
    start = time.perf_counter()
    info["kernels_compiled"] = cuda_kernels.warm_up(0)
    info["compile_s"] = round(time.perf_counter() - start, 3)
    import cupy.cuda.compiler as compiler

    info["nvrtc_arch"] = compiler._get_arch()
    info["nvrtc_version"] = ".".join(map(str, compiler._get_nvrtc_version()))
    if not info["kernels_compiled"]:
        raise RuntimeError(f"the kernels did not compile: {info}")
    return info


# -- 2. fsdp ---------------------------------------------------------------------------------
# A case's ranks are processes of their own (``--rank-job``); on a GPU each case has its own
# processes, all started at once; the dry run runs its cases one after the other in one
# pair of processes (importing torch's FSDP costs more than the steps). A rank writes each
# case's result, or the traceback of what it raised, to its file the moment it has it,
# and after a failure leaves at once without tearing the process group down (a peer may
# be blocked in a collective). The parent waits for every rank; once a rank has failed,
# the peers of its process group get FSDP_GRACE_S seconds to fail too, then SIGUSR1
# (faulthandler prints every thread's stack into the rank's log) and SIGKILL. So the
# report names each rank's fate: what it returned, what it raised, or where it stood when
# it was killed and why.
FSDP_STEPS = 6
FSDP_GRACE_S = 5.0


@dataclasses.dataclass
class RankProc:
    group: str  # the process group's name: its cases' names joined
    rank: int
    proc: subprocess.Popen
    result: Path
    log: Path
    killed: str | None = None

    def outcomes(self) -> dict:
        try:
            return json.loads(self.result.read_text())
        except (OSError, ValueError):
            return {}

    def failed(self) -> bool:
        return any(not o["ok"] for o in self.outcomes().values()) or self.proc.poll() not in (None, 0)


def fsdp_cases(dry: bool) -> list[dict]:
    """FSDP2 cases (tests/support/cuda_support.py's ``fsdp_training``): two ranks over Gloo (sharing
    the GPU, or on CPU tensors in the dry run) with the default and with bits=4 +
    all_gather=8, both of which must compress both collectives; on a GPU a world of one on
    NCCL too (FSDP2 calls no comm in a shard group of one: it must train, nothing more)."""
    device = "cpu" if dry else "cuda"
    cases = [dict(name=f"gloo_2_ranks_{register}", world=2, backend="gloo", device=device, register=register,
                  must_compress=True) for register in ("default", "bits4_ag8")]
    if not dry:
        cases.append(dict(name="nccl_world_of_one_bits4_ag8", world=1, backend="nccl", device="cuda",
                          register="bits4_ag8", must_compress=False))
    return cases


def rank_main(job: dict) -> int:
    """One rank of a process group running ``job["cases"]`` in turn (``--rank-job JSON``):
    each case's result or traceback into the JSON file ``job["result"]``."""
    import datetime as dt

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent's last look before a kill
    out, outcomes = Path(job["result"]), {}

    def write(name: str, value: dict) -> None:
        outcomes[name] = value
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(outcomes, default=str))
        tmp.replace(out)  # the parent never reads half a file

    code, name = 0, job["cases"][0]["name"]
    try:
        import torch
        import torch.distributed as dist

        from cuda_support import FSDP_CASES, fsdp_training

        extra = {}
        if job["device"] == "cuda":
            torch.cuda.set_device(0)  # Gloo ranks share GPU 0 (NCCL refuses two ranks on one GPU)
            if job["backend"] == "nccl":
                extra["device_id"] = torch.device("cuda", 0)
        dist.init_process_group(job["backend"], init_method=f"tcp://127.0.0.1:{job['port']}", rank=job["rank"],
                                world_size=job["world"], timeout=dt.timedelta(seconds=job["pg_timeout"]), **extra)
        for case in job["cases"]:
            name = case["name"]
            write(name, {"ok": True, "result": fsdp_training(job["rank"], job["world"], job["device"],
                                                              FSDP_CASES[case["register"]], job["steps"])})
    except BaseException:  # noqa: BLE001 - the parent reports it
        write(name, {"ok": False, "error": traceback.format_exc()})
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no teardown: a peer may still be blocked in a collective


def start_ranks(cases: list[dict], work: Path, timeout: float) -> list[RankProc]:
    """The ranks of one process group that runs ``cases`` (one world, backend, device) in turn."""
    from hhook.launch import free_port

    first, port = cases[0], free_port("127.0.0.1")
    group = "+".join(c["name"] for c in cases)
    procs = []
    for rank in range(first["world"]):
        result, log = work / f"{first['name']}-rank{rank}.json", work / f"{first['name']}-rank{rank}.log"
        job = dict(rank=rank, world=first["world"], backend=first["backend"], device=first["device"], port=port,
                   cases=[{"name": c["name"], "register": c["register"]} for c in cases], steps=FSDP_STEPS,
                   result=str(result), pg_timeout=max(5, int(timeout) - 5))  # a collective that never completes raises
        with open(log, "w") as f:
            proc = subprocess.Popen([sys.executable, __file__, "--rank-job", json.dumps(job)], cwd=ROOT,
                                    env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=f, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        procs.append(RankProc(group, rank, proc, result, log))
    return procs


def wait_ranks(procs: list[RankProc], deadline: float, grace: float = FSDP_GRACE_S) -> None:
    """Until every rank has exited: kill (stacks first) the peers of a failed rank after
    ``grace`` seconds, and everyone left at ``deadline``; ``killed`` says why."""
    failed_at: dict = {}  # process group -> (rank, time) of its first failure
    while True:
        alive = [p for p in procs if p.proc.poll() is None]
        now = time.monotonic()
        for p in procs:
            if p.group not in failed_at and p.failed():
                failed_at[p.group] = (p.rank, now)
        doomed = []
        for p in alive:
            if now >= deadline:
                p.killed = "killed: the stage's time ran out"
            elif p.group in failed_at and now >= failed_at[p.group][1] + grace:
                p.killed = f"killed {grace:g} s after rank {failed_at[p.group][0]} of its process group had failed"
            else:
                continue
            doomed.append(p)
        for p in doomed:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.proc.pid, signal.SIGUSR1)
        if doomed:
            time.sleep(1.0)
        for p in doomed:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.proc.pid, signal.SIGKILL)
            p.proc.wait()
        if not alive:
            return
        if not doomed:
            time.sleep(0.05)


def rank_report(p: RankProc, case: str) -> dict:
    """Rank ``p``'s fate in ``case``: returned, raised (the traceback), or why not."""
    out = p.outcomes().get(case)
    entry = {"rank": p.rank, "exit_code": p.proc.returncode}
    if out is not None and out["ok"]:
        return {**entry, "status": "ok", "result": out["result"]}
    if out is not None:
        entry.update(status="raised", error=_tail(out["error"], 4000))
    elif p.killed:
        entry["status"] = p.killed
    elif any(not o["ok"] for o in p.outcomes().values()):
        entry["status"] = "not run: an earlier case failed in this process"
    else:
        entry["status"] = f"exited with code {p.proc.returncode} before writing a result"
    log = p.log.read_text(errors="replace") if p.log.exists() else ""
    entry["log_tail"] = _tail(log, 4000)  # its stderr, and its stacks when it was killed
    return entry


def judge_case(case: dict, ranks: list[dict]) -> dict:
    """pass/fail with the reasons, rank 0's loss and the all-gather's stats."""
    reasons = []
    for r in ranks:
        if r["status"] == "raised":
            last = r["error"].strip().splitlines()[-1] if r["error"].strip() else "?"
            reasons.append(f"rank {r['rank']} raised {last}")
        elif r["status"] != "ok":
            reasons.append(f"rank {r['rank']} {r['status']}")
    entry = {"world": case["world"], "backend": case["backend"], "device": case["device"],
             "register": case["register"], "ranks": ranks}
    results = [r["result"] for r in ranks if r["status"] == "ok"]
    if len(results) == case["world"]:
        first = results[0]
        losses = [res["losses"] for res in results]
        entry.update(loss=first["losses"][-1], losses=first["losses"], all_gather_stats=first["all_gather_stats"],
                     reduce_scatter=first["reduce_scatter"], decision=first["decision"])
        if not all(v == v and abs(v) != float("inf") for ls in losses for v in ls):
            reasons.append("a loss is not finite")
        elif not all(ls[-1] < ls[0] for ls in losses):
            reasons.append(f"the loss did not fall in {len(first['losses'])} steps: {losses}")
        if case["must_compress"]:
            ag = first["all_gather_stats"]
            if ag is None:
                reasons.append("hhook.fsdp.all_gather_stats(model) is None: the all-gather is not compressed")
            elif not ag.get("compressed_calls"):
                reasons.append(f"no compressed all-gather call: {ag}")
            if not first["reduce_scatter"].get("compressed_calls"):
                reasons.append(f"no compressed reduce-scatter call: {first['reduce_scatter']}")
    entry["status"] = "fail" if reasons else "pass"
    entry["reasons"] = reasons
    return entry


def stage_fsdp(ctx: Context) -> dict:
    cases = fsdp_cases(ctx.dry)
    timeout = ctx.left(3)
    groups = [cases] if ctx.dry else [[c] for c in cases]
    procs = [start_ranks(g, ctx.work, timeout) for g in groups]
    wait_ranks([p for ps in procs for p in ps], time.monotonic() + timeout)
    result = ctx.partial
    for group, ps in zip(groups, procs):
        for case in group:
            result[case["name"]] = entry = judge_case(case, [rank_report(p, case["name"]) for p in ps])
            print(f"fsdp: {case['name']}: {entry['status']}" + (
                f": {'; '.join(entry['reasons'])}" if entry["reasons"]
                else f", loss {entry['loss']:.4f}, all-gather {entry['all_gather_stats']}"), flush=True)
            for r in entry["ranks"]:
                if r["status"] != "ok":
                    print(f"--- rank {r['rank']}: {r['status']}\n{r.get('error') or r['log_tail']}", flush=True)
    if ctx.dry:
        result["would"] = "on cuda:0: " + ", ".join(c["name"] for c in fsdp_cases(False))
    failed = {k: v["reasons"] for k, v in result.items() if isinstance(v, dict) and v.get("status") == "fail"}
    if failed:
        raise RuntimeError(f"failed: {failed}")
    return result


# -- speed (issue 44) ----------------------------------------------------------------------------
SPEED_PLAN = ((25, "float32"), (25, "bfloat16"), (100, "float32"), (100, "bfloat16"))  # MB, dtype
SPEED_WORLD = 16  # THC's lanes hold the sum of 16 ranks' codes (8-bit lanes at 4 bits)


def speed_rows(device: str, scale: float, iters: int, host_iters: int) -> list[dict]:
    """Per bucket of ``SPEED_PLAN`` (``scale`` times its MB): THC encode + decode through
    ``THCCodec`` (4 bits, lanes for 16 ranks, allocations included), torch's fp16 hook's
    compress + decompress (one cast each way), a copy of the bucket, and the host's time
    to issue one THC bucket, with hhook.profile.codec_bench's timers."""
    import torch

    from hhook.codec import THCCodec
    from hhook.profile import codec_bench as bench

    codec = THCCodec(bits=4, block_size=1024, seed=1, world_size=SPEED_WORLD)
    rows = []
    for mb, name in SPEED_PLAN:
        dtype = getattr(torch, name)
        x = torch.randn(int(mb * scale * 1e6) // dtype.itemsize, dtype=torch.float32, device=device).to(dtype)
        thc = bench.roundtrip_seconds(codec, x, iters)
        fp16 = bench.fp16_hook_seconds(x, iters, SPEED_WORLD)
        copy = bench.copy_seconds(x, iters)
        host = bench.host_time_per_bucket(codec, x, host_iters)
        rows.append({"mb": mb * scale, "dtype": name, "thc_ms": thc * 1e3, "fp16_hook_ms": fp16 * 1e3,
                     "copy_ms": copy * 1e3, "host_us": host * 1e6, "thc_vs_fp16": thc / fp16,
                     "thc_gbps": x.nbytes / thc / 1e9, "copy_gbps": x.nbytes / copy / 1e9, "thc_of_copy": copy / thc,
                     "fp16_of_copy": copy / fp16})
        del x
    return rows


def speed_table(rows: list[dict], device: str) -> str:
    head = (f"{'bucket':>9} {'dtype':>8} {'THC ms':>8} {'fp16 ms':>8} {'copy ms':>8} {'host us':>8} "
            f"{'THC/fp16':>8} {'THC GB/s':>9} {'of copy':>8}")
    lines = [f"# {device}: THCCodec 4 bits, lanes for {SPEED_WORLD} ranks, encode + decode (allocations "
             "included); fp16 hook: one cast each way; copy: device to device; host: issuing one THC bucket",
             head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['mb']:>6g} MB {r['dtype']:>8} {r['thc_ms']:>8.3f} {r['fp16_hook_ms']:>8.3f} "
                     f"{r['copy_ms']:>8.3f} {r['host_us']:>8.1f} {r['thc_vs_fp16']:>7.2f}x {r['thc_gbps']:>9.1f} "
                     f"{r['thc_of_copy']:>7.2f}x")
    return "\n".join(lines)


def stage_speed(ctx: Context) -> dict:
    """Issue 44's quick look (``--only speed``: under 2 minutes on a GPU, the kernels'
    compile included): the table of :func:`speed_rows`; the dry run on CPU tensors of
    1/1000 the size."""
    import torch

    if ctx.dry:
        device, scale, iters, host_iters, name = "cpu", 1e-3, 2, 2, "cpu (dry run, 1/1000 the sizes)"
    else:
        device, scale, iters, host_iters, name = "cuda", 1.0, 20, 50, torch.cuda.get_device_name()
    rows = speed_rows(device, scale, iters, host_iters)
    table = speed_table(rows, name)
    print(table, flush=True)
    return {"device": name, "table": table, "rows": [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}
                                     for r in rows],
            "note": "ms: medians of CUDA-event timings on a GPU (wall clock on CPU); host_us: the minimum wall-clock "
                    "time to issue one THC bucket (prepare, quantize, decode); thc_vs_fp16: THC's time over the fp16 "
                    "hook's; thc_of_copy: THC's GB/s as a fraction of the copy's"}


# -- 2. tests ---------------------------------------------------------------------------------
def _junit(path: Path) -> dict:
    import xml.etree.ElementTree as ET

    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failed, skipped = [], {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            counts["passed"] += 1
        elif outcome.tag == "skipped":
            counts["skipped"] += 1
            reason = (outcome.get("message") or "")[:200]
            skipped[reason] = skipped.get(reason, 0) + 1
        else:
            counts["failed" if outcome.tag == "failure" else "errors"] += 1
            failed.append({"test": name, "message": _tail((outcome.get("message") or "") + "\n" + (outcome.text or ""), 2500)})
    return {**counts, "failed_tests": failed, "skip_reasons": skipped}


def stage_tests(ctx: Context) -> dict:
    xml = ctx.work / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/codec/test_cuda.py",
           "tests/codec/test_cuda_transport.py", "-rfEs",
           f"--junitxml={xml}", "-o", "junit_family=xunit1"]
    # On a GPU: every test but the CPU emulator's and nvcc's (CI runs those), 8 at a time
    # (pytest-xdist where installed).
    if ctx.dry:
        cmd += ["--collect-only"]
    else:
        cmd += ["-k", "not emulated and not nvcc"]
        if importlib.util.find_spec("xdist") is not None:
            cmd += ["-n", "8"]
    done = _run(cmd, ctx.left(5))
    print(done.stdout)
    result = ctx.partial
    result.update(command=" ".join(cmd[1:]), returncode=done.returncode, output_tail=_tail(done.stdout, 4000))
    if ctx.dry:
        result["collected"] = int(m.group(1)) if (m := re.search(r"(\d+) tests? collected", done.stdout)) else None
        if done.returncode != 0:
            raise RuntimeError(f"pytest could not collect tests/codec/test_cuda*.py:\n{_tail(done.stdout)}")
        return result
    if xml.exists():
        result.update(_junit(xml))
    if done.returncode != 0:
        raise RuntimeError(f"pytest returned {done.returncode}")
    return result


# -- 3. parity --------------------------------------------------------------------------------
def parity_cases(dry: bool) -> list[dict]:
    """The sweep's cases: the whole cross on small lengths, fewer as they grow."""
    import torch

    from cuda_support import KINDS

    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    roundings = ("correlated", "independent")
    if dry:  # the emulator runs a thread per CUDA thread: a sample
        return [dict(kind=k, numel=1025, dtype=dtypes[i % 3], bits=(2, 5, 8)[i % 3], rounding=roundings[i % 2])
                for i, k in enumerate(KINDS * 2)]
    big = [dict(kind="random", numel=100_000_007, dtype=torch.float32, bits=4, rounding="correlated"),
           dict(kind="random", numel=100_000_007, dtype=torch.bfloat16, bits=2, rounding="independent"),
           dict(kind="outlier", numel=100_000_007, dtype=torch.float16, bits=8, rounding="correlated"),
           dict(kind="subnormal", numel=100_000_007, dtype=torch.float32, bits=3, rounding="independent")]
    cross = [dict(kind=k, numel=n, dtype=d, bits=b, rounding=r)
             for n in (1000, 4097, 65539) for k in KINDS for d in dtypes for b in range(2, 9) for r in roundings]
    cases = cross[:210] + big[:1] + cross[210:]  # 1000 whole, one 100 M, then the rest as time allows
    cases += [dict(kind=k, numel=65539, dtype=torch.float32, bits=b, rounding=r, block_size=bs)
              for bs in (64, 4096) for k in KINDS for b in (3, 7) for r in roundings]
    cases += [dict(kind=k, numel=(1 << 20) + 3, dtype=d, bits=b, rounding=r)
              for k in KINDS for d in dtypes for b in (2, 5, 8) for r in roundings]
    cases += [dict(kind=k, numel=25_000_003, dtype=d, bits=4, rounding="correlated")
              for k in ("random", "nonfinite", "outlier") for d in dtypes]
    cases += big[1:]
    return cases


def stage_parity(ctx: Context) -> dict:
    import torch

    from cuda_support import build_emulator, emulated, parity_sweep

    torch.backends.cuda.matmul.allow_tf32 = False
    cases = parity_cases(ctx.dry)
    if ctx.dry:
        with emulated(build_emulator(ctx.work)):
            result = parity_sweep(cases, "cpu", time.monotonic() + ctx.left(5))
        result["would"] = f"run {len(parity_cases(False))} cases on cuda:0 (1 K to 100 M coordinates)"
    else:
        result = parity_sweep(cases, "cuda", time.monotonic() + ctx.left(5))
    if result["differing_elements"]:
        raise RuntimeError(f"the kernels differ from the reference: {result['failing'][:3]}")
    return result


# -- 4. throughput ----------------------------------------------------------------------------
def _bench_cuda():
    spec = importlib.util.spec_from_file_location("bench_cuda", ROOT / "examples" / "bench_cuda.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stage_throughput(ctx: Context) -> dict:
    import torch

    from hhook.codec import THCCodec
    from hhook.codec.weights import WeightCodec
    from hhook.profile import codec_bench as bench

    codec = THCCodec(bits=4, block_size=1024, seed=1, world_size=4)
    weights = WeightCodec(bits=8, block_size=256, seed=1)
    if ctx.dry:  # the same code on CPU tensors of 256 KB, two timed repeats
        device, iters, scale = "cpu", 2, 0.01
    else:
        device, iters, scale = "cuda", 20, 1.0
    plan = [(torch.float32, 25), (torch.float32, 100), (torch.bfloat16, 100), (torch.float32, 400)]
    if ctx.dry:
        plan = plan[:1] + plan[2:3]
    rows = []
    for dtype, mb in plan:
        x = torch.randn(int(mb * scale * 1e6) // dtype.itemsize, dtype=torch.float32, device=device).to(dtype)
        t = bench.stage_times(codec, x, iters=iters)
        fused = t["encode_s"] + t["decode_s"]
        rows.append({"dtype": str(dtype).replace("torch.", ""), "mb": mb * scale,
                     **{k: round(v * 1e3, 4) for k, v in t.items()},
                     "of_copy": round(t["copy_s"] / fused, 3), "encode_of_copy": round(t["copy_s"] / t["encode_s"], 3),
                     "decode_of_copy": round(t["copy_s"] / t["decode_s"], 3),
                     "copy_gbps": round(2 * x.nbytes / t["copy_s"] / 1e9, 1)})
        del x
    # FSDP2's all-gather codec (8 bits, blocks of 256) on a float32 shard
    weight_rows = []
    for mb in (25, 100):
        n = int(mb * scale * 1e6) // 4 // weights.block_size * weights.block_size
        x = torch.randn(n, dtype=torch.float32, device=device)
        t = bench.weight_codec_times(weights, x, iters)
        weight_rows.append({"mb": round(n * 4 / 1e6, 3), "bits": weights.bits, "block_size": weights.block_size,
                            **{k: round(v * 1e3, 4) for k, v in t.items() if k.endswith("_s")},
                            "encode_of_copy": round(t["copy_s"] / t["encode_s"], 3),
                            "decode_of_copy": round(t["copy_s"] / t["decode_s"], 3),
                            "ratio_vs_bf16": round(2 * n / t["payload_bytes"], 3)})
        del x
    if device == "cuda":
        torch.cuda.empty_cache()
    bucket = torch.randn(int(25 * scale * 1e6) // 4, dtype=torch.float32, device=device)
    host = bench.host_time_per_bucket(codec, bucket, 50 if not ctx.dry else 3)
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "rows": rows,
              "weight_codec": weight_rows, f"host_us_per_{25 * scale:g}mb_bucket": round(host * 1e6, 1),
              "note": "*_s are milliseconds (medians of CUDA-event timings on a GPU, wall clock on CPU); "
                      "of_copy = copy time / (encode + decode) time; weight_codec: hhook.codec.weights.WeightCodec "
                      "(FSDP2's all-gather), encode includes the shard's copy into its block workspace"}
    if ctx.dry:
        result["would"] = "the same on cuda:0 at 25/100/400 MB, and the reference codec at 25 MB"
    else:
        ref = _bench_cuda().codec_throughput(codec, [25], (torch.float32,), 5)[0]
        result["vs_reference_25mb"] = round(ref["vs_ref"], 1)
    return result


# -- 5. sanitizer -----------------------------------------------------------------------------
def kernel_smoke(device: str) -> list[str]:
    """Every kernel once on small inputs (for compute-sanitizer): each input dtype, int32
    and int64 words, blocks of 64/1024/4096, residual in place and into another buffer,
    decode into each output dtype. Returns the kernels launched."""
    import torch

    from hhook.codec.kernels import cuda as cuda_kernels
    from hhook.codec import THCCodec

    launched = set()
    run = cuda_kernels._launch

    def counting(launch, dev):
        launched.add(launch.name)
        run(launch, dev)

    cuda_kernels._launch = counting
    try:
        for bits, world in ((2, 4), (8, 16)):  # int32 and int64 words
            for block in (64, 1024, 4096):
                codec = THCCodec(bits=bits, block_size=block, seed=3, world_size=world)
                for dtype in (torch.float32, torch.bfloat16, torch.float16):
                    x = torch.randn(5003, device=device).to(dtype)
                    p = cuda_kernels.prepare(codec, x)
                    agreed = p.scales.clone()
                    agreed[3] += 1
                    residual = torch.zeros(codec.n_blocks(5003) * block, device=device)
                    codec.quantize(p, agreed, 1, residual)
                    words = codec.quantize(p, agreed, 2, residual, torch.empty_like(residual))
                    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
                        codec.decode(p, agreed, words, torch.empty(5003, dtype=out_dtype, device=device))
        if device != "cpu":
            torch.cuda.synchronize()
    finally:
        cuda_kernels._launch = run
    return sorted(launched)


def stage_sanitizer(ctx: Context) -> dict:
    from hhook.codec.kernels import cuda as cuda_kernels

    if ctx.dry:
        from cuda_support import build_emulator, emulated

        with emulated(build_emulator(ctx.work)):
            launched = kernel_smoke("cpu")
        missing = sorted(set(cuda_kernels.KERNEL_NAMES) - set(launched))
        if missing:
            raise RuntimeError(f"the smoke run misses kernels: {missing}")
        return {"kernels": len(launched), "would": "compute-sanitizer --tool memcheck and --tool racecheck over it"}
    tool_path = _sanitizer_path()
    if tool_path is None:
        raise RuntimeError("compute-sanitizer not found")
    env = {**os.environ, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}  # one allocation per tensor: bounds are checked
    result = ctx.partial
    for tool in ("memcheck", "racecheck"):
        cmd = [tool_path, "--tool", tool, "--error-exitcode", "9", "--print-limit", "20",
               sys.executable, __file__, "--kernel-smoke"]
        done = _run(cmd, ctx.left(3) / (2 if tool == "memcheck" else 1), env=env)
        errors = re.search(r"ERROR SUMMARY: (\d+) error", done.stdout)
        hazards = re.search(r"RACECHECK SUMMARY: (\d+) hazard", done.stdout)
        launched = re.search(r"kernels launched: (\d+)", done.stdout)
        result[tool] = {"returncode": done.returncode, "errors": int(errors.group(1)) if errors else None,
                        "hazards": int(hazards.group(1)) if hazards else None,
                        "kernels": int(launched.group(1)) if launched else None, "output_tail": _tail(done.stdout, 2500)}
    bad = [t for t, r in result.items() if r["returncode"] != 0 or r["errors"] or r["hazards"]]
    if bad:
        raise RuntimeError(f"compute-sanitizer: {bad}")
    return result


# -- 6. train ---------------------------------------------------------------------------------
TRAIN_RUNS = (("wide-cnn", 150), ("gpt", 100))  # steps: what fits the run's 8 minutes
TRAIN_METHODS = "fp32,fp16,thc:4,thc:auto"


def _train_summary(rows: list[dict]) -> list[dict]:
    """Per method: step time, bytes, and the training loss against fp32's at the same
    steps (the mean over the evaluations of the second half)."""
    def late_loss(row):
        evals = row.get("evals") or []
        late = [e["loss"] for e in evals if e["step"] > row["steps"] / 2]
        return sum(late) / len(late) if late else None

    fp32 = next((late_loss(r) for r in rows if r["method"] == "fp32" and r["status"] == "ok"), None)
    out = []
    for r in rows:
        item = {k: r.get(k) for k in ("method", "status", "message", "median_ms", "p90_ms", "bytes_per_step",
                                      "final_accuracy", "final_val_loss", "decision")}
        if r["status"] == "ok":
            item["late_train_loss"] = late_loss(r)
            if fp32 and item["late_train_loss"] is not None:
                item["loss_vs_fp32"] = round(item["late_train_loss"] / fp32 - 1, 4)
        out.append(item)
    return out


def _two_ranks(cmd, timeout: float) -> subprocess.CompletedProcess:
    """``cmd`` as ranks 0 and 1 of one job, as torchrun would set them up but without its
    rendezvous (a machine without a network can still meet on 127.0.0.1); rank 0's output."""
    from hhook.launch import free_port

    base = {**os.environ, "OMP_NUM_THREADS": "2", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port("127.0.0.1"))}
    other = subprocess.Popen(cmd, cwd=ROOT, env={**base, "RANK": "1", "LOCAL_RANK": "1"}, stdout=subprocess.DEVNULL,
                             stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return _run(cmd, timeout, env={**base, "RANK": "0", "LOCAL_RANK": "0"})
    finally:
        try:
            other.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(other.pid, signal.SIGKILL)


def stage_train(ctx: Context) -> dict:
    result = ctx.partial
    for model, steps in TRAIN_RUNS:
        path = ctx.work / f"train-{model}.json"
        args = ["-m", "hhook.profile", "train", "--model", model, "--methods", TRAIN_METHODS, "--steps", str(steps),
                "--backend", "gloo", "--device", "cuda", "--eval-every", "25", "--timeout", "30", "--quiet",
                "--json", str(path)]
        if ctx.dry:  # the arguments parse, --device included
            done = _run([sys.executable, *args[:3], "--help"], ctx.left(2))
            if done.returncode != 0 or "--device" not in done.stdout:
                raise RuntimeError(f"hhook-profile train --help:\n{_tail(done.stdout)}")
            result[model] = {"would": "2 ranks (RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1) of python " + " ".join(args)}
            continue
        done = _two_ranks([sys.executable, *args], ctx.left(2))
        print(done.stdout)
        entry = {"returncode": done.returncode, "output_tail": _tail(done.stdout, 2500)}
        if path.exists():
            entry["methods"] = _train_summary(json.loads(path.read_text())["results"])
        result[model] = entry
    return result


# -- 7. NCCL world of one, FSDP2 on CUDA --------------------------------------------------------
def _wait(futures, seconds: float = 20.0) -> None:
    """Wait for ``futures`` on the host, at most ``seconds``: a future that a failed
    continuation never completes is a finding, not a hang of the check."""
    limit = time.monotonic() + seconds
    while not all(f.done() for f in futures):
        if time.monotonic() > limit:
            raise TimeoutError(f"{sum(not f.done() for f in futures)} of {len(futures)} futures never completed")
        time.sleep(0.001)
    for f in futures:
        f.wait()


def _nccl_world_of_one() -> dict:
    """The hook's real path in a world of one on NCCL (flat._reduce: the MAX, the SUM on
    the second communicator, decode). After a first call (the handshake), 5 rounds under
    sync debug mode "warn" name the host syncs issued from hhook's files, then 10 under
    "error" (on the default and a side stream, two keys in flight) must raise nothing."""
    import warnings

    import torch
    import torch.distributed as dist

    import hhook
    from hhook.schedule.flat import _reduce, second_group
    from hhook.launch import free_port

    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port('127.0.0.1')}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    print("nccl: process group", flush=True)
    try:
        state = hhook.THCState(bits=4)
        device = torch.device("cuda", 0)
        ctx = state.context()  # the handshake (nothing to compare in a world of one), a plain CallContext
        out = {"second_communicator": type(second_group(ctx, device).backend).__name__}
        hhook_dir = os.path.dirname(hhook.__file__)
        side = torch.cuda.Stream()
        pairs = []

        def rounds(n: int) -> None:
            for _ in range(n):
                for stream in (torch.cuda.current_stream(), side):
                    with torch.cuda.stream(stream):
                        xs = [torch.randn(300_007 * (k + 1), device=device) for k in range(2)]
                        pairs.extend((x, x.clone()) for x in xs)
                        _wait([_reduce(ctx, x, f"k{k}", (tuple(x.shape), str(x.dtype))) for k, x in enumerate(xs)])

        rounds(1)
        torch.cuda.synchronize()
        print("nccl: first call done", flush=True)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                rounds(5)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        out["warn_mode_syncs_from_hhook"] = sorted({f"{os.path.relpath(w.filename, hhook_dir)}:{w.lineno}" for w in seen
                                                    if "synchroniz" in str(w.message) and w.filename.startswith(hhook_dir)})
        print(f"nccl: warn mode done: {out['warn_mode_syncs_from_hhook']}", flush=True)
        errors = []
        torch.cuda.set_sync_debug_mode("error")
        try:
            rounds(10)
        except Exception as err:  # noqa: BLE001 - reported
            errors.append(f"{type(err).__name__}: {err}"[:800])
        finally:
            torch.cuda.set_sync_debug_mode(0)
        print(f"nccl: error mode done: {errors}", flush=True)
        torch.cuda.synchronize()
        state.check_deferred(wait=True)
        exact = all(bool(torch.equal(x, want)) for x, want in pairs)  # a world of one: the input itself
        out.update(host_sync_errors=errors, calls=len(pairs), results_exact=exact, stats=state.stats())
        return out
    finally:
        dist.destroy_process_group()


def stage_nccl(ctx: Context) -> dict:
    if ctx.dry:
        from hhook.schedule.flat import _reduce  # noqa: F401 - the path the GPU run takes exists

        return {"would": "a world of one on NCCL through hhook.schedule.flat._reduce, sync debug mode 'error'"}
    result = ctx.partial
    try:
        result["nccl_world_of_one"] = _nccl_world_of_one()
    except Exception as err:  # noqa: BLE001 - reported
        result["nccl_world_of_one"] = {"error": _tail(f"{type(err).__name__}: {err}", 4000)}
    failed = [k for k, v in result.items() if "error" in v or v.get("host_sync_errors")
              or v.get("warn_mode_syncs_from_hhook") or v.get("results_exact") is False]
    if failed:
        raise RuntimeError(f"failed: {failed}")
    return result


# -- ncu (only with --only): where the kernels' time goes ----------------------------------------
NCU_METRICS = ("Duration", "Memory Throughput", "DRAM Throughput", "Compute (SM) Throughput", "Registers Per Thread",
               "Achieved Occupancy", "Theoretical Occupancy")


def kernel_bench() -> None:
    """prepare, quantize and decode once each on 100 MB of float32 (for ncu)."""
    import torch

    from hhook.codec import THCCodec

    codec = THCCodec(bits=4, block_size=1024, seed=1, world_size=4)
    x = torch.randn(25_000_000, device="cuda")
    p = codec.prepare(x)
    agreed = p.scales.clone()
    agreed[3] += 1
    codec.decode(p, agreed, codec.quantize(p, agreed, 7), torch.empty_like(x))
    torch.cuda.synchronize()


def stage_ncu(ctx: Context) -> dict:
    import csv
    import io

    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    cmd = [ncu, "--kernel-name", "regex:hh_", "--launch-count", "3", "--section", "SpeedOfLight", "--section",
           "Occupancy", "--section", "LaunchStats", "--csv", sys.executable, __file__, "--kernel-bench"]
    if ctx.dry:
        return {"would": " ".join(cmd)}
    done = _run(cmd, ctx.left(2))
    print(done.stdout)
    rows = {}
    text = done.stdout[done.stdout.find('"ID"'):] if '"ID"' in done.stdout else ""
    for row in csv.DictReader(io.StringIO(text)):
        if row.get("Metric Name") in NCU_METRICS:
            rows.setdefault(row["Kernel Name"].split("(")[0], {})[row["Metric Name"]] = f"{row['Metric Value']} {row['Metric Unit']}"
    ctx.partial.update(returncode=done.returncode, kernels=rows)
    if not rows:
        raise RuntimeError(f"ncu measured nothing:\n{_tail(done.stdout)}")
    return ctx.partial


# -- the driver -------------------------------------------------------------------------------
STAGES = {  # name: (function, seconds at most on a GPU)
    "env": (stage_env, 40),
    "fsdp": (stage_fsdp, 60),
    "speed": (stage_speed, 60),
    "tests": (stage_tests, 100),
    "parity": (stage_parity, 75),
    "throughput": (stage_throughput, 40),
    "sanitizer": (stage_sanitizer, 75),
    "nccl": (stage_nccl, 30),
    "train": (stage_train, 150),
    "ncu": (stage_ncu, 50),  # not run by default: --only ncu
}
DEFAULT_STAGES = [name for name in STAGES if name != "ncu"]


def run_stage(name: str, dry: bool, deadline: float, result_path: Path) -> int:
    """The child: one stage, its result (or error) written to ``result_path``."""
    work = Path(tempfile.mkdtemp(prefix=f"gpu-check-{name}-"))
    ctx = Context(dry, deadline, work)
    # A hang prints every thread's stack to the log before the parent kills the stage.
    faulthandler.dump_traceback_later(max(1.0, ctx.left(4)), exit=False)
    try:
        out = {"status": "ok", "result": STAGES[name][0](ctx)}
    except BaseException as err:  # noqa: BLE001 - the parent records it
        out = {"status": "failed", "error": _tail(traceback.format_exc(), 6000), "result": ctx.partial}
        if isinstance(err, RuntimeError) and getattr(err, "args", None):
            out["error_summary"] = str(err)[:1000]
    result_path.write_text(json.dumps(out, default=str, indent=1))
    return 0 if out["status"] == "ok" else 1


def verdicts(stages: dict) -> dict:
    """The issue's targets, met or missed, from what the stages measured."""
    def get(*keys):
        node = stages
        for k in keys:
            node = node.get(k) if isinstance(node, dict) else None
        return node

    tests = get("tests", "result") or {}
    thr = [r for r in get("throughput", "result", "rows") or [] if r["mb"] == 100 and r["dtype"] == "float32"]
    san = get("sanitizer", "result") or {}
    nccl = get("nccl", "result", "nccl_world_of_one") or {}
    fsdp = [v for v in (get("fsdp", "result") or {}).values() if isinstance(v, dict) and "status" in v]
    speed = {(r["mb"], r["dtype"]): r for r in get("speed", "result", "rows") or []}
    s25, s100 = speed.get((25, "float32")), speed.get((100, "float32"))
    losses = [m.get("loss_vs_fp32") for run in (get("train", "result") or {}).values() if isinstance(run, dict)
              for m in run.get("methods", []) if m["method"].startswith("thc")]
    return {
        "every CUDA test passes": None if "passed" not in tests else tests["failed"] + tests["errors"] == 0,
        "FSDP2 trains on CUDA, both collectives compressed (2 ranks)": None if not fsdp
        else all(v["status"] == "pass" for v in fsdp),
        "zero bit differences": None if get("parity", "result") is None else get("parity", "result", "differing_elements") == 0,
        "zero sanitizer errors": None if not san else all(not r["errors"] and not r["hazards"] for r in san.values()),
        "zero host syncs from hhook (NCCL, mode 'error')": None if "host_sync_errors" not in nccl
        else not nccl["host_sync_errors"] and not nccl.get("warn_mode_syncs_from_hhook"),
        "THC encode + decode <= 2x the fp16 hook's casts (25 MB fp32)": None if not s25 else s25["thc_vs_fp16"] <= 2,
        "host <= 50 us to issue a 25 MB fp32 bucket": None if not s25 else s25["host_us"] <= 50,
        "THC >= 0.4x a copy's GB/s at 100 MB fp32": None if not s100 else s100["thc_of_copy"] >= 0.4,
        "encode + decode >= 0.5x a copy at 100 MB": None if not thr else thr[0]["of_copy"] >= 0.5,
        "THC's training loss within 1% of fp32's": None if not losses or None in losses else max(losses) <= 0.01,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="everything that needs no GPU; say what else would run")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench"), help="folder of the JSON and log")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for the whole run (default 450)")
    parser.add_argument("--only", help="comma-separated stages to run (default: all, in order)")
    parser.add_argument("--stage", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--kernel-smoke", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kernel-bench", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank-job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_job:
        return rank_main(json.loads(args.rank_job))
    if args.kernel_bench:
        kernel_bench()
        return 0
    if args.kernel_smoke:
        print(f"kernels launched: {len(kernel_smoke('cuda'))}")
        return 0
    if args.stage:
        return run_stage(args.stage, args.dry_run, args.deadline, Path(args.result))
    names = DEFAULT_STAGES if not args.only else args.only.split(",")
    unknown = [n for n in names if n not in STAGES]
    if unknown:
        parser.error(f"unknown stages {unknown} (known: {', '.join(STAGES)})")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "gpu-check" if not args.only else "gpu-check-" + "-".join(names)  # a partial rerun keeps the full run's files
    json_path, log_path = out_dir / f"{stem}.json", out_dir / f"{stem}.log"
    start = time.monotonic()
    end = start + args.budget
    report = {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "host": platform.node(), "dry_run": args.dry_run, "budget_s": args.budget,
              "command": "bash ci/gpu_check.sh " + " ".join(sys.argv[1:]), "stages": {}}
    with open(log_path, "w") as log:
        for name in names:
            left = end - time.monotonic()
            limit = min(STAGES[name][1], left) if not args.dry_run else left
            if limit < 10:
                report["stages"][name] = {"status": "skipped", "error": "out of time"}
                continue
            print(f"== {name} ({'dry run, ' if args.dry_run else ''}at most {limit:.0f} s)", flush=True)
            log.write(f"== {name}\n")
            log.flush()
            result_path = Path(tempfile.mkstemp(prefix=f"gpu-check-{name}-", suffix=".json")[1])
            cmd = [sys.executable, __file__, "--stage", name, "--result", str(result_path),
                   "--deadline", str(time.monotonic() + limit - 3)] + (["--dry-run"] if args.dry_run else [])
            t0 = time.monotonic()
            done = _run(cmd, limit)
            log.write(done.stdout + "\n")
            log.flush()
            try:
                entry = json.loads(result_path.read_text())
            except (OSError, ValueError):
                entry = {"status": "timeout" if done.returncode == -9 else "crashed",
                         "error": _tail(done.stdout, 4000)}
            entry["seconds"] = round(time.monotonic() - t0, 1)
            report["stages"][name] = entry
            print(f"   {entry['status']} in {entry['seconds']} s" +
                  (f": {entry.get('error_summary') or entry.get('error', '')[-300:]}" if entry["status"] != "ok" else ""),
                  flush=True)
            if isinstance(entry.get("result"), dict) and entry["result"].get("table"):
                print(entry["result"]["table"], flush=True)  # a stage's table on the console too
            report["seconds"] = round(time.monotonic() - start, 1)
            if not args.dry_run:
                report["targets"] = verdicts(report["stages"])
            json_path.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {json_path} and {log_path}")
    if report.get("targets"):
        for target, met in report["targets"].items():
            print(f"  {'met' if met else 'not measured' if met is None else 'MISSED'}: {target}")
    return 0 if all(s["status"] == "ok" for s in report["stages"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
