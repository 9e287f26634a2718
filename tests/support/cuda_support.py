"""What the CUDA kernels' checks share: tests/codec/test_cuda.py (CPU emulator and GPU) and
ci/gpu_check.py (the prepared run on a GPU, and its dry run anywhere).

* :func:`reference`: the torch reference codec, also for CUDA tensors: every stage of the
  kernels must give its bits;
* :func:`build_emulator` / :func:`emulated_launch`: the very kernel source run on the CPU
  (g++, one std::thread per CUDA thread, a barrier for ``__syncthreads``);
* test data (:func:`gradient`, :func:`agreed_from`, :func:`adversarial`) and
  :func:`parity_case`, one case of the bit-parity sweep over every stage.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import torch

from hhook.codec.kernels import cuda as cuda_kernels
from hhook.codec import HEADER

GXX = shutil.which("g++")

@contextlib.contextmanager
def reference():
    """The torch reference codec, also for CUDA tensors (the kernels must give its bits)."""
    old = os.environ.get(cuda_kernels.FORCE_REFERENCE_ENV)
    os.environ[cuda_kernels.FORCE_REFERENCE_ENV] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ[cuda_kernels.FORCE_REFERENCE_ENV]
        else:
            os.environ[cuda_kernels.FORCE_REFERENCE_ENV] = old


# -- backends: CPU emulator and the real GPU ---------------------------------------------------
_SHIM = r"""
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#define HHOOK_HOST_EMULATION 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__
#define __launch_bounds__(...)

