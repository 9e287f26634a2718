"""The CUDA kernels (src/hhook/codec/kernels/csrc/thc_kernels.cu, src/hhook/codec/kernels/cuda.py) against the reference codec.

Layers, so that most of it runs without a GPU:

* nvcc compiles the kernels for sm_80 and sm_90 with CuPy's ``-ftz=true`` (ptxas: no
  spills; the PTX's float arithmetic keeps subnormals and has no FMA), and NVRTC compiles
  them as CuPy does, wherever a libnvrtc is found;
* an emulator runs the very same kernel source on the CPU (g++, one std::thread per CUDA
  thread, a barrier for ``__syncthreads``) through the same launch code, so index
  arithmetic, RNG, rounding, lane packing, the header and the argument lists are checked
  on machines without a GPU;
* on a GPU with CuPy, the same tests on the real kernels (the transport, two ranks:
  tests/codec/test_cuda_transport.py).

The kernels perform the specification's float operations in its order
(docs/guarantees.md), so every stage must give the reference codec's bits, and a CUDA rank
decodes the summed words to the bits a CPU rank does.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hhook.codec import rng, rotation
from hhook.codec.kernels import cpu as cpu_kernels
from hhook.codec.kernels import cuda as cuda_kernels
from hhook.codec import HEADER, THCCodec

from tests.support.cuda_support import (KINDS, agreed_from, build_emulator, emulated_launch, emulator_unavailable,
                                        gradient, mine, parity_case, reference)

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "src" / "hhook" / "codec" / "kernels" / "csrc"
CU_FILES = sorted(CSRC.glob("*.cu"))
NVCC = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.exists(p)), None)
SMALLEST_NORMAL = float(torch.finfo(torch.float32).tiny)


pytestmark = pytest.mark.usefixtures("no_tf32")  # tests/conftest.py


# -- compile checks (any machine with nvcc / libnvrtc) ------------------------------------
def test_kernel_sources_exist_and_are_shipped():
    assert CU_FILES, f"no .cu file in {CSRC}"
    assert cuda_kernels.source_path().resolve() == (CSRC / cuda_kernels.SOURCE_NAME).resolve()
    source = cuda_kernels.kernel_source()
    for name in (*cuda_kernels.KERNEL_NAMES, *cuda_kernels.WEIGHT_KERNEL_NAMES):
        assert f"({name}," in source or f" {name}(" in source, name
    structs = cuda_kernels.arg_types()  # the kernels' argument structs, read from the source
    assert set(structs) == {"HhPrepareArgs", "HhQuantizeArgs", "HhDecodeArgs", "HhWeightArgs"}
    for struct in structs.values():
        names = [name for name, _ in struct.ctype._fields_]
        assert all(f" {name};" in source for name in names) and list(struct.per_call) == names[: len(struct.per_call)]
        assert struct.packer.size <= ctypes.sizeof(struct.ctype)


@pytest.mark.parametrize("path", CU_FILES, ids=lambda p: p.name)
def test_sources_need_no_host_headers(path):
    """NVRTC has no host headers: the kernels must compile without any #include."""
    includes = [line for line in path.read_text().splitlines() if line.lstrip().startswith("#include")]
    assert includes == []


def _nvcc(path, arch, flags, out):
    return subprocess.run(
        [NVCC, f"-arch={arch}", "-ftz=true", *flags, "-o", str(out), str(path)], capture_output=True, text=True
    )


@pytest.fixture(scope="session")
def nvcc_ptx(tmp_path_factory):
    """``ptx(path, arch)``: nvcc's PTX of a source (and the finished run), compiled once a
    session: the front end is most of an nvcc run, and the tests below read one PTX twice."""
    folder, done = tmp_path_factory.mktemp("nvcc"), {}

    def ptx(path, arch):
        if (path, arch) not in done:
            out = folder / f"{path.stem}.{arch}.ptx"
            done[path, arch] = _nvcc(path, arch, ["--ptx"], out), out
        return done[path, arch]
    return ptx


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("path", CU_FILES, ids=lambda p: p.name)
def test_nvcc_compiles_without_spills(path, arch, tmp_path, nvcc_ptx):
    # --ptx is what NVRTC produces; -cubin also runs ptxas, which applies the launch
    # bounds (register caps) and reports spills. The cubin is ptxas's of that PTX (the
    # same bytes as nvcc -cubin from the source, without a second front-end run).
    ptx = nvcc_ptx(path, arch)
    cubin = _nvcc(ptx[1], arch, ["-cubin", "-Xptxas", "-v"], tmp_path / "k.cubin"), tmp_path / "k.cubin"
    for done, out in (ptx, cubin):
        assert done.returncode == 0, done.stderr
        assert "warning" not in done.stderr.lower(), done.stderr
        assert out.stat().st_size > 0
        spills = [line for line in done.stderr.splitlines() if "spill" in line]
        assert all("0 bytes spill stores, 0 bytes spill loads" in line for line in spills), done.stderr


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
def test_float_arithmetic_keeps_subnormals_under_ftz_and_never_contracts(nvcc_ptx):
    """Under CuPy's -ftz=true the kernels' float operations are still the CPU's (built with
    -ffp-contract=off): no f32 instruction that flushes subnormals (.ftz: arithmetic,
    comparisons, negation, conversions), no fused multiply-add, and every add, sub, mul and
    div with an explicit rounding mode, which ptxas never contracts into an FFMA."""
    import re

    for path in CU_FILES:
        done, out = nvcc_ptx(path, "sm_90")
        assert done.returncode == 0, done.stderr
        ptx = out.read_text()
        ops = re.findall(r"(?<![.%\w])([a-z]+(?:\.\w+)*\.f32)\b", ptx)  # also inside inline asm's braces
        arithmetic = [op for op in ops if op.split(".")[0] in ("add", "sub", "mul", "div")]
        assert len(arithmetic) > 100, sorted(set(ops))
        assert ".ftz" not in ptx and [op for op in ops if op.startswith("setp.lt")]
        assert [op for op in ops if op.split(".")[0] in ("fma", "mad")] == []
        assert [op for op in arithmetic if op.split(".")[1] not in ("rn", "rz", "rm", "rp")] == []


