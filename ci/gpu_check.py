"""hhook's CUDA path on one GPU, in one prepared run (docs/gpu.md; ``bash ci/gpu_check.sh``).

Stages, most decisive first, so what matters most exists if time runs out. Each runs in a
child process of its own (a crash or a hang costs that stage only) under a time limit,
and the JSON file is rewritten after every stage. The run's budget (``--budget``, 270 s
by default: one call of about five minutes on a lent GPU) is shared out by
:data:`STAGES`: each stage has the seconds it needs on an H200 and a cap; while a stage
runs, the needs of the stages after it stay reserved, so a stage that hangs or fails
costs its own slice, never the next stage's. ``--only`` takes stage names and the
presets of :data:`PRESETS` (``env`` always runs first: every JSON says what ran where).

1. ``env``        versions (Python, torch, CUDA, cuDNN, NCCL, CuPy, its CUDA runtime and
                  NVRTC, the driver), the GPU, the checkout (git commit or a digest of its
                  sources), the kernels' NVRTC compile (time, architecture), and whether
                  network namespaces and tc work here (the step stage's links);
2. ``speed``      the kernel figures (issues 44 and 50): per bucket of 25 and 100 MB, fp32
                  and bf16, THC encode + decode through ``THCCodec`` (4 bits, lanes for 16
                  ranks, allocations included), torch's fp16 hook's compress + decompress
                  (one cast each way), a device-to-device copy, the host's time to issue
                  one THC bucket, the ratios THC/fp16 and THC's GB/s over the copy's
                  (``hhook.profile.codec_bench``'s timers; the dry run on CPU tensors of
                  1/1000 the size). ``hhook-profile model --gpu-cluster --from`` reads it;
3. ``parity``     the CUDA kernels against the CPU codec users run (fused C, else the
                  reference) on CPU tensors, stage by stage, over issue 50's cases (sizes,
                  fp32/bf16/fp16, block sizes 2-4096 with odd log2 B, lanes for 1-16 ranks):
                  how many coordinates differ; then the kernels against the reference codec
                  in the kernels' own order on the GPU, bit for bit (random and adversarial
                  inputs, 2-8 bits, both roundings, 1 K to 100 M), as time allows;
4. ``tests``      tests/codec/test_cuda.py and test_cuda_transport.py on the GPU (not the
                  CPU emulator's cases): kernels, two ranks sharing the GPU over Gloo, side
                  streams, allocator pressure, no host sync from hhook, the default
                  ``bits="auto"`` hook;
5. ``step``       real training steps (issue 50, point 4): ResNet-18 (11.2M parameters) and
                  the GPT of ``hhook-profile train``, DDP on 2 ranks sharing the GPU over
                  Gloo, the fp16 hook, THC 4 bits, ``hhook.register``'s default and fp32,
                  60 steps each (ms per step: the median of the last 30; loss; bytes),
                  through emulated 10 and 1 Gbit/s links (ci/netcluster.sh) where network
                  namespaces work, else over loopback (the output says which and why), then
                  a world of one on NCCL (what the hook adds to a step without a wire);
6. ``fsdp``       FSDP2 training for real on CUDA: a 256-1024-1024-16 MLP sharded layer by
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
7. ``throughput`` FSDP2's all-gather codec (``WeightCodec``, 8 bits, blocks of 256) encode
                  and decode at 25 and 100 MB against THC's codec on the same bytes; THC's
                  encode, decode and each stage against a device-to-device copy
                  (25/100/400 MB), host time per bucket (``hhook.profile.codec_bench``'s
                  timers; the dry run runs them on CPU tensors of 1/100 the size);
8. ``sanitizer``  compute-sanitizer memcheck and racecheck over each kernel, small;
9. ``nccl``       a world of one on NCCL through the hook's real path (the second
                  communicator on NCCL, ``set_sync_debug_mode("error")`` after the first
                  call).

``--dry-run`` runs everything that needs no GPU (imports, arguments, the JSON writer, the
two-rank FSDP2 cases and the step stage's machinery on CPU tensors over Gloo and loopback,
the speed and throughput timers on small CPU tensors, the parity sweeps and the kernel
smoke run on the CPU emulator of the kernels, pytest's collection) and says what it would
run on a GPU; CI runs it. It never changes the network.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import faulthandler
import importlib.util
import json
import math
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
for _path in (ROOT, ROOT / "src", ROOT / "tests" / "support"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
NETCLUSTER = ROOT / "ci" / "netcluster.sh"


@dataclasses.dataclass
class Context:
    dry: bool
    deadline: float  # time.monotonic() by which the stage must be done
    work: Path  # a scratch folder of this stage
    partial: dict = dataclasses.field(default_factory=dict)  # what a stage measured before it failed
    options: dict = dataclasses.field(default_factory=dict)  # the run's stage options (``--step-runs``)
    scratch: Path | None = None  # the run's folder: what a stage leaves for the driver to undo (a network)

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
def _cuda_tool(name: str, *elsewhere: str) -> str | None:
    """A CUDA tool on PATH, else where the toolkit puts it."""
    for candidate in (shutil.which(name), f"/usr/local/cuda/bin/{name}", *elsewhere):
        if candidate and os.path.exists(candidate):
            return candidate
    return None


def _sanitizer_path() -> str | None:
    return _cuda_tool("compute-sanitizer", "/usr/local/cuda/compute-sanitizer/compute-sanitizer")


def netns_probe() -> dict:
    """Whether ci/netcluster.sh can emulate links here: root, its tools, and a network
    namespace of this probe's own name with a veth pair, a bridge and a tbf qdisc in it
    (what ``netcluster.sh up`` makes); removed again. ``usable`` and, when not, ``why``."""
    tools = {t: shutil.which(t) for t in ("ip", "tc", "bridge", "unshare", "nsenter")}
    out = {"usable": False, "root": os.geteuid() == 0, "tools": tools}
    missing = [t for t, where in tools.items() if where is None]
    if not out["root"] or missing:
        out["why"] = "not root" if not out["root"] else f"missing {', '.join(missing)}"
        return out
    name = f"hhgc-probe-{os.getpid()}"
    steps = [["ip", "netns", "add", name],
             ["ip", "-n", name, "link", "add", "hhgc0", "type", "veth", "peer", "name", "hhgc1"],
             ["ip", "-n", name, "link", "add", "hhgcbr", "type", "bridge"],
             ["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "hhgc0", "root", "tbf", "rate", "1gbit",
              "burst", "262144", "latency", "20ms"]]
    try:
        for cmd in steps:
            done = _run(cmd, 15)
            if done.returncode != 0:
                out["why"] = f"{' '.join(cmd[:4])} ...: {done.stdout.strip()[-300:]}"
                return out
        out["usable"] = True
        return out
    finally:
        _run(["ip", "netns", "del", name], 15)


def source_identity() -> dict:
    """Which hhook ran: the git commit (and whether the tree had changes) where git and the
    repository are here, and always a digest of hhook's and this script's sources (a copy
    of a working tree carries no .git)."""
    import hashlib

    digest = hashlib.sha256()
    for path in sorted((ROOT / "src" / "hhook").rglob("*.py")) + sorted((ROOT / "src" / "hhook").rglob("*.cu")) + [Path(__file__)]:
        digest.update(path.relative_to(ROOT).as_posix().encode() + b"\0" + path.read_bytes())
    out = {"sources_sha256": digest.hexdigest()[:16]}
    if shutil.which("git") and (ROOT / ".git").exists():
        head = _run(["git", "rev-parse", "HEAD"], 10)
        dirty = _run(["git", "status", "--porcelain", "--untracked-files=no"], 10)
        if head.returncode == 0:
            out.update(commit=head.stdout.strip(), changed_files=len(dirty.stdout.splitlines()))
    return out


def _version(module: str) -> str | None:
    try:
        return importlib.import_module(module).__version__
    except Exception as err:  # noqa: BLE001 - reported
        return f"not importable: {type(err).__name__}"


def stage_env(ctx: Context) -> dict:
    import torch
    import torch.distributed as dist

    import hhook
    from hhook.codec.kernels import cuda as cuda_kernels

    info = {"python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "hhook": os.path.dirname(hhook.__file__), "source": source_identity(), "nccl_available": dist.is_nccl_available(),
            "cupy_cache_dir": os.environ.get("CUPY_CACHE_DIR"), "compute_sanitizer": _sanitizer_path(),
            "ncu": _cuda_tool("ncu"),
            "cpus": os.cpu_count(), "kernel": platform.release(),
            # what later stages lean on: the digits (step), pytest-xdist (tests, 8 at a time)
            "packages": {m: _version(m) for m in ("numpy", "sklearn", "xdist", "cupy")},
            "network_namespaces": netns_probe()}
    from hhook.profile.codec_bench import fused_available

    info["cpu_codec"] = "fused C" if fused_available("cpu") else "reference (no C compiler?)"  # parity's CPU side
    print(f"env: network namespaces {'usable' if info['network_namespaces']['usable'] else 'not usable: ' + info['network_namespaces']['why']}",
          flush=True)
    nvcc = shutil.which("nvcc")
    if nvcc:
        info["nvcc"] = _run([nvcc, "--version"], 30).stdout.strip().splitlines()[-1]
    try:
        import cupy

        info["cupy"] = cupy.__version__
    except Exception as err:  # noqa: BLE001 - reported
        info["cupy"] = f"not importable: {type(err).__name__}: {err}"
    if ctx.dry:
        info["would"] = ("read the GPU's name, capability, driver, cuDNN and NCCL versions, compile the kernels with NVRTC "
                         "and time it")
        return info
    props = torch.cuda.get_device_properties(0)
    info.update(gpu=props.name, capability=f"{props.major}.{props.minor}", sms=props.multi_processor_count,
                memory_gib=round(props.total_memory / 2**30, 1), device_count=torch.cuda.device_count(),
                cudnn=torch.backends.cudnn.version(),
                nccl=".".join(map(str, torch.cuda.nccl.version())) if dist.is_nccl_available() else None)
    smi = shutil.which("nvidia-smi")
    if smi:
        info["nvidia_smi"] = _run([smi, "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                                   "--format=csv,noheader"], 30).stdout.strip()
    start = time.perf_counter()
    info["kernels_compiled"] = cuda_kernels.warm_up(0)
    info["compile_s"] = round(time.perf_counter() - start, 3)
    import cupy
    import cupy.cuda.compiler as compiler

    info["nvrtc_arch"] = compiler._get_arch()
    info["nvrtc_version"] = ".".join(map(str, compiler._get_nvrtc_version()))
    info["cupy_cuda_runtime"] = cupy.cuda.runtime.runtimeGetVersion()
    info["cuda_driver"] = cupy.cuda.runtime.driverGetVersion()
    print(f"env: {info['gpu']}, torch {info['torch']}, CuPy {info['cupy']}, NVRTC {info['nvrtc_version']} "
          f"(sm_{info['nvrtc_arch']}), kernels compiled in {info['compile_s']} s", flush=True)
    if not info["kernels_compiled"]:
        raise RuntimeError(f"the kernels did not compile: {info}")
    return info


# -- 2. speed (issues 44 and 50) ----------------------------------------------------------------
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


# -- 3. parity --------------------------------------------------------------------------------
CROSS_BLOCKS = (2, 8, 32, 128, 512, 2048, 64, 1024, 4096)  # odd log2 B first (issue 50: the leftover pass)
CROSS_WORLDS = (1, 2, 3, 4, 16)  # lanes for 1-16 ranks


def cross_backend_cases(dry: bool) -> list[dict]:
    """Issue 50's cases of CUDA against the CPU: every block size x dtype x ranks' lanes on
    65539 coordinates (input kinds, bits and roundings cycling), then buckets of 4 M and of
    25 MB; the dry run (the CPU emulator of the kernels) a sample on 1025."""
    import torch

    from cuda_support import KINDS

    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    roundings = ("correlated", "independent")
    if dry:
        return [dict(kind=KINDS[i], numel=1025, dtype=dtypes[i % 3], bits=(2, 4, 8, 3, 5)[i], block_size=b, world=w,
                     rounding=roundings[i % 2]) for i, (b, w) in enumerate(((2, 1), (128, 3), (1024, 2), (8, 5), (512, 4)))]
    cases = [dict(kind=KINDS[i % 5], numel=65539, dtype=d, bits=(2, 4, 8, 3, 6, 5, 7)[i % 7], block_size=b, world=w,
                  rounding=roundings[i % 2])
             for i, (b, d, w) in enumerate((b, d, w) for b in CROSS_BLOCKS for d in dtypes for w in CROSS_WORLDS)]
    cases += [dict(kind="random", numel=(1 << 22) + 5, dtype=d, bits=4, block_size=b, world=4, rounding="correlated")
              for d in dtypes for b in (1024, 2048)]
    cases += [dict(kind="random", numel=6_250_003, dtype=d, bits=4, block_size=1024, world=16, rounding="correlated")
              for d in dtypes[:2]]
    return cases


def cross_backend_case(kind: str, numel: int, dtype, bits: int, block_size: int, world: int, rounding: str,
                       device) -> dict:
    """The CUDA kernels on ``device`` (the emulator on CPU tensors in the dry run) against
    the CPU codec users run on CPU tensors (fused C, else the reference), stage by stage:
    each rank's prepared scales and words under the CPU's agreed scales, and the decode of
    the CPU's summed words. Differing elements per stage."""
    import torch

    from cuda_support import adversarial, differing

    from hhook.codec import THCCodec
    from hhook.codec.kernels import cuda as cuda_kernels

    codec = THCCodec(bits=bits, block_size=block_size, seed=bits + 7, world_size=world, rounding=rounding)
    xs = [adversarial(kind, numel, dtype, seed=numel + 13 * r + bits) for r in range(world)]
    cpu = [codec.prepare(x) for x in xs]
    agreed = torch.stack([p.scales for p in cpu]).amax(0)
    words = [codec.quantize(p, agreed, codec.stream(r, 2)) for r, p in enumerate(cpu)]
    total = words[0].clone()
    for w in words[1:]:
        total += w
    want = codec.decode(cpu[0], agreed, total, torch.empty(numel, dtype=dtype))
    gpu = [cuda_kernels.prepare(codec, x.to(device)) for x in xs]
    on = agreed.to(device)
    diff = {"scales": sum(differing(g.scales.cpu(), c.scales) for g, c in zip(gpu, cpu)),
            "words": sum(differing(codec.quantize(g, on, codec.stream(r, 2)).cpu(), w)
                         for r, (g, w) in enumerate(zip(gpu, words)))}
    got = codec.decode(gpu[0], on, total.to(device), torch.empty(numel, dtype=dtype, device=device))
    diff["decode"] = differing(got.cpu(), want)
    backend = cpu[0].backend
    return {**diff, "cpu_codec": "reference" if backend is None else backend.__name__.rsplit(".", 1)[-1]}


