r"""``model``: time per update and speedup against the number of workers ``M``.

Two models predict the time of one data-parallel update of a model of ``W`` bytes
(float32 gradients) whose global batch takes ``C`` seconds to compute on one worker:

**Ring (alpha-beta).** Each of ``M`` workers computes ``C / M``, then the gradients
are averaged by a ring allreduce of ``W / ratio`` bytes, plus the codec's own time::

    T(M) = C / M + 2 (M - 1) alpha + 2 (M - 1) / M * (W / ratio) / beta + codec(M)

An allgather-based compressor (zlib here) instead pays ``(M - 1) (alpha + (W / ratio)
/ beta)`` and decompresses ``M`` payloads, so its codec time grows with ``M``. ``alpha``
and ``beta`` come from ``link``'s fit (or are given).

**The homomorphic-compression paper's model** (parameter-server form, no latency)::

    T(M) = h C / M + rho M W / chi

with ``rho = 1 / ratio`` the compressed fraction, ``chi`` the link rate (``beta``) and
``h`` the overhead factor of computing on compressed data (1 unless given).

The two disagree widely (the paper's communication grows with ``M``, the ring's does
not) because they describe different systems: the ring model an allreduce over one link
per worker, which is how hhook runs (DDP, Horovod, MPI, NCCL); the paper model a parameter
server whose one link carries every worker's gradients. Read the ring model for hhook.

Speedup is ``C / T(M)``: against one worker that neither communicates nor compresses.
For THC the ratio at ``M`` follows the lane width, which grows with ``M``
(``ceil(log2(M (L - 1) + 1))`` bits per lane): it is recomputed from the codec's
layout for each ``M``, starting from the measured bits and block size.
"""

from __future__ import annotations

import dataclasses
import math

from ..codec import THCCodec


