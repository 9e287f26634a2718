r"""The codec's data layout, shared by the torch reference and the fused backends.

Only formats live here (the scale vector's header, what stage 1 hands to stages 3 and 5,
the lanes of the summed words, the dtypes the codec takes), so :mod:`hhook.codec` can dispatch to the backends and the
backends can read these formats without importing the codec: each layer looks down.
"""

from __future__ import annotations

import dataclasses

import torch

#: The scale vector's header: ``[non-finite flag, f, -f, d_lo, -d_lo, d_hi, -d_hi]``.
#: ``f`` is the configuration fingerprint, ``d_lo``/``d_hi`` the two 24-bit halves of a
#: 48-bit digest of the tensor's bits. After the MAX allreduce, ``max(v) == -max(-v)``
#: holds exactly when every rank sent the same ``v``.
HEADER = 7
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def constant(values, dtype: torch.dtype, device=None) -> torch.Tensor:
    """A small tensor of Python ``values`` on ``device`` without a host synchronisation.

    ``torch.tensor(values, device="cuda")`` copies from pageable memory and waits for the
    copy: a host sync in the middle of the hook's path. Here the values go through pinned
    memory and the copy is queued on the current stream like any kernel."""
    host = torch.tensor(values, dtype=dtype)
    device = torch.device(device) if device is not None else host.device
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclasses.dataclass
class Prepared:
    """What stage 1 leaves for stages 3 and 5 of one tensor.

    ``source`` is the input flattened (a view when it was contiguous): quantize and
    decode read it again, so it must not change until :meth:`THCCodec.decode` returns.
    ``blocks`` holds the rotated blocks where a backend keeps them (the reference and the
    CPU kernels do; the CUDA kernels recompute the rotation in quantize instead, which
    moves fewer bytes through GPU memory).
    """

    numel: int
    source: torch.Tensor
    scales: torch.Tensor  # header + local block maxima; the transport MAX-reduces it
    blocks: torch.Tensor | None = None
    backend: object = None  # the fused module that prepared it; None: this reference


@dataclasses.dataclass(frozen=True)
class LaneLayout:
    """How codes sit in the summed words: ``lanes`` lanes of ``width`` bits per
    ``word_dtype`` word (:mod:`hhook.codec.lanes` packs them, and chooses the layout for a
    world size and level count)."""

    width: int  # bits per lane, w
    lanes: int  # lanes per word, k
    word_dtype: torch.dtype  # torch.int32 or torch.int64

    @property
    def word_bits(self) -> int:
        return 32 if self.word_dtype == torch.int32 else 64

    @property
    def mask(self) -> int:
        return (1 << self.width) - 1

    @property
    def bits_per_code(self) -> float:
        return self.word_bits / self.lanes

    def n_words(self, count: int) -> int:
        return -(-count // self.lanes)


def agreed_status(agreed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(nonfinite, mismatch, identical)`` of a MAX-reduced header, as 0-d bool tensors.

    Tensor operations only: no host synchronisation. ``identical``: every rank sent a
    tensor with the same bits, whose mean is that tensor itself.
    """
    h = agreed[:HEADER]
    nonfinite = h[0] > 0
    mismatch = h[1] != -h[2]
    identical = (h[3] == -h[4]) & (h[5] == -h[6])
    return nonfinite, mismatch, identical