def cross_backend_sweep(cases: list[dict], device, deadline: float) -> dict:
    """:func:`cross_backend_case` over ``cases`` until ``deadline``: totals per stage, the
    share of decoded coordinates that differ, and the first differing cases."""
    out = {"cases": 0, "cases_planned": len(cases), "cases_differing": 0, "scales": 0, "words": 0, "decode": 0,
           "decoded_coordinates": 0, "cpu_codec": None, "differing": []}
    for case in cases:
        if time.monotonic() > deadline:
            break
        diff = cross_backend_case(device=device, **case)
        out["cases"] += 1
        out["cpu_codec"] = diff.pop("cpu_codec")
        out["decoded_coordinates"] += case["numel"]
        for stage in ("scales", "words", "decode"):
            out[stage] += diff[stage]
        if any(diff.values()):
            out["cases_differing"] += 1
            if len(out["differing"]) < 20:
                out["differing"].append({**{k: str(v) for k, v in case.items()}, **diff,
                                         "decode_share": round(diff["decode"] / case["numel"], 4)})
    out["decode_share"] = round(out["decode"] / max(1, out["decoded_coordinates"]), 6)
    return out


def parity_cases(dry: bool) -> list[dict]:
    """The kernels-against-their-reference sweep's cases: the whole cross on small lengths,
    fewer as they grow."""
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