def _find_nvrtc() -> str | None:
    """libnvrtc: $HHOOK_NVRTC_LIBRARY, an nvidia-cuda-nvrtc wheel (CUDA 12:
    ``nvidia/cuda_nvrtc/lib``; CUDA 13: ``nvidia/cu13/lib``), or the CUDA toolkit."""
    if os.environ.get("HHOOK_NVRTC_LIBRARY"):
        return os.environ["HHOOK_NVRTC_LIBRARY"]
    folders = []
    try:
        import nvidia  # namespace package of the NVIDIA wheels

        for root in map(Path, nvidia.__path__):
            folders += sorted(root.glob("*/lib"))
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
    """What CuPy does at run time: NVRTC, its options and -ftz=true, no host headers."""
    path = Path(_find_nvrtc())
    # libnvrtc dlopens libnvrtc-builtins by name: a wheel's folder is not on the search path.
    for builtins in sorted(path.parent.glob("libnvrtc-builtins.so*")):
        if ".alt." not in builtins.name:
            ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(str(path))
    prog = ctypes.c_void_p()
    source = cuda_kernels.kernel_source().encode()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source, b"thc_kernels.cu", 0, None, None) == 0
    try:
        options = [f"--gpu-architecture={arch}".encode(), *(o.encode() for o in cuda_kernels.COMPILE_OPTIONS), b"-ftz=true"]
        rc = lib.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value + 1)
        lib.nvrtcGetProgramLog(prog, log)
        assert rc == 0 and not log.value.strip(), log.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def test_import_needs_no_cupy():
    code = "import sys, hhook, hhook.codec.kernels.cuda; assert 'cupy' not in sys.modules"
    done = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr


def test_force_reference_switches_the_kernels_off(monkeypatch):
    monkeypatch.setenv(cuda_kernels.FORCE_REFERENCE_ENV, "1")
    assert not cuda_kernels.available() and not cuda_kernels.usable("cuda:0", 1024)
    assert not cuda_kernels.warm_up("cuda:0")


def test_failed_compile_falls_back_with_one_log_line(monkeypatch, caplog):
    """A missing NVRTC must not raise inside the backward pass: usable() says no, once."""
    monkeypatch.delenv(cuda_kernels.FORCE_REFERENCE_ENV, raising=False)
    monkeypatch.setattr(cuda_kernels, "_cupy_importable", lambda: True)
    monkeypatch.setattr(cuda_kernels, "_functions", lambda index: (_ for _ in ()).throw(OSError("libnvrtc.so: not found")))
    cuda_kernels._warm_up.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="hhook.codec.kernels.cuda"):
            assert not cuda_kernels.usable("cuda:7", 1024)
            assert not cuda_kernels.usable("cuda:7", 1024)
            assert not cuda_kernels.warm_up("cuda:7")
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and "cuda:7" in lines[0] and "libnvrtc" in lines[0]
    finally:
        cuda_kernels._warm_up.cache_clear()


def test_constants_agree_with_the_codec_and_the_source():
    from hhook.codec import layout
    from hhook.codec.kernels import cuda_launches

    source = cuda_kernels.kernel_source()
    assert cuda_kernels._HEADER == HEADER and f"#define HH_HEADER {HEADER}\n" in source
    assert f"#define HH_PREFIX {layout.PREFIX} " in source
    assert f"#define HH_RANK_FAILED (1 << {layout.RANK_FAILED.bit_length() - 1}) " in source
    assert f"#define HH_WARPS {cuda_launches._WARPS}\n" in source
    assert f"#define HH_CHUNK {cuda_launches._CHUNK} " in source
    assert f"#define HH_WORD_BYTES {cuda_launches._WORD_BYTES} " in source


def test_sign_table_is_the_rotation_diagonal():
    for seed, block in ((0, 1), (3, 16), (7, 1024), (11, 4096)):
        bits = cuda_kernels.sign_bits(seed, block)
        negative = [(int(bits[p >> 5]) >> (p & 31)) & 1 for p in range(block)]
        assert torch.equal(torch.tensor(negative, dtype=torch.float32), (1 - rotation.signs(seed, block, "cpu")) / 2)


