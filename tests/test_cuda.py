"""The CUDA kernels (csrc/thc_kernels.cu, hhook/cuda_kernels.py) against the reference codec.

Three layers, so that most of it runs without a GPU:

* nvcc compiles every ``csrc/*.cu`` for sm_80 and sm_90 (wherever nvcc is installed);
* an emulator runs the very same kernel source on the CPU (g++, one std::thread per CUDA
  thread, a barrier for ``__syncthreads``) through the same launch code, so the index
  arithmetic, the RNG, the rounding order, the lane packing and the argument lists are
  checked on machines without a GPU (its float operations are those of the GPU, so it
  also predicts the GPU's output);
* on a GPU with CuPy, the real kernels, directly and through the codec.

The rotation sums in another order than torch's matmul: rotated and decoded values are
compared with a tolerance, the words of ``quantize`` bit for bit.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hhook import cuda_kernels
from hhook.codec import HEADER, THCCodec

ROOT = Path(__file__).resolve().parents[1]
CU_FILES = sorted((ROOT / "csrc").glob("*.cu"))
NVCC = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.exists(p)), None)
GXX = shutil.which("g++")
EPS32 = 2.0**-23


# -- compile checks (any machine with nvcc) ------------------------------------------
def test_kernel_sources_exist_and_are_shipped():
    assert CU_FILES, "no .cu file in csrc/"
    assert cuda_kernels.source_path().resolve() == (ROOT / "csrc" / cuda_kernels.SOURCE_NAME).resolve()
    source = cuda_kernels.kernel_source()
    for name in cuda_kernels.KERNEL_NAMES:
        assert f"{name}," in source or f"{name})" in source, name


@pytest.mark.parametrize("path", CU_FILES, ids=lambda p: p.name)
def test_sources_need_no_host_headers(path):
    """NVRTC has no host headers: the kernels must compile without any #include."""
    includes = [line for line in path.read_text().splitlines() if line.lstrip().startswith("#include")]
    assert includes == []


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("path", CU_FILES, ids=lambda p: p.name)
def test_nvcc_compiles(path, arch, tmp_path):
    # --ptx is what NVRTC produces; -cubin also runs ptxas, which checks registers and
    # shared memory (and reports spills).
    for flags in (["--ptx"], ["-cubin", "-Xptxas", "-v"]):
        out = tmp_path / ("k.ptx" if "--ptx" in flags else "k.cubin")
        done = subprocess.run(
            [NVCC, f"-arch={arch}", *flags, "-o", str(out), str(path)], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        assert "warning" not in done.stderr.lower(), done.stderr
        assert out.stat().st_size > 0
        spills = [line for line in done.stderr.splitlines() if "spill" in line]
        assert all("0 bytes spill stores, 0 bytes spill loads" in line for line in spills), done.stderr


def _find_nvrtc() -> str | None:
    """libnvrtc: $HHOOK_NVRTC_LIBRARY, the nvidia-cuda-nvrtc wheel, or the CUDA toolkit."""
    if os.environ.get("HHOOK_NVRTC_LIBRARY"):
        return os.environ["HHOOK_NVRTC_LIBRARY"]
    folders = []
    try:
        import nvidia.cuda_nvrtc

        folders += [Path(p) / "lib" for p in nvidia.cuda_nvrtc.__path__]
    except ImportError:
        pass
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            folders.append(Path(os.environ[var]) / "lib64")
    folders += [Path(NVCC).resolve().parents[1] / "lib64"] if NVCC else []
    for folder in folders:
        found = sorted(folder.glob("libnvrtc.so*")) if folder.is_dir() else []
        if found:
            return str(found[0])
    return ctypes.util.find_library("nvrtc")


@pytest.mark.skipif(_find_nvrtc() is None, reason="libnvrtc not found (set HHOOK_NVRTC_LIBRARY)")
@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
def test_nvrtc_compiles(arch):
    """What CuPy does at run time: NVRTC, no include path, no host headers."""
    lib = ctypes.CDLL(_find_nvrtc())
    prog = ctypes.c_void_p()
    source = cuda_kernels.kernel_source().encode()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source, b"thc_kernels.cu", 0, None, None) == 0
    try:
        options = [f"--gpu-architecture={arch}".encode(), b"-std=c++14"]
        rc = lib.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value + 1)
        lib.nvrtcGetProgramLog(prog, log)
        assert rc == 0 and not log.value.strip(), log.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def test_import_needs_no_cupy():
    code = "import sys, hhook, hhook.cuda_kernels; assert 'cupy' not in sys.modules"
    done = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr


