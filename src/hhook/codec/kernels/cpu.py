r"""Fused CPU stages of :class:`hhook.codec.THCCodec`: a small C file compiled on first use.

The pure-torch codec makes about a dozen passes over memory per stage (0.2 GB/s on one
thread); each stage here is one pass per block, from ``csrc/thc_cpu.c``:

1. ``prepare``: load (fp32/fp16/bf16), digest of the float32 bits, sign diagonal,
   Walsh-Hadamard butterflies in L1, ``1/sqrt(B)``, per-block max ``|y|``; the rotated
   blocks go to a recycled workspace (``Prepared.blocks``), the scale vector to
   ``Prepared.scales``.
2. ``quantize``: ``y + residual``, stochastic rounding with the counter-based RNG of
   :mod:`hhook.codec.rng` (independent or correlated thresholds, :class:`hhook.codec.rng.Stream`), written straight into the lane words of :mod:`hhook.codec.lanes`, and the
   new residual. Given the same rotated blocks and scales the words equal the
   reference's bit for bit (same float32 operations in the same order, no contraction).
3. ``decode``: unpack, dequantize, inverse rotation, crop, store in the output's dtype;
   ``decode_gathered`` the same over gathered scales' one-rank messages, summed in rank order.

The butterflies run in the order :mod:`hhook.codec.rotation` specifies, so every stage's
output (rotated blocks, maxima, words, residuals, the decoded mean) is the reference's, bit
for bit, at every instruction set the C file is built for (``HHOOK_CPU_MARCH``).

Why a C file and ctypes: no new dependency and nothing to build at install time
(``pip install hhook`` needs no compiler). On first use the system C compiler (``$CC``,
else Python's, else ``cc``/``gcc``/``clang``) builds it with ``-O3 -march=native`` into
``$HHOOK_CACHE_DIR`` (default ``~/.cache/hhook``), keyed by the source, the compiler, the
flags and the CPU, so every later process (every rank of every job) just loads it. A
file lock makes concurrent ranks compile once; the library is written to a temporary
file and renamed, so no process ever loads a half-written one. Only a library of this
user (or root) in a folder that nobody else can change is loaded, from the very file that
was checked (:mod:`hhook.codec.kernels.trust`): in a shared cache another user could
plant code there, so the library is then built in a private temporary folder, with one
log line. Without a working
compiler the codec logs one line and uses the reference. ``HHOOK_CPU_MARCH`` builds for
another ``-march`` than ``native`` (the same bits, another speed). ctypes releases the GIL, so
the blocks are split over ``torch.get_num_threads()`` Python threads (:mod:`.threads`).
``HHOOK_FORCE_REFERENCE=1`` forces the reference.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

from . import backend, threads, trust
from .. import layout as spec
from .. import rng, rotation
from .backend import FORCE_REFERENCE_ENV  # noqa: F401 - named here by hhook.profile.codec_bench

logger = logging.getLogger(__name__)

CACHE_ENV = "HHOOK_CACHE_DIR"
#: ``HHOOK_CPU_MARCH=x86-64-v2`` (any ``-march`` value): build for that instruction set
#: instead of ``native``. The results are the same bits at every instruction set (the C
#: file performs the specification's float operations in its order, without contraction);
#: only the speed differs.
MARCH_ENV = "HHOOK_CPU_MARCH"
SOURCE_NAME = "thc_cpu.c"
FLAGS = ("-O3", "-ffp-contract=off", "-fno-fast-math", "-fno-trapping-math", "-std=c11", "-fPIC", "-shared")
_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

#: How the library was obtained in this process: ``path``, ``compiled`` (False: loaded
#: from the cache), ``seconds`` (compile or load time); empty until first use.
build_info: dict = {}

_c_int, _c_i64, _c_u32, _c_ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_uint32, ctypes.c_void_p
_SIGNATURES = {
    "hh_prepare": (_c_ptr, _c_int, _c_i64, _c_i64, _c_i64, _c_i64, _c_ptr, ctypes.c_float, _c_ptr, _c_ptr, _c_ptr,
                   _c_ptr, _c_ptr),
    "hh_quantize": (_c_ptr, _c_ptr, _c_ptr, _c_ptr, _c_i64, _c_int, _c_int, _c_u32, _c_ptr, _c_u32, _c_int, _c_u32,
                    _c_i64, _c_int, _c_int, _c_int, _c_i64, _c_i64, _c_ptr),
    "hh_decode": (_c_ptr, _c_int, _c_i64, _c_int, _c_ptr, _c_int, _c_int, _c_i64, _c_i64, _c_ptr, _c_i64, _c_i64,
                  _c_ptr, _c_int, _c_ptr),
    "hh_decode_gathered": (_c_ptr, _c_int, _c_i64, _c_i64, _c_int, _c_ptr, _c_i64, _c_int, _c_int, _c_i64, _c_i64,
                           _c_ptr, _c_i64, _c_i64, _c_ptr, _c_int, _c_ptr),
}


# -- building ------------------------------------------------------------------------
def source_path() -> Path:
    return backend.source_path(SOURCE_NAME)


def cache_dir() -> Path:
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hhook"


def compiler() -> list[str]:
    """The C compiler command: ``$CC``, else the one Python was built with, else the first
    of ``cc``, ``gcc``, ``clang`` on the PATH. Raises FileNotFoundError if none exists."""
    candidates = [os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc", "gcc", "clang"]
    if os.environ.get("CC"):
        candidates = candidates[:1]  # an explicit choice is not second-guessed
    for cand in candidates:
        if cand:
            cmd = shlex.split(cand)
            if cmd and shutil.which(cmd[0]):
                return cmd
    raise FileNotFoundError(f"no C compiler found (tried {', '.join(c for c in candidates if c)})")


def _cpu_identity() -> str:
    """What ``-march=native`` depends on: the CPU model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        keep = [ln for ln in lines if ln.split(":")[0].strip() in ("model name", "flags", "Features")]
        return "\n".join(sorted(set(keep)))
    except OSError:
        return f"{platform.machine()} {platform.processor()}"