@pytest.mark.parametrize("block", [1 << k for k in range(13)])
def test_launch_geometry_fits_the_hardware(block):
    """Shared memory without an opt-in, the launch bounds' thread count, and a tile of
    whole blocks."""
    if block > cuda_kernels.MAX_BLOCK:
        assert not cuda_kernels.supports(block)
        return
    assert cuda_kernels._TILE % block == 0
    for bits, world in ((4, 4), (4, 8)):  # int32 and int64 words
        codec = THCCodec(bits=bits, block_size=block, world_size=world)
        x = torch.zeros(3 * cuda_kernels._TILE + 5)
        scales = torch.zeros(HEADER + codec.n_blocks(x.numel()))
        signs, ws = torch.zeros(max(1, block // 32), dtype=torch.int32), torch.zeros(33, dtype=torch.int64)
        words = torch.empty(codec.words_numel(x.numel()), dtype=codec.layout.word_dtype)
        launches = [
            cuda_kernels.prepare_launch(x, signs, scales, None, ws, x.numel(), block, 1),
            cuda_kernels.quantize_launch(x, signs, scales, words, None, None, block, codec.layout, 16, 1),
            cuda_kernels.decode_launch(words, signs, scales, x, x, block, codec.layout, 16, 4),
        ]
        for launch in launches:
            assert launch.shared_mem <= cuda_kernels._SHARED_LIMIT, launch.name
            assert launch.block == cuda_kernels._THREADS


def test_block_size_limits():
    assert all(cuda_kernels.supports(1 << k) for k in range(13))
    assert not cuda_kernels.supports(8192) and not cuda_kernels.supports(65536) and not cuda_kernels.supports(3)
    with pytest.raises(ValueError):
        cuda_kernels.prepare(THCCodec(block_size=8192), torch.zeros(20000))


@pytest.fixture(scope="session")
def emulator(tmp_path_factory):
    why = emulator_unavailable()
    if why:
        pytest.skip(why)
    return build_emulator(tmp_path_factory.mktemp("emu"))


class Backend:
    def __init__(self, name: str, device: torch.device, fast: bool):
        self.name, self.device, self.fast = name, device, fast


def _cuda_ready() -> bool:
    return torch.cuda.is_available() and cuda_kernels._cupy_importable()


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
    monkeypatch.setattr(cuda_kernels, "_launch", functools.partial(emulated_launch, lib))
    return Backend("emulated", torch.device("cpu"), fast=False)


SIZES_FAST = [0, 1, 2, 3, 5, 16, 17, 100, 1000, 1024, 1025, 3000, 4097, 20000, 65536 + 3, 1 << 20]
SIZES_EMULATED = [0, 1, 3, 17, 100, 1025, 3000, 9000]


# -- stage 1 -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 2, 16, 64, 1024, 2048, 4096])
def test_prepare_equals_reference_bit_for_bit(backend, dtype, block_size):
    """Header (flag, fingerprint, digest) and block maxima, exactly."""
    codec = THCCodec(bits=4, block_size=block_size, seed=11, world_size=4)
    for numel in SIZES_FAST if backend.fast else SIZES_EMULATED:
        x = gradient(numel, seed=numel, dtype=dtype, device=backend.device).view(-1, 1)
        with reference():
            want = codec.prepare(x)
        got = mine(codec, x)
        assert got.numel == numel and got.blocks is None and got.backend is cuda_kernels
        assert torch.equal(got.scales, want.scales), f"numel={numel}"


def test_prepare_flags_nonfinite_and_leaves_the_workspace_clean(backend):
    codec = THCCodec(bits=4, block_size=64, world_size=2)
    x = gradient(3000, seed=2, device=backend.device)
    clean = mine(codec, x).scales.clone()
    for bad in (float("inf"), float("-inf"), float("nan")):
        y = x.clone()
        y[517] = bad
        got = mine(codec, y).scales
        with reference():
            want = codec.prepare(y).scales
        assert got[0].item() == 1.0 and torch.equal(got[HEADER:], torch.zeros_like(got[HEADER:]))
        assert torch.equal(got, want)
        assert torch.equal(mine(codec, x).scales, clean)  # digest and flag were reset


def test_subnormals_are_kept_as_the_cpu_keeps_them(backend):
    """CuPy compiles with -ftz=true, yet subnormal inputs rotate, round and decode to the
    reference's bits (a bf16 block of subnormals: scales near 1e-37), not as zeros."""
    codec = THCCodec(bits=4, block_size=64, world_size=2)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.linspace(-1, 1, 200, device=backend.device) * 1e-39).to(dtype)
        ours = mine(codec, x)
        with reference():
            want = codec.prepare(x)
            zeros = codec.prepare(torch.zeros_like(x)).scales
        assert torch.equal(ours.scales, want.scales) and (want.scales[HEADER:] > 0).all()
        assert not torch.equal(ours.scales[3:HEADER], zeros[3:HEADER])
        agreed = agreed_from(want, seed=1)
        words = codec.quantize(ours, agreed, 3)
        with reference():
            assert torch.equal(words, codec.quantize(want, agreed, 3))
            expected = codec.decode(want, agreed, words + words, torch.empty_like(x))
        got = codec.decode(ours, agreed, words + words, torch.full_like(x, float("nan")))
        assert torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                           expected.view(torch.int16 if dtype != torch.float32 else torch.int32))
        assert (expected != 0).any()


