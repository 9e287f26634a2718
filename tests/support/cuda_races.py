"""Data races inside a CUDA block of the kernels, found by ThreadSanitizer (tests/codec/test_cuda_races.py).

TSan cannot be loaded into Python here, so the check runs in two steps:

* :func:`recording`: launches of :mod:`hhook.codec.kernels.cuda` run on the CPU emulator
  (tests/support/cuda_support.py) and are recorded: kernel, grid, the argument struct's bytes,
  and the memory its pointers point into, before and after the launch;
* :func:`build_replay` / :func:`replay`: a standalone program, compiled with
  ``-fsanitize=thread`` from the emulator's very shim and the kernel source, replays them (the
  pointers moved to its own buffers) through the same ``hh_run``, checks that it writes the
  recorded bytes, and TSan reports every pair of accesses of one CUDA block's threads that no
  ``__syncwarp`` / ``__syncthreads`` orders. Shuffles and votes order no other memory there
  (``HH_SHUFFLE_WAIT``), as on a GPU; CUDA blocks run one after the other (races between
  blocks are out of scope).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import platform
import re
import shutil
import struct
import subprocess
from pathlib import Path

from hhook.codec.kernels import cuda as cuda_kernels
from hhook.codec.kernels import cuda_launches

from tests.support.cuda_support import GXX, emulated, emulated_launch, emulator_unavailable, shimmed

TSAN_FLAGS = ["-fsanitize=thread", "-g", "-O1", "-std=c++20", "-ffp-contract=off", "-pthread"]
#: halt_on_error=0: every race of a run; exitcode 66 says there was one.
TSAN_OPTIONS = "halt_on_error=0:exitcode=66:history_size=4:report_signal_unsafe=0"
_RACE = "WARNING: ThreadSanitizer: data race"

# Two threads exchange a value across a std::barrier (the shim's __syncthreads / __syncwarp):
# TSan must see no race with the barrier and one without (argument "skip").
_PROBE = r"""
#include <barrier>
#include <cstdio>
#include <cstring>
#include <thread>
int data[2];
int main(int argc, char** argv) {
    const bool wait = argc < 2 || std::strcmp(argv[1], "skip") != 0;
    std::barrier<> bar(2);
    auto f = [&](int i) { data[i] = i + 1; if (wait) bar.arrive_and_wait(); std::printf("%d\n", data[1 - i]); };
    std::thread a(f, 0), b(f, 1);
    a.join(), b.join();
}
"""

# The replay: the shim with a shuffle wait that orders no memory (relaxed atomics: TSan takes
# no happens-before from them; x86 and the compiler barriers keep the exchange itself right).
_REPLAY_HEAD = r"""
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <map>
static void hh_unordered_wait();
#define HH_SHUFFLE_WAIT hh_unordered_wait
"""
_REPLAY_MAIN = r"""
struct HhSpin { unsigned count, gen; };
static HhSpin hh_spin[64];
static void hh_unordered_wait() {
    HhSpin& s = hh_spin[threadIdx.x / 32];
    asm volatile("" ::: "memory");
    const unsigned gen = __atomic_load_n(&s.gen, __ATOMIC_RELAXED);
    if (__atomic_add_fetch(&s.count, 1u, __ATOMIC_RELAXED) == 32u) {
        __atomic_store_n(&s.count, 0u, __ATOMIC_RELAXED);
        asm volatile("" ::: "memory");
        __atomic_store_n(&s.gen, gen + 1u, __ATOMIC_RELAXED);
    } else {
        while (__atomic_load_n(&s.gen, __ATOMIC_RELAXED) == gen) std::this_thread::yield();
    }
    asm volatile("" ::: "memory");
}

typedef int (*HhEntry)(int, int, void**, const char*, char*);
static const std::map<std::string, HhEntry> hh_entries = {ENTRIES};

template <class T> static T hh_read(FILE* f) {
    T v;
    if (std::fread(&v, sizeof(T), 1, f) != 1) { std::fprintf(stderr, "replay: truncated recording\n"); std::exit(3); }
    return v;
}
static std::vector<unsigned char> hh_bytes(FILE* f, std::size_t n) {
    std::vector<unsigned char> b(n);
    if (n && std::fread(b.data(), 1, n, f) != n) { std::fprintf(stderr, "replay: truncated recording\n"); std::exit(3); }
    return b;
}

