r"""``allreduce``: averaging a float32 buffer four ways, timed phase by phase.

Methods (every one produces the mean over ranks of a float32 buffer of ``S`` bytes):

``fp32``
    One SUM allreduce of the buffer, the baseline. Its inputs are multiples of 1/128
    below 1 in magnitude, so every summation order is exact and the result is checked
    element by element against the exact sum: ``#wrong`` (nccl-tests).
``thc`` / ``thc:BITS``
    hhook's codec: ``prepare`` (rotate, block maxima), MAX allreduce of the float32
    scales, ``quantize`` (stochastic rounding, lane packing), SUM allreduce of the
    packed integer words, ``decode``. No rank ever decompresses a partial sum.
``thc:BITS:topology=T`` (T flat, auto or K ranks per node; torch.distributed backends)
    :func:`hhook.thc_allreduce` on a ``THCState(topology=T)``, keyed per size as DDP keys
    its buckets, timed as one call (its phases are not split, so codec and wire show
    ``-``): with several nodes, the two-level schedule of :mod:`hhook.schedule.two_level`. ``wire_bytes`` is what one rank hands
    to collectives between nodes, ``intra_wire_bytes`` what stays inside its node (the
    state's ``stats()``), per call.
``fp16``
    Cast to float16, SUM allreduce in float16, cast back and divide (Horovod's
    ``Compression.fp16``).
``zlib``
    ``zlib.compress`` the buffer, allgather the variable-length payloads, decompress
    all ``n`` and add: the non-homomorphic baseline, whose traffic grows with ``n``.

Each iteration is timed per phase on every rank: *encode* and *decode* (codec time)
and each collective (wire time). A barrier precedes every collective, so the wire
time of a collective does not include waiting for a slower rank's encoder; ``wall_us``
is the iteration's wall time including those barriers. The row's ``time_us`` is
encode + wire + decode, averaged over the timed iterations; avg/min/max are over ranks.

``algbw = S / time`` and ``busbw = algbw * 2 (n - 1) / n`` (nccl-tests' allreduce
definitions) always use the float32 payload ``S``, so a compressed method's busbw is
the float32 bus bandwidth it is *worth* and may exceed the link's; with one rank nothing
crosses a network and ``busbw`` is ``None``. ``wire_bytes`` is
what one rank hands to the collectives (payload and scales); ``ratio = S / wire_bytes``.
``vnmse = ||mean_hat - mean||^2 / mean_i ||x_i||^2`` against the exact mean, computed in
float64 on rank 0 from every rank's regenerated input.
"""

from __future__ import annotations

import statistics
import time
import zlib

import numpy as np
import torch

from ..codec import THCCodec
from ..codec import rng
from ..errors import ConfigMismatchError
from .methods import FP16, FP32, THC_BITS, ZLIB, Method, parse
from .units import iterations

#: The kinds of method this module measures (:mod:`hhook.profile.methods`): the THC codec
#: runs directly here (no THCState), so a thc entry takes BITS only.
KINDS = (FP32, THC_BITS, FP16, ZLIB)
DEFAULT_METHODS = "fp32,thc,fp16,zlib"


def parse_methods(text: str, bits: int) -> list[Method]:
    """``"fp32,thc,thc:8,fp16,zlib"`` -> methods (a bare ``thc`` at ``bits``); ValueError names the entry."""
    return parse(text, KINDS, bits=bits)


# -- inputs -------------------------------------------------------------------
def gradient_like(rank: int, numel: int, seed: int = 0) -> torch.Tensor:
    """Heavy-tailed synthetic gradient of one rank: ``0.01 * N(0,1) * exp(0.5 N(0,1))``."""
    g = torch.Generator().manual_seed(rng.mix32(seed * 7919 + rank) + 1)
    x = torch.randn(numel, generator=g)
    x.mul_(torch.randn(numel, generator=g).mul_(0.5).exp_()).mul_(0.01)
    return x


def exact_input(rank: int, numel: int) -> torch.Tensor:
    """Multiples of 1/128 in (-1, 1): sums of up to 2**16 ranks are exact in float32."""
    i = torch.arange(numel, dtype=torch.int64)
    return (((i * 7 + rank * 13 + 5) % 255) - 127).to(torch.float32).div_(128.0)