# -- stage 3 -----------------------------------------------------------------------------------
@pytest.mark.parametrize("bits", range(1, 9))
def test_quantize_equals_reference_bit_for_bit(backend, bits):
    """Words and the new residual, exactly; residual in place, into another buffer, or none."""
    sizes = SIZES_FAST if backend.fast else SIZES_EMULATED
    worlds = range(1, 17) if backend.fast else (1, 3, 16)
    for world in worlds:
        codec = THCCodec(bits=bits, block_size=1024, seed=bits, world_size=world)
        for i, numel in enumerate(sizes):
            if not backend.fast and (i + world) % 3 and numel > 100:
                continue  # the emulator is slow: a rotating subset of the larger sizes
            dtype = (torch.float32, torch.bfloat16, torch.float16)[(i + world) % 3]
            x = gradient(numel, seed=numel + world, dtype=dtype, device=backend.device)
            with reference():
                prepared = codec.prepare(x)
            agreed = agreed_from(prepared, seed=numel)
            key = (0x9E3779B9 * (numel + 7 * world + bits)) & 0xFFFFFFFF
            if (i + bits) % 2:  # correlated rounding: this rank's strata among the world's
                key = rng.Stream(key, rng.shared_key(bits, numel), (numel + bits) % world, world)
            residual = 0.01 * gradient(prepared.blocks.numel(), seed=5, device=backend.device).view_as(prepared.blocks)
            want_res = residual.clone()
            with reference():
                want = codec.quantize(prepared, agreed, key)
                want_ef = codec.quantize(prepared, agreed, key, want_res)
            ours = mine(codec, x)
            got = codec.quantize(ours, agreed, key)  # dispatches to the kernels via ours.backend
            in_place = residual.clone()
            got_ef = codec.quantize(ours, agreed, key, in_place)
            into = torch.full_like(residual, float("nan"))
            got_into = codec.quantize(ours, agreed, key, residual.clone(), into)
            assert got.dtype == want.dtype and torch.equal(got, want), f"bits={bits} world={world} numel={numel}"
            assert torch.equal(got_ef, want_ef) and torch.equal(got_into, want_ef)
            assert torch.equal(in_place, want_res) and torch.equal(into, want_res)


def test_a_nonfinite_residual_sets_the_flag_as_in_the_reference(backend, monkeypatch):
    """The residual that quantize adds is covered by prepare's flag (issue 58): the scale
    vector and the rank's own header say non-finite, as the reference's do."""
    from hhook.codec import codec as codec_module

    monkeypatch.setattr(codec_module, "fused_backend", lambda x, block: cuda_kernels)
    codec = THCCodec(bits=4, block_size=64, world_size=2)
    x = gradient(3000, seed=2, device=backend.device)
    for bad in (float("nan"), float("inf"), 1e3):
        residual = torch.zeros(47, 64, device=backend.device)
        residual[5, 3] = bad
        got = codec.prepare(x, residual)
        with reference():
            want = codec.prepare(x, residual)
        assert torch.equal(got.scales, want.scales) and torch.equal(got.header, want.header), bad
        assert (got.header[0].item() == 1) == (bad != 1e3)


@pytest.mark.parametrize("verdict", ["nonfinite", "identical"])
def test_quantize_keeps_the_residual_when_the_header_says_so(backend, verdict):
    codec = THCCodec(bits=4, block_size=64, world_size=2)
    x = gradient(3000, seed=3, device=backend.device)
    ours = mine(codec, x)
    agreed = ours.scales.clone()  # as sent: every rank identical
    if verdict == "nonfinite":
        agreed[0] = 1.0
        agreed[3] += 1
    residual = gradient(agreed.numel() - HEADER, seed=4, device=backend.device).repeat_interleave(64).view(-1, 64)
    old = residual.clone()
    into = torch.full_like(residual, float("nan"))
    codec.quantize(ours, agreed, 5, residual.clone(), into)
    codec.quantize(ours, agreed, 5, residual)
    assert torch.equal(into, old) and torch.equal(residual, old)


def test_quantize_tiny_scales_round_like_the_reference(backend):
    """0 < M < 3.7e-37 at 8 bits: (L - 1) / 2M overflows; both zero it, so every code is 0;
    the residuals (y + M, many subnormal) are the reference's bits."""
    codec = THCCodec(bits=8, block_size=64, world_size=1)
    x = gradient(640, seed=6, device=backend.device) * 1e-39  # rotated values far below the scales
    with reference():
        prepared = codec.prepare(x)
    agreed = prepared.scales.clone()
    agreed[3] += 1
    agreed[HEADER:] = torch.linspace(2e-38, 3.6e-37, agreed.numel() - HEADER)
    want_res = torch.zeros_like(prepared.blocks)
    with reference():
        want = codec.quantize(prepared, agreed, 9, want_res)
    got_res = torch.zeros_like(prepared.blocks)
    got = codec.quantize(mine(codec, x), agreed, 9, got_res)
    assert torch.equal(got, want) and not got.any()
    assert torch.equal(got_res.view(torch.int32), want_res.view(torch.int32)) and (want_res != 0).any()


# -- stage 5 -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bits,world", [(1, 1), (2, 16), (4, 4), (4, 7), (8, 2), (8, 16)])
def test_decode_equals_reference_bit_for_bit(backend, dtype, bits, world):
    sizes = [1, 3, 17, 1000, 1025, 4097, 70000, (1 << 20) + 1] if backend.fast else [1, 17, 1025, 3000]
    block_sizes = (64, 1024, 4096) if backend.fast or dtype == torch.float32 else (1024,)
    for block_size in block_sizes:
        codec = THCCodec(bits=bits, block_size=block_size, seed=21, world_size=world)
        for numel in sizes:
            x = gradient(numel, seed=numel, dtype=dtype, device=backend.device)
            with reference():  # ranks differ in their rounding streams (and another's scales)
                prepared = codec.prepare(x)
                agreed = agreed_from(prepared, seed=world)
                words = [codec.quantize(prepared, agreed, 1000 + r) for r in range(world)]
            total = words[0].clone()
            for w in words[1:]:
                total += w  # wraps like the collectives
            want = torch.empty(numel, dtype=dtype, device=backend.device)
            with reference():
                codec.decode(prepared, agreed, total, want)
            got = torch.full((numel,), float("nan"), dtype=dtype, device=backend.device)
            codec.decode(mine(codec, x), agreed, total, got)
            assert torch.equal(got, want), f"block={block_size} numel={numel}"


