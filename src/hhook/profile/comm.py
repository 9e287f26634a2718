r"""The communicators the profiler measures through.

:class:`MPIComm` drives mpi4py directly on CPU tensors (zero-copy numpy views);
:class:`TorchComm` drives torch.distributed (Gloo on CPU, NCCL on the local GPU),
initialised by :func:`hhook.init_distributed` from the launcher's variables. Both expose
the same few operations, so every measurement is written once:

* ``allreduce(t, "sum" | "max")`` in place (float32, float16, int32, int64);
* ``allgather_bytes(data) -> list[bytes]`` for variable-length payloads;
* ``send``/``recv`` of a uint8 tensor for ping-pong;
* ``barrier``, ``sync`` (waits for the device), object gathers and broadcasts.

Packed integer words are reduced as *unsigned* integers under MPI: their sum wraps
modulo ``2**W`` by definition, which is exactly the lane arithmetic hhook relies on.
"""

from __future__ import annotations

import os
import socket
import sys
import warnings

import numpy as np
import torch



class Comm:
    """Interface (and shared helpers) of the profiler's communicators."""

    backend: str
    rank: int
    size: int
    device: torch.device

    def allreduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        raise NotImplementedError

    def allgather_bytes(self, data) -> tuple[list[bytes], int]:
        """Every rank's ``data``, in rank order, and the bytes this rank handed over."""
        raise NotImplementedError

    def send(self, t: torch.Tensor, peer: int) -> None:
        raise NotImplementedError

    def recv(self, t: torch.Tensor, peer: int) -> None:
        raise NotImplementedError

    def barrier(self) -> None:
        raise NotImplementedError

    def allgather_object(self, obj) -> list:
        raise NotImplementedError

    def bcast_object(self, obj, root: int = 0):
        raise NotImplementedError

    def library(self) -> dict:
        raise NotImplementedError

    def abort(self, code: int = 1) -> None:
        os._exit(code)

    def finalize(self) -> None:
        pass

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def host_info(self) -> dict:
        return {
            "rank": self.rank,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "device": str(self.device),
            "torch_threads": torch.get_num_threads(),
        }


class MPIComm(Comm):
    backend = "mpi"

    def __init__(self):
        from .deps import require

        MPI = require("mpi4py.MPI", "MPI runs")  # initialises MPI: only after the arguments were checked

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.device = torch.device("cpu")
        self._types = {
            torch.float32: (np.float32, MPI.FLOAT),
            torch.float64: (np.float64, MPI.DOUBLE),
            torch.int32: (np.uint32, MPI.UINT32_T),
            torch.int64: (np.uint64, MPI.UINT64_T),
            torch.uint8: (np.uint8, MPI.UINT8_T),
            torch.float16: (np.uint16, MPI.UINT16_T),
        }
        self._ops = {"sum": MPI.SUM, "max": MPI.MAX}
        # MPI has no half-precision type: a commutative user op adds uint16 bit patterns as float16.
        self._half_sum = MPI.Op.Create(_half_sum, commute=True)

    def _buffer(self, t: torch.Tensor):
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("the mpi backend reduces contiguous CPU tensors")
        np_dtype, mpi_type = self._types[t.dtype]
        array = t.numpy()
        if array.dtype != np_dtype:
            array = array.view(np_dtype)
        return [array, mpi_type]

    def allreduce(self, t, op="sum"):
        if t.dtype == torch.float16:
            if op != "sum":
                raise ValueError("float16 allreduce supports only sum")
            mpi_op = self._half_sum
        else:
            mpi_op = self._ops[op]
        self.comm.Allreduce(self.MPI.IN_PLACE, self._buffer(t), op=mpi_op)
        return t

    def allgather_bytes(self, data):
        MPI = self.MPI
        counts = self.comm.allgather(len(data))
        displs = np.concatenate(([0], np.cumsum(counts[:-1]))).astype(np.int64).tolist()
        out = bytearray(sum(counts))
        self.comm.Allgatherv([data, MPI.BYTE], [out, counts, displs, MPI.BYTE])
        view = memoryview(out)
        return [view[d : d + c] for d, c in zip(displs, counts)], len(data)

    def send(self, t, peer):
        self.comm.Send(self._buffer(t), dest=peer, tag=17)

    def recv(self, t, peer):
        self.comm.Recv(self._buffer(t), source=peer, tag=17)

    def barrier(self):
        self.comm.Barrier()

    def allgather_object(self, obj):
        return self.comm.allgather(obj)

    def bcast_object(self, obj, root=0):
        return self.comm.bcast(obj, root=root)

    def host_info(self):
        info = super().host_info()
        info["host"] = self.MPI.Get_processor_name()
        return info

    def library(self):
        import mpi4py

        MPI = self.MPI
        major, minor = MPI.Get_version()
        return {
            "name": MPI.Get_library_version().strip().splitlines()[0].split(",")[0].strip(),
            "library_version": MPI.Get_library_version().strip().splitlines()[0],
            "mpi_standard": f"{major}.{minor}",
            "mpi4py": mpi4py.__version__,
        }

    def abort(self, code=1):
        sys.stdout.flush()
        sys.stderr.flush()
        self.comm.Abort(code)

    def finalize(self):
        self._half_sum.Free()