def test_force_reference_switches_the_kernels_off(monkeypatch):
    monkeypatch.setenv(cuda_kernels.FORCE_REFERENCE_ENV, "1")
    assert not cuda_kernels.available()


def test_constants_agree_with_the_codec_and_the_source():
    source = cuda_kernels.kernel_source()
    assert cuda_kernels._HEADER == HEADER and f"#define HH_HEADER {HEADER}\n" in source
    assert f"#define HH_LOG2R {cuda_kernels._R.bit_length() - 1}\n" in source


def test_block_size_limits():
    assert all(cuda_kernels.supports(1 << k) for k in range(14))
    assert not cuda_kernels.supports(16384) and not cuda_kernels.supports(65536)
    with pytest.raises(ValueError):
        cuda_kernels.prepare(THCCodec(block_size=16384), torch.zeros(20000))


# -- backends: CPU emulator and the real GPU ----------------------------------------
_SHIM = r"""
#include <barrier>
#include <cstring>
#include <math.h>
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

struct hh_dim3 { unsigned x = 0, y = 0, z = 0; };
static thread_local hh_dim3 threadIdx, blockIdx;
static hh_dim3 blockDim, gridDim;
static std::barrier<>* hh_bar;
static std::vector<unsigned long long> hh_slots;
alignas(16) float hh_smem[16384];  // dynamic shared memory, above the 48 KiB kernels use

static inline void __syncthreads() { hh_bar->arrive_and_wait(); }
// Every thread of the block calls the shuffles together (as the kernels do), so a
// block-wide exchange through memory stands in for the warp's.
template <class T> static inline T __shfl_xor_sync(unsigned, T v, int off) {
    unsigned long long bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    hh_slots[threadIdx.x] = bits;
    hh_bar->arrive_and_wait();
    bits = hh_slots[threadIdx.x ^ off];
    hh_bar->arrive_and_wait();
    T r;
    std::memcpy(&r, &bits, sizeof(T));
    return r;
}
static inline unsigned atomicMax(unsigned* p, unsigned v) {
    unsigned old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (old < v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {}
    return old;
}
static inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }
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
    const char kind = std::is_pointer_v<T> ? 'p' : std::is_floating_point_v<T> ? 'f' : std::is_signed_v<T> ? 'i' : 'u';
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


@pytest.fixture(scope="session")
def emulator(tmp_path_factory):
    if GXX is None:
        pytest.skip("g++ is not installed: cannot emulate the kernels")
    version = subprocess.run([GXX, "-dumpversion"], capture_output=True, text=True).stdout.strip()
    if int(version.split(".")[0] or 0) < 12:
        pytest.skip(f"the emulator needs g++ >= 12 (C++20 <barrier>, _Float16), not {version}")
    folder = tmp_path_factory.mktemp("emu")
    entry = 'extern "C" int emu_{0}(int g, int b, void** a, const char* s, char* e)'
    entry += " {{ return hh_run({0}, g, b, a, s, e); }}\n"
    entries = "".join(entry.format(n) for n in cuda_kernels.KERNEL_NAMES)
    src = folder / "emu.cpp"
    src.write_text(_SHIM.replace("#include KERNELS", f'#include "{cuda_kernels.source_path()}"') + entries)
    lib = folder / "emu.so"
    cmd = [GXX, "-std=c++20", "-O2", "-ffp-contract=off", "-fPIC", "-shared", "-pthread", "-o", str(lib), str(src)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return ctypes.CDLL(str(lib))


def _signature_code(arg) -> str:
    if isinstance(arg, torch.Tensor):
        return "p8"
    kind = {"f": "f", "i": "i", "u": "u"}[arg.dtype.kind]
    return f"{kind}{arg.dtype.itemsize}"


def _emulated_launch(lib, launch: cuda_kernels.Launch, device) -> None:
    assert launch.shared_mem <= 48 * 1024, "needs the opt-in for more than 48 KiB of shared memory"
    assert launch.block % 32 == 0 and launch.block <= 1024
    keep = []
    pointers = (ctypes.c_void_p * len(launch.args))()
    for i, arg in enumerate(launch.args):
        if isinstance(arg, torch.Tensor):
            assert arg.device.type == "cpu" and (arg.is_contiguous() or arg.numel() == 0)
            value = ctypes.c_void_p(arg.data_ptr())
        else:
            value = ctypes.create_string_buffer(arg.tobytes(), arg.nbytes)
        keep.append(value)
        pointers[i] = ctypes.cast(ctypes.pointer(value), ctypes.c_void_p)
    sig = "".join(_signature_code(a) for a in launch.args)
    expected = ctypes.create_string_buffer(256)
    rc = getattr(lib, f"emu_{launch.name}")(launch.grid, launch.block, pointers, sig.encode(), expected)
    assert rc == 0, f"{launch.name}: arguments {sig}, kernel expects {expected.value.decode()}"


class Backend:
    def __init__(self, name: str, device: torch.device, fast: bool):
        self.name, self.device, self.fast = name, device, fast


@pytest.fixture(params=["emulated", "cuda"])
def backend(request, monkeypatch):
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        if not cuda_kernels._cupy_importable():
            pytest.skip("CuPy is not installed (pip install hhook[cuda])")
        monkeypatch.delenv(cuda_kernels.FORCE_REFERENCE_ENV, raising=False)
        return Backend("cuda", torch.device("cuda"), fast=True)
    lib = request.getfixturevalue("emulator")
    monkeypatch.setattr(cuda_kernels, "_launch", functools.partial(_emulated_launch, lib))
    return Backend("emulated", torch.device("cpu"), fast=False)


@contextlib.contextmanager
def reference():
    """Make the codec take the reference path even for CUDA tensors."""
    old = os.environ.get(cuda_kernels.FORCE_REFERENCE_ENV)
    os.environ[cuda_kernels.FORCE_REFERENCE_ENV] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ[cuda_kernels.FORCE_REFERENCE_ENV]
        else:
            os.environ[cuda_kernels.FORCE_REFERENCE_ENV] = old


def gradient(numel: int, seed: int, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """Heavy-tailed test data with some all-zero stretches (blocks whose scale is 0)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=g) * torch.exp(torch.randn(numel, generator=g))  # fits fp16
    if numel > 64:
        x[numel // 3 : numel // 3 + min(numel // 4, 2048)] = 0
    return x.to(dtype).to(device)


def agreed_from(prepared, seed: int) -> torch.Tensor:
    """Scales as after a MAX allreduce: other ranks raise some maxima."""
    g = torch.Generator().manual_seed(seed)
    agreed = prepared.scales.clone()
    grow = 1 + 0.5 * torch.rand(agreed.numel() - HEADER, generator=g).to(agreed.device)
    agreed[HEADER:] *= grow
    return agreed


def codes_of(words: torch.Tensor, layout, count: int) -> torch.Tensor:
    """Lane values as int64 (independent of the reference's unpack dtype)."""
    planes = [(words.long() >> (j * layout.width)) & layout.mask for j in range(layout.lanes)]
    return torch.cat(planes)[:count]


def residual_tolerance(agreed: torch.Tensor, levels: int) -> float:
    # torch on CUDA divides by a Python scalar as a multiplication by its float32
    # reciprocal, so the reference's step may differ from M*2/(L-1) by an ulp.
    return float(2 * levels * EPS32 * agreed[HEADER:].max() * 2 / (levels - 1)) + 1e-30


SIZES_FAST = [0, 1, 2, 3, 5, 16, 17, 100, 1000, 1024, 1025, 3000, 4097, 20000, 65536 + 3, 1 << 20]
SIZES_EMULATED = [0, 1, 2, 3, 5, 16, 17, 100, 1000, 1024, 1025, 3000, 4097, 9000]


# -- stage 3: words bit for bit -----------------------------------------------------
@pytest.mark.parametrize("bits", range(1, 9))
def test_quantize_words_equal_reference_bit_for_bit(backend, bits):
    sizes = SIZES_FAST if backend.fast else SIZES_EMULATED
    worlds = range(1, 17) if backend.fast else (1, 3, 8, 16)
    for world in worlds:
        codec = THCCodec(bits=bits, block_size=1024, seed=bits, world_size=world)
        for i, numel in enumerate(sizes):
            if not backend.fast and i % 3 != world % 3 and numel > 100:
                continue  # the emulator is slow: a rotating subset of the larger sizes
            x = gradient(numel, seed=numel + world, device=backend.device)
            with reference():
                prepared = codec.prepare(x)
            agreed = agreed_from(prepared, seed=numel)
            key = (0x9E3779B9 * (numel + 7 * world + bits)) & 0xFFFFFFFF
            want_res = torch.empty_like(prepared.blocks)
            with reference():
                want = codec.quantize(prepared, agreed, key, want_res)
            got_res = torch.full_like(prepared.blocks, float("nan"))
            got = cuda_kernels.quantize(codec, prepared, agreed, key, got_res)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(got, want), f"bits={bits} world={world} numel={numel}"
            if backend.fast:
                tol = residual_tolerance(agreed, codec.levels)
                torch.testing.assert_close(got_res, want_res, rtol=0, atol=tol)
            else:
                assert torch.equal(got_res, want_res)


def test_quantize_block_sizes_beyond_the_rotation_kernels(backend):
    """Quantization runs in the kernel for any block size, 65536 included."""
    numel = 70000 if backend.fast else 20000
    for block_size in (16, 8192, 65536):
        codec = THCCodec(bits=4, block_size=block_size, seed=3, world_size=4)
        x = gradient(numel, seed=block_size, device=backend.device)
        with reference():
            prepared = codec.prepare(x)
            want = codec.quantize(prepared, prepared.scales, 77)
        assert torch.equal(cuda_kernels.quantize(codec, prepared, prepared.scales, 77), want)


# -- stage 1: rotation and maxima ----------------------------------------------------
def rotation_atol(block: int, scale) -> float:
    """Two fp32 summation orders of a B-point transform of values up to ``scale`` (measured
    on the emulator: below 4e-6 * scale at B = 8192, a tenth of this)."""
    return 32 * EPS32 * max(1, math.log2(block)) * float(scale) + 1e-30


def assert_rotated_close(got, want, block, scale):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=rotation_atol(block, scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 2, 16, 64, 1024, 2048, 8192])
def test_prepare_matches_reference(backend, dtype, block_size):
    sizes = SIZES_FAST if backend.fast else [0, 1, 3, 17, 1000, 3000, 9000]
    codec = THCCodec(bits=4, block_size=block_size, seed=11, world_size=4)
    for numel in sizes:
        x = gradient(numel, seed=numel, dtype=dtype, device=backend.device).view(-1, 1)
        with reference():
            want = codec.prepare(x)
        got = cuda_kernels.prepare(codec, x)
        assert got.numel == want.numel and got.blocks.shape == want.blocks.shape
        assert torch.equal(got.scales[:HEADER], want.scales[:HEADER])
        block = want.blocks.shape[1]
        scale = want.scales[HEADER:].max() if numel else 1.0
        assert_rotated_close(got.blocks, want.blocks, block, scale)
        assert_rotated_close(got.scales[HEADER:], want.scales[HEADER:], block, scale)
        if numel:  # the maxima are exactly those of the kernel's own blocks
            assert torch.equal(got.scales[HEADER:], got.blocks.abs().amax(dim=1))