def exact_sum(world: int, numel: int) -> torch.Tensor:
    total = torch.zeros(numel, dtype=torch.float64)
    for r in range(world):
        total.add_(exact_input(r, numel))
    return total


class Reference:
    """Exact float64 mean and ``mean_i ||x_i||^2`` of every rank's input at one size."""

    def __init__(self, world: int, numel: int, seed: int, exact: bool):
        self.mean = torch.zeros(numel, dtype=torch.float64)
        self.norm2 = 0.0
        for r in range(world):
            x = (exact_input(r, numel) if exact else gradient_like(r, numel, seed)).double()
            self.mean.add_(x)
            self.norm2 += float(x.square().sum()) / world
        self.mean.div_(world)

    def vnmse(self, estimate: torch.Tensor) -> float:
        err = float((estimate.detach().cpu().double() - self.mean).square().sum())
        return err / self.norm2 if self.norm2 > 0 else err


# -- one method ----------------------------------------------------------------
class _Timer:
    def __init__(self, comm):
        self.comm = comm
        self.phases: dict[str, float] = {}
        self.t = time.perf_counter()

    def lap(self, phase: str) -> None:
        self.comm.sync()
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self.t
        self.t = now

    def collective(self, phase: str, fn, barrier: bool):
        """Time ``fn()`` as ``phase``; with ``barrier``, wait for every rank first, untimed."""
        if barrier:
            self.lap("idle")
            self.comm.barrier()
            self.t = time.perf_counter()
        result = fn()
        self.lap(phase)
        return result


def _check_codec(comm, codec: THCCodec, device) -> None:
    """Every rank of this MPI transport built the same codec (a MAX of ``[f, -f]`` of its
    fingerprint): ``block_size`` changes the length of the scale vector the ranks reduce
    together, which the per-call header alone cannot catch. (The package's own exchanges
    run :mod:`hhook.schedule.handshake`, over torch.distributed.)"""
    f = float(codec.fingerprint())
    vector = torch.tensor([f, -f], dtype=torch.float32, device=device)
    comm.allreduce(vector, "max")
    if vector[0].item() != -vector[1].item():
        raise ConfigMismatchError(f"hhook-profile: ranks use different codec configurations; this rank has "
                                  f"{codec.describe()}. Every rank must run with the same options.")


class Runner:
    """Buffers and one timed iteration of a method at one size."""

    def __init__(self, comm, method: Method, numel: int, seed: int, block_size: int, zlib_level: int, barrier: bool,
                 states: dict):
        """``states``: the sweep's THCStates of ``topology=`` methods, by name (made once)."""
        self.comm, self.method, self.numel = comm, method, numel
        self.barrier = barrier
        self.seed = seed
        self.zlib_level = zlib_level
        dev = comm.device
        x = exact_input(comm.rank, numel) if method.exact else gradient_like(comm.rank, numel, seed)
        self.x = x.to(dev)
        self.out = torch.empty(numel, dtype=torch.float32, device=dev)
        self.wire_bytes = 4 * numel
        self.codec = None
        self.state = None
        self.intra_bytes = None
        self.calls = 0
        if method.kind == "thc" and method.topology is not None:
            from ..state import THCState

            if method.name not in states:  # one per method for the whole sweep: its sub-groups are made once
                states[method.name] = THCState(bits=method.bits, block_size=block_size, seed=seed,
                                               topology=method.topology, rounding=method.rounding or "correlated")
                states[method.name].node_layout()  # one all-gather, the same on every rank
            self.state = states[method.name]
        elif method.kind == "thc":
            self.codec = THCCodec(method.bits, block_size, seed, comm.size, method.rounding or "correlated")
            _check_codec(comm, self.codec, dev)
            self.wire_bytes = self.codec.wire_bytes(numel)
        elif method.kind == "fp16":
            self.wire_bytes = 2 * numel

    def step(self) -> dict[str, float]:
        """One iteration; returns seconds per phase (encode, decode, wire phases)."""
        kind, comm = self.method.kind, self.comm
        if kind == "fp32":
            self.out.copy_(self.x)
            comm.sync()
        timer = _Timer(comm)
        if kind == "fp32":
            timer.collective("allreduce", lambda: comm.allreduce(self.out, "sum"), self.barrier)
        elif kind == "fp16":
            half = self.x.to(torch.float16)
            timer.lap("encode")
            timer.collective("allreduce", lambda: comm.allreduce(half, "sum"), self.barrier)
            torch.div(half.to(torch.float32), comm.size, out=self.out)
            timer.lap("decode")
        elif self.state is not None:
            from ..schedule.allreduce import thc_allreduce

            self.out.copy_(self.x)
            comm.sync()
            timer = _Timer(comm)
            before = self.state.stats()
            # Keyed per size, as DDP keys its buckets: two-level CPU calls then reuse their
            # node-shared memory (key=None maps fresh memory every call; docs/topology.md).
            call = lambda: thc_allreduce(self.out, self.state, key=("allreduce", self.numel))  # noqa: E731
            timer.collective("call", call, self.barrier)
            after = self.state.stats()
            self.wire_bytes = after["wire_bytes"] - before["wire_bytes"]
            self.intra_bytes = after.get("intra_wire_bytes", 0) - before.get("intra_wire_bytes", 0)
        elif kind == "thc":
            codec = self.codec
            prepared = codec.prepare(self.x)
            timer.lap("encode")
            agreed = timer.collective("scales", lambda: comm.allreduce(prepared.scales, "max"), self.barrier)
            key = codec.stream(comm.rank, self.calls)
            self.calls += 1
            words = codec.quantize(prepared, agreed, key)
            timer.lap("encode")
            timer.collective("words", lambda: comm.allreduce(words, "sum"), self.barrier)
            codec.decode(prepared, agreed, words, self.out)
            timer.lap("decode")
        elif kind == "zlib":
            host = self.x.cpu().numpy()
            packed = zlib.compress(memoryview(host).cast("B"), self.zlib_level)
            timer.lap("encode")
            parts, handed = timer.collective("allgather", lambda: comm.allgather_bytes(packed), self.barrier)
            self.wire_bytes = handed
            acc = np.zeros(self.numel, dtype=np.float32)
            for part in parts:
                acc += np.frombuffer(zlib.decompress(part), dtype=np.float32)
            acc /= comm.size
            self.out.copy_(torch.from_numpy(acc))
            timer.lap("decode")
        phases = timer.phases
        # Time between the last lap and the barrier is nothing but the lap itself: drop it.
        phases.pop("idle", None)
        return phases


