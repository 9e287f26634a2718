"""The CUDA kernels under ThreadSanitizer: no data race inside a CUDA block.

On a GPU (independent thread scheduling, Volta on) a shared or global value that one thread
writes and another of its CUDA block reads or writes without a ``__syncwarp`` (same warp) or
``__syncthreads`` in between is a race; the emulator's bit-parity tests (test_cuda.py) see
one only when the OS schedules its threads just so (296d192: 2 failures in 15 runs).
ThreadSanitizer sees every one the launches reach, deterministically:
tests/support/cuda_races.py records launches on the emulator and replays them in a
TSan-instrumented program built from the same shim and kernel source.
"""

from __future__ import annotations

import re

import pytest
import torch

from hhook.codec import THCCodec
from hhook.codec.kernels import cuda as cuda_kernels
from hhook.codec.layout import PREFIX
from tests.support import cuda_races
from tests.support.cuda_support import agreed_from, build_emulator, gradient, mine, parity_case

# One worker builds the programs and the recording once (tests/conftest.py groups by module too).
pytestmark = [pytest.mark.usefixtures("no_tf32"), pytest.mark.xdist_group("tests/codec/test_cuda_races.py")]

#: parity_case's (dtype, block, bits, rounding, kind, numel), two ranks each: every prepare /
#: quantize / decode kernel (bits 8 with 2 ranks: int64 words), B < 32, 32, <= 1024 and
#: phase C (2048, 4096), the correlated table, subnormal inputs, non-finite ones outside warp 0
#: (the flag's atomic against the last CUDA block's reset), and more tiles than the emulator's 3
#: resident CUDA blocks (a CUDA block's second tile, with and without phase C).
THC_CASES = [(torch.float32, 16, 3, "correlated", "random", 1025), (torch.float32, 2048, 8, "independent", "random", 13000),
             (torch.bfloat16, 256, 5, "independent", "subnormal", 1025), (torch.bfloat16, 4096, 8, "correlated", "random", 4097),
             (torch.float16, 1024, 4, "correlated", "outlier", 3000), (torch.float16, 32, 8, "independent", "random", 1025),
             (torch.float32, 64, 2, "correlated", "nonfinite", 3000), (torch.bfloat16, 8, 1, "independent", "random", 13000)]
#: WeightCodec's (bits, block, rotate, n_blocks): every width's layout, B of 8 to 1024, all three
#: rotation modes ("auto" with plain and rotated blocks), 3 CUDA blocks, and two chunks per warp
#: (4 planes of 1600: the arrays and tiles reused).
WEIGHT_CASES = [(8, 64, "auto", 9), (6, 8, "auto", 33), (4, 128, True, 11), (2, 16, "auto", 400), (3, 1024, "auto", 5),
                (5, 8, True, 129), (7, 512, False, 5), (8, 32, "auto", 130)]


def _launch_everything() -> None:
    """The launches the replay checks (each kernel's outputs also feed the next stage)."""
    from hhook.codec.weights import WeightCodec

    for dtype, block, bits, rounding, kind, numel in THC_CASES:
        parity_case(kind, numel, dtype, bits, rounding, device="cpu", world=2, block_size=block)
    for bits, world in ((4, 4), (8, 2)):  # quantize's message prefix, decode's check of it
        codec = THCCodec(bits=bits, block_size=64, world_size=world)
        ours = mine(codec, gradient(1000, seed=world))
        agreed, fps = agreed_from(ours, 1), (0x1234, 0x7FF0)
        message = torch.zeros(PREFIX + codec.words_numel(1000), dtype=codec.layout.word_dtype)
        codec.quantize(ours, agreed, 3, out=message[PREFIX:], prefix=(message[:PREFIX], fps))
        flags = torch.zeros(2, dtype=torch.int32)
        codec.decode(ours, agreed, message[PREFIX:], torch.empty(1000), check=(message[:PREFIX], world, fps, flags))
    for case, (bits, block, rotate, n) in enumerate(WEIGHT_CASES):
        codec = WeightCodec(bits, block, rotate, seed=case)
        g = torch.Generator().manual_seed(case)
        x = torch.randn(n, block, generator=g) ** 3
        x[0::3] = torch.rand(len(x[0::3]), block, generator=g) * 2 - 1  # uniform rows stay plain under "auto"
        x[-1, 1] = float("nan") if case % 3 == 0 else 1e3
        payload = torch.empty(codec.nbytes(n), dtype=torch.uint8)
        cuda_kernels.weight_encode(codec, x, payload)
        cuda_kernels.weight_decode(codec, payload, n, torch.empty(n, block))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tsan")
    why = cuda_races.tsan_unavailable(path)
    if why:
        pytest.skip(why)
    return path


@pytest.fixture(scope="module")
def recording(folder):
    with cuda_races.recording(build_emulator(folder)) as records:
        _launch_everything()
    missing = {*cuda_kernels.KERNEL_NAMES, *cuda_kernels.WEIGHT_KERNEL_NAMES} - cuda_races.recorded_names(records)
    assert not missing, f"no launch of {sorted(missing)}"
    return cuda_races.write_recording(records, folder / "launches.bin")


def _replay(folder, recording, source=None):
    build = folder / ("racy" if source else "kernels")
    build.mkdir(exist_ok=True)
    done = cuda_races.replay(cuda_races.build_replay(build, source), recording, timeout=300)
    return done, cuda_races.races(done.stderr)


def test_tsan_sees_a_race_without_the_emulators_barrier_and_none_with_it(folder):
    """The check's premise: libstdc++'s std::barrier (the shim's __syncthreads and
    __syncwarp) gives TSan its happens-before, and TSan reports an exchange without it."""
    assert cuda_races.probe(folder) == (0, 1)


def test_no_data_race_inside_a_cuda_block(folder, recording):
    """Every kernel on every path the recording takes: no TSan report, and the replay writes
    the recorded bytes (so it ran the launches the emulator ran)."""
    done, found = _replay(folder, recording)
    assert not found, "data races:\n" + "\n".join(found) + "\n" + done.stderr[-6000:]
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]


def test_the_check_finds_the_missing_syncwarp_of_296d192(folder, recording):
    """Without the __syncwarp after hh_wq_row_stats in hh_wq_encode (its first lanes' writes,
    read by other lanes) the replay must report that race."""
    source = cuda_kernels.source_path().read_text()
    racy, n = re.subn(r"(hh_wq_row_stats\(v, lane, log2B, a\.norm, w\);\n)\s*__syncwarp\(\);[^\n]*\n", r"\1", source)
    assert n == 1, "the __syncwarp after hh_wq_row_stats moved: update this test"
    (folder / "racy.cu").write_text(racy)
    done, found = _replay(folder, recording, folder / "racy.cu")
    assert any("hh_wq_encode" in r and "hh_wq_row_stats" in r for r in found), done.stderr[-3000:]