def test_prepare_reads_strided_input(backend):
    codec = THCCodec(bits=4, block_size=64)
    x = gradient(1000, seed=1, device=backend.device)[::2]
    with reference():
        want = codec.prepare(x)
    assert_rotated_close(cuda_kernels.prepare(codec, x).blocks, want.blocks, 64, want.scales[HEADER:].max())


def test_nonfinite_is_flagged_and_maxima_zeroed(backend):
    codec = THCCodec(bits=4, block_size=64, world_size=2)
    for bad in (float("inf"), float("-inf"), float("nan")):
        x = gradient(1000, seed=2, device=backend.device)
        x[517] = bad
        got = cuda_kernels.prepare(codec, x)
        assert got.scales[0].item() == 1.0
        assert torch.equal(got.scales[HEADER:], torch.zeros_like(got.scales[HEADER:]))
        assert got.scales[1].item() == codec.fingerprint(1000) == -got.scales[2].item()


# -- error feedback --------------------------------------------------------------------
def test_error_feedback_residual(backend):
    numel = 200_000 if backend.fast else 5000
    for bits in (1, 4, 8):
        codec = THCCodec(bits=bits, block_size=1024, seed=5, world_size=3)
        x = gradient(numel, seed=bits, device=backend.device)
        with reference():
            first = codec.prepare(x)
        residual = torch.empty_like(first.blocks)
        with reference():
            codec.quantize(first, first.scales, 1, residual)
        # the next step starts from this residual
        with reference():
            want = codec.prepare(x, residual)
        got = cuda_kernels.prepare(codec, x, residual)
        scale = want.scales[HEADER:].max() + residual.abs().max()
        assert_rotated_close(got.blocks, want.blocks, 1024, scale)
        assert_rotated_close(got.scales[HEADER:], want.scales[HEADER:], 1024, scale)
        want_res, got_res = torch.empty_like(residual), torch.empty_like(residual)
        with reference():
            want_words = codec.quantize(want, want.scales, 2, want_res)
        got_words = cuda_kernels.quantize(codec, want, want.scales, 2, got_res)
        assert torch.equal(got_words, want_words)
        torch.testing.assert_close(got_res, want_res, rtol=0, atol=residual_tolerance(want.scales, codec.levels))


