r"""What the fused backends (:mod:`hhook.cpu_kernels`, :mod:`hhook.cuda_kernels`) share.

The switch that forces the torch reference, where their sources live, and the check of
the tensors whose raw pointers they hand to compiled code. Like the backends, it reads
no codec: :mod:`hhook.codec` dispatches to them.
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
    """``hhook/csrc/<name>``: installed package data, or in a checkout the symlink to
    ``csrc/``, else ``csrc/`` beside the package."""
    here = Path(__file__).resolve().parent
    for folder in (Path(__file__).parent / "csrc", here.parent / "csrc"):
        if (folder / name).is_file():
            return folder / name
    raise FileNotFoundError(f"hhook: {name} is missing from {here / 'csrc'} and {here.parent / 'csrc'}")


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