PARITY_CROSS_SHARE = 0.4  # of the stage's time, at most, for CUDA against the CPU (it needs about 10 s)


def emulator(ctx: Context):
    """The CPU emulator of the kernels (tests/support/cuda_support.py), compiled once per
    run: the parity and sanitizer stages' dry runs share it through the run's folder."""
    import ctypes

    from cuda_support import build_emulator

    shared = (ctx.scratch or ctx.work) / "kernel-emulator.so"
    if shared.exists():
        return ctypes.CDLL(str(shared))
    lib = build_emulator(ctx.work)
    if ctx.scratch is not None and (ctx.work / "emu.so").exists():  # build_emulator's output: whole, or not shared
        shutil.copy(ctx.work / "emu.so", shared.with_suffix(".tmp"))
        shared.with_suffix(".tmp").replace(shared)
    return lib


def stage_parity(ctx: Context) -> dict:
    """First CUDA against the CPU (issue 50's target: a measurement, reported with the
    share of coordinates that differ), then the kernels against the reference codec in
    the kernels' order (a difference there is a fault: the stage fails)."""
    import torch

    from cuda_support import emulated, parity_sweep

    torch.backends.cuda.matmul.allow_tf32 = False
    device = "cpu" if ctx.dry else "cuda"
    with emulated(emulator(ctx)) if ctx.dry else contextlib.nullcontext():
        cross = cross_backend_sweep(cross_backend_cases(ctx.dry), device,
                                    time.monotonic() + PARITY_CROSS_SHARE * ctx.left(5))
        print(f"parity: CUDA against the CPU ({cross['cpu_codec']} codec): {cross['cases']} of {cross['cases_planned']} "
              f"cases, {cross['cases_differing']} differ; decode differs on {cross['decode_share']:.2%} of "
              f"{cross['decoded_coordinates']} coordinates", flush=True)
        result = parity_sweep(parity_cases(ctx.dry), device, time.monotonic() + ctx.left(5))
    result["cpu_vs_cuda"] = cross
    if result["cases"] < result["cases_planned"] or cross["cases"] < cross["cases_planned"]:
        result["incomplete"] = True  # the time ran out first: a rerun reaches more cases
    if ctx.dry:
        result["would"] = (f"run {len(cross_backend_cases(False))} cases of CUDA against the CPU and "
                           f"{len(parity_cases(False))} of the kernels against their reference on cuda:0 "
                           "(1 K to 100 M coordinates); here the CUDA side is the CPU emulator of the kernels")
    if result["differing_elements"]:
        raise RuntimeError(f"the kernels differ from the reference: {result['failing'][:3]}")
    return result


# -- 4. tests -----------------------------------------------------------------------------------
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


# -- rank processes (the step and fsdp stages) --------------------------------------------------
# A case's ranks are processes of their own (``--rank-job``), each running its cases in
# turn (the fsdp and step stages: :data:`RANK_JOBS`). A rank writes each
# case's result, or the traceback of what it raised, to its file the moment it has it,
# and after a failure leaves at once without tearing the process group down (a peer may
# be blocked in a collective). The parent waits for every rank; once a rank has failed,
# the peers of its process group get RANK_GRACE_S seconds to fail too, then SIGUSR1
# (faulthandler prints every thread's stack into the rank's log) and SIGKILL. So the
# report names each rank's fate: what it returned, what it raised, or where it stood when
# it was killed and why.
RANK_GRACE_S = 5.0


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


def rank_main(job: dict) -> int:
    """One rank of a process group running ``job["cases"]`` in turn (``--rank-job JSON``;
    ``job["kind"]`` names the cases' runner in :data:`RANK_JOBS`): each case's result or
    traceback into the JSON file ``job["result"]``; exits at the first failure."""
    from hhook.profile.train_child import watch_parent

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent's last look before a kill
    watch_parent()  # a stage killed at its limit takes its ranks with it
    out, outcomes = Path(job["result"]), {}

    def write(name: str, value: dict) -> None:
        outcomes[name] = value
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(outcomes, default=str))
        tmp.replace(out)  # the parent never reads half a file

    code, name = 0, job["cases"][0]["name"]
    try:
        for name, run in RANK_JOBS[job["kind"]](job):
            write(name, {"ok": True, "result": run()})
    except BaseException:  # noqa: BLE001 - the parent reports it
        write(name, {"ok": False, "error": traceback.format_exc()})
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no teardown: a peer may still be blocked in a collective


