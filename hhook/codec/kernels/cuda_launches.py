r"""The launches of the fused CUDA kernels (:mod:`hhook.codec.kernels.cuda`): each
stage's grid, threads, shared memory and arguments, as plain data (:class:`Launch`) that
a test can run on the CPU emulator as well as CuPy on a GPU.

Host time: what depends only on the bucket's shape and the codec (the kernel's name, the
grid, the shared memory, the scalar arguments as exact C types) is computed once per
shape and kept (``functools.lru_cache``; numpy scalars are immutable, so launches share
them); a call adds the pointers, the alignment flags and the rounding stream.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import torch

from .. import rng

_DTYPE_SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_WORD_SUFFIX = {torch.int32: "i32", torch.int64: "i64"}
_R = 8  # HH_R in the .cu: values per thread per butterfly pass
_MIN_TILE = 2048  # coordinates per CUDA block in prepare/decode at least
_MAX_THREADS = 512  # HH_THREADS in the .cu (launch bounds)
_QUANTIZE_THREADS = 256  # at least; more when one span must cover a 4096-block
_WORDS_PER_THREAD = 8  # HH_MAX_WORDS_PER_THREAD in the .cu
_SHARED_LIMIT = 48 * 1024  # bytes of dynamic shared memory without an opt-in


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
    """``(tile, threads)`` of prepare/decode: a CUDA block rotates ``tile`` coordinates,
    whole blocks of B, ``_R`` per thread."""
    tile = max(block, _MIN_TILE)
    return tile, tile // _R


def _quantize_geometry(block: int) -> tuple[int, int, int]:
    """``(threads, span, window)`` of quantize: a CUDA block packs ``span`` words; one
    lane's codes then lie in a window of at most ``window`` coordinates of whole blocks."""
    cover = max(block, _R)
    threads = max(_QUANTIZE_THREADS, cover // _WORDS_PER_THREAD)
    span = _WORDS_PER_THREAD * threads  # a multiple of cover
    return threads, span, span + cover


def _pad(n: int) -> int:
    return n + (n >> 5)  # hh_pad: one spare float every 32 against bank conflicts


def _aligned(t: torch.Tensor) -> np.int32:
    """Whether 4 consecutive elements from a multiple of 4 form one aligned vector access."""
    return np.int32(t.data_ptr() % (4 * t.element_size()) == 0)


@functools.lru_cache(maxsize=1024)
def _prepare_static(dtype, numel: int, block: int, fingerprint: int) -> tuple:
    n_blocks = -(-numel // block)
    tile, threads = _tile(block)
    return (
        f"hh_prepare_{_DTYPE_SUFFIX[dtype]}",
        max(1, -(-(n_blocks * block) // tile)),  # one block even when empty: it writes the header
        threads,
        4 * (_pad(tile) + tile // block + 1),
        (
            np.int64(numel),
            np.int64(n_blocks * block),
            np.int32(block.bit_length() - 1),
            np.float32(1.0 / math.sqrt(block)),
            np.float32(fingerprint),
        ),
    )


def prepare_launch(source, signs, scales, workspace, numel: int, block: int, fingerprint: int) -> Launch:
    name, grid, threads, shared, scalars = _prepare_static(source.dtype, numel, block, fingerprint)
    return Launch(name, grid, threads, shared, (source, signs, scales, workspace, *scalars, _aligned(source)))


@functools.lru_cache(maxsize=1024)
def _quantize_static(dtype, word_dtype, width: int, lanes: int, numel: int, n_words: int, block: int,
                     levels: int) -> tuple:
    total = -(-numel // block) * block
    threads, span, window = _quantize_geometry(block)
    return (
        f"hh_quantize_{_DTYPE_SUFFIX[dtype]}_{_WORD_SUFFIX[word_dtype]}",
        -(-n_words // span),
        threads,
        4 * (_pad(window) + 3 * (window // block)),
        (np.int64(numel), np.int64(total), np.int64(n_words), np.int32(block.bit_length() - 1), np.int32(levels),
         np.int32(width), np.int32(lanes)),
        (np.float32(1.0 / math.sqrt(block)), np.int32(_WORDS_PER_THREAD)),
    )


_HAS_RESIDUAL = (np.int32(0), np.int32(1))


def quantize_launch(
    source, signs, agreed, words, residual, residual_out, block: int, layout, levels: int, key
) -> Launch:
    stream = rng.as_stream(key)
    name, grid, threads, shared, sizes, tail = _quantize_static(
        source.dtype, layout.word_dtype, layout.width, layout.lanes, source.numel(), words.numel(), block, levels)
    has_residual = residual is not None
    return Launch(
        name,
        grid,
        threads,
        shared,
        (
            source,
            signs,
            agreed,
            words,
            residual if has_residual else agreed,  # never read when has_residual is 0
            residual_out if has_residual else agreed,  # never written either
            _HAS_RESIDUAL[has_residual],
            *sizes,
            np.uint32(stream.key),
            np.uint32(stream.shared & rng.MASK32),
            np.uint32(stream.row),
            np.int32(stream.strata_bits),
            np.uint32(stream.offset),
            *tail,
            _aligned(source),
        ),
    )


@functools.lru_cache(maxsize=1024)
def _decode_static(word_dtype, out_dtype, source_dtype, width: int, numel: int, n_words: int, block: int,
                   levels: int, world_size: int) -> tuple:
    total = -(-numel // block) * block
    tile, threads = _tile(block)
    return (
        f"hh_decode_{_WORD_SUFFIX[word_dtype]}_{_DTYPE_SUFFIX[out_dtype]}_{_DTYPE_SUFFIX[source_dtype]}",
        -(-total // tile),
        threads,
        4 * (_pad(tile) + 2 * (tile // block)),
        (np.int64(numel), np.int64(total), np.int64(n_words), np.int32(block.bit_length() - 1), np.int32(levels),
         np.int32(world_size), np.int32(width), np.float32(1.0 / math.sqrt(block))),
    )


def decode_launch(words, signs, agreed, out_flat, source, block: int, layout, levels: int, world_size: int) -> Launch:
    name, grid, threads, shared, scalars = _decode_static(
        layout.word_dtype, out_flat.dtype, source.dtype, layout.width, out_flat.numel(), words.numel(), block, levels,
        world_size)
    return Launch(name, grid, threads, shared,
                  (words, signs, agreed, out_flat, source, *scalars, _aligned(out_flat), _aligned(source)))
