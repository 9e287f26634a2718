r"""Fused CUDA kernels for :class:`hhook.codec.THCCodec`, compiled at run time by CuPy.

The pure-torch codec is the specification; this module only makes it faster on a GPU.
:meth:`THCCodec.prepare`, :meth:`~THCCodec.quantize` and :meth:`~THCCodec.decode` call
:func:`prepare`, :func:`quantize` and :func:`decode` here for CUDA tensors when
:func:`available` says so. Each stage is one kernel from ``csrc/thc_kernels.cu``:

1. ``prepare``: pad, sign diagonal, Walsh-Hadamard transform, per-block max ``|y|``,
   error-feedback residual; reads the input in its own dtype (fp32/fp16/bf16).
2. ``quantize``: stochastic rounding with the counter-based RNG of :mod:`hhook.rng`,
   written straight into the lane words of :mod:`hhook.lanes`. Given the same rotated
   blocks and scales the words equal the reference's bit for bit.
3. ``decode``: unpack, dequantize, inverse rotation, crop, store in the output's dtype.

The rotation sums in a different order than torch's matmul, so rotated values (and hence,
rarely, a code) differ from the reference in the last bit.

Why CuPy and NVRTC rather than a compiled extension: ``pip install hhook[cuda]`` needs no
compiler and no build matched to the torch/CUDA versions; the kernels compile once per
device on first use (CuPy also caches the binary on disk, ``~/.cupy/kernel_cache``).
Tensors cross over zero-copy through DLPack and kernels run on torch's current stream.

The rotation kernels keep a block in shared memory, so they support block sizes up to
:data:`MAX_BLOCK`; the codec uses the reference rotation above that (quantization still
runs here). Set ``HHOOK_FORCE_REFERENCE=1`` to use the reference codec everywhere.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from pathlib import Path

import numpy as np
import torch

from . import rng

#: Largest rotation block the prepare/decode kernels handle (tile in shared memory, < 48 KiB).
MAX_BLOCK = 8192
FORCE_REFERENCE_ENV = "HHOOK_FORCE_REFERENCE"
SOURCE_NAME = "thc_kernels.cu"
KERNEL_NAMES = (
    "hh_prepare_f32",
    "hh_prepare_f16",
    "hh_prepare_bf16",
    "hh_quantize_i32",
    "hh_quantize_i64",
    *(f"hh_decode_{w}_{o}" for w in ("i32", "i64") for o in ("f32", "f16", "bf16")),
)

_R = 16  # values per thread per butterfly pass: HH_R in the .cu
_MIN_TILE = 2048  # coordinates per CUDA block at least (several small blocks share one)
_QUANTIZE_THREADS = 256
_QUANTIZE_MAX_GRID = 8192  # grid-stride beyond this
_HEADER = 3  # codec.HEADER, repeated to keep this module free of a circular import
_DTYPE_SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_WORD_SUFFIX = {torch.int32: "i32", torch.int64: "i64"}


# -- availability ----------------------------------------------------------------
@functools.cache
def _cupy_importable() -> bool:
    try:
        import cupy  # noqa: F401
    except Exception:  # ImportError, or a CuPy built for another CUDA failing to load
        return False
    return True


def available() -> bool:
    """Whether CUDA tensors go through these kernels: CuPy importable and not forced off.

    CuPy is imported here, lazily, so importing hhook never needs it.
    """
    if os.environ.get(FORCE_REFERENCE_ENV, "") == "1":
        return False
    return _cupy_importable()


def supports(block: int) -> bool:
    """Whether the rotation kernels handle this block size (the codec falls back if not)."""
    return 1 <= block <= MAX_BLOCK and block & (block - 1) == 0


# -- sources -----------------------------------------------------------------------
def source_path() -> Path:
    """The kernel source: ``hhook/csrc`` (installed package data, or the checkout's symlink
    to ``csrc/``), else ``csrc/`` beside the package in a source checkout."""
    here = Path(__file__).resolve().parent
    for folder in (Path(__file__).parent / "csrc", here.parent / "csrc"):
        if (folder / SOURCE_NAME).is_file():
            return folder / SOURCE_NAME
    raise FileNotFoundError(f"hhook: {SOURCE_NAME} is missing from {here / 'csrc'} and {here.parent / 'csrc'}")


@functools.cache
def kernel_source() -> str:
    return source_path().read_text()


# -- launches ----------------------------------------------------------------------
@dataclasses.dataclass
class Launch:
    """One kernel launch: everything but the device, so a test can run it elsewhere."""

    name: str
    grid: int
    block: int
    shared_mem: int
    args: tuple  # torch tensors (passed as pointers) and numpy scalars (exact C types)


def _tile(block: int) -> tuple[int, int]:
    """``(tile, threads)``: a CUDA block rotates ``tile`` coordinates, whole blocks of B."""
    tile = max(block, _MIN_TILE)
    return tile, tile // _R


def _pad(n: int) -> int:
    return n + (n >> 5)  # hh_pad: one spare float every 32 against bank conflicts


def prepare_launch(x_flat, residual, blocks, scales, numel: int, block: int, seed: int, fingerprint: int) -> Launch:
    total = blocks.numel()
    tile, threads = _tile(block)
    has_residual = residual is not None
    return Launch(
        f"hh_prepare_{_DTYPE_SUFFIX[x_flat.dtype]}",
        -(-total // tile),
        threads,
        4 * (_pad(tile) + tile // block),
        (
            x_flat,
            residual if has_residual else blocks,  # never read when has_residual is 0
            np.int32(has_residual),
            blocks,
            scales,
            np.int64(numel),
            np.int64(total),
            np.int32(block.bit_length() - 1),
            np.uint32(rng.sign_key(seed)),
            np.float32(1.0 / math.sqrt(block)),
            np.float32(fingerprint),
        ),
    )


def quantize_launch(blocks, maxima, words, residual, layout, levels: int, key: int) -> Launch:
    count = blocks.numel()
    n_words = words.numel()
    has_residual = residual is not None
    return Launch(
        f"hh_quantize_{_WORD_SUFFIX[layout.word_dtype]}",
        max(1, min(-(-n_words // _QUANTIZE_THREADS), _QUANTIZE_MAX_GRID)),
        _QUANTIZE_THREADS,
        0,
        (
            blocks,
            maxima,
            words,
            residual if has_residual else blocks,  # never written when has_residual is 0
            np.int32(has_residual),
            np.int64(count),
            np.int64(n_words),
            np.int32(blocks.shape[1].bit_length() - 1),
            np.int32(levels),
            np.int32(layout.width),
            np.int32(layout.lanes),
            np.uint32(key & rng.MASK32),
        ),
    )


def decode_launch(
    words, maxima, out_flat, numel: int, n_blocks: int, block: int, layout, levels: int, world_size: int, seed: int
) -> Launch:
    total = n_blocks * block
    tile, threads = _tile(block)
    return Launch(
        f"hh_decode_{_WORD_SUFFIX[layout.word_dtype]}_{_DTYPE_SUFFIX[out_flat.dtype]}",
        -(-total // tile),
        threads,
        4 * (_pad(tile) + 2 * (tile // block)),
        (
            words,
            maxima,
            out_flat,
            np.int64(numel),
            np.int64(total),
            np.int64(words.numel()),
            np.int32(block.bit_length() - 1),
            np.int32(levels),
            np.int32(world_size),
            np.int32(layout.width),
            np.uint32(rng.sign_key(seed)),
            np.float32(1.0 / math.sqrt(block)),
        ),
    )


@functools.cache
def _module():
    import cupy

    # CuPy compiles the module with NVRTC for the current device's architecture on first
    # use and caches it per device (and on disk): compile once per device.
    return cupy.RawModule(code=kernel_source(), options=("-std=c++14",))


@functools.cache
def _function(name: str):
    try:
        return _module().get_function(name)
    except Exception as err:  # NVRTC missing or failing: say how to carry on without it
        raise RuntimeError(
            f"hhook: could not compile the CUDA kernels ({err}); set {FORCE_REFERENCE_ENV}=1 to use the reference codec"
        ) from err


def _as_cupy(cupy, value):
    if not isinstance(value, torch.Tensor):
        return value
    if value.dtype in (torch.float16, torch.bfloat16):
        value = value.view(torch.int16)  # the kernels take raw 16-bit patterns; CuPy has no bf16
    return cupy.from_dlpack(value)


def _cupy_launch(launch: Launch, device: torch.device) -> None:
    """Run ``launch`` on ``device``, on torch's current stream there, tensors via DLPack."""
    import cupy

    index = device.index if device.index is not None else torch.cuda.current_device()
    with cupy.cuda.Device(index):
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(index).cuda_stream)
        with stream:
            args = tuple(_as_cupy(cupy, a) for a in launch.args)
            _function(launch.name)((launch.grid,), (launch.block,), args, shared_mem=launch.shared_mem)