# -- stages 1 + 3: codes of the full encode path ---------------------------------------
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_encode_codes_match_up_to_rare_off_by_one(backend, bits):
    numel = (1 << 20) + 5 if backend.fast else 9000
    codec = THCCodec(bits=bits, block_size=1024, seed=9, world_size=4)
    x = gradient(numel, seed=bits, device=backend.device)
    with reference():
        ref = codec.prepare(x)
        want = codec.quantize(ref, ref.scales, 1234)
    mine = cuda_kernels.prepare(codec, x)
    got = cuda_kernels.quantize(codec, mine, mine.scales, 1234)
    count = ref.blocks.numel()
    diff = codes_of(got, codec.layout, count) - codes_of(want, codec.layout, count)
    assert diff.abs().max().item() <= 1
    assert (diff != 0).sum().item() <= max(2, 1e-4 * count)


# -- stage 5: decode --------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits,world", [(1, 1), (2, 16), (4, 4), (4, 7), (8, 2), (8, 16)])
def test_decode_matches_reference(backend, dtype, bits, world):
    sizes = [0, 1, 3, 17, 1000, 1025, 4097, 70000, (1 << 20) + 1] if backend.fast else [1, 3, 17, 1025, 3000]
    block_sizes = (64, 1024, 8192) if backend.fast or dtype == torch.float32 else (1024,)
    for block_size in block_sizes:
        codec = THCCodec(bits=bits, block_size=block_size, seed=21, world_size=world)
        for numel in sizes:
            with reference():  # ranks differ in their rounding streams (and another's scales)
                prepared = codec.prepare(gradient(numel, seed=numel, device=backend.device))
                agreed = agreed_from(prepared, seed=world)
                words = [codec.quantize(prepared, agreed, 1000 + r) for r in range(world)]
            total = words[0].clone()
            for w in words[1:]:
                total += w  # wraps like the collectives
            want = torch.empty(numel, dtype=dtype, device=backend.device)
            got = torch.full((numel,), float("nan"), dtype=dtype, device=backend.device)
            with reference():
                codec.decode(prepared, agreed, total.clone(), want)
            cuda_kernels.decode(codec, prepared, agreed, total, got)
            atol = rotation_atol(prepared.blocks.shape[1], agreed[HEADER:].max()) if numel else 0.0
            if dtype == torch.float32:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=atol)
            else:  # one rounding of the output dtype apart at most
                eps = torch.finfo(dtype).eps
                torch.testing.assert_close(got.float(), want.float(), rtol=eps, atol=atol)