struct hh_dim3 { unsigned x = 0, y = 0, z = 0; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
static thread_local hh_dim3 threadIdx, blockIdx;
static hh_dim3 blockDim, gridDim;
static std::barrier<>* hh_bar;
static std::vector<std::barrier<>*> hh_warp_bars;
static std::vector<unsigned long long> hh_slots;
alignas(16) float hh_smem[16384];  // dynamic shared memory, above the 48 KiB kernels use

static inline void __syncthreads() { hh_bar->arrive_and_wait(); }
static inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
// Warp-level operations: every lane of the warp calls them together (as the kernels do); an
// exchange through memory between two arrivals at the warp's barrier stands in for the warp's.
static inline void __syncwarp(unsigned = 0xffffffffu) { hh_warp_bars[threadIdx.x / 32]->arrive_and_wait(); }
// A shuffle's lanes wait for each other with HH_SHUFFLE_WAIT: __syncwarp here; the race check
// (tests/support/cuda_races.py) defines a wait that orders no other memory, as on a GPU.
#ifndef HH_SHUFFLE_WAIT
#define HH_SHUFFLE_WAIT __syncwarp
#endif
static inline void hh_slot_put(unsigned long long v) { __atomic_store_n(&hh_slots[threadIdx.x], v, __ATOMIC_RELAXED); }
static inline unsigned long long hh_slot(unsigned i) { return __atomic_load_n(&hh_slots[i], __ATOMIC_RELAXED); }
template <class T> static inline T hh_exchange(T v, unsigned src) {
    unsigned long long bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    hh_slot_put(bits);
    HH_SHUFFLE_WAIT();
    bits = hh_slot((threadIdx.x & ~31u) | (src & 31u));
    HH_SHUFFLE_WAIT();
    T r;
    std::memcpy(&r, &bits, sizeof(T));
    return r;
}
template <class T> static inline T __shfl_xor_sync(unsigned, T v, int off) { return hh_exchange(v, (threadIdx.x & 31) ^ off); }
template <class T> static inline T __shfl_sync(unsigned, T v, int src) { return hh_exchange(v, src); }
static inline unsigned __ballot_sync(unsigned, int pred) {
    hh_slot_put(pred != 0);
    HH_SHUFFLE_WAIT();
    unsigned mask = 0;
    for (unsigned i = 0; i < 32; ++i) mask |= (unsigned)hh_slot((threadIdx.x & ~31u) | i) << i;
    HH_SHUFFLE_WAIT();
    return mask;
}
static inline int __popc(unsigned x) { return __builtin_popcount(x); }
// CUDA's atomics are relaxed: they order no other memory (TSan takes no happens-before from them).
static inline unsigned atomicMax(unsigned* p, unsigned v) {
    unsigned old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (old < v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
    return old;
}
static inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
static inline unsigned long long atomicAdd(unsigned long long* p, unsigned long long v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
static inline unsigned atomicOr(unsigned* p, unsigned v) { return __atomic_fetch_or(p, v, __ATOMIC_RELAXED); }
static inline unsigned long long atomicOr(unsigned long long* p, unsigned long long v) {
    return __atomic_fetch_or(p, v, __ATOMIC_RELAXED);
}
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
// The kernels' non-flushing PTX arithmetic: IEEE float32 operations (compiled without
// contraction; SSE keeps subnormals).
static inline float hh_add(float a, float b) { return a + b; }
static inline float hh_sub(float a, float b) { return a - b; }
static inline float hh_mul(float a, float b) { return a * b; }
static inline float hh_div(float a, float b) { return a / b; }
static inline float hh_floor(float a) { return std::floor(a); }
static inline bool hh_lt(float a, float b) { return a < b; }
static inline bool hh_le(float a, float b) { return a <= b; }
static inline bool hh_eq(float a, float b) { return a == b; }
static inline unsigned hh_to_u32(float f) { return (unsigned)f; }
static inline float hh_half_to_float(unsigned short h) { _Float16 x; std::memcpy(&x, &h, 2); return (float)x; }
static inline unsigned short hh_float_to_half(float f) {
    _Float16 x = (_Float16)f;
    unsigned short h;
    std::memcpy(&h, &x, 2);
    return h;
}

#include KERNELS

template <class A> static std::string hh_code() {
    using T = std::remove_cv_t<A>;
    const char kind = std::is_class_v<T> ? 's' : std::is_pointer_v<T> ? 'p' : std::is_floating_point_v<T> ? 'f'
                      : std::is_signed_v<T> ? 'i' : 'u';
    return kind + std::to_string(sizeof(T));
}

template <class... A, std::size_t... I>
static void hh_call(void (*k)(A...), void** args, std::index_sequence<I...>) {
    k(*static_cast<std::remove_cv_t<A>*>(args[I])...);
}

// Returns 0, or -1 with the expected signature in `expected` when the arguments differ.
template <class... A>
static int hh_run(void (*k)(A...), int grid, int block, void** args, const char* sig, char* expected) {
    const std::string want = (std::string() + ... + hh_code<A>());
    if (want != sig) {
        std::strncpy(expected, want.c_str(), 255);
        return -1;
    }
    gridDim.x = grid;
    blockDim.x = block;
    std::barrier<> bar(block);
    hh_bar = &bar;
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    hh_warp_bars.clear();
    for (int w = 0; w < block / 32; ++w) {
        warps.emplace_back(new std::barrier<>(32));
        hh_warp_bars.push_back(warps.back().get());
    }
    hh_slots.assign(block, 0);
    std::vector<std::thread> threads;
    for (int t = 0; t < block; ++t)
        threads.emplace_back([=, &bar] {
            threadIdx.x = t;
            for (int b = 0; b < grid; ++b) {
                blockIdx.x = b;
                hh_call(k, args, std::index_sequence_for<A...>{});
                bar.arrive_and_wait();
            }
        });
    for (auto& th : threads) th.join();
    return 0;
}
"""


def emulator_unavailable() -> str | None:
    """Why the emulator cannot be built here, or None."""
    if GXX is None:
        return "g++ is not installed: cannot emulate the kernels"
    version = subprocess.run([GXX, "-dumpversion"], capture_output=True, text=True).stdout.strip()
    if int(version.split(".")[0] or 0) < 12:
        return f"the emulator needs g++ >= 12 (C++20 <barrier>, _Float16), not {version}"
    return None


def shimmed(source: Path | None = None) -> str:
    """The shim with the kernel ``source`` (default: the package's) included: what the
    emulator and the race check's replay (tests/support/cuda_races.py) compile."""
    return _SHIM.replace("#include KERNELS", f'#include "{source or cuda_kernels.source_path()}"')


def build_emulator(folder: Path) -> ctypes.CDLL:
    """Compile the kernel source for the CPU into ``folder`` and load it."""
    entry = 'extern "C" int emu_{0}(int g, int b, void** a, const char* s, char* e)'
    entry += " {{ return hh_run({0}, g, b, a, s, e); }}\n"
    entries = "".join(entry.format(n) for n in (*cuda_kernels.KERNEL_NAMES, *cuda_kernels.WEIGHT_KERNEL_NAMES))
    src = Path(folder) / "emu.cpp"
    src.write_text(shimmed() + entries)
    lib = Path(folder) / "emu.so"
    cmd = [GXX, "-std=c++20", "-O1", "-ffp-contract=off", "-fPIC", "-shared", "-pthread", "-o", str(lib), str(src)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the kernel emulator did not compile:\n{done.stderr}")
    return ctypes.CDLL(str(lib))


@contextlib.contextmanager
def emulated(lib: ctypes.CDLL, run=None):
    """Launches of :mod:`hhook.codec.kernels.cuda` run on the CPU emulator ``lib`` inside,
    through ``run(lib, launch, device)`` (default :func:`emulated_launch`)."""
    saved, run = cuda_kernels._launch, run or emulated_launch
    cuda_kernels._launch = lambda launch, device: run(lib, launch, device)
    try:
        yield
    finally:
        cuda_kernels._launch = saved


def emulated_launch(lib, launch: cuda_kernels.Launch, device) -> None:
    assert launch.shared_mem <= cuda_kernels._SHARED_LIMIT, "needs the opt-in for more than 48 KiB"
    assert launch.block == cuda_kernels._THREADS
    for t in launch.tensors:
        assert t is None or (t.device.type == "cpu" and (t.is_contiguous() or t.numel() == 0))
    pointers = (ctypes.c_void_p * 1)(ctypes.addressof(launch.args))
    sig = f"s{ctypes.sizeof(launch.args)}"
    expected = ctypes.create_string_buffer(256)
    rc = getattr(lib, f"emu_{launch.name}")(launch.grid, launch.block, pointers, sig.encode(), expected)
    assert rc == 0, f"{launch.name}: argument {sig}, kernel expects {expected.value.decode()}"


def gradient(numel: int, seed: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """Heavy-tailed test data with some all-zero stretches (blocks whose scale is 0); made
    on ``device`` itself above 4 M values (a GPU's generator: 100 M in milliseconds)."""
    where = torch.device(device) if numel > 1 << 22 else torch.device("cpu")
    g = torch.Generator(device=where).manual_seed(seed)
    x = torch.randn(numel, generator=g, device=where) * torch.exp(torch.randn(numel, generator=g, device=where))
    if numel > 64:
        x[numel // 3 : numel // 3 + min(numel // 4, 2048)] = 0
    return x.to(dtype).to(device)


def agreed_from(prepared, seed: int) -> torch.Tensor:
    """Scales as after a MAX allreduce with other ranks: some maxima raised, and the
    digest of another tensor (so the header does not read "identical")."""
    g = torch.Generator().manual_seed(seed)
    agreed = prepared.scales.clone()
    grow = 1 + 0.5 * torch.rand(agreed.numel() - HEADER, generator=g).to(agreed.device)
    agreed[HEADER:] *= grow
    agreed[3] = agreed[3] + 1  # max over ranks of d_lo, while -d_lo stays this rank's
    return agreed


def mine(codec, x):
    """prepare through the kernels (the codec dispatches only CUDA tensors itself)."""
    return cuda_kernels.prepare(codec, x.reshape(-1))



# -- the bit-parity sweep (tests/codec/test_cuda.py small; ci/gpu_check.py up to 100M) -----------------
KINDS = ("random", "zeros", "nonfinite", "subnormal", "outlier")


def adversarial(kind: str, numel: int, dtype: torch.dtype, seed: int, device="cpu") -> torch.Tensor:
    """Test data of ``kind`` (on the CPU below 4 M values): heavy-tailed random values; all zeros; inf and NaN
    among them; one value in 7 subnormal (in float32/bfloat16; float16's are normal floats
    in float32); one huge outlier."""
    x = gradient(numel, seed, device=device) if kind != "zeros" else torch.zeros(numel, device=device)
    if kind == "nonfinite" and numel:
        x[numel // 2] = float("inf")
        x[numel // 3] = float("nan")
    elif kind == "subnormal":
        x[::7] = 1e-39 * (1 + torch.rand(len(x[::7]), generator=torch.Generator().manual_seed(seed))).to(x.device)
    elif kind == "outlier" and numel:
        x[numel // 2] = 6e4 if dtype == torch.float16 else 1e30
    return x.to(dtype)


def differing(got: torch.Tensor, want: torch.Tensor) -> int:
    """Elements whose bits differ (NaN against NaN counts as equal, any payload)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return max(got.numel(), want.numel(), 1)
    if got.is_floating_point():
        both_nan = got.isnan() & want.isnan()
        return int(((got != want) & ~both_nan).sum())
    return int((got != want).sum())


def parity_case(kind: str, numel: int, dtype: torch.dtype, bits: int, rounding: str, device,
                world: int = 4, block_size: int = 1024) -> dict:
    """One case of every stage against the reference on ``device``: prepare's scales,
    quantize's words and residual (error feedback) for each of ``world`` ranks' rounding
    streams, and decode of their summed words. Returns the differing elements per stage
    (0 everywhere is parity), subnormal inputs included."""
    from hhook.codec import rng
    from hhook.codec import THCCodec

    codec = THCCodec(bits=bits, block_size=block_size, seed=bits + 7, world_size=world, rounding=rounding)
    x = adversarial(kind, numel, dtype, seed=numel + bits, device=device).to(device)
    ours = mine(codec, x)
    with reference():
        want = codec.prepare(x)
    diff = {"scales": differing(ours.scales, want.scales)}
    agreed = agreed_from(want, seed=numel)
    residual = 0.01 * gradient(want.blocks.numel(), seed=5, device=device).view_as(want.blocks)
    total_want = total_got = None
    diff["words"] = diff["residual"] = 0
    for r in range(world):
        key = (0x9E3779B9 * (numel + 7 * r + bits)) & 0xFFFFFFFF
        if rounding == "correlated":
            key = rng.Stream(key, rng.shared_key(bits, numel), r, world)
        res_want, res_got = residual.clone(), residual.clone()
        with reference():
            words_want = codec.quantize(want, agreed, key, res_want)
        words_got = codec.quantize(ours, agreed, key, res_got)
        diff["words"] += differing(words_got, words_want)
        diff["residual"] += differing(res_got, res_want)
        total_want = words_want.clone() if total_want is None else total_want.add_(words_want)
        total_got = words_got.clone() if total_got is None else total_got.add_(words_got)
    out_want = torch.empty(numel, dtype=dtype, device=device)
    out_got = torch.full((numel,), float("nan"), dtype=dtype, device=device)
    with reference():
        codec.decode(want, agreed, total_want, out_want)
    codec.decode(ours, agreed, total_got, out_got)
    diff["decode"] = differing(out_got, out_want)
    return diff


def parity_sweep(cases, device, deadline: float | None = None) -> dict:
    """:func:`parity_case` over ``cases`` (dicts of its arguments) until ``deadline``
    (time.monotonic()); the totals, the cases run and the first failing ones."""
    import time

    totals = {"cases": 0, "cases_planned": len(cases), "differing_elements": 0, "failing": []}
    for case in cases:
        if deadline is not None and time.monotonic() > deadline:
            break
        diff = parity_case(device=device, **case)
        totals["cases"] += 1
        bad = sum(diff.values())
        totals["differing_elements"] += bad
        if bad and len(totals["failing"]) < 20:
            totals["failing"].append({**{k: str(v) for k, v in case.items()}, **diff})
    return totals


#: ci/gpu_check.py's FSDP2 cases: name -> hhook.fsdp.register's keyword arguments.
FSDP_CASES = {"default": {}, "bits4_ag8": {"bits": 4, "all_gather": 8}}
FSDP_WIDTHS = (256, 1024, 1024, 16)  # the MLP's layer widths


def fsdp_training(rank: int, world_size: int, device: str, register: dict, steps: int,
                  widths=FSDP_WIDTHS, batch: int = 64) -> dict:
    """A few FSDP2 training steps with ``hhook.fsdp.register(model, **register)`` in the
    process group already set up: an MLP of ``widths`` (ReLU between), every Linear sharded
    with ``fully_shard`` and then the root, Adam on one batch per rank (the same every
    step). Returns the losses of every step, the reduce-scatter's counters
    (``state.stats()``) and ``hhook.fsdp.all_gather_stats(model)`` (None: not compressed)."""
    import torch
    from torch.distributed.fsdp import fully_shard

    import hhook.fsdp

    torch.manual_seed(0)  # the same initial weights on every rank
    layers = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers += [torch.nn.Linear(a, b, dtype=torch.float32)] + ([torch.nn.ReLU()] if i < len(widths) - 2 else [])
    model = torch.nn.Sequential(*layers).to(device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    state = hhook.fsdp.register(model, **register)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(batch, widths[0], dtype=torch.float32, generator=gen).to(device)
    y = torch.randn(batch, widths[-1], dtype=torch.float32, generator=gen).to(device)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    stats = state.stats()
    return {"losses": [float(v) for v in losses],
            "reduce_scatter": {k: stats.get(k) for k in ("compressed_calls", "dense_calls", "nonfinite_calls",
                                                         "local_calls", "ratio")},
            "decision": str(stats.get("decision")) if stats.get("decision") is not None else None,
            "all_gather_stats": hhook.fsdp.all_gather_stats(model)}


# -- host work per bucket: launches and allocations (issue 44) -------------------------------------
#: aten ops that only allocate (no kernel runs on a GPU for them).
ALLOCATING_OPS = ("empty.memory_format", "empty_strided.default", "empty_like.default", "new_empty.default",
                  "new_empty_strided.default")


@contextlib.contextmanager
def counting_host_work():
    """Count what the code inside issues, as a GPU would see it: ``launches`` (the fused
    kernels, by name, from :data:`hhook.codec.kernels.cuda._launch`, the emulator or CuPy),
    ``torch_ops`` (every other aten op that computes: one or more kernels each on a GPU)
    and ``allocations`` (aten ops whose output has storage of its own, not an input's or
    a view of one). Yields the dict of three ``collections.Counter``."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    counts = {"launches": collections.Counter(), "torch_ops": collections.Counter(),
              "allocations": collections.Counter()}

    class _Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            name = func.__name__ if "." in func.__name__ else f"{func.__name__}.default"
            inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor)}
            fresh = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)
                     and t.untyped_storage().nbytes() and t.untyped_storage().data_ptr() not in inputs]
            if fresh:
                counts["allocations"][name] += len(fresh)
            if name not in ALLOCATING_OPS and not func.is_view and "view" not in name:
                counts["torch_ops"][name] += 1
            return out

    saved = cuda_kernels._launch

    def launch(the_launch, device):
        counts["launches"][the_launch.name] += 1
        with _paused(mode):  # the emulator's own torch calls are not the kernels'
            saved(the_launch, device)

    mode = _Mode()
    cuda_kernels._launch = launch
    try:
        with mode:
            yield counts
    finally:
        cuda_kernels._launch = saved


@contextlib.contextmanager
def _paused(mode):
    from torch.utils._python_dispatch import _pop_mode_temporarily

    with _pop_mode_temporarily():
        yield