#: How launches run; tests replace it with a CPU emulator of the kernels.
_launch = _cupy_launch


# -- the three codec stages ----------------------------------------------------------
def _check_sizes(tensor: torch.Tensor, expected: int, what: str) -> None:
    """Kernels index raw pointers: a wrong length would read or write out of bounds."""
    if tensor.numel() != expected:
        raise ValueError(f"hhook: {what} has {tensor.numel()} elements, expected {expected}")


def prepare(codec, x: torch.Tensor, residual: torch.Tensor | None = None):
    """:meth:`THCCodec.prepare` in one kernel (block size at most :data:`MAX_BLOCK`)."""
    from .codec import Prepared

    numel = x.numel()
    block = codec.block_for(numel)
    n_blocks = codec.n_blocks(numel)
    if not supports(block):
        raise ValueError(f"hhook CUDA kernels rotate blocks of at most {MAX_BLOCK}, not {block}")
    blocks = torch.empty(n_blocks, block, dtype=torch.float32, device=x.device)
    scales = torch.zeros(_HEADER + n_blocks, dtype=torch.float32, device=x.device)
    f = codec.fingerprint(numel)
    if n_blocks == 0:
        scales[1:_HEADER] = torch.tensor([f, -f], dtype=torch.float32)
        return Prepared(numel, blocks, scales)
    if residual is not None:
        _check_sizes(residual, blocks.numel(), "residual")
        residual = residual.to(torch.float32).contiguous()
    flat = x.reshape(-1).contiguous()
    _launch(prepare_launch(flat, residual, blocks, scales, numel, block, codec.seed, f), x.device)
    # A non-finite rank reports zero maxima, as the reference does.
    scales[_HEADER:].masked_fill_(scales[0] != 0, 0.0)
    return Prepared(numel, blocks, scales)