def march() -> str:
    """The ``-march`` the library is built for: ``$HHOOK_CPU_MARCH``, else ``native``."""
    return os.environ.get(MARCH_ENV) or "native"


def flags(arch: str | None = None) -> tuple[str, ...]:
    return (*FLAGS, f"-march={arch or march()}")


def library_path(cc: list[str], arch: str | None = None) -> Path:
    """Cache file of the library for this source, compiler, flags and CPU."""
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=60).stdout
    key = hashlib.sha256(
        "\0".join((source_path().read_text(), " ".join(cc), version, " ".join(flags(arch)), _cpu_identity())).encode()
    ).hexdigest()[:20]
    return cache_dir() / f"thc_cpu-{key}{sysconfig.get_config_var('SHLIB_SUFFIX') or '.so'}"


@contextlib.contextmanager
def _file_lock(path: Path):
    """Exclusive lock held across processes (no-op where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


_private: list = []  # the private folder of this process, once made


def _private_dir(problem: str) -> Path:
    """A folder of this process that only this user can write, made on first use with
    one log line saying why the cache is not used; removed at exit."""
    if not _private:
        folder = tempfile.mkdtemp(prefix="hhook-cpu-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        _private.append(Path(folder))
        logger.warning("hhook: the fused CPU codec's cache is not loaded (%s): it is built in %s for this process "
                       "instead; set %s to a folder only you can write", problem, folder, CACHE_ENV)
    return _private[0]


def build(arch: str | None = None, folder: Path | None = None) -> Path:
    """Compile the library (for ``-march=arch``, default :func:`march`) into the cache
    (or ``folder``) unless it is there; returns its path.

    Concurrent callers (ranks of one node) serialise on a lock file: the first compiles,
    the others find the result. The compiler writes a temporary file that is renamed
    into place, so a reader never sees a partial library. A cache folder that someone else
    could change (:func:`hhook.codec.kernels.trust.unsafe_folder`: it, or a folder above
    it) is not used: the library is built in a private folder (:func:`_private_dir`).
    """
    cc = compiler()
    target = library_path(cc, arch)
    if folder is None:
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        problem = trust.unsafe_folder(target.parent)
        if problem is not None:
            folder = _private_dir(problem)
    if folder is not None:
        target = folder / target.name
    start = time.perf_counter()
    with _file_lock(target.with_suffix(".lock")):
        if target.is_file():
            build_info.update(path=str(target), compiled=False)
            return target
        fd, tmp = tempfile.mkstemp(prefix=target.stem + ".", suffix=".tmp", dir=target.parent)
        os.close(fd)
        try:
            done = subprocess.run([*cc, *flags(arch), "-o", tmp, str(source_path()), "-lm"],
                                  capture_output=True, text=True, timeout=300)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cc)} failed: {done.stderr.strip()[-2000:]}")
            os.chmod(tmp, 0o755)  # whatever the umask: a cache file writable by others is never loaded
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    build_info.update(path=str(target), compiled=True, compile_seconds=time.perf_counter() - start)
    return target


def _open(arch: str):
    """The library, loaded from the very file that was checked (:func:`trust.load`); one
    that someone else could have written is rebuilt in the private folder instead."""
    path = build(arch)
    try:
        return trust.load(path)
    except trust.Untrusted as exc:
        if _private and path.parent == _private[0]:
            raise
        return trust.load(build(arch, _private_dir(str(exc))))


def _library(arch: str | None = None):
    """The loaded library for ``-march=arch`` (default :func:`march`, read at every call), or
    None (logged once) when it cannot be built here."""
    return _load(arch or march())


@functools.cache
def _load(arch: str):
    start = time.perf_counter()
    try:
        lib = _open(arch)
    except Exception as e:  # no compiler, a failing one, an unwritable cache: use the reference
        logger.warning("hhook: fused CPU codec unavailable, using the torch reference (%s)", e)
        return None
    for name, args in _SIGNATURES.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = None
    build_info["seconds"] = time.perf_counter() - start
    return lib


_library.cache_clear = _load.cache_clear


def available() -> bool:
    """Whether CPU tensors go through this module: not forced off and the library loads."""
    return not backend.forced_off() and _library() is not None


def supports(block: int) -> bool:
    return 1 <= block <= 1 << 16 and block & (block - 1) == 0


@functools.lru_cache(maxsize=64)
def scaled_signs(seed: int, block: int) -> torch.Tensor:
    """``D`` times ``rotation.norm(B)``: decode's last multiply, ``(H y * norm) * D`` in one
    (the sign is exact, so the bits are the specification's)."""
    return (rotation.signs(seed, block, torch.device("cpu")) * rotation.norm(block)).contiguous()


# -- stages ------------------------------------------------------------------------
def rotate(codec, source: torch.Tensor, residual: torch.Tensor | None = None):
    """``(blocks, maxima, digest, nonfinite)`` of a flat tensor: the fused stage 1 without
    the header (tests compare its blocks with the reference quantizer's input).
    ``nonfinite`` covers ``residual`` too (:meth:`hhook.codec.THCCodec.prepare`)."""
    lib = _library()
    numel = source.numel()
    block = codec.block_for(numel)
    n_blocks = codec.n_blocks(numel)
    src = source.contiguous()
    blocks = threads.take_workspace(n_blocks * block).view(n_blocks, block)
    maxima = torch.empty(n_blocks, dtype=torch.float32)
    signs = rotation.signs(codec.seed, block, torch.device("cpu"))
    norm = rotation.norm(block)
    dtype = _DTYPE_CODE[src.dtype]
    if residual is not None:
        backend.check(residual, n_blocks * block, "residual", torch.float32, device_type="cpu")
        residual = residual.contiguous()

    def run(first, last):
        digest, nonfinite = ctypes.c_uint64(0), ctypes.c_int32(0)
        lib.hh_prepare(src.data_ptr(), dtype, numel, block, first, last, signs.data_ptr(), norm, blocks.data_ptr(),
                       maxima.data_ptr(), residual.data_ptr() if residual is not None else None,
                       ctypes.byref(digest), ctypes.byref(nonfinite))
        return digest.value, nonfinite.value

    parts = threads.parallel(run, n_blocks, block)
    digest = sum(d for d, _ in parts) & ((1 << 48) - 1)
    nonfinite = any(f for _, f in parts)
    return blocks, maxima, digest, nonfinite


def prepare(codec, source: torch.Tensor, residual: torch.Tensor | None = None):
    numel = source.numel()
    blocks, maxima, digest, nonfinite = rotate(codec, source, residual)
    if nonfinite:
        maxima.zero_()
    head = codec.header(numel, float(nonfinite), digest)
    return spec.Prepared(numel, source, torch.cat((head, maxima)), blocks, backend=_module(), header=head)


def _verdicts(agreed: torch.Tensor) -> tuple[bool, bool, bool]:
    """``codec.agreed_status`` read on the host: free on CPU, no device to wait for."""
    return tuple(bool(v) for v in spec.agreed_status(agreed))


def quantize(codec, prepared, agreed, key, residual=None, residual_out=None, out=None) -> torch.Tensor:
    lib = _library()
    stream = rng.as_stream(key)
    blocks = prepared.blocks
    if blocks is None:
        raise RuntimeError("hhook: this Prepared was already decoded; prepare the tensor again")
    n_blocks, block = blocks.shape
    layout = codec.layout
    count = blocks.numel()
    n_words = layout.n_words(count)
    backend.check(agreed, codec.scales_numel(prepared.numel), "agreed scales", torch.float32, device_type="cpu")
    nonfinite, _, identical = _verdicts(agreed)
    words = torch.empty(n_words, dtype=layout.word_dtype) if out is None else out
    if residual is not None:
        backend.check(residual, count, "residual", torch.float32, device_type="cpu")
        backend.check(residual_out, count, "residual_out", torch.float32, device_type="cpu")
    if nonfinite or identical:  # the words carry nothing
        words.zero_()
        if residual is not None and residual_out is not residual:
            residual_out.copy_(residual)
        return words
    maxima = agreed[spec.HEADER :].contiguous()
    table = stream.table(block).bitwise_left_shift_(24 - stream.strata_bits) if stream.strata_bits else None
    r_in = residual.contiguous() if residual is not None else None
    direct = residual_out is not None and residual_out.is_contiguous()
    r_out = residual_out if direct or residual_out is None else torch.empty(count, dtype=torch.float32)

    def run(first, last):
        lib.hh_quantize(blocks.data_ptr(), r_in.data_ptr() if r_in is not None else None,
                        r_out.data_ptr() if r_out is not None else None, maxima.data_ptr(), count,
                        block.bit_length() - 1, codec.levels, stream.key, table.data_ptr() if table is not None else None,
                        stream.row, stream.strata_bits, stream.offset, n_words, layout.lanes,
                        layout.width, layout.word_bits, first, last, words.data_ptr())

    threads.parallel(run, n_words, layout.lanes)
    if residual_out is not None and not direct:
        residual_out.copy_(r_out.view(residual_out.shape))
    return words


def release(prepared) -> None:
    """Hand ``prepared``'s rotated blocks back to the workspaces once its words are written
    (a decode needs only the words): the next prepare reuses them, without page faults."""
    if prepared.blocks is not None:
        threads.give_workspace(prepared.blocks)
        prepared.blocks = None


def decode(codec, prepared, agreed, words: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    lib = _library()
    numel = prepared.numel
    block = codec.block_for(numel)
    n_blocks = codec.n_blocks(numel)
    layout = codec.layout
    n_words = layout.n_words(n_blocks * block)
    backend.check(agreed, codec.scales_numel(numel), "agreed scales", torch.float32, device_type="cpu")
    backend.check(words, n_words, "words", layout.word_dtype, device_type="cpu")
    backend.check(out, numel, "out", device_type="cpu")
    nonfinite, mismatch, identical = _verdicts(agreed)
    release(prepared)
    if nonfinite or mismatch:
        return out.fill_(float("nan"))
    if identical:
        out.copy_(prepared.source.view(out.shape))
        return out
    direct = out.is_contiguous() and out.dtype in _DTYPE_CODE
    target = out if direct else torch.empty(numel, dtype=torch.float32)
    words = words.contiguous()
    maxima = agreed[spec.HEADER :].contiguous()
    signs = scaled_signs(codec.seed, block)
    dtype = _DTYPE_CODE[target.dtype]

    def run(first, last):
        work = torch.empty(block, dtype=torch.float32)
        lib.hh_decode(words.data_ptr(), layout.word_bits, n_words, layout.width, maxima.data_ptr(), codec.levels,
                      codec.world_size, numel, block, signs.data_ptr(), first, last, target.data_ptr(), dtype,
                      work.data_ptr())

    threads.parallel(run, n_blocks, block)
    if not direct:
        out.copy_(target.view(out.shape))
    return out


def decode_gathered(solo, rows: torch.Tensor, start: int, meta: int, numel: int, out: torch.Tensor) -> torch.Tensor:
    """The mean of gathered scales' one-rank messages (:func:`hhook.scales.gathered.decode`'s
    specification, bit for bit): ``rows`` holds one message a row, its block maxima (float32
    bits) in words ``[start, start + meta)`` and its codes in ``solo``'s lanes after them;
    the sum in rank order, divided by the count, rotated back once, into ``out``."""
    lib = _library()
    block, n_blocks, layout = solo.block_for(numel), solo.n_blocks(numel), solo.layout
    n_words = layout.n_words(n_blocks * block)
    messages, row_words = rows.shape
    if rows.dtype != layout.word_dtype or row_words != start + meta + n_words or not rows.is_contiguous():
        raise ValueError(f"hhook: gathered messages of {row_words} {rows.dtype} words; this tensor's take "
                         f"{start + meta + n_words} {layout.word_dtype}")
    backend.check(out, numel, "out", device_type="cpu")
    direct = out.is_contiguous() and out.dtype in _DTYPE_CODE
    target = out if direct else torch.empty(numel, dtype=torch.float32)
    word_bytes = rows.element_size()
    signs, dtype = scaled_signs(solo.seed, block), _DTYPE_CODE[target.dtype]

    def run(first, last):
        work = torch.empty(block, dtype=torch.float32)
        lib.hh_decode_gathered(rows.data_ptr() + (start + meta) * word_bytes, layout.word_bits, n_words, row_words,
                               layout.width, rows.data_ptr() + start * word_bytes, row_words * word_bytes // 4,
                               solo.levels, messages, numel, block, signs.data_ptr(), first, last, target.data_ptr(),
                               dtype, work.data_ptr())

    threads.parallel(run, n_blocks, block * messages)
    if not direct:
        out.copy_(target.view(out.shape))
    return out


def _module():
    import sys

    return sys.modules[__name__]