def test_decode_header_verdicts(backend):
    """NaN on non-finite or mismatch; the input's bits (in out's dtype) when identical."""
    codec = THCCodec(bits=4, block_size=64, world_size=3)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = gradient(1000, seed=8, dtype=dtype, device=backend.device)
        ours = mine(codec, x)
        words = codec.quantize(ours, agreed_from(ours, 1), 3)
        for out_dtype in (dtype, torch.float32):
            out = torch.empty(1000, dtype=out_dtype, device=backend.device)
            codec.decode(ours, ours.scales, words, out)  # as sent: every rank identical
            assert torch.equal(out, x.to(out_dtype))
        for field in (0, 1):
            agreed = agreed_from(ours, 2)
            agreed[field] += 1  # non-finite flag; fingerprint max differs from -max(-f)
            out = torch.zeros(1000, dtype=dtype, device=backend.device)
            codec.decode(ours, agreed, words, out)
            assert torch.isnan(out).all()


def test_decode_into_strided_output(backend):
    codec = THCCodec(bits=4, block_size=64, world_size=2)
    x = gradient(500, seed=4, device=backend.device)
    ours = mine(codec, x)
    agreed = agreed_from(ours, 3)
    words = codec.quantize(ours, agreed, 0)
    want = codec.decode(ours, agreed, words, torch.empty(500, device=backend.device))
    out = torch.zeros(1000, device=backend.device)[::2]
    codec.decode(ours, agreed, words, out)
    assert torch.equal(out, want)


def test_stages_never_read_device_values_on_the_host(backend, monkeypatch):
    """No .item(), bool(), .tolist(), .cpu() or numpy() of a tensor in any stage (the
    GPU-side check is test_compressed_step_has_no_host_syncs)."""
    codec = THCCodec(bits=4, block_size=256, world_size=2)
    x = gradient(5000, seed=1, device=backend.device)
    residual = torch.zeros(codec.n_blocks(5000), 256, device=backend.device)
    cuda_kernels._signs_on(codec.seed, 256, backend.device)  # the one-time upload
    mine(codec, x)  # and the workspace

    def refuse(*args, **kwargs):
        raise AssertionError("host read of a device value")

    for name in ("item", "__bool__", "tolist", "cpu", "numpy", "__float__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    ours = mine(codec, x)
    words = codec.quantize(ours, ours.scales, 1, residual)
    codec.decode(ours, ours.scales, words, torch.empty_like(x))
    monkeypatch.undo()


def test_bad_buffers_are_errors_not_copies(backend):
    codec = THCCodec(bits=4, block_size=64, world_size=2)
    ours = mine(codec, gradient(1000, seed=1, device=backend.device))
    with pytest.raises(ValueError, match="agreed"):
        codec.quantize(ours, ours.scales[:-1], 1)
    with pytest.raises(ValueError, match="residual"):
        codec.quantize(ours, ours.scales, 1, torch.zeros(16, 64, dtype=torch.float64, device=backend.device))
    with pytest.raises(ValueError, match="words"):
        codec.decode(ours, ours.scales, torch.zeros(3, dtype=torch.int32, device=backend.device), torch.empty(1000))


# -- one specification: CUDA ranks decode to the CPU ranks' bits (issue 50, point 3) --------------
#: (block size, ranks, dtype, length): block sizes with odd and even log2 B, 1-16 ranks' lanes
#: (int32 and int64 words), lengths off the block.
SPEC_CASES = [(2, 16, torch.float32, 1001), (8, 3, torch.bfloat16, 999), (32, 1, torch.float16, 3001),
              (128, 5, torch.float32, 4099), (512, 8, torch.bfloat16, 9000), (1024, 16, torch.float32, 70001),
              (1024, 2, torch.float16, 5000), (2048, 7, torch.float32, 20001), (4096, 4, torch.bfloat16, 12289),
              (4096, 16, torch.float16, 9000), (64, 12, torch.float32, 777), (256, 6, torch.float16, 1025)]
SPEC_EMULATED = (0, 1, 3, 5, 7, 8)  # the emulator is slow: these indices of SPEC_CASES


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("case", range(len(SPEC_CASES)))
def test_cuda_ranks_decode_to_the_bits_of_cpu_ranks(backend, case, monkeypatch):
    """Ranks on CPUs (the fused C codec and the torch reference) and on the CUDA kernels
    get the same words from the same inputs and decode the same summed words to the same
    bits, in every dtype, at odd and even log2 B, for 1-16 ranks' lanes: a job may mix
    them, and a checkpoint resumes on either."""
    if not backend.fast and case not in SPEC_EMULATED:
        pytest.skip("the emulator runs a subset")
    block, world, dtype, numel = SPEC_CASES[case]
    codec = THCCodec(bits=4 if world < 16 else 3, block_size=block, seed=case, world_size=world)
    g = torch.Generator().manual_seed(case)
    inputs = [(torch.randn(numel, generator=g) * torch.exp(torch.randn(numel, generator=g))).to(dtype)
              for _ in range(world)]
    runs = {}
    for path in ("reference", "fused C", "cuda"):
        if path == "reference":
            monkeypatch.setenv(cuda_kernels.FORCE_REFERENCE_ENV, "1")
        else:
            monkeypatch.delenv(cuda_kernels.FORCE_REFERENCE_ENV, raising=False)
        if path == "fused C" and not cpu_kernels.available():
            continue
        on = (lambda t: t.to(backend.device)) if path == "cuda" else (lambda t: t)
        prepared = [mine(codec, on(x)) if path == "cuda" else codec.prepare(x) for x in inputs]
        assert path != "fused C" or prepared[0].backend is cpu_kernels
        agreed = torch.stack([p.scales.cpu() for p in prepared]).amax(0)
        words = [codec.quantize(p, on(agreed), codec.stream(r, 2)).cpu() for r, p in enumerate(prepared)]
        total = words[0].clone()
        for w in words[1:]:
            total += w
        out = codec.decode(prepared[0], on(agreed), on(total), on(torch.full((numel,), float("nan"), dtype=dtype)))
        runs[path] = [agreed, *words, _as_bits(out.cpu())]
    want = runs.pop("reference")
    assert torch.isfinite(want[-1].view(dtype)).all()
    for path, got in runs.items():
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), path