// Usage: replay RECORDING. Exit 0: every launch wrote the recorded bytes; 1: some did not.
int main(int argc, char** argv) {
    FILE* f = std::fopen(argv[1], "rb");
    if (!f) { std::perror(argv[1]); return 3; }
    const unsigned count = hh_read<unsigned>(f);
    int differ = 0;
    for (unsigned i = 0; i < count; ++i) {
        const auto name_bytes = hh_bytes(f, hh_read<unsigned>(f));
        const std::string name(name_bytes.begin(), name_bytes.end());
        const int grid = hh_read<int>(f), block = hh_read<int>(f);
        alignas(16) unsigned char args[1024];
        const unsigned size = hh_read<unsigned>(f);
        const auto arg_bytes = hh_bytes(f, size);
        std::memcpy(args, arg_bytes.data(), size);
        const unsigned regions = hh_read<unsigned>(f);
        std::vector<unsigned char*> raw, base;
        std::vector<std::vector<unsigned char>> after;
        for (unsigned r = 0; r < regions; ++r) {
            const auto n = hh_read<unsigned long long>(f);
            const unsigned at = hh_read<unsigned>(f);  // the recorded pointer's offset from 64 bytes
            raw.push_back(static_cast<unsigned char*>(std::aligned_alloc(64, (n + 191) / 64 * 64)));
            base.push_back(raw.back() + at);
            const auto before = hh_bytes(f, n);
            if (n) std::memcpy(base.back(), before.data(), n);
            after.push_back(hh_bytes(f, n));
        }
        const unsigned relocations = hh_read<unsigned>(f);
        for (unsigned k = 0; k < relocations; ++k) {
            const unsigned at = hh_read<unsigned>(f), r = hh_read<unsigned>(f);
            const unsigned char* p = base[r] + hh_read<unsigned long long>(f);
            std::memcpy(args + at, &p, sizeof p);
        }
        std::fprintf(stderr, "replay: launch %u %s grid %d\n", i, name.c_str(), grid);
        void* pointers[1] = {args};
        char expected[256] = {0};
        const std::string sig = "s" + std::to_string(size);
        if (hh_entries.at(name)(grid, block, pointers, sig.c_str(), expected) != 0) {
            std::fprintf(stderr, "replay: %s expects %s, recorded %s\n", name.c_str(), expected, sig.c_str());
            return 3;
        }
        for (unsigned r = 0; r < regions; ++r) {
            std::size_t k = 0;
            while (k < after[r].size() && base[r][k] == after[r][k]) ++k;
            if (k < after[r].size()) {
                std::fprintf(stderr, "replay: launch %u %s: buffer %u differs from the recording at byte %zu of %zu\n", i,
                             name.c_str(), r, k, after[r].size());
                ++differ;
            }
            std::free(raw[r]);
        }
    }
    std::printf("replayed %u launches, %d buffers differ\n", count, differ);
    return differ ? 1 : 0;
}
"""
_ENTRY = '{{"{0}", +[](int g, int b, void** a, const char* s, char* e) {{ return hh_run({0}, g, b, a, s, e); }}}}'
#: The argument struct of each kernel family (the struct's pointer fields are relocated).
_ARGS = {"hh_prepare_": "HhPrepareArgs", "hh_quantize_": "HhQuantizeArgs", "hh_decode_": "HhDecodeArgs",
         "hh_wq_": "HhWeightArgs"}


def _compile(source: str, folder: Path, name: str) -> Path:
    src, exe = Path(folder) / f"{name}.cpp", Path(folder) / name
    src.write_text(source)
    done = subprocess.run([GXX, *TSAN_FLAGS, "-o", str(exe), str(src)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{name} did not compile with -fsanitize=thread:\n{done.stderr[-4000:]}")
    return exe


#: What runs a TSan program: itself, or under ``setarch -R`` where the address space's
#: randomization leaves TSan no room ("unexpected memory mapping"; tsan_unavailable chooses).
_LAUNCHER: list[str] = []


def _run(exe: Path, *args: str, timeout: float | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"} | {"TSAN_OPTIONS": TSAN_OPTIONS}
    return subprocess.run([*_LAUNCHER, str(exe), *args], capture_output=True, text=True, timeout=timeout, env=env)


def probe(folder: Path) -> tuple[int, int]:
    """Race reports of the barrier probe: ``(with the barrier, without)``; (0, 1) is right."""
    exe = _compile(_PROBE, folder, "probe")
    return tuple(_run(exe, *arg, timeout=60).stderr.count(_RACE) for arg in ((), ("skip",)))


def tsan_unavailable(folder: Path) -> str | None:
    """Why the race check cannot run here (no g++ >= 12, no libtsan, TSan cannot start), or None."""
    why = emulator_unavailable()
    if why:
        return why
    try:
        exe = _compile(_PROBE, folder, "probe")
    except RuntimeError as e:
        return f"g++ cannot build a ThreadSanitizer program (is libtsan installed?): {str(e)[-300:]}"
    setarch = shutil.which("setarch")
    for launcher in ([], [setarch, platform.machine(), "-R"]) if setarch else ([],):
        _LAUNCHER[:] = launcher
        done = _run(exe, timeout=60)
        if done.returncode == 0:
            return None
    return f"a ThreadSanitizer program does not run here (exit {done.returncode}): {done.stderr[-300:]}"


# -- recording -------------------------------------------------------------------------------
def _regions(tensors) -> list[list[int]]:
    """The launch's memory as disjoint ``[start, end)`` (tensors that overlap: one region)."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
                   for t in tensors if t is not None and t.data_ptr())
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and start < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _pointer_fields(name: str, size: int) -> list[int]:
    kind = next(v for k, v in _ARGS.items() if name.startswith(k))
    mirror = cuda_launches.arg_types()[kind].ctype
    assert ctypes.sizeof(mirror) == size, (name, size)
    return [getattr(mirror, f).offset for f, t in mirror._fields_ if t is ctypes.c_void_p]


