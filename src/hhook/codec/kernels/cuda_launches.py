r"""The launches of the fused CUDA kernels (:mod:`hhook.codec.kernels.cuda`): each
stage's grid, threads, shared memory and argument, as plain data (:class:`Launch`) that a
test can run on the CPU emulator as well as CuPy on a GPU.

Every kernel takes one argument: a struct (``Hh*Args`` in ``csrc/thc_kernels.cu``) passed
by value. Its ctypes mirror is built from the kernel source itself (:func:`arg_types`), so
the two layouts cannot drift apart (ctypes lays out fields by the C rules nvcc follows for
kernel parameters). Host time: what depends only on the bucket's shape and the codec
(the kernel's name, the grid, the shared memory, the shape's fields) is computed once per
shape and kept as the struct's bytes; a call copies them and writes the fields that change
(pointers, alignment, the rounding stream), which lead the struct, with one ``pack_into``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
import re
import struct

import numpy as np
import torch

from .. import rng
from . import backend

_DTYPE_SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # HhDecodeArgs.source_dtype
_WORD_SUFFIX = {torch.int32: "i32", torch.int64: "i64"}
_WARPS = 4  # HH_WARPS in the .cu
_THREADS = 32 * _WARPS  # HH_THREADS: every kernel's CUDA block
_CHUNK = 1024  # HH_CHUNK: a warp's coordinates
_TILE = _CHUNK * _WARPS  # HH_TILE: a CUDA block's coordinates in prepare and decode
_WORD_BYTES = 16384  # HH_WORD_BYTES: quantize's words in shared memory per CUDA block
_SHARED_LIMIT = 48 * 1024  # bytes of dynamic shared memory without an opt-in
SOURCE_NAME = "thc_kernels.cu"


# -- the argument structs, read from the source -----------------------------------------
_C_TYPES = {"hh_i64": ctypes.c_int64, "int": ctypes.c_int32, "hh_u32": ctypes.c_uint32, "float": ctypes.c_float}
_PACK_CODES = {ctypes.c_void_p: "Q", ctypes.c_int64: "q", ctypes.c_int32: "i", ctypes.c_uint32: "I",
               ctypes.c_float: "f"}
_SHAPE_MARKER = "// -- the same for every call of a shape:"


@dataclasses.dataclass(frozen=True)
class ArgStruct:
    """One kernel's argument struct: its ctypes mirror, and how a call writes the fields
    that change from call to call (the struct's first ones, up to the source's marker
    line) into a copy of the shape's bytes in one ``pack_into``."""

    ctype: type
    per_call: tuple
    packer: struct.Struct


@functools.cache
def arg_types() -> dict[str, ArgStruct]:
    """``{"HhPrepareArgs": ArgStruct, ...}`` from the structs of the kernel source: one
    field per line, ``type name;``; pointers are ``c_void_p``."""
    source = backend.source_path(SOURCE_NAME).read_text()
    types = {}
    for name, body in re.findall(r"struct (Hh\w+Args) \{(.*?)\n\};", source, re.S):
        fields, per_call = [], None
        for line in body.splitlines():
            if line.strip() == _SHAPE_MARKER:
                per_call = len(fields)
                continue
            decl = line.split("//")[0].strip()
            if not decl:
                continue
            match = re.fullmatch(r"(?:const )?(\w+)\s*(\*?)\s*(\w+);", decl)
            if match is None:
                raise ValueError(f"hhook: cannot read the field {decl!r} of {name} in {SOURCE_NAME}")
            ctype, pointer, field = match.groups()
            fields.append((field, ctypes.c_void_p if pointer else _C_TYPES[ctype]))
        if per_call is None:
            raise ValueError(f"hhook: {name} in {SOURCE_NAME} lacks the line {_SHAPE_MARKER!r}")
        mirror = type(name, (ctypes.Structure,), {"_fields_": fields})
        fmt, at = "<", 0
        for field, ctype in fields[:per_call]:
            offset = getattr(mirror, field).offset
            fmt += "x" * (offset - at) + _PACK_CODES[ctype]
            at = offset + ctypes.sizeof(ctype)
        types[name] = ArgStruct(mirror, tuple(f for f, _ in fields[:per_call]), struct.Struct(fmt))
    return types