def launch_rank(group: str, label: str, rank: int, job: dict, work: Path, prefix=(), env=None) -> RankProc:
    """Rank ``rank`` of ``group`` running ``job`` (``--rank-job``), its result file and log
    in ``work`` named by ``label``; ``prefix`` runs it elsewhere (a network namespace)."""
    result, log = work / f"{label}-rank{rank}.json", work / f"{label}-rank{rank}.log"
    job = {**job, "rank": rank, "result": str(result)}
    with open(log, "w") as f:
        proc = subprocess.Popen([*prefix, sys.executable, __file__, "--rank-job", json.dumps(job)], cwd=ROOT,
                                env=env or {**os.environ, "OMP_NUM_THREADS": "1"}, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
    return RankProc(group, rank, proc, result, log)


def wait_ranks(procs: list[RankProc], deadline: float, grace: float = RANK_GRACE_S) -> None:
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


# -- 5. step: real training steps on the GPU (issue 50, point 4) --------------------------------
STEP_STEPS = 60  # per case; ms per step is the median of the last half
STEP_MODELS = ("gpt", "resnet18")  # in each method's turn the cheaper first
STEP_METHODS = ("fp16", "thc:4", "thc:auto", "fp32")  # the issue's comparison first; fp32 (slowest on a slow link) last
STEP_LINKS = ("10gbit", "1gbit")  # emulated (ci/netcluster.sh) where network namespaces work, else one loopback run
STEP_RUNS = (*STEP_LINKS, "nccl1")  # nccl1: a world of one on NCCL, no wire: what each method adds to a step
STEP_DRY = {"models": ("mlp", "deep-cnn"), "steps": 6, "batch_size": 8}  # the dry run: CPU tensors over loopback
STEP_ATTEMPTS = 3  # process pairs per run: a case that fails costs its own pair, not the cases after it
STEP_MIN_S = 15.0  # no pair starts with less time left
STEP_PG_TIMEOUT_S = 20  # a collective that never completes raises after this
STEP_MEASURE_MB = {"10gbit": 250, "1gbit": 30}  # netcluster.sh measure: about 0.2 s of each link
STEP_PORT = 29600  # in a fresh network namespace every port is free
NET_MARKER = "netcluster-up"  # in the run's scratch folder while the step stage's emulated cluster is up


@dataclasses.dataclass
class StepRun:
    """Where one run's ranks train, and how a rank is started there."""

    name: str
    world: int
    backend: str
    addr: str = "127.0.0.1"  # the rendezvous (rank 0's address)
    prefix: tuple = ()  # per rank: the command that puts it in its node (``netcluster.sh exec I``)
    interface: str = "lo"  # Gloo's
    fixed_ports: bool = False  # a fresh namespace: STEP_PORT + i; else free ports of this host

    def ports(self, n: int, attempt: int) -> list[int]:
        if self.fixed_ports:
            return [STEP_PORT + 50 * attempt + i for i in range(n)]
        from hhook.launch import free_port

        ports: list[int] = []
        while len(ports) < n:
            port = free_port("127.0.0.1")
            ports += [port] if port not in ports else []
        return ports

    def start(self, rank: int) -> list[str]:
        return [part.format(rank=rank) for part in self.prefix]

    def env(self, threads: int) -> dict:
        return {**os.environ, "OMP_NUM_THREADS": str(threads), "GLOO_SOCKET_IFNAME": self.interface,
                "TP_SOCKET_IFNAME": self.interface}


def step_rank_cases(job: dict):
    """(name, run) of each training case of the step stage: ``hhook-profile train``'s child
    worker (:func:`hhook.profile.train_child.worker`), each case in a process group of its
    own on the case's port, in this one process (no start-up per case)."""
    import functools

    from hhook.profile.train_child import worker

    for i, case in enumerate(job["cases"]):
        spec = {**job["spec"], **case["spec"], "rank": job["rank"], "local_rank": job["rank"],
                "beat_path": f"{job['result']}.{i}.beat"}
        yield case["name"], functools.partial(worker, spec)


def synthetic_digits(n: int = 1797, test: int = 450) -> tuple:
    """The digits' shapes (64 pixels in [0, 1], 10 classes) from fixed class prototypes and
    noise: the step stage's stand-in where scikit-learn (the bundled digits) is missing."""
    import torch

    g = torch.Generator().manual_seed(0)
    prototypes = torch.rand(10, 64, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    x = (0.7 * prototypes[y] + 0.3 * torch.rand(n, 64, generator=g)).clamp(0, 1)
    return x[test:], y[test:], x[:test], y[:test]


def task_data(models, work: Path) -> tuple[dict, dict]:
    """Each model's data saved for its ranks (the child worker loads it, as in
    ``hhook-profile train``): paths, and where the data came from."""
    import torch

    from hhook.profile.tasks import TASKS

    paths, sources = {}, {}
    for model in models:
        try:
            data, sources[model] = TASKS[model].load(), "bundled"
        except ImportError as err:  # the digits need scikit-learn: a stand-in of their shapes, said
            data, sources[model] = synthetic_digits(), f"synthetic stand-in of the digits ({err})"
        paths[model] = str(work / f"data-{model}.pt")
        torch.save(tuple(data), paths[model])
    return paths, sources


def step_cases(models, methods, data: dict, batch_size: int | None = None) -> list[dict]:
    """One case per (method, model), method by method (the order in which time is spent);
    each model's batch size unless ``batch_size`` is given."""
    from hhook.profile import train
    from hhook.profile.tasks import TASKS

    return [{"name": f"{model}/{method.name}", "model": model, "method": method.name,
             "spec": {"method": dataclasses.asdict(method), "task": model, "lr": TASKS[model].lr,
                      "batch_size": batch_size or TASKS[model].batch_size, "data_path": data[model]}}
            for method in train.parse_methods(",".join(methods)) for model in models]


def run_step_cases(run: StepRun, cases: list[dict], common: dict, work: Path, deadline: float) -> tuple[dict, int]:
    """``cases`` on ``run``'s ranks, one process per rank for all of them; after a failed
    case the cases left start again in a fresh pair (at most :data:`STEP_ATTEMPTS` pairs,
    none with under :data:`STEP_MIN_S` left). Returns each case's per-rank reports
    (:func:`rank_report`; a case never reached has none) and the pairs started."""
    outcomes, todo, attempts = {}, list(cases), 0
    while todo and attempts < STEP_ATTEMPTS and deadline - time.monotonic() > STEP_MIN_S:
        ports = run.ports(len(todo), attempts)
        job = {"kind": "step", "spec": {**common, "master_addr": run.addr},
               "cases": [{"name": c["name"], "spec": {**c["spec"], "port": port}} for c, port in zip(todo, ports)]}
        label = f"{run.name}-{attempts}"
        procs = [launch_rank(label, label, rank, job, work, run.start(rank), run.env(common["threads"]))
                 for rank in range(run.world)]
        wait_ranks(procs, deadline)
        attempts += 1
        for c in todo:
            reports = [rank_report(p, c["name"]) for p in procs]
            if any(r["status"] in ("ok", "raised") for r in reports):
                outcomes[c["name"]] = reports
        left = [c for c in todo if c["name"] not in outcomes]
        if len(left) == len(todo):
            break  # killed before a case ended: the time is up
        todo = left
    return outcomes, attempts


def _rank_failure(report: dict) -> dict:
    """A rank's report as the child result ``hhook.profile.train.verdict`` reads."""
    if report["status"] == "raised":
        lines = report["error"].strip().splitlines()
        return {"status": "failed", "message": lines[-1] if lines else "raised"}
    return {"status": "hung" if report["status"].startswith("killed") else "failed", "message": report["status"]}


STEP_TABLE_ORDER = ("fp32", "fp16", "thc:4", "thc:auto")


def step_rows(cases: list[dict], outcomes: dict, steps: int) -> list[dict]:
    """Per case, ``hhook-profile train``'s summary of rank 0's steps (the median of the last
    half), bytes per rank and step, the losses, and per model the speedups against fp16
    and fp32; compacted for the JSON."""
    from hhook.profile import train
    from hhook.profile.commands.train import add_speedups, decision_line, summarize

    methods = {m.name: m for m in train.parse_methods(",".join(dict.fromkeys(c["method"] for c in cases)))}
    rows = []
    for model in dict.fromkeys(c["model"] for c in cases):
        mine = sorted((c for c in cases if c["model"] == model), key=lambda c: STEP_TABLE_ORDER.index(c["method"])
                      if c["method"] in STEP_TABLE_ORDER else len(STEP_TABLE_ORDER))
        summaries = []
        for c in mine:
            reports = outcomes.get(c["name"])
            if reports is None:
                summaries.append({"method": c["method"], "status": "not run", "message": "the stage's time ran out first"})
                continue
            results = [r["result"] if r["status"] == "ok" else _rank_failure(r) for r in reports]
            status, message = train.verdict(results)
            summaries.append(summarize(methods[c["method"]], status, message, results, steps // 2, 1.0))
        add_speedups(summaries)
        for r in summaries:
            decision = r.get("decision")
            rows.append({"model": model, "method": r["method"], "status": r["status"], "message": r["message"],
                         "ms_per_step": r.get("median_ms"), "p90_ms": r.get("p90_ms"),
                         "bytes_per_step": r.get("bytes_per_step"), "train_loss": r.get("final_loss"),
                         "val_loss": r.get("final_val_loss"), "accuracy": r.get("final_accuracy"),
                         "vs_fp16": r.get("speedup_vs_fp16"), "vs_fp32": r.get("speedup_vs_fp32"),
                         "params": r.get("params"), "peak_cuda_mb": max(r["peak_cuda_mb"]) if r.get("peak_cuda_mb") else None,
                         "decision": decision_line(decision) if decision else None})
    return rows


def step_table(rows: list[dict], title: str) -> str:
    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    head = (f"{'model':<9} {'method':<9} {'ms/step':>8} {'p90':>8} {'MB/step':>8} {'vs fp16':>8} {'vs fp32':>8} "
            f"{'val loss':>9} {'train loss':>10}")
    lines = [title, head, "-" * len(head)]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"{r['model']:<9} {r['method']:<9} {r['status']}: {r['message'][:100]}")
            continue
        lines.append(f"{r['model']:<9} {r['method']:<9} {num(r['ms_per_step'], '8.2f')} {num(r['p90_ms'], '8.2f')} "
                     f"{num(r['bytes_per_step'] / 1e6, '8.3f')} {num(r['vs_fp16'], '7.2f')}x {num(r['vs_fp32'], '7.2f')}x "
                     f"{num(r['val_loss'], '9.4f')} {num(r['train_loss'], '10.4f')}")
    lines += [f"# {r['model']} {r['method']}: {r['decision']}" for r in rows if r.get("decision")]
    return "\n".join(lines)


def step_run(run: StepRun, cases, common, work, deadline, title: str) -> dict:
    """One run's cases, rows and table (printed)."""
    outcomes, attempts = run_step_cases(run, cases, common, work, deadline)
    rows = step_rows(cases, outcomes, common["steps"])
    table = step_table(rows, title)
    print(table, flush=True)
    failed = {name: [r.get("error", r.get("log_tail", ""))[-1500:] for r in reports if r["status"] != "ok"]
              for name, reports in outcomes.items() if any(r["status"] != "ok" for r in reports)}
    return {"title": title, "rows": rows, "table": table, "pairs_started": attempts, "failures": failed}


def netcluster(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return _run(["bash", str(NETCLUSTER), *args], timeout)


def plan_network(ctx: Context) -> dict:
    """How the two-rank runs meet: ``netns`` (emulated links) where :func:`netns_probe`
    says they work, else ``loopback`` and why. The dry run never changes the network: it
    checks ``netcluster.sh plan`` (no root, nothing made) and says what it would do."""
    if ctx.dry:
        plan = netcluster("plan", "2", timeout=30)
        if plan.returncode != 0:
            raise RuntimeError(f"ci/netcluster.sh plan 2:\n{_tail(plan.stdout)}")
        return {"mode": "loopback", "why": "dry run: the network is left as it is", "plan": plan.stdout.splitlines(),
                "would": "ci/netcluster.sh up 2 10gbit, then reshape 1gbit, where network namespaces work"}
    probe = netns_probe()
    if probe["usable"]:
        return {"mode": "netns", "probe": probe}
    return {"mode": "loopback", "why": f"network namespaces do not work here: {probe['why']}", "probe": probe}


def emulate_link(rate: str, first: bool, ctx: Context) -> dict:
    """Bring ci/netcluster.sh's two nodes up at ``rate`` (``first``) or reshape them to it,
    and measure the link (MB/s from hh0 to hh1)."""
    done = netcluster("up", "2", rate) if first else netcluster("reshape", rate)
    if first and ctx.scratch is not None:
        (ctx.scratch / NET_MARKER).write_text(rate)  # the driver takes it down if this stage dies
    if done.returncode != 0:
        raise RuntimeError(f"netcluster.sh {'up 2' if first else 'reshape'} {rate}:\n{_tail(done.stdout, 800)}")
    measured = netcluster("measure", str(STEP_MEASURE_MB[rate]), timeout=30)
    found = re.search(r"([\d.]+) MB/s", measured.stdout)
    return {"rate": rate, "measured_MBps": float(found.group(1)) if found else None,
            "measure_output": _tail(measured.stdout.strip(), 300)}


def take_network_down(scratch: Path | None) -> None:
    netcluster("down", timeout=60)
    if scratch is not None:
        (scratch / NET_MARKER).unlink(missing_ok=True)


def _emulated_runs(ctx, links, cases, common, deadline, result) -> None:
    """The links of ``links`` through ci/netcluster.sh's two namespaces, one after the other."""
    hosts = netcluster("hosts", "2", timeout=30).stdout.split()
    run = StepRun("", 2, "gloo", addr=hosts[0] if hosts else "10.77.0.1", interface="eth0", fixed_ports=True,
                  prefix=("bash", str(NETCLUSTER), "exec", "{rank}"))
    try:
        for i, link in enumerate(links):
            if deadline - time.monotonic() < STEP_MIN_S:
                result["runs"][link] = {"status": "skipped: out of time"}
                continue
            measured = emulate_link(link, i == 0, ctx)
            title = (f"# step: 2 ranks sharing {common['gpu']} over Gloo through an emulated {link} link "
                     f"(ci/netcluster.sh; measured {measured['measured_MBps']} MB/s); {common['steps']} steps, "
                     f"ms/step = median of the last {common['steps'] - common['steps'] // 2}")
            result["runs"][link] = {"link": measured, **step_run(dataclasses.replace(run, name=link), cases, common,
                                                                 ctx.work, deadline, title)}
            statuses = {row["status"] for row in result["runs"][link]["rows"]}
            if "ok" not in statuses and statuses - {"not run"}:
                break  # nothing trained through the namespaces: the time goes to loopback
    finally:
        take_network_down(ctx.scratch)


def stage_step(ctx: Context) -> dict:
    """Issue 50's measured GPU step: :data:`STEP_MODELS` x :data:`STEP_METHODS`, 2 ranks
    sharing the GPU over Gloo through each of :data:`STEP_LINKS` (or loopback), then a world
    of one on NCCL; ``--step-runs`` picks among :data:`STEP_RUNS`. The dry run: small
    models on CPU tensors over loopback, no world of one."""
    import torch

    from hhook.profile.tasks import TASKS

    missing = [m for m in (*STEP_MODELS, *STEP_DRY["models"]) if m not in TASKS]
    if missing:
        raise RuntimeError(f"hhook.profile.tasks has no {missing}")
    wanted = ctx.options.get("step_runs") or list(STEP_RUNS)
    if ctx.dry:
        models, steps, device, threads, gpu = STEP_DRY["models"], STEP_DRY["steps"], "cpu", 1, "the CPU (dry run)"
    else:
        if not torch.cuda.is_available():
            raise RuntimeError("no GPU here: the step stage trains on one (--dry-run runs its machinery on the CPU)")
        models, steps, device, threads, gpu = STEP_MODELS, STEP_STEPS, "cuda", 2, torch.cuda.get_device_name()
    data, sources = task_data(models, ctx.work)
    result = ctx.partial
    result.update(models=sources, steps=steps, methods=list(STEP_METHODS), runs={})
    common = dict(world_size=2, backend="gloo", device=device, threads=threads, seed=0, steps=steps, eval_every=steps,
                  pg_timeout_s=STEP_PG_TIMEOUT_S, parallel="ddp", ranks_per_node=None, gpu=gpu)
    cases = step_cases(models, STEP_METHODS, data, STEP_DRY["batch_size"] if ctx.dry else None)
    deadline = time.monotonic() + ctx.left(10)  # time to take the network down and to summarise
    links = [link for link in STEP_LINKS if link in wanted]
    net = result["network"] = plan_network(ctx) if links else {"mode": "none"}
    if links and net["mode"] == "netns":
        try:
            _emulated_runs(ctx, links, cases, common, deadline, result)
        except RuntimeError as err:  # netcluster.sh failed
            net["error"] = _tail(str(err), 1000)
        rows = [row for r in result["runs"].values() for row in r.get("rows", [])]
        if not any(row["status"] == "ok" for row in rows) and (net.get("error") or any(
                row["status"] != "not run" for row in rows)):  # nothing trained on the emulated links: loopback, said
            net.update(mode="loopback", why="the emulated links failed: " + (net.get("error") or "; ".join(
                f"{k}: {list(v.get('failures', {}).values())[:1]}" for k, v in result["runs"].items()))[:1500])
    if links and net["mode"] == "loopback":
        title = (f"# step: 2 ranks sharing {gpu} over Gloo on LOOPBACK ({net['why']}): no link is emulated, so "
                 f"the figures say what the codec and the hooks cost, not what they save; {steps} steps, ms/step = "
                 f"median of the last {steps - steps // 2}")
        result["runs"]["loopback"] = step_run(StepRun("loopback", 2, "gloo"), cases, common, ctx.work, deadline, title)
    if "nccl1" in wanted:
        if ctx.dry:
            result["runs"]["nccl1"] = {"would": f"{', '.join(STEP_MODELS)} x {', '.join(STEP_METHODS)} in a world "
                                                f"of one on NCCL, {STEP_STEPS} steps each"}
        elif ctx.left(3) < STEP_MIN_S:
            result["runs"]["nccl1"] = {"status": "skipped: out of time"}
        else:
            title = (f"# step: a world of one on NCCL on {gpu} (no wire: what each method adds to a step); "
                     f"{steps} steps, ms/step = median of the last {steps - steps // 2}")
            result["runs"]["nccl1"] = step_run(StepRun("nccl1", 1, "nccl"), cases, {**common, "world_size": 1,
                                               "backend": "nccl"}, ctx.work, time.monotonic() + ctx.left(3), title)
    result["table"] = "\n\n".join(r["table"] for r in result["runs"].values() if r.get("table"))
    # what the time did not reach, for the rerun hint: the runs to give --step-runs
    unfinished = [name for name, r in result["runs"].items() if str(r.get("status", "")).startswith("skipped")
                  or any(row["status"] == "not run" for row in r.get("rows", []))]
    if unfinished:
        result["incomplete"] = sorted({link for name in unfinished
                                       for link in (STEP_LINKS if name == "loopback" else (name,))},
                                      key=STEP_RUNS.index)
    bad = [f"{name} {row['model']}/{row['method']}: {row['status']} {row['message'][:200]}"
           for name, r in result["runs"].items() for row in r.get("rows", []) if row["status"] not in ("ok", "not run")]
    if bad:
        raise RuntimeError("failed: " + "; ".join(bad)[:1500])
    return result


# -- 6. fsdp ------------------------------------------------------------------------------------
# On a GPU each case has its own processes, all started at once; the dry run runs its cases
# one after the other in one pair of processes (importing torch's FSDP costs more than the
# steps).
FSDP_STEPS = 6


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


def fsdp_rank_cases(job: dict):
    """(name, run) of each FSDP2 case, in one process group joined here."""
    import datetime as dt
    import functools

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
        yield case["name"], functools.partial(fsdp_training, job["rank"], job["world"], job["device"],
                                              FSDP_CASES[case["register"]], job["steps"])


def start_ranks(cases: list[dict], work: Path, timeout: float) -> list[RankProc]:
    """The ranks of one process group that runs the FSDP2 ``cases`` (one world, backend,
    device) in turn."""
    from hhook.launch import free_port

    first = cases[0]
    job = dict(kind="fsdp", world=first["world"], backend=first["backend"], device=first["device"],
               port=free_port("127.0.0.1"), cases=[{"name": c["name"], "register": c["register"]} for c in cases],
               steps=FSDP_STEPS, pg_timeout=max(5, int(timeout) - 5))  # a collective that never completes raises
    group = "+".join(c["name"] for c in cases)
    return [launch_rank(group, first["name"], rank, job, work) for rank in range(first["world"])]


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


# -- 7. throughput ------------------------------------------------------------------------------
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
        plan = plan[:2]
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
    # FSDP2's all-gather codec (8 bits, blocks of 256) on a float32 shard, against THC's
    # encode + decode of the same bytes (issue 50: within 1.5x)
    weight_rows = []
    for mb in (25, 100):
        n = int(mb * scale * 1e6) // 4 // weights.block_size * weights.block_size
        x = torch.randn(n, dtype=torch.float32, device=device)
        t = bench.weight_codec_times(weights, x, iters)
        thc = next(r for r in rows if r["dtype"] == "float32" and r["mb"] == mb * scale)
        weight_rows.append({"mb": round(n * 4 / 1e6, 3), "bits": weights.bits, "block_size": weights.block_size,
                            **{k: round(v * 1e3, 4) for k, v in t.items() if k.endswith("_s")},
                            "encode_of_copy": round(t["copy_s"] / t["encode_s"], 3),
                            "decode_of_copy": round(t["copy_s"] / t["decode_s"], 3),
                            "vs_thc_codec": round((t["encode_s"] + t["decode_s"]) * 1e3 / (thc["encode_s"] + thc["decode_s"]), 3),
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
                      "(FSDP2's all-gather), encode includes the shard's copy into its block workspace; vs_thc_codec: its "
                      "encode + decode over THC's (THCCodec, 4 bits) on the same float32 bytes"}
    if ctx.dry:
        result["would"] = "the same on cuda:0 at 25/100/400 MB, and the reference codec at 25 MB"
    else:
        ref = _bench_cuda().codec_throughput(codec, [25], (torch.float32,), 5)[0]
        result["vs_reference_25mb"] = round(ref["vs_ref"], 1)
    return result


# -- 8. sanitizer -------------------------------------------------------------------------------
def kernel_smoke(device: str, odd_blocks: bool = True) -> list[str]:
    """Every kernel once on small inputs (for compute-sanitizer): each input dtype, int32
    and int64 words, blocks of 64/1024/4096 and, with int32 words, of 8/128/2048 (odd log2 B:
    where a butterfly pass could reach past its block; not in the dry run, whose parity
    stage runs them on the emulator), residual in place and into another
    buffer, decode into each output dtype; then FSDP2's all-gather codec's two kernels.
    Returns the kernels launched."""
    import torch

    from hhook.codec import THCCodec
    from hhook.codec.kernels import cuda as cuda_kernels
    from hhook.codec.weights import WeightCodec

    launched = set()
    run = cuda_kernels._launch

    def counting(launch, dev):
        launched.add(launch.name)
        run(launch, dev)

    cuda_kernels._launch = counting
    try:
        for bits, world in ((2, 4), (8, 16)):  # int32 and int64 words
            for block in (64, 1024, 4096) + ((8, 128, 2048) if bits == 2 and odd_blocks else ()):
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
        for rotate in (True, False, "auto"):  # FSDP2's all-gather codec, each way
            weights = WeightCodec(bits=8, block_size=256, rotate=rotate, seed=3)
            payload = torch.empty(weights.nbytes(19), dtype=torch.uint8, device=device)
            cuda_kernels.weight_encode(weights, torch.randn(19, 256, device=device), payload)
            cuda_kernels.weight_decode(weights, payload, 19, torch.empty(19, 256, device=device))
        if device != "cpu":
            torch.cuda.synchronize()
    finally:
        cuda_kernels._launch = run
    return sorted(launched)


def stage_sanitizer(ctx: Context) -> dict:
    from hhook.codec.kernels import cuda as cuda_kernels

    if ctx.dry:
        from cuda_support import emulated

        with emulated(emulator(ctx)):
            launched = kernel_smoke("cpu", odd_blocks=False)  # the emulator ran them in the parity stage
        missing = sorted(set(cuda_kernels.KERNEL_NAMES + cuda_kernels.WEIGHT_KERNEL_NAMES) - set(launched))
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


# -- 9. nccl: the hook's path in a world of one on NCCL -----------------------------------------
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

    ncu = _cuda_tool("ncu") or "ncu"
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
RANK_JOBS = {"fsdp": fsdp_rank_cases, "step": step_rank_cases}  # --rank-job's cases, by the job's kind
STAGES = {  # name: (function, seconds it needs on an H200, seconds at most), most decisive first
    "env": (stage_env, 12, 40),
    "speed": (stage_speed, 15, 45),
    "parity": (stage_parity, 35, 50),
    "tests": (stage_tests, 60, 90),
    "step": (stage_step, 70, 240),  # spends what the others leave it, runs first to last in value
    "fsdp": (stage_fsdp, 25, 50),
    "throughput": (stage_throughput, 10, 30),
    "sanitizer": (stage_sanitizer, 25, 45),
    "nccl": (stage_nccl, 12, 30),
    "ncu": (stage_ncu, 20, 60),  # not run by default: --only ncu
}
DEFAULT_STAGES = [name for name in STAGES if name != "ncu"]
#: --only's presets (a rerun in a second call): "kernels" after a kernel change (its
#: figures, its bits, its tests, its memory safety: about 150 s), "train" for training on
#: the GPU (the step stage's whole matrix, FSDP2, NCCL: about 250 s).
PRESETS = {"all": DEFAULT_STAGES, "kernels": ["speed", "parity", "tests", "throughput", "sanitizer"],
           "train": ["step", "fsdp", "nccl"]}
DEFAULT_BUDGET, DRY_BUDGET = 270.0, 540.0  # one call of about five minutes on a lent GPU; CI's loaded CPUs


def stages_of(only: str | None) -> list[str]:
    """``--only``'s stages and presets, in :data:`STAGES`' order, ``env`` first; ValueError
    for an unknown name."""
    names = {"env"}
    for item in (only.split(",") if only else ["all"]):
        item = item.strip()
        if item not in STAGES and item not in PRESETS:
            raise ValueError(f"unknown stage or preset {item!r} (stages: {', '.join(STAGES)}; presets: "
                             f"{', '.join(PRESETS)})")
        names.update(PRESETS.get(item, [item]))
    return [name for name in STAGES if name in names]


def stage_limit(name: str, later: list[str], left: float) -> float:
    """Seconds stage ``name`` may take with ``left`` of the budget: up to its cap, but the
    needs of the ``later`` stages stay reserved unless that leaves it less than its own."""
    need, cap = STAGES[name][1:]
    return min(cap, max(need, left - sum(STAGES[n][1] for n in later)), left)


def run_stage(name: str, dry: bool, deadline: float, result_path: Path, options: dict, scratch: Path | None) -> int:
    """The child: one stage, its result (or error) written to ``result_path``."""
    work = Path(tempfile.mkdtemp(prefix=f"gpu-check-{name}-"))
    ctx = Context(dry, deadline, work, options=options, scratch=scratch)
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


def _step_reported(step: dict) -> bool | None:
    """The step stage's target: THC 4 bits and the default beside the fp16 hook, on every
    model, at 10 and 1 Gbit/s (or on loopback, said): each of those rows trained."""
    runs = step.get("runs") or {}
    names = ["loopback"] if "loopback" in runs else [n for n in STEP_LINKS if n in runs]
    if not names:
        return None
    if names != ["loopback"] and names != list(STEP_LINKS):
        return False

    def trained(run):
        rows = run.get("rows") or []
        ok = {(r["model"], r["method"]) for r in rows if r["status"] == "ok"}
        return bool(rows) and all((m, k) in ok for m in {r["model"] for r in rows} for k in ("fp16", "thc:4", "thc:auto"))

    return all(trained(runs[n]) for n in names)


def verdicts(stages: dict) -> dict:
    """Issue 50's targets (and the earlier issues' that still stand), met (True), missed
    (False) or not measured (None), from what the stages measured."""
    def get(*keys):
        node = stages
        for k in keys:
            node = node.get(k) if isinstance(node, dict) else None
        return node

    tests = get("tests", "result") or {}
    san = get("sanitizer", "result") or {}
    nccl = get("nccl", "result", "nccl_world_of_one") or {}
    fsdp = [v for v in (get("fsdp", "result") or {}).values() if isinstance(v, dict) and "status" in v]
    speed = {(r["mb"], r["dtype"]): r for r in get("speed", "result", "rows") or []}
    s25, s100, b100 = speed.get((25, "float32")), speed.get((100, "float32")), speed.get((100, "bfloat16"))
    cross = get("parity", "result", "cpu_vs_cuda") or {}
    crossed = None if not cross.get("cases") else (
        False if cross["cases_differing"] else True if cross["cases"] == cross["cases_planned"] else None)
    weights = [r for r in get("throughput", "result", "weight_codec") or [] if round(r["mb"]) == 100]
    step = get("step", "result") or {}
    step_rows = [row for run in (step.get("runs") or {}).values() for row in run.get("rows") or [] if row["status"] == "ok"]
    return {
        "host <= 20 us to issue a 25 MB fp32 bucket": None if not s25 else s25["host_us"] <= 20,
        "THC encode + decode <= 2x the fp16 hook's casts (25 MB fp32)": None if not s25 else s25["thc_vs_fp16"] <= 2,
        "THC >= 0.4x a copy's GB/s at 100 MB fp32": None if not s100 else s100["thc_of_copy"] >= 0.4,
        "THC >= 0.3x a copy's GB/s at 100 MB bf16": None if not b100 else b100["thc_of_copy"] >= 0.3,
        "CUDA and CPU codecs bit-identical (issue 50's cases)": crossed,
        "zero bit differences from the reference in the kernels' order": None if get("parity", "result") is None
        else get("parity", "result", "differing_elements") == 0,
        "step stage: THC 4 bits and the default beside the fp16 hook at 10 and 1 Gbit/s (or loopback, said)":
            _step_reported(step),
        "every step-stage case that trained has a finite loss": None if not step_rows else all(
            r["val_loss"] is not None and math.isfinite(r["val_loss"]) for r in step_rows),
        "all-gather codec of a 100 MB shard within 1.5x THC's codec time": None if not weights
        else weights[0]["vs_thc_codec"] <= 1.5,
        "every CUDA test passes": None if "passed" not in tests else tests["failed"] + tests["errors"] == 0,
        "FSDP2 trains on CUDA, both collectives compressed (2 ranks)": None if not fsdp
        else all(v["status"] == "pass" for v in fsdp),
        "zero sanitizer errors": None if not san else all(not r["errors"] and not r["hazards"] for r in san.values()),
        "zero host syncs from hhook (NCCL, mode 'error')": None if "host_sync_errors" not in nccl
        else not nccl["host_sync_errors"] and not nccl.get("warn_mode_syncs_from_hhook"),
    }


def rerun_hint(report: dict) -> str | None:
    """The command that reruns the stages that did not end well or did not finish their
    plan (``incomplete``: the step stage's runs left, given to ``--step-runs``), within
    one call's budget."""
    def unfinished(stage):
        return stage["status"] != "ok" or bool((stage.get("result") or {}).get("incomplete"))

    again = [name for name, s in report["stages"].items() if name != "env" and unfinished(s)]
    if not again:
        return None
    budget = min(DEFAULT_BUDGET, STAGES["env"][1] + sum(STAGES[n][2] for n in again))
    step = report["stages"].get("step") or {}
    runs = (step.get("result") or {}).get("incomplete") if step.get("status") == "ok" else None
    return (f"bash ci/gpu_check.sh --only {','.join(again)} --budget {budget:.0f}"
            + (f" --step-runs {','.join(runs)}" if isinstance(runs, list) else ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="everything that needs no GPU; say what else would run")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench"), help="folder of the JSON and log")
    parser.add_argument("--budget", type=float, help=f"seconds for the whole run (default {DEFAULT_BUDGET:g}; "
                        f"{DRY_BUDGET:g} with --dry-run)")
    presets = "; ".join(f"{k}: {'+'.join(v)}" for k, v in PRESETS.items() if k != "all")
    parser.add_argument("--only", help=f"comma-separated stages ({', '.join(STAGES)}) and presets ({presets}); "
                        "env always runs first; default all but ncu")
    parser.add_argument("--step-runs", help=f"the step stage's runs, comma-separated (default {','.join(STEP_RUNS)})")
    parser.add_argument("--stage", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--options", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", help=argparse.SUPPRESS)
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
        return run_stage(args.stage, args.dry_run, args.deadline, Path(args.result), json.loads(args.options or "{}"),
                         Path(args.scratch) if args.scratch else None)
    try:
        names = stages_of(args.only)
    except ValueError as err:
        parser.error(str(err))
    options = {}
    if args.step_runs:
        options["step_runs"] = [r.strip() for r in args.step_runs.split(",")]
        if set(options["step_runs"]) - set(STEP_RUNS):
            parser.error(f"--step-runs: unknown runs {sorted(set(options['step_runs']) - set(STEP_RUNS))} "
                         f"(known: {', '.join(STEP_RUNS)})")
    budget = args.budget if args.budget is not None else DRY_BUDGET if args.dry_run else DEFAULT_BUDGET
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "gpu-check" if not args.only else "gpu-check-" + "-".join(n.strip() for n in args.only.split(","))
    json_path, log_path = out_dir / f"{stem}.json", out_dir / f"{stem}.log"  # a partial rerun keeps the full run's
    scratch = Path(tempfile.mkdtemp(prefix="gpu-check-run-"))
    start = time.monotonic()
    end = start + budget
    report = {"started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "host": platform.node(), "dry_run": args.dry_run, "budget_s": budget,
              "command": "bash ci/gpu_check.sh " + " ".join(sys.argv[1:]), "stages": {}}
    with open(log_path, "w") as log:
        for i, name in enumerate(names):
            left = end - time.monotonic()
            limit = left if args.dry_run else stage_limit(name, names[i + 1:], left)
            if limit < 10:
                report["stages"][name] = {"status": "skipped", "error": "out of time"}
                continue
            print(f"== {name} ({'dry run, ' if args.dry_run else ''}at most {limit:.0f} s)", flush=True)
            log.write(f"== {name}\n")
            log.flush()
            result_path = Path(tempfile.mkstemp(prefix=f"gpu-check-{name}-", suffix=".json")[1])
            cmd = [sys.executable, __file__, "--stage", name, "--result", str(result_path), "--scratch", str(scratch),
                   "--options", json.dumps(options), "--deadline", str(time.monotonic() + limit - 3)]
            t0 = time.monotonic()
            done = _run(cmd + (["--dry-run"] if args.dry_run else []), limit)
            log.write(done.stdout + "\n")
            log.flush()
            if (scratch / NET_MARKER).exists():  # the step stage died with its emulated network up
                print("   the step stage left ci/netcluster.sh's namespaces up: taking them down", flush=True)
                take_network_down(scratch)
            try:
                entry = json.loads(result_path.read_text())
            except (OSError, ValueError):
                entry = {"status": "timeout" if done.returncode == -9 else "crashed",
                         "error": _tail(done.stdout, 4000)}
            entry["seconds"] = round(time.monotonic() - t0, 1)
            entry["limit_s"] = round(limit, 1)
            report["stages"][name] = entry
            print(f"   {entry['status']} in {entry['seconds']} s" +
                  (f": {entry.get('error_summary') or entry.get('error', '')[-300:]}" if entry["status"] != "ok" else ""),
                  flush=True)
            if isinstance(entry.get("result"), dict) and entry["result"].get("table"):
                print(entry["result"]["table"], flush=True)  # a stage's table on the console too
            report["seconds"] = round(time.monotonic() - start, 1)
            if not args.dry_run:
                report["targets"] = verdicts(report["stages"])
            report["rerun"] = rerun_hint(report)
            json_path.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {json_path} and {log_path} ({report.get('seconds', 0)} s of a {budget:g} s budget)")
    if report.get("targets"):
        for target, met in report["targets"].items():
            print(f"  {'met' if met else 'not measured' if met is None else 'MISSED'}: {target}")
    if report.get("rerun"):
        print(f"  rerun what did not end well: {report['rerun']}")
    shutil.rmtree(scratch, ignore_errors=True)
    return 0 if all(s["status"] == "ok" for s in report["stages"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
