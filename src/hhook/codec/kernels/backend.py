r"""What the fused backends (:mod:`hhook.codec.kernels.cpu`, :mod:`hhook.codec.kernels.cuda`) share.

The switch that forces the torch reference, where their sources live, and the check of
the tensors whose raw pointers they hand to compiled code. Like the backends, it reads
no codec: :class:`hhook.codec.THCCodec` dispatches to them.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

#: ``HHOOK_FORCE_REFERENCE=1``: every tensor takes the torch reference.
FORCE_REFERENCE_ENV = "HHOOK_FORCE_REFERENCE"


def forced_off() -> bool:
    """Whether the reference is forced; read at every call, so tests and benchmarks can
    switch it within one process."""
    return os.environ.get(FORCE_REFERENCE_ENV, "") == "1"


def source_path(name: str) -> Path:
    """``csrc/<name>`` beside the backends (installed as package data)."""
    path = Path(__file__).resolve().parent / "csrc" / name
    if not path.is_file():
        raise FileNotFoundError(f"hhook: {name} is missing from {path.parent}")
    return path


def check(tensor: torch.Tensor, numel: int, what: str, dtype=None, device_type=None, contiguous=False) -> None:
    """Compiled code indexes raw pointers: a wrong length, dtype, device or layout would
    read or write out of bounds, so it is an error, never a silent copy."""
    if (
        tensor.numel() != numel
        or (dtype is not None and tensor.dtype != dtype)
        or (device_type is not None and tensor.device.type != device_type)
        or (contiguous and not tensor.is_contiguous())
    ):
        wanted = " ".join(w for w in ("contiguous" if contiguous else "", (device_type or "").upper(),
                                      "" if dtype is None else str(dtype), "tensor") if w)
        raise ValueError(
            f"hhook: {what} must be a {wanted} of {numel} elements, got {tuple(tensor.shape)} "
            f"{tensor.dtype} on {tensor.device}" + ("" if tensor.is_contiguous() else " (not contiguous)")
        )