def record_launch(lib, launch: cuda_launches.Launch, device) -> bytes:
    """Run ``launch`` on the emulator ``lib`` and return its record for the replay."""
    regions = _regions(launch.tensors)
    before = [ctypes.string_at(s, e - s) for s, e in regions]
    emulated_launch(lib, launch, device)
    args = bytes(launch.args)
    out = [struct.pack("<I", len(launch.name)), launch.name.encode(), struct.pack("<iiI", launch.grid, launch.block,
                                                                                   len(args)), args,
           struct.pack("<I", len(regions))]
    for (start, end), old in zip(regions, before):
        out += [struct.pack("<QI", end - start, start % 64), old, ctypes.string_at(start, end - start)]
    relocations = []
    for at in _pointer_fields(launch.name, len(args)):
        (p,) = struct.unpack_from("<Q", args, at)
        if p:
            r = next((i for i, (s, e) in enumerate(regions) if s <= p < e or s == p == e), None)
            if r is None:
                raise ValueError(f"{launch.name}: the pointer at byte {at} of its argument is in none of its tensors")
            relocations.append(struct.pack("<IIQ", at, r, p - regions[r][0]))
    return b"".join(out + [struct.pack("<I", len(relocations))] + relocations)


@contextlib.contextmanager
def recording(lib):
    """Launches of :mod:`hhook.codec.kernels.cuda` inside run on the emulator ``lib``; yields
    the list their records (:func:`record_launch`) are appended to."""
    records: list[bytes] = []
    with emulated(lib, lambda lib, launch, device: records.append(record_launch(lib, launch, device))):
        yield records


def write_recording(records: list[bytes], path: Path) -> Path:
    Path(path).write_bytes(struct.pack("<I", len(records)) + b"".join(records))
    return Path(path)


def recorded_names(records: list[bytes]) -> set[str]:
    return {r[4 : 4 + struct.unpack_from("<I", r)[0]].decode() for r in records}


# -- the replay under TSan ------------------------------------------------------------------
def build_replay(folder: Path, source: Path | None = None) -> Path:
    """The TSan replay program of the kernel source (default: the package's)."""
    names = (*cuda_kernels.KERNEL_NAMES, *cuda_kernels.WEIGHT_KERNEL_NAMES)
    kernels = shimmed(source)
    main = _REPLAY_MAIN.replace("{ENTRIES}", "{" + ", ".join(_ENTRY.format(n) for n in names) + "}")
    return _compile(_REPLAY_HEAD + kernels + main, folder, "replay")


def replay(exe: Path, recording: Path, timeout: float | None = None) -> subprocess.CompletedProcess:
    return _run(exe, str(recording), timeout=timeout)


def races(stderr: str) -> list[str]:
    """One line per TSan data-race report: the launch it happened in, and each access's
    innermost frame (``what by thread: function file:line``)."""
    found, launch = [], "?"
    for block in re.split(r"(?m)^(?===================$)", stderr):
        if _RACE in block:
            accesses = re.findall(r"(?m)^  (?:Previous )?(\w+(?: \w+)? of size \d+) at \S+ by (?:thread T\d+|main thread)"
                                  r"[^\n]*\n\s*#0 (.+?) (\S+:\d+) \(", block)
            where = [f"{what.lower()}: {func.split('(')[0]} {Path(loc).name}" for what, func, loc in accesses]
            found.append(f"{launch}: {' / '.join(where) or block.strip()[:300]}")
        for m in re.finditer(r"replay: launch \d+ (\S+)", block):
            launch = m.group(1)
    return found