def ring_allreduce_s(n: int, nbytes: float, alpha: float, beta: float) -> float:
    """Ring allreduce: ``2 (n - 1) alpha + 2 (n - 1) / n * nbytes / beta`` (0 for n = 1)."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / beta


def allgather_s(n: int, nbytes: float, alpha: float, beta: float) -> float:
    """Ring allgather of ``nbytes`` per rank: ``(n - 1) (alpha + nbytes / beta)``."""
    if n <= 1:
        return 0.0
    return (n - 1) * (alpha + nbytes / beta)


def paper_update_s(M: int, C: float, W: float, chi: float, rho: float = 1.0, h: float = 1.0) -> float:
    """``T = h C / M + rho M W / chi``."""
    return h * C / M + rho * M * W / chi


@dataclasses.dataclass(frozen=True)
class ModelMethod:
    """What the models need to know about one way of averaging gradients."""

    name: str
    ratio: float  # original / compressed bytes, as measured (or given)
    encode_s: float = 0.0  # codec time at the model size W
    decode_s: float = 0.0  # at the model size W and ``n_ref`` ranks
    n_ref: int = 1  # ranks at which decode_s was measured
    collective: str = "allreduce"  # or "allgather"
    bits: int | None = None  # THC: ratio follows the lane layout at each M
    block_size: int = 1024
    h: float = 1.0

    def ratio_at(self, M: int, W: float, fixed: bool = False) -> float:
        if self.bits is None or fixed:
            return self.ratio
        numel = max(1, int(W) // 4)
        return 4 * numel / THCCodec(self.bits, self.block_size, 0, M).wire_bytes(numel)

    def codec_s(self, M: int) -> float:
        if self.collective == "allgather":
            return self.encode_s + self.decode_s * M / self.n_ref
        return self.encode_s + self.decode_s


def ring_update_s(M: int, C: float, W: float, alpha: float, beta: float, method: ModelMethod,
                  fixed_ratio: bool = False) -> tuple[float, float, float]:
    """``(T, communication, codec)`` seconds of one update under the ring model."""
    wire = W / method.ratio_at(M, W, fixed_ratio)
    comm = allgather_s(M, wire, alpha, beta) if method.collective == "allgather" else ring_allreduce_s(M, wire, alpha, beta)
    codec = method.codec_s(M) if M > 1 else 0.0  # one worker averages nothing
    return C / M + comm + codec, comm, codec


def predict(methods, workers, C: float, W: float, alpha: float, beta: float, fixed_ratio: bool = False) -> list[dict]:
    """One row per model, method and ``M``: time, speedup and speedup over fp32."""
    rows = []
    base = {}
    for M in workers:
        for m in methods:
            ratio = m.ratio_at(M, W, fixed_ratio)
            t_ring, comm, codec = ring_update_s(M, C, W, alpha, beta, m, fixed_ratio)
            t_paper = paper_update_s(M, C, W, beta, 1.0 / ratio, m.h)
            for model, t, extra in (
                ("ring", t_ring, {"comm_us": comm * 1e6, "codec_us": codec * 1e6}),
                ("paper", t_paper, {"comm_us": M * W / ratio / beta * 1e6, "codec_us": (m.h - 1) * C / M * 1e6}),
            ):
                if m.name == "fp32":
                    base[(model, M)] = t
                algbw = W / t / 1e9
                rows.append(
                    {
                        "op": "model",
                        "model": model,
                        "method": m.name,
                        "workers": M,
                        "bytes": W,
                        "compute_us": C * 1e6,
                        "time_us": t * 1e6,
                        "speedup": C / t,
                        "algbw_GBps": algbw,
                        "busbw_GBps": algbw * 2 * (M - 1) / M,
                        "wire_bytes": W / ratio,
                        "ratio": ratio,
                        "vnmse": None,
                        "h": m.h,
                        **extra,
                    }
                )
    for r in rows:
        b = base.get((r["model"], r["workers"]))
        r["speedup_vs_fp32"] = b / r["time_us"] * 1e6 if b else None
    return rows


def methods_from_allreduce(doc: dict, W: float) -> list[ModelMethod]:
    """Model methods from an ``allreduce --json`` document: for each method the row whose
    size is nearest ``W`` (log scale), with its codec time scaled linearly to ``W``."""
    rows = [r for r in doc.get("results", []) if r.get("op") == "allreduce"]
    if not rows:
        raise ValueError("the allreduce JSON holds no allreduce results")
    n_ref = int(doc.get("meta", {}).get("world_size") or rows[0].get("world_size") or 1)
    by_method: dict[str, dict] = {}
    for r in rows:
        best = by_method.get(r["method"])
        if best is None or abs(math.log(r["bytes"] / W)) < abs(math.log(best["bytes"] / W)):
            by_method[r["method"]] = r
    out = []
    for name, r in by_method.items():
        scale = W / r["bytes"]
        kind = r.get("kind", name.split(":")[0])
        out.append(
            ModelMethod(
                name=name,
                ratio=float(r["ratio"]),
                encode_s=r.get("encode_us", 0.0) * 1e-6 * scale,
                decode_s=r.get("decode_us", 0.0) * 1e-6 * scale,
                n_ref=n_ref,
                collective="allgather" if kind == "zlib" else "allreduce",
                bits=r.get("bits") if kind == "thc" else None,
                block_size=r.get("block_size", 1024),
            )
        )
    return out


def fit_from_link(doc: dict) -> tuple[float, float]:
    """``(alpha_s, beta_Bps)`` from a ``link --json`` document: refitted from its ping-pong
    rows when it has them (so the current fit applies), else its recorded fit."""
    from .link import fit_rows

    rows = [r for r in doc.get("results", []) if r.get("op") == "pingpong"]
    if len({r["bytes"] for r in rows}) >= 2:
        fit = fit_rows(rows)
        if math.isfinite(fit.beta_Bps):
            return fit.alpha_s, fit.beta_Bps
    fit = doc.get("meta", {}).get("fit")
    if not fit or fit.get("beta_GBps") is None:
        raise ValueError("the link JSON holds no usable alpha-beta fit")
    return fit["alpha_us"] * 1e-6, fit["beta_GBps"] * 1e9