# -- launches ----------------------------------------------------------------------
@dataclasses.dataclass
class Launch:
    """One kernel launch: everything but the device, so a test can run it elsewhere.
    ``args`` holds the bytes of the kernel's argument struct; ``tensors`` what its
    pointers point into."""

    name: str
    grid: int
    block: int
    shared_mem: int
    args: ctypes.Array
    tensors: tuple


def _pointer(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _aligned(t: torch.Tensor) -> int:
    """Whether the tensor's data start on 16 bytes (its aligned elements load as vectors)."""
    return int(t.data_ptr() % 16 == 0)


def _static(kind: str, **fields) -> tuple:
    """The bytes of an argument struct with the shape's fields set, and its packer."""
    layout = arg_types()[kind]
    return bytes(layout.ctype(**fields)), layout.packer


def _fill(template: tuple, *per_call) -> ctypes.Array:
    """A copy of the shape's bytes with the call's fields (in the struct's order) written in."""
    data, packer = template
    args = (ctypes.c_char * len(data)).from_buffer_copy(data)
    packer.pack_into(args, 0, *per_call)
    return args


def _log2(block: int) -> int:
    return block.bit_length() - 1


def _norm(block: int) -> float:
    """float32(1/sqrt(B)), as rotation.norm (numpy: no tensor on the way)."""
    return float(np.float32(1.0 / math.sqrt(block)))


#: u64 of prepare's per-stream workspace: HH_SLOTS digest slots and the counters.
WORKSPACE = 33


@functools.lru_cache(maxsize=1024)
def _prepare_static(dtype, numel: int, block: int, fingerprint: int, resident: int) -> tuple:
    total = -(-numel // block) * block
    return (f"hh_prepare_{_DTYPE_SUFFIX[dtype]}", max(1, min(-(-total // _TILE), resident)), _THREADS,
            4 * (_TILE + 32),
            _static("HhPrepareArgs", numel=numel, total=total, log2B=_log2(block), norm=_norm(block),
                    fingerprint=float(fingerprint)))


def prepare_launch(source, signs, scales, header, workspace, numel: int, block: int, fingerprint: int,
                   resident: int = 2**20) -> Launch:
    """``header``: where the header's copy goes (this rank's own, kept from the MAX), or None;
    ``resident``: at most this many CUDA blocks, each taking every ``grid``-th tile (the
    CUDA blocks the GPU holds at once: one digest atomic and one counter atomic each)."""
    name, grid, threads, shared, template = _prepare_static(source.dtype, numel, block, fingerprint, resident)
    args = _fill(template, source.data_ptr(), signs.data_ptr(), scales.data_ptr(), _pointer(header),
                 workspace.data_ptr(), _aligned(source))
    return Launch(name, grid, threads, shared, args, (source, signs, scales, header, workspace))


def quantize_geometry(block: int, word_dtype) -> tuple[int, int]:
    """``(words per CUDA block, shared memory bytes)`` of quantize."""
    return _WORD_BYTES // (4 if word_dtype == torch.int32 else 8), _WORD_BYTES + 4 * _TILE + 2 * block


@functools.lru_cache(maxsize=1024)
def _quantize_static(dtype, word_dtype, width: int, lanes: int, numel: int, n_words: int, block: int,
                     levels: int) -> tuple:
    span, shared = quantize_geometry(block, word_dtype)
    return (f"hh_quantize_{_DTYPE_SUFFIX[dtype]}_{_WORD_SUFFIX[word_dtype]}", -(-n_words // span), _THREADS, shared,
            _static("HhQuantizeArgs", numel=numel, total=-(-numel // block) * block, n_words=n_words,
                    log2B=_log2(block), levels=levels, width=width, lanes=lanes, norm=_norm(block)))


def quantize_launch(source, signs, agreed, words, residual, residual_out, block: int, layout, levels: int, key,
                    prefix=None) -> Launch:
    """``prefix``: ``(words, fingerprints, header)``: also write the message prefix
    (:func:`hhook.codec.layout.write_prefix`) there, or None."""
    stream = rng.as_stream(key)
    name, grid, threads, shared, template = _quantize_static(
        source.dtype, layout.word_dtype, layout.width, layout.lanes, source.numel(), words.numel(), block, levels)
    head, fps, own = prefix if prefix is not None else (None, (0, 0), None)
    args = _fill(template, source.data_ptr(), signs.data_ptr(), agreed.data_ptr(), words.data_ptr(),
                 _pointer(residual), _pointer(residual_out), _pointer(head), _pointer(own), stream.key,
                 stream.shared & rng.MASK32, stream.row, stream.offset, stream.strata_bits, _aligned(source), *fps)
    return Launch(name, grid, threads, shared, args, (source, signs, agreed, words, residual, residual_out, head, own))


@functools.lru_cache(maxsize=1024)
def _decode_static(word_dtype, out_dtype, source_dtype, width: int, lanes: int, numel: int, n_words: int,
                   block: int, levels: int, world_size: int, expect: tuple) -> tuple:
    total = -(-numel // block) * block
    return (f"hh_decode_{_WORD_SUFFIX[word_dtype]}_{_DTYPE_SUFFIX[out_dtype]}", -(-total // _TILE), _THREADS,
            4 * _TILE,
            _static("HhDecodeArgs", source_dtype=_DTYPE_CODES[source_dtype], numel=numel, total=total,
                    n_words=n_words, expect_count=expect[0],
                    expect_fp0=expect[1], expect_fp1=expect[2], log2B=_log2(block), levels=levels, world=world_size,
                    width=width, lanes=lanes, norm=_norm(block)))


def decode_launch(words, signs, agreed, out_flat, source, block: int, layout, levels: int, world_size: int,
                  check=None) -> Launch:
    """``check``: ``(summed prefix, expected (count, fp0, fp1), flags)``: NaN unless the
    summed message prefix is as expected, and its verdict into ``flags`` (int32
    ``[bad, nonfinite]``, may be None), or None."""
    head, expect, flags = check if check is not None else (None, (0, 0, 0), None)
    name, grid, threads, shared, template = _decode_static(
        layout.word_dtype, out_flat.dtype, source.dtype, layout.width, layout.lanes, out_flat.numel(), words.numel(),
        block, levels, world_size, tuple(expect))
    args = _fill(template, words.data_ptr(), signs.data_ptr(), agreed.data_ptr(), out_flat.data_ptr(),
                 source.data_ptr(), _pointer(head), _pointer(flags))
    return Launch(name, grid, threads, shared, args, (words, signs, agreed, out_flat, source, head, flags))


# -- FSDP2's all-gather codec (hhook.codec.weights.WeightCodec) -------------------------------
_WQ_SPAN = 2048  # HH_WQ_SPAN: plane positions per CUDA block of encode
_ROTATE_CODES = {False: 0, True: 1, "auto": 2}


def weight_planes(bits: int) -> int:
    """``k``: codes that share a byte position (weights.pack's planar layouts), else 1."""
    return {2: 4, 4: 2, 6: 4}.get(bits, 1)


@functools.lru_cache(maxsize=256)
def _weight_static(encode: bool, n_blocks: int, block: int, bits: int, rotate) -> tuple:
    n = n_blocks * block
    plane = n // weight_planes(bits)
    fields = dict(n_blocks=n_blocks, plane=plane, planes=weight_planes(bits), log2B=_log2(block), bits=bits,
                  rotate=_ROTATE_CODES[rotate], norm=_norm(block))
    if encode:
        return "hh_wq_encode_f32", -(-plane // _WQ_SPAN), 4 * (_WQ_SPAN + 2 * _TILE + 4 * 128 * _WARPS), \
            _static("HhWeightArgs", **fields)
    return "hh_wq_decode_f32", -(-n // _TILE), 4 * 2 * _TILE, _static("HhWeightArgs", **fields)


def weight_encode_launch(codec, blocks, payload, signs, nonfinite) -> Launch:
    name, grid, shared, template = _weight_static(True, blocks.shape[0], codec.block_size, codec.bits, codec.rotate)
    args = _fill(template, blocks.data_ptr(), 0, payload.data_ptr(), signs.data_ptr(), nonfinite.data_ptr(),
                 _aligned(blocks))
    return Launch(name, grid, _THREADS, shared, args, (blocks, payload, signs, nonfinite))


def weight_decode_launch(codec, payload, n_blocks: int, out, signs) -> Launch:
    name, grid, shared, template = _weight_static(False, n_blocks, codec.block_size, codec.bits, codec.rotate)
    args = _fill(template, 0, out.data_ptr(), payload.data_ptr(), signs.data_ptr(), 0, 0)
    return Launch(name, grid, _THREADS, shared, args, (payload, out, signs))