WIRE_PHASES = ("allreduce", "scales", "words", "allgather")


def measure(comm, methods, sizes, *, iters, warmup, fixed, seed=0, block_size=1024, zlib_level=1,
            barrier=True, check=True, progress=None, on_rows=None) -> list[dict]:
    """Rows (complete on rank 0) for every size and method, in that order.

    ``on_rows(rows)`` is called with each size's rows as soon as they are measured.
    """
    rows = []
    n = comm.size
    states: dict = {}  # thc:...:topology= methods' THCStates, by name
    for size in sizes:
        numel = size // 4
        n_iter, n_warm = iterations(size, iters, warmup, fixed)
        refs: dict[bool, Reference] = {}
        size_rows = []
        for method in methods:
            runner = Runner(comm, method, numel, seed, block_size, zlib_level, barrier, states)
            sums: dict[str, float] = {}
            totals, walls, wires = [], [], []
            for it in range(n_warm + n_iter):
                comm.barrier()
                t0 = time.perf_counter()
                phases = runner.step()
                wall = time.perf_counter() - t0
                if it >= n_warm:
                    totals.append(sum(phases.values()))
                    walls.append(wall)
                    wires.append(sum(phases.get(p, 0.0) for p in WIRE_PHASES))
                    for k, v in phases.items():
                        sums[k] = sums.get(k, 0.0) + v
                if progress is not None:
                    progress.advance(size + 4096, f"{method.name} {size} B")
            mean = {k: v / n_iter for k, v in sums.items()}
            wrong = None
            if method.exact and check:
                wrong = int((runner.out.cpu().double() != exact_sum(n, numel)).sum())
            mine = {
                "rank": comm.rank,
                "time_us": sum(totals) / n_iter * 1e6,
                "best_us": min(totals) * 1e6,
                "median_us": statistics.median(totals) * 1e6,
                "wire_median_us": statistics.median(wires) * 1e6,
                "wire_best_us": min(wires) * 1e6,
                "wall_us": sum(walls) / n_iter * 1e6,
                "encode_us": mean.get("encode", 0.0) * 1e6,
                "decode_us": mean.get("decode", 0.0) * 1e6,
                "wire_us": sum(mean.get(p, 0.0) for p in WIRE_PHASES) * 1e6,
                "phases_us": {k: v * 1e6 for k, v in mean.items()},
                "wire_bytes": runner.wire_bytes,
                "intra_wire_bytes": runner.intra_bytes,
                "wrong": wrong,
            }
            ranks = comm.allgather_object(mine)
            vnmse = None
            if check and comm.rank == 0:
                if method.exact not in refs:
                    refs[method.exact] = Reference(n, numel, seed, method.exact)
                # The fp32 path leaves the sum (checked exactly above); its mean is sum / n.
                mean = runner.out.div(n) if method.exact else runner.out
                vnmse = refs[method.exact].vnmse(mean)
            size_rows.append(_row(method, size, n, n_iter, n_warm, ranks, vnmse, block_size, zlib_level))
            del runner
        _speedups(size_rows)
        rows.extend(size_rows)
        if on_rows is not None:
            on_rows(size_rows)
    return rows


