r"""hhook-profile: what homomorphic compression saves on your network.

An MPI-launched bandwidth profiler in the style of nccl-tests and the OSU
micro-benchmarks, with five subcommands (one module each in
:mod:`hhook.profile.commands`; what they share is :mod:`hhook.profile.common`):

``link``
    Ping-pong between ring neighbours over a size sweep; latency and bandwidth per size
    and a fitted ``t(S) = alpha + S / beta``.
``allreduce``
    Average a float32 buffer with a plain fp32 allreduce (checked exactly), hhook's THC
    codec (MAX allreduce of the scales, SUM allreduce of the packed words), fp16, and
    zlib + allgather (the non-homomorphic baseline); time split into codec and wire,
    nccl-tests' algbw/busbw, wire bytes, compression ratio and error.
``model``
    Predicted time per update and speedup against the number of workers, with the
    alpha-beta ring model and the homomorphic-compression paper's
    ``T = h C / M + rho M W / chi``, for measured (or given) link and ratios.
``codec``
    Encode/decode throughput of the codec alone, fused beside reference and copy
    (:mod:`hhook.profile.codec_bench`).
``train``
    Real DDP training with each method, one after another in child processes: step time,
    time to accuracy, bytes per rank and step (:mod:`hhook.profile.train`).

``allreduce`` and ``train`` read their ``--methods`` with one grammar
(:mod:`hhook.profile.methods`).

Run it with ``mpirun -np N python -m hhook.profile SUBCOMMAND ...`` (or the
``hhook-profile`` console script). ``--backend gloo|nccl`` takes the same measurements
through torch.distributed. mpi4py is imported only when a subcommand needs it.
"""

from .cli import main

__all__ = ["main"]