def _each_path(backend, monkeypatch):
    """(name, to-device function, prepare) of the reference, the fused C codec (where it
    builds) and the kernels on ``backend``."""
    def use(path):
        if path == "reference":
            monkeypatch.setenv(cuda_kernels.FORCE_REFERENCE_ENV, "1")
        else:
            monkeypatch.delenv(cuda_kernels.FORCE_REFERENCE_ENV, raising=False)
    for path in ("reference", "fused C", "cuda"):
        use(path)
        if path == "fused C" and not cpu_kernels.available():
            continue
        if path == "cuda":
            yield path, (lambda t: t.to(backend.device)), (lambda codec, x: mine(codec, x))
        else:
            yield path, (lambda t: t), (lambda codec, x: codec.prepare(x))


def test_finite_inputs_too_large_to_sum_are_flagged_like_inf_on_every_path(backend, monkeypatch):
    """B = 2 and a value of 3e38: |y| = 2.1e38, so 2M overflows and the mean would decode
    to NaN unflagged. At or above layout.overflow_limit(B) a block counts as non-finite on
    every path (flag set, maxima zeroed, NaN out); just below it the bucket is finite."""
    from hhook.codec.layout import overflow_limit

    for block, big in ((2, 3e38), (1024, 3e37)):
        codec = THCCodec(bits=4, block_size=block, world_size=2)
        for value, flagged in ((big, True), (0.99 * overflow_limit(block) * block ** 0.5, False)):
            x = gradient(4 * block, seed=block)
            x[block + 1] = value  # rotates to a block of +-value / sqrt(B)
            for path, on, prepare in _each_path(backend, monkeypatch):
                p = prepare(codec, on(x))
                scales = p.scales.cpu()
                assert bool(scales[0] == 1) == flagged, (path, block, value)
                agreed = agreed_from(p, seed=1)
                out = codec.decode(p, agreed, codec.quantize(p, agreed, 7), on(torch.empty_like(x))).cpu()
                assert bool(out.isnan().all()) == flagged and (flagged or bool(out.isfinite().all())), (path, value)


def test_a_nan_threshold_rounds_to_code_zero_on_every_path(backend, monkeypatch):
    """A residual holding NaN (error feedback, nothing flagged in the header) makes t NaN:
    every path sends code 0 for it (fmaxf's choice; C's and torch's clamps keep NaN)."""
    codec = THCCodec(bits=4, block_size=64, world_size=4)
    x = gradient(640, seed=3)
    results = {}
    for path, on, prepare in _each_path(backend, monkeypatch):
        p = prepare(codec, on(x))
        residual = torch.zeros(10, 64)
        residual[3, 5] = residual[7, 0] = float("nan")
        residual = on(residual)
        agreed = agreed_from(p, seed=2)
        results[path] = codec.quantize(p, agreed, codec.stream(1, 3), residual).cpu(), residual.cpu()
    want_words, want_residual = results.pop("reference")
    lanes = codec.layout
    codes = [(want_words >> (j * lanes.width)) & lanes.mask for j in range(lanes.lanes)]
    assert int(torch.stack(codes).view(-1)[3 * 64 + 5]) == 0
    for path, (words, res) in results.items():
        assert torch.equal(words, want_words), path
        assert torch.equal(res.isnan(), want_residual.isnan()), path


# -- the codec's dispatch (GPU only) ------------------------------------------------------------
needs_gpu = pytest.mark.skipif(not _cuda_ready(), reason="needs a CUDA device and CuPy")


@needs_gpu
def test_codec_uses_the_kernels_on_cuda(monkeypatch):
    monkeypatch.delenv(cuda_kernels.FORCE_REFERENCE_ENV, raising=False)
    assert cuda_kernels.warm_up("cuda")
    for block_size, fused in ((1024, True), (65536, False)):
        codec = THCCodec(bits=4, block_size=block_size, seed=1, world_size=2)
        x = gradient(300_000, seed=block_size, device="cuda").view(100, -1).requires_grad_()
        p = codec.prepare(x.detach())
        assert (p.backend is cuda_kernels) == fused
        out = codec.decode(p, p.scales, codec.quantize(p, p.scales, 5), torch.empty_like(x))
        assert torch.equal(out, x.detach())  # one rank: identical, so exact


@pytest.mark.parametrize("kind", KINDS)
def test_every_stage_matches_the_reference_on_adversarial_inputs(backend, kind):
    """prepare, quantize (every rank's stream, error feedback) and decode of the summed
    words: zero differing bits on zeros, inf/NaN, subnormals and an outlier,
    at lengths off the block (ci/gpu_check.py runs the large sweep on a GPU)."""
    sizes = (1000, 4097, 65539) if backend.fast else (1025,)
    for numel in sizes:
        for i, (dtype, rounding) in enumerate(((torch.float32, "correlated"), (torch.bfloat16, "independent"),
                                               (torch.float16, "correlated"))):
            if not backend.fast and i == 2:
                continue  # the emulator is slow
            diff = parity_case(kind, numel, dtype, bits=3 + 2 * i, rounding=rounding, device=backend.device)
            assert not any(diff.values()), (numel, dtype, rounding, diff)


