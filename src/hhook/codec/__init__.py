r"""The codec: homomorphic compression that a stock SUM allreduce can add, and no
communication.

:class:`THCCodec` (:mod:`hhook.codec.codec`) is the pure-torch specification, built from
the counter-based random numbers (:mod:`~hhook.codec.rng`), the randomized Hadamard
rotation (:mod:`~hhook.codec.rotation`), unbiased stochastic rounding
(:mod:`~hhook.codec.quantization`) and lanes with headroom (:mod:`~hhook.codec.lanes`),
on one data layout (:mod:`~hhook.codec.layout`). It hands tensors to the fused kernels of
:mod:`hhook.codec.kernels` where they run, which read the layout, never the codec.
:mod:`~hhook.codec.error_model` says how many bits a world needs.
"""

from ..errors import ConfigMismatchError
from .codec import CODEC_VERSION, ROUNDINGS, THCCodec, fused_backend, warm_up
from .layout import HEADER, SUPPORTED_DTYPES, Prepared, agreed_status

__all__ = ["CODEC_VERSION", "ConfigMismatchError", "HEADER", "Prepared", "ROUNDINGS", "SUPPORTED_DTYPES", "THCCodec",
           "agreed_status", "fused_backend", "warm_up"]
