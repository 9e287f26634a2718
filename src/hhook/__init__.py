r"""hhook: homomorphic gradient compression for data-parallel PyTorch.

Gradients are rotated, quantized onto levels every rank agrees on, and packed into
integer lanes with headroom, so a stock SUM allreduce adds the compressed buffers
directly. One line turns it on::

    state = hhook.register(ddp_model)   # bits="auto": measures, keeps THC or a dense exchange

(``hhook.register(ddp_model, bits=4)`` always compresses at 4 bits; Horovod:
:mod:`hhook.horovod`; FSDP2: :mod:`hhook.fsdp`; every option: docs/usage.md.)
"""

from .schedule.allreduce import thc_allreduce, thc_allreduce_async
from .codec import CODEC_VERSION, THCCodec
from .ddp_hook import register, thc_hook
from .launch import detect_env, init_distributed
from .errors import ConfigMismatchError, OpMismatchError, PeerLostError, PeerTimeoutError, RankFailedError
from .state import THCState

__version__ = "0.1.0"

__all__ = [
    "CODEC_VERSION",
    "ConfigMismatchError",
    "OpMismatchError",
    "PeerLostError",
    "PeerTimeoutError",
    "RankFailedError",
    "THCCodec",
    "THCState",
    "detect_env",
    "init_distributed",
    "register",
    "thc_allreduce",
    "thc_allreduce_async",
    "thc_hook",
]