# -- host work per bucket (issue 44) ------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_steady_state_host_work_per_bucket_through_thccodec(emulator, monkeypatch, dtype):
    """What one bucket costs the host through THCCodec on the CUDA path (the emulator
    standing in for the GPU), from the second bucket on: the three fused kernels and
    nothing else, no torch op (no helper kernel on a GPU), and two allocations, the
    scale vector that prepare returns and the words that quantize returns; one, when
    quantize writes into the caller's ``out`` (as the transport's message does). The
    first bucket adds prepare's per-stream workspace, made once."""
    from hhook.codec import codec as codec_module

    from tests.support.cuda_support import counting_host_work, emulated

    monkeypatch.setattr(codec_module, "fused_backend", lambda x, block: cuda_kernels)  # CPU tensors: the CUDA path
    codec = THCCodec(bits=4, block_size=1024, seed=5, world_size=16)
    cuda_kernels._sizes_cache.clear()
    x = gradient(9000, seed=1, dtype=dtype)
    out, words_out = torch.empty_like(x), None
    kernels = {f"hh_prepare_{cuda_kernels._DTYPE_SUFFIX[dtype]}": 1,
               f"hh_quantize_{cuda_kernels._DTYPE_SUFFIX[dtype]}_i32": 1,
               f"hh_decode_i32_{cuda_kernels._DTYPE_SUFFIX[dtype]}": 1}
    with emulated(emulator):
        for call in range(4):
            p0 = codec.prepare(x) if call == 0 else None
            agreed = agreed_from(p0 if p0 is not None else codec.prepare(x), call)
            if call == 3:
                words_out = torch.empty(codec.words_numel(x.numel()), dtype=torch.int32)
            stream, hashes = codec.stream(0, call), []
            monkeypatch.setattr(rng, "mix32", lambda v, f=rng.mix32: hashes.append(sys._getframe(1).f_code.co_name) or f(v))
            with counting_host_work() as counts:
                p = codec.prepare(x)
                words = codec.quantize(p, agreed, stream, out=words_out)
                codec.decode(p, agreed, words, out)
            monkeypatch.undo()
            monkeypatch.setattr(codec_module, "fused_backend", lambda x, block: cuda_kernels)
            if call == 0:
                continue  # the workspace of a new stream may be made here
            assert dict(counts["launches"]) == kernels, counts
            assert not counts["torch_ops"], counts
            assert sum(counts["allocations"].values()) == (1 if words_out is not None else 2), counts
            # sizes, fingerprint and launch arguments were kept from the first bucket: the one
            # hash left is this call's rounding stream's row key
            assert hashes == ["row"], hashes
    monkeypatch.setattr(codec_module, "fused_backend", lambda x, block: None)
    with reference():
        p = codec.prepare(x)
        want = codec.decode(p, agreed, codec.quantize(p, agreed, codec.stream(0, 3)), torch.empty_like(x))
    assert torch.equal(out, want)  # the counted path is the exact one


def test_steady_state_host_work_per_bucket_through_the_transport(emulator, monkeypatch):
    """One bucket through the scale policy as the flat schedule runs it on a GPU (agreed
    scales, device-side checks): from the second bucket of a key on, the three kernels
    and no other torch op (the message prefix is written by quantize's kernel and checked
    by decode's, the rank's header comes from prepare's), three allocations (the scale
    vector with the header's copy, the message, the verdict's two flags), and no Python
    hash but the rounding streams' (the fingerprints are kept per length)."""
    from hhook.codec import codec as codec_module
    from hhook.codec.layout import PREFIX, expected_prefix
    from hhook.scales.policy import ScalePolicy

    from tests.support.cuda_support import counting_host_work, emulated

    monkeypatch.setattr(codec_module, "fused_backend", lambda x, block: cuda_kernels)  # CPU tensors: the CUDA path
    policy = ScalePolicy(bits=4, block_size=1024, seed=5, predict=False)
    x = gradient(9000, seed=1)
    deferred = []
    with emulated(emulator):
        for call in range(3):
            hashes = []
            monkeypatch.setattr(rng, "mix32", lambda v, f=rng.mix32: hashes.append(sys._getframe(1).f_code.co_name) or f(v))
            with counting_host_work() as counts:
                plan = policy.begin(x, "bucket", 0, 16, call, config=7)
            agreed = agreed_from(plan.prepared, call)  # as after the MAX round: not "identical"
            with counting_host_work() as more:
                words = policy.finish(plan, agreed)
            sums = words.clone()  # as after the SUM over 16 ranks, the prefix's count and fingerprints summed
            sums[0], sums[2], sums[3] = (torch.tensor(v) for v in expected_prefix(16, plan.fps, 32))
            out = torch.full_like(x, float("nan"))
            with counting_host_work() as last:
                policy.decode(sums, plan, out, lambda bad, nonfinite, what: deferred.append((bad, nonfinite)))
            monkeypatch.undo()
            monkeypatch.setattr(codec_module, "fused_backend", lambda x, block: cuda_kernels)
            launches = counts["launches"] + more["launches"] + last["launches"]
            assert dict(launches) == {"hh_prepare_f32": 1, "hh_quantize_f32_i32": 1, "hh_decode_i32_f32": 1}
            if call == 0:
                continue  # the workspace of a new stream, the fingerprints
            assert not counts["torch_ops"] + more["torch_ops"] + last["torch_ops"], (counts, more, last)
            allocations = counts["allocations"] + more["allocations"] + last["allocations"]
            assert sum(allocations.values()) == 3, allocations
            assert sorted(set(hashes)) == ["row", "shared_key", "stream_key"], hashes
            assert deferred[-1][0].item() == 0 and deferred[-1][1].item() == 0
            codec = policy.codec(16)
            with reference():
                want = codec.decode(plan.prepared, agreed, sums[PREFIX:], torch.empty_like(x))
            assert torch.equal(out, want)