def test_decode_into_strided_output(backend):
    codec = THCCodec(bits=4, block_size=64, world_size=1)
    x = gradient(500, seed=4, device=backend.device)
    with reference():
        p = codec.prepare(x)
        words = codec.quantize(p, p.scales, 0)
        want = codec.decode(p, p.scales, words, torch.empty(500, device=backend.device))
    out = torch.zeros(1000, device=backend.device)[::2]
    cuda_kernels.decode(codec, p, p.scales, words, out)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=rotation_atol(64, p.scales[HEADER:].max()))


# -- the codec's dispatch (GPU only) ------------------------------------------------------
def test_codec_uses_the_kernels_on_cuda_and_matches_the_reference(backend, monkeypatch):
    if backend.name != "cuda":
        pytest.skip("the codec only dispatches CUDA tensors")
    calls = []
    for stage in ("prepare", "quantize", "decode"):
        real = getattr(cuda_kernels, stage)
        monkeypatch.setattr(cuda_kernels, stage, lambda *a, _r=real, _s=stage, **k: calls.append(_s) or _r(*a, **k))
    for block_size in (1024, 65536):
        calls.clear()
        codec = THCCodec(bits=4, block_size=block_size, seed=1, world_size=2)
        x = gradient(300_000, seed=block_size, device="cuda").view(100, -1)
        p = codec.prepare(x)
        words = codec.quantize(p, p.scales, 5)
        out = codec.decode(p, p.scales, words, torch.empty_like(x))
        expected = ["prepare", "quantize", "decode"] if block_size <= cuda_kernels.MAX_BLOCK else ["quantize"]
        with reference():
            rp = codec.prepare(x)
            rout = codec.decode(rp, rp.scales, codec.quantize(rp, rp.scales, 5), torch.empty_like(x))
        assert calls == expected
        # one scale step of the mean (n = 2) covers a rare off-by-one code
        step = float(p.scales[HEADER:].max()) * 2 / 15 / 2
        torch.testing.assert_close(out, rout, rtol=0, atol=step * 1.01 + 1e-6)


def test_codec_nonfinite_on_cuda(backend):
    if backend.name != "cuda":
        pytest.skip("the codec only dispatches CUDA tensors")
    codec = THCCodec(bits=4, world_size=1)
    x = gradient(5000, seed=0, device="cuda")
    x[10] = float("nan")
    p = codec.prepare(x)
    assert codec.quantize(p, p.scales, 0) is None
    assert torch.isnan(codec.decode(p, p.scales, None, torch.empty_like(x))).all()