def quantize(codec, prepared, agreed: torch.Tensor, key: int, residual: torch.Tensor | None = None) -> torch.Tensor:
    """The words of :meth:`THCCodec.quantize` once the header checks have passed."""
    blocks = prepared.blocks.contiguous()
    layout = codec.layout
    words = torch.empty(layout.n_words(blocks.numel()), dtype=layout.word_dtype, device=blocks.device)
    if words.numel() == 0:
        return words
    maxima = agreed[_HEADER:].to(device=blocks.device, dtype=torch.float32).contiguous()
    _check_sizes(maxima, blocks.shape[0], "agreed block scales")
    target = None
    if residual is not None:
        _check_sizes(residual, blocks.numel(), "residual")
        direct = residual.dtype == torch.float32 and residual.is_contiguous()
        target = residual if direct else torch.empty(blocks.shape, dtype=torch.float32, device=blocks.device)
    _launch(quantize_launch(blocks, maxima, words, target, layout, codec.levels, key), blocks.device)
    if target is not None and target is not residual:
        residual.copy_(target.view_as(residual))
    return words


def decode(codec, prepared, agreed: torch.Tensor, words: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """:meth:`THCCodec.decode` for finite sums: the mean over ranks, written into ``out``."""
    n_blocks, block = prepared.blocks.shape
    if not supports(block):
        raise ValueError(f"hhook CUDA kernels rotate blocks of at most {MAX_BLOCK}, not {block}")
    _check_sizes(out, prepared.numel, "out")
    if prepared.numel == 0:
        return out
    _check_sizes(words, codec.layout.n_words(n_blocks * block), "words")
    direct = out.is_contiguous() and out.dtype in _DTYPE_SUFFIX
    target = out if direct else torch.empty(out.shape, dtype=torch.float32, device=words.device)
    maxima = agreed[_HEADER:].to(device=words.device, dtype=torch.float32).contiguous()
    _check_sizes(maxima, n_blocks, "agreed block scales")
    words = words.to(codec.layout.word_dtype).contiguous()
    launch = decode_launch(
        words,
        maxima,
        target.view(-1),
        prepared.numel,
        n_blocks,
        block,
        codec.layout,
        codec.levels,
        codec.world_size,
        codec.seed,
    )
    _launch(launch, words.device)
    if not direct:
        out.copy_(target)
    return out