def test_the_kernels_write_and_check_the_message_prefix_as_the_reference(backend):
    """quantize's kernel writes layout.write_prefix's words; decode's kernel writes NaN and
    the flags of layout.prefix_verdict for a wrong count, a failed rank, a fingerprint
    mismatch, and only the flags for a non-finite status."""
    from hhook.codec.layout import PREFIX, RANK_FAILED, expected_prefix, prefix_verdict, write_prefix

    for bits, world in ((4, 4), (4, 8)):  # int32 and int64 words
        codec = THCCodec(bits=bits, block_size=64, world_size=world)
        x = gradient(1000, seed=world, device=backend.device)
        ours = mine(codec, x)
        agreed = agreed_from(ours, 1)
        fps = (0x12345678, 0x7FFFFFF0)
        message = torch.full((PREFIX + codec.words_numel(1000),), -1, dtype=codec.layout.word_dtype,
                             device=backend.device)
        codec.quantize(ours, agreed, 3, out=message[PREFIX:], prefix=(message[:PREFIX], fps))
        want = torch.zeros(PREFIX, dtype=message.dtype, device=backend.device)
        write_prefix(want, fps, ours.header)
        assert torch.equal(message[:PREFIX], want)
        count, fp0, fp1 = expected_prefix(world, fps, codec.layout.word_bits)
        good = message.clone()  # as summed over the ranks
        good[:4] = torch.tensor([count, 0, fp0, fp1])
        for change, word, value in ((None, 0, 0), ("count", 0, world - 1), ("failed", 1, RANK_FAILED),
                                    ("fingerprint", 3, 5), ("nonfinite", 1, 2)):
            sums = good.clone()
            if change is not None:
                sums[word] = value
            flags = torch.full((2,), -1, dtype=torch.int32, device=backend.device)
            out = codec.decode(ours, agreed, sums[PREFIX:], torch.empty_like(x), check=(sums[:PREFIX], world, fps, flags))
            bad, nonfinite = prefix_verdict(sums[:PREFIX], world, fps)
            assert flags.tolist() == [int(bad), int(nonfinite)], change
            assert bool(out.isnan().all()) == bool(bad) and (bool(bad) or not out.isnan().any()), change


# -- FSDP2's all-gather codec (issue 50, point 5) -------------------------------------------------
WEIGHT_CASES = [(8, 256, "auto", 37), (8, 1024, True, 6), (8, 64, False, 50), (6, 256, "auto", 9), (4, 128, True, 11),
                (2, 16, "auto", 33), (3, 256, "auto", 7), (5, 8, True, 129), (7, 512, False, 5), (6, 8, "auto", 65)]


def _weights(n_blocks: int, block: int, seed: int) -> torch.Tensor:
    """Rows of four kinds: uniform (stays plain under "auto"), heavy-tailed (rotated),
    zeros, and an outlier; as FSDP's shard of weights."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_blocks, block, generator=g) ** 3
    x[0::4] = torch.rand(len(x[0::4]), block, generator=g) * 2 - 1
    x[2::4] = 0.0
    x[3::4, 1] = 1e3
    return x


@pytest.mark.parametrize("case", range(len(WEIGHT_CASES)))
def test_weight_codec_kernels_give_the_torch_paths_bits(backend, case, monkeypatch):
    """WeightCodec's one-pass CUDA encode and decode against its torch path: the same
    payload bytes (scales with their rotation bits, packed codes in every width's layout),
    the same finite verdict, the same decoded bits; non-finite values flagged alike."""
    from hhook.codec.weights import WeightCodec

    bits, block, rotate, n = WEIGHT_CASES[case]
    codec = WeightCodec(bits, block, rotate, seed=case)
    x = _weights(n, block, case)
    for bad in (None, float("nan")):
        if bad is not None:
            x[n // 2, 3] = bad
        monkeypatch.setenv(cuda_kernels.FORCE_REFERENCE_ENV, "1")
        want = torch.empty(codec.nbytes(n), dtype=torch.uint8)
        finite = codec.encode(x.clone(), want)
        decoded = codec.decode(want, n)
        monkeypatch.delenv(cuda_kernels.FORCE_REFERENCE_ENV, raising=False)
        blocks = x.clone().to(backend.device)
        payload = torch.full((codec.nbytes(n),), 7, dtype=torch.uint8, device=backend.device)
        assert cuda_kernels.weight_encode(codec, blocks, payload) == finite == (bad is None)
        assert torch.equal(blocks.cpu().view(torch.int32), x.view(torch.int32))  # read, not overwritten
        if bad is None:
            assert torch.equal(payload.cpu(), want)
        out = torch.full((n, block), float("nan"), device=backend.device)
        got = cuda_kernels.weight_decode(codec, want.to(backend.device), n, out).cpu()
        if bad is None:
            assert torch.equal(got.view(torch.int32), decoded.view(torch.int32))
            if rotate == "auto":  # both domains in one shard
                signs = torch.signbit(codec.scales(want, n))
                assert signs.any() and not signs.all()