def _half_sum(inbuf, inoutbuf, datatype):
    # torch adds float16 several times faster than numpy (vectorised through float32).
    acc = torch.from_numpy(np.frombuffer(inoutbuf, dtype=np.float16))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the input buffer is read-only; it is only read
        acc.add_(torch.from_numpy(np.frombuffer(inbuf, dtype=np.float16)))


class TorchComm(Comm):
    def __init__(self, backend: str, timeout_s: float = 300.0):
        import torch.distributed as dist

        from ..launch import init_distributed

        self.dist = dist
        self.backend = backend
        self.env = init_distributed(backend=backend, timeout_s=timeout_s)
        self.rank = dist.get_rank()
        self.size = dist.get_world_size()
        if backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self._ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}
        self._token = torch.zeros(1, device=self.device)

    def allreduce(self, t, op="sum"):
        self.dist.all_reduce(t, op=self._ops[op])
        return t

    def allgather_bytes(self, data):
        # Collectives need equal lengths: send the sizes, then payloads padded to the longest.
        dist = self.dist
        sizes = torch.tensor([len(data)], dtype=torch.int64, device=self.device)
        gathered = [torch.empty_like(sizes) for _ in range(self.size)]
        dist.all_gather(gathered, sizes)
        counts = [int(s.item()) for s in gathered]
        longest = max(counts)
        mine = torch.zeros(longest, dtype=torch.uint8)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        mine = mine.to(self.device)
        parts = [torch.empty(longest, dtype=torch.uint8, device=self.device) for _ in range(self.size)]
        dist.all_gather(parts, mine)
        return [p[:c].cpu().numpy().tobytes() for p, c in zip(parts, counts)], longest

    def send(self, t, peer):
        self.dist.send(t, dst=peer)

    def recv(self, t, peer):
        self.dist.recv(t, src=peer)

    def barrier(self):
        # An allreduce of one element is a barrier every backend runs on its own device.
        self.dist.all_reduce(self._token)
        self.sync()

    def allgather_object(self, obj):
        out = [None] * self.size
        self.dist.all_gather_object(out, obj)
        return out

    def bcast_object(self, obj, root=0):
        box = [obj]
        self.dist.broadcast_object_list(box, src=root)
        return box[0]

    def library(self):
        info = {"name": f"torch.distributed {self.backend}", "torch": torch.__version__}
        if self.backend == "nccl":
            version = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
            info["library_version"] = f"NCCL {info['nccl']}"
        else:
            info["library_version"] = f"Gloo (torch {torch.__version__})"
        info["launcher"] = self.env.launcher
        info["master"] = f"{self.env.master_addr}:{self.env.master_port}"
        return info

    def finalize(self):
        if self.dist.is_initialized():
            self.dist.barrier()  # destroying the group under a peer still talking aborts Gloo at random
            self.dist.destroy_process_group()


def connect(backend: str, timeout_s: float = 300.0) -> Comm:
    """A communicator for ``backend`` (arguments must have been validated already)."""
    if backend == "mpi":
        return MPIComm()
    if backend in ("gloo", "nccl"):
        return TorchComm(backend, timeout_s)
    raise ValueError(f"unknown backend {backend!r}")