def _avg(values):
    return sum(values) / len(values)


def _row(method, size, n, n_iter, n_warm, ranks, vnmse, block_size, zlib_level) -> dict:
    times = [r["time_us"] for r in ranks]
    t = _avg(times)
    wire_bytes = _avg([r["wire_bytes"] for r in ranks])
    algbw = size / (t * 1e-6) / 1e9 if t > 0 else float("inf")
    encode, decode = _avg([r["encode_us"] for r in ranks]), _avg([r["decode_us"] for r in ranks])
    phases = {k: _avg([r["phases_us"].get(k, 0.0) for r in ranks]) for k in ranks[0]["phases_us"]}
    row = {
        "op": "allreduce",
        "method": method.name,
        "kind": method.kind,
        "bytes": size,
        "numel": size // 4,
        "world_size": n,
        "iters": n_iter,
        "warmup": n_warm,
        "time_us": t,
        "time_us_min": min(times),
        "time_us_max": max(times),
        "best_us": min(r["best_us"] for r in ranks),
        # Robust companions of the averages (shared or noisy machines): median over ranks of
        # each rank's median over iterations.
        "median_us": statistics.median(r["median_us"] for r in ranks),
        "wire_median_us": statistics.median(r["wire_median_us"] for r in ranks),
        "wire_best_us": min(r["wire_best_us"] for r in ranks),
        "wall_us": _avg([r["wall_us"] for r in ranks]),
        "algbw_GBps": algbw,
        "busbw_GBps": algbw * 2 * (n - 1) / n if n > 1 else None,  # one rank: no bus, no busbw
        "wire_bytes": wire_bytes,
        "ratio": size / wire_bytes if wire_bytes else None,
        "codec_us": encode + decode,
        "encode_us": encode,
        "decode_us": decode,
        "wire_us": _avg([r["wire_us"] for r in ranks]),
        "phases_us": phases,
        "vnmse": vnmse,
        "wrong": sum(r["wrong"] for r in ranks) if method.exact and ranks[0]["wrong"] is not None else None,
        "ranks": ranks,
    }
    if method.topology is not None:  # thc_allreduce as a whole: no codec/wire split
        row.update(codec_us=None, encode_us=None, decode_us=None, wire_us=None, topology=method.topology,
                   intra_wire_bytes=_avg([r["intra_wire_bytes"] for r in ranks]))
    if method.kind == "thc":
        row.update(bits=method.bits, block_size=block_size)
    if method.kind == "zlib":
        row.update(zlib_level=zlib_level)
    return row


def _speedups(rows) -> None:
    """``speedup_wire`` and ``speedup_total``: fp32's time over this method's wire and total time."""
    base = next((r for r in rows if r["kind"] == "fp32"), None)
    for r in rows:
        if base is None:
            r["speedup_wire"] = r["speedup_total"] = r["speedup_wire_median"] = r["speedup_total_median"] = None
            continue
        split = r["wire_us"] is not None
        r["speedup_wire"] = base["time_us"] / r["wire_us"] if split and r["wire_us"] > 0 else None
        r["speedup_total"] = base["time_us"] / r["time_us"] if r["time_us"] > 0 else None
        r["speedup_wire_median"] = base["median_us"] / r["wire_median_us"] if split and r["wire_median_us"] > 0 else None
        r["speedup_total_median"] = base["median_us"] / r["median_us"] if r["median_us"] > 0 else None
