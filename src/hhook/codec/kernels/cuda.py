r"""Fused CUDA kernels for :class:`hhook.codec.THCCodec` and FSDP2's all-gather codec
(:class:`hhook.codec.weights.WeightCodec`), compiled at run time by CuPy.

The pure-torch codec is the specification; this module only makes it faster on a GPU.
:func:`hhook.codec.fused_backend` sends CUDA tensors here when :func:`usable` says so, and
the codec's three stages call :func:`prepare`, :func:`quantize` and :func:`decode`. Each
is one kernel from ``csrc/thc_kernels.cu``, reading its input once and writing its output
once; none reads a device value on the host.

1. ``prepare`` reads the input (fp32/fp16/bf16): sign diagonal, Walsh-Hadamard
   butterflies, per-block max ``|y|``, the 48-bit digest of its float32 bits, and the
   header (:data:`hhook.codec.HEADER`) with this rank's copy of it (``Prepared.header``).
2. ``quantize`` reads the input again and recomputes the rotation instead of storing it,
   adds the residual, rounds onto the agreed scales and packs the lane words; it can write
   the message prefix too (``prefix=``). The agreed header is read on the device:
   "non-finite" or "identical" makes zero words and keeps the old residual.
3. ``decode`` writes NaN (non-finite, mismatch, or a summed message prefix that is wrong,
   with ``check=``), the input itself (identical), or the unpacked, dequantized,
   inverse-rotated mean, in the output's dtype.

Every float operation is the specification's, in its order (docs/guarantees.md): the
butterflies on strides 1..B/2 ascending, inline PTX arithmetic with a rounding mode and no
``.ftz`` (no FMA contraction; subnormals kept although CuPy compiles with ``-ftz=true``).
So a CUDA rank decodes the summed words to the bits of a CPU rank; tests check it on a CPU
emulator of the same source.

**Streams and lifetimes.** Each launch runs on torch's current stream of the tensor's
device. A transport that runs a later stage on another stream (NCCL and Gloo futures run
``then`` callbacks on side streams, as soon as the work is queued) must keep what that
kernel reads or writes alive and ordered: every launch here therefore calls
:func:`keep_alive` (``Tensor.record_stream``) on its tensors for the stream it runs on, so
the caching allocator cannot hand their memory to anything else before the kernel is done.
What each launch touches:

=========== ============================================ ===============================
stage       reads                                        writes
=========== ============================================ ===============================
prepare     ``source``                                   ``scales``, ``header``
quantize    ``source``, ``agreed``, ``residual``,        ``words``, ``residual_out``,
            ``Prepared.header``                          the prefix
decode      ``words``, ``agreed``, ``source``            ``out`` (or a temporary, copied),
            (identical), the summed prefix               the flags
=========== ============================================ ===============================

``source`` (``prepared.source``) must not change between ``prepare`` and ``decode``.

**Host cost.** Each kernel takes one struct by value: the bytes of a bucket's shape are
kept (:mod:`.cuda_launches`), a call writes its pointers and rounding stream into a copy
with one ``pack_into`` and hands CuPy one pointer; stream objects and per-stream workspaces
are cached; no helper kernels. Per bucket in steady state: three launches, no other torch
op, and two allocations, the scale vector (the header's copy in the same allocation) and
the words (none when the caller passes ``out``); both escape to the caller, who may hold
several buckets of one length in flight, so they are not reused here
(``tests/codec/test_cuda.py::test_steady_state_host_work_per_bucket_through_thccodec``).

**Availability.** :func:`warm_up` compiles the kernels for a device (NVRTC, seconds, once;
CuPy also caches the binary on disk, ``~/.cupy/kernel_cache``, or a private temporary
folder when that is not writable). Call it when the training
state is built; otherwise the first compressed bucket does. If compiling fails (no NVRTC,
no CUDA headers, an unsupported GPU) it logs one line and the codec falls back to the
reference for that device; so does a CuPy that does not import (one log line too).
``HHOOK_FORCE_REFERENCE=1`` forces the reference everywhere.
Block sizes above :data:`MAX_BLOCK` use the reference too (above
:data:`WEIGHT_MAX_BLOCK` for the all-gather codec).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

from .. import rng
from . import backend
from .backend import FORCE_REFERENCE_ENV  # noqa: F401 - named here by tests/codec/test_cuda.py
from ..layout import HEADER as _HEADER
from ..layout import PREFIX, Prepared, expected_prefix
# The launches' geometry and arguments (named here too: tests read them from this module).
from .cuda_launches import (_DTYPE_SUFFIX, _SHARED_LIMIT, _THREADS, _TILE, _WORD_SUFFIX, SOURCE_NAME,  # noqa: F401
                            WORKSPACE, Launch, arg_types, decode_launch, prepare_launch, quantize_geometry, quantize_launch,
                            weight_decode_launch, weight_encode_launch)

logger = logging.getLogger(__name__)

#: Largest rotation block the kernels handle: four warps' tiles of 1024 coordinates.
MAX_BLOCK = 4096
#: NVRTC options; CuPy appends ``-ftz=true`` (and the architecture) itself.
COMPILE_OPTIONS = ("-std=c++14",)

KERNEL_NAMES = (
    *(f"hh_prepare_{d}" for d in _DTYPE_SUFFIX.values()),
    *(f"hh_quantize_{d}_{w}" for d in _DTYPE_SUFFIX.values() for w in _WORD_SUFFIX.values()),
    *(f"hh_decode_{w}_{o}" for w in _WORD_SUFFIX.values() for o in _DTYPE_SUFFIX.values()),
)
#: FSDP2's all-gather codec (:class:`hhook.codec.weights.WeightCodec`), from the same source.
WEIGHT_KERNEL_NAMES = ("hh_wq_encode_f32", "hh_wq_decode_f32")
#: Largest block of the all-gather codec's kernels (a warp's chunk of 1024 holds whole blocks).
WEIGHT_MAX_BLOCK = 1024


# -- availability ----------------------------------------------------------------
CACHE_ENV = "CUPY_CACHE_DIR"


def _writable_folder(path: str) -> bool:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return False
    return os.access(path, os.W_OK | os.X_OK)


def _ensure_cache_dir() -> None:
    """CuPy 14 creates its kernel cache folder (``~/.cupy/kernel_cache``) when it is
    imported and fails to import if it cannot: a read-only or missing home (containers,
    batch jobs under a service account) would switch the kernels off. Where the user set no
    ``CUPY_CACHE_DIR`` and the default is unusable, point CuPy at a private temporary
    folder (one log line; the kernels are then compiled once per process)."""
    if os.environ.get(CACHE_ENV) or _writable_folder(os.path.expanduser("~/.cupy/kernel_cache")):
        return
    folder = tempfile.mkdtemp(prefix="hhook-cupy-cache-")
    os.environ[CACHE_ENV] = folder
    logger.warning("hhook: ~/.cupy/kernel_cache is not writable; CuPy caches hhook's kernels in %s "
                   "(set %s to keep them across processes)", folder, CACHE_ENV)


_import_error: list = []  # why CuPy did not import, for the one log line of warm_up


@functools.cache
def _cupy_importable() -> bool:
    _ensure_cache_dir()
    try:
        import cupy  # noqa: F401
    except Exception as err:  # ImportError, or a CuPy built for another CUDA failing to load
        _import_error.append(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
        return False
    return True


def available() -> bool:
    """Whether CUDA tensors may go through these kernels: CuPy importable and not forced
    off. CuPy is imported here, lazily, so importing hhook never needs it."""
    return not backend.forced_off() and _cupy_importable()


def supports(block: int) -> bool:
    """Whether the kernels handle this rotation block size (the codec falls back if not)."""
    return 1 <= block <= MAX_BLOCK and block & (block - 1) == 0


def _device_index(device) -> int:
    device = torch.device(device) if device is not None else torch.device("cuda")
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _warm_up(index: int) -> bool:
    try:
        _functions(index)
    except Exception as err:  # NVRTC or headers missing, unsupported GPU, driver too old
        logger.warning(
            "hhook: CUDA kernels unavailable on cuda:%d (%s: %s); using the reference codec there",
            index,
            type(err).__name__,
            str(err).splitlines()[0] if str(err) else "",
        )
        return False
    return True


@functools.cache
def _say_unavailable() -> None:
    logger.warning(
        "hhook: CuPy is not importable (%s); CUDA tensors use the reference codec, several times slower "
        "(pip install cupy-cuda13x, or cupy-cuda12x for a CUDA 12 build of torch)",
        _import_error[0] if _import_error else "ImportError")


def warm_up(device=None) -> bool:
    """Compile and load the kernels for ``device`` now; False (and one log line) if that fails.

    The transport calls it when its state is built, so that neither the compile (seconds,
    once) nor a failure happens inside the backward pass.
    """
    if backend.forced_off():
        return False
    if not _cupy_importable():
        _say_unavailable()
        return False
    return _warm_up(_device_index(device))


def usable(device, block: int) -> bool:
    """Whether the codec should run tensors on ``device`` with this block size here."""
    return available() and supports(block) and _warm_up(_device_index(device))


# -- sources -----------------------------------------------------------------------
def source_path() -> Path:
    return backend.source_path(SOURCE_NAME)


@functools.cache
def kernel_source() -> str:
    return source_path().read_text()


# -- host-side constants -----------------------------------------------------------------
def sign_bits(seed: int, block: int) -> np.ndarray:
    """The sign diagonal of :func:`hhook.codec.rotation.signs` as a bit table: bit ``p`` of word
    ``p // 32`` is set where entry ``p`` is -1."""
    key = rng.sign_key(seed)
    table = np.zeros(-(-block // 32), dtype=np.uint32)
    for p in range(block):
        if rng.mix32(p + key) & 1:
            table[p >> 5] |= np.uint32(1 << (p & 31))
    return table


@functools.lru_cache(maxsize=64)
def _signs_on(seed: int, block: int, device: torch.device) -> torch.Tensor:
    """The table on ``device``, uploaded once per (seed, block, device), through pinned
    memory: a plain upload would wait for the copy (a host sync at a width's first call)."""
    table = torch.from_numpy(sign_bits(seed, block).view(np.int32))
    return table.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else table.to(device)


_workspaces: dict = {}


def _workspace(device: torch.device) -> torch.Tensor:
    """prepare's running digest (in slots) and counters: int64 zeros per (device, stream).

    Launches on one stream run in order and each leaves it zeroed again; launches on
    different streams get different workspaces.
    """
    key = (device, _stream_pointer(device))
    ws = _workspaces.get(key)
    if ws is None:
        ws = _workspaces[key] = torch.zeros(WORKSPACE, dtype=torch.int64, device=device)
    return ws


#: prepare's CUDA blocks per SM (HH_MIN_BLOCKS); the CPU emulator's grid: several tiles each.
_BLOCKS_PER_SM, _EMULATED_BLOCKS = 4, 3


@functools.lru_cache(maxsize=64)
def _resident(device: torch.device) -> int:
    on_gpu = device.type == "cuda"
    return _BLOCKS_PER_SM * torch.cuda.get_device_properties(_device_index(device)).multi_processor_count if on_gpu \
        else _EMULATED_BLOCKS


def _stream_pointer(device: torch.device) -> int:
    if device.type != "cuda":
        return 0  # the CPU emulator in the tests
    index = _device_index(device)
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(index) if raw is not None else torch.cuda.current_stream(index).cuda_stream


# -- running them with CuPy ------------------------------------------------------------
@functools.cache
def _functions(index: int) -> dict:
    """The compiled kernels on device ``index`` (NVRTC once per device; raises on failure)."""
    import cupy

    with cupy.cuda.Device(index):
        module = cupy.RawModule(code=kernel_source(), options=COMPILE_OPTIONS)
        module.compile()
        # RawKernel.kernel: the driver function for the current device, whose call takes
        # (grid, block, args, shared_mem, stream) with no per-call conversions.
        return {name: module.get_function(name).kernel for name in (*KERNEL_NAMES, *WEIGHT_KERNEL_NAMES)}


@functools.lru_cache(maxsize=256)
def _cupy_stream(index: int, pointer: int):
    import cupy

    with warnings.catch_warnings():  # CuPy 14 deprecates ExternalStream; it still works, and older CuPy needs it
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(pointer, index)


@functools.lru_cache(maxsize=256)
def _torch_stream(index: int, pointer: int) -> torch.cuda.Stream:
    """torch's object for the current stream (kept per raw pointer: making one per launch
    costs microseconds)."""
    return torch.cuda.current_stream(index)


def keep_alive(tensors, stream: torch.cuda.Stream | None = None) -> None:
    """Keep CUDA ``tensors`` from being reused before the work now queued on ``stream``
    (default: the current one) is done: ``record_stream`` for each. A tensor allocated on
    that very stream needs nothing (the allocator ignores it then)."""
    for t in tensors:
        if t is not None and t.is_cuda:
            t.record_stream(stream if stream is not None else torch.cuda.current_stream(t.device))


@functools.cache
def _argument_passer():
    """How a struct goes to CuPy's launch as one argument passed by value: a
    ``CPointer`` to its bytes (no conversion at all), or else a one-element numpy array of
    them (which CuPy passes by value too)."""
    try:
        from cupy.cuda.function import CPointer

        CPointer(0)
        return lambda args: CPointer(ctypes.addressof(args))
    except Exception:  # another CuPy: its documented way
        return lambda args: np.frombuffer(args, dtype=np.dtype((np.void, ctypes.sizeof(args))))


def _cupy_launch(launch: Launch, device: torch.device) -> None:
    """Run ``launch`` on torch's current stream of ``device``: one argument, the struct."""
    index = _device_index(device)
    pointer = _stream_pointer(device)
    function = _functions(index)[launch.name]
    function((launch.grid, 1, 1), (launch.block, 1, 1), (_argument_passer()(launch.args),), launch.shared_mem,
             _cupy_stream(index, pointer))
    keep_alive(launch.tensors, _torch_stream(index, pointer))


#: How launches run; tests replace it with a CPU emulator of the kernels.
_launch = _cupy_launch


# -- the three codec stages ----------------------------------------------------------
_sizes_cache: dict = {}


def _sizes(codec, numel: int) -> tuple[int, int, int, int]:
    """``(block, n_blocks, words_numel, fingerprint)`` of a bucket of ``numel`` values, kept
    per codec configuration and length (the fingerprint alone is seven hashes in Python)."""
    key = (type(codec), codec.bits, codec.block_size, codec.seed, codec.world_size, codec.rounding, numel)
    if key not in _sizes_cache:
        block = codec.block_for(numel)
        if not supports(block):
            raise ValueError(f"hhook CUDA kernels rotate blocks of at most {MAX_BLOCK}, not {block}")
        if len(_sizes_cache) >= 4096:
            _sizes_cache.clear()
        _sizes_cache[key] = (block, codec.n_blocks(numel), codec.words_numel(numel), codec.fingerprint(numel))
    return _sizes_cache[key]


def prepare(codec, source: torch.Tensor):
    """:meth:`THCCodec.prepare` in one kernel. ``source`` is the flattened input. The scale
    vector and this rank's own copy of its header (``Prepared.header``) share one allocation."""

    if not source.is_contiguous() or source.dtype not in _DTYPE_SUFFIX:
        raise ValueError("hhook: prepare needs a contiguous float32/float16/bfloat16 source")
    numel = source.numel()
    block, n_blocks, _, fingerprint = _sizes(codec, numel)
    both = torch.empty(2 * _HEADER + n_blocks, dtype=torch.float32, device=source.device)
    scales, header = both[: _HEADER + n_blocks], both[_HEADER + n_blocks :]
    signs = _signs_on(codec.seed, block, source.device)
    _launch(prepare_launch(source, signs, scales, header, _workspace(source.device), numel, block, fingerprint,
                           _resident(source.device)), source.device)
    return Prepared(numel, source, scales, None, sys.modules[__name__], header)


def quantize(codec, prepared, agreed: torch.Tensor, key, residual=None, residual_out=None, out=None,
             prefix=None) -> torch.Tensor:
    """:meth:`THCCodec.quantize`: the lane words; the residual as described there.
    ``prefix``: ``(words, fingerprints)``: the message prefix
    (:func:`hhook.codec.layout.write_prefix` of ``prepared.header``), written by the same kernel."""
    source = prepared.source
    block, n_blocks, n_words, _ = _sizes(codec, prepared.numel)
    layout = codec.layout
    words = torch.empty(n_words, dtype=layout.word_dtype, device=source.device) if out is None else out
    backend.check(agreed, _HEADER + n_blocks, "agreed scales", torch.float32, contiguous=True)
    if residual is not None:
        residual_out = residual if residual_out is None else residual_out
        backend.check(residual, n_blocks * block, "residual", torch.float32, contiguous=True)
        backend.check(residual_out, n_blocks * block, "residual_out", torch.float32, contiguous=True)
    if prefix is not None:
        backend.check(prefix[0], PREFIX, "prefix", layout.word_dtype, contiguous=True)
        prefix = (prefix[0], prefix[1], prepared.header)
    elif words.numel() == 0:
        return words
    signs = _signs_on(codec.seed, block, source.device)
    _launch(quantize_launch(source, signs, agreed, words, residual, residual_out, block, layout, codec.levels, key,
                            prefix), source.device)
    return words


def decode(codec, prepared, agreed: torch.Tensor, words: torch.Tensor, out: torch.Tensor, check=None) -> torch.Tensor:
    """:meth:`THCCodec.decode`: the mean (or NaN, or the input) written into ``out``.
    ``check``: ``(summed prefix, world size, fingerprints, flags)``: NaN too unless the
    summed message prefix is right (:func:`hhook.codec.layout.prefix_verdict`), and its
    verdict into the int32 ``flags`` (``[bad, nonfinite]``; may be None)."""
    numel = prepared.numel
    if out.numel() != numel:
        raise ValueError(f"hhook: out has {out.numel()} elements, expected {numel}")
    if numel == 0:
        return out
    block, n_blocks, n_words, _ = _sizes(codec, numel)
    backend.check(agreed, _HEADER + n_blocks, "agreed scales", torch.float32, contiguous=True)
    backend.check(words, n_words, "words", codec.layout.word_dtype, contiguous=True)
    if check is not None:
        sums, world_size, fps, flags = check
        backend.check(sums, PREFIX, "summed prefix", codec.layout.word_dtype, contiguous=True)
        check = (sums, expected_prefix(world_size, fps, codec.layout.word_bits), flags)
    direct = out.is_contiguous() and out.dtype in _DTYPE_SUFFIX
    target = out.view(-1) if direct else torch.empty(numel, dtype=torch.float32, device=out.device)
    signs = _signs_on(codec.seed, block, out.device)
    _launch(decode_launch(words, signs, agreed, target, prepared.source, block, codec.layout, codec.levels,
                          codec.world_size, check), out.device)
    if not direct:
        out.copy_(target.view(out.shape))
    return out


# -- FSDP2's all-gather codec ---------------------------------------------------------------
def weights_usable(codec, blocks: torch.Tensor, payload: torch.Tensor) -> bool:
    """Whether :class:`hhook.codec.weights.WeightCodec` runs ``blocks`` (float32 ``(n, B)``,
    contiguous, on a GPU whose kernels compiled) and ``payload`` (its scales aligned as
    float32) through the kernels."""
    return (blocks.is_cuda and blocks.dtype == torch.float32 and blocks.is_contiguous()
            and codec.block_size <= WEIGHT_MAX_BLOCK and payload.data_ptr() % 4 == 0
            and usable(blocks.device, codec.block_size))


def weight_encode(codec, blocks: torch.Tensor, out: torch.Tensor) -> bool:
    """:meth:`WeightCodec.encode` in one kernel: ``blocks`` are read, not overwritten."""
    backend.check(out, codec.nbytes(blocks.shape[0]), "payload", torch.uint8, contiguous=True)
    nonfinite = torch.zeros(1, dtype=torch.int32, device=blocks.device)
    signs = _signs_on(codec.seed, codec.block_size, blocks.device)
    _launch(weight_encode_launch(codec, blocks, out, signs, nonfinite), blocks.device)
    return not bool(nonfinite)  # a host read, as the reference's (the all-gather reads its headers anyway)


def weight_decode(codec, payload: torch.Tensor, n_blocks: int, out: torch.Tensor) -> torch.Tensor:
    """:meth:`WeightCodec.decode` in one kernel, into the float32 ``(n_blocks, B)`` ``out``."""
    backend.check(payload, codec.nbytes(n_blocks), "payload", torch.uint8, contiguous=True)
    backend.check(out, n_blocks * codec.block_size, "out", torch.float32, contiguous=True)
    _launch(weight_decode_launch(codec, payload, n_blocks, out, _signs_on(codec.seed, codec.block_size, out.device)),
            out.device)
    return out
