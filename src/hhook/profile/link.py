r"""``link``: ping-pong between ring neighbours and the alpha-beta fit.

Rank ``i`` and rank ``i + 1 (mod n)`` bounce a message of ``S`` bytes back and forth; half
the round trip is the one-way time ``t(S)``. Pairs that share no rank run at the same
time (two or three rounds cover the ring), as the neighbours of a ring allreduce do.
Warm-up round trips are not timed (OSU). Per size the table gives ``t`` and ``S / t``
as min/avg/max over pairs.

The fit is the latency-bandwidth (Hockney) model ``t(S) = alpha + S / beta``, by weighted
least squares with weights ``1 / t``: the variance of a transfer time grows with the
time (it is a sum of per-packet delays), so the small sizes, which determine ``alpha``,
are not drowned by the large ones, which determine ``beta``. (Weights ``1 / t^2``,
relative residuals, let the mid sizes dominate; on a token-bucket-shaped link, whose
bucket passes a burst of a few hundred KB at line rate, that overstates ``beta``.)
Its quality is the weighted coefficient of determination R^2.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy
import torch

from .units import iterations


@dataclasses.dataclass(frozen=True)
class Fit:
    alpha_s: float  # latency per message, seconds
    beta_Bps: float  # bandwidth, bytes per second (inf if the fit has no slope)
    r2: float  # weighted coefficient of determination
    points: int
    alpha_clamped: bool = False  # the unconstrained fit gave alpha < 0; refitted with alpha = 0

    def predict(self, nbytes: float) -> float:
        return self.alpha_s + nbytes / self.beta_Bps

    def as_dict(self) -> dict:
        finite = math.isfinite(self.beta_Bps)
        return {
            "model": "t(S) = alpha + S / beta (least squares, weights 1/t)",
            "alpha_us": self.alpha_s * 1e6,
            "beta_GBps": self.beta_Bps / 1e9 if finite else None,
            "beta_Gbitps": self.beta_Bps * 8 / 1e9 if finite else None,
            "r2": self.r2,
            "points": self.points,
            "alpha_clamped": self.alpha_clamped,
        }


def fit_alpha_beta(sizes, times) -> Fit:
    """Weighted least-squares fit of ``times = alpha + sizes / beta`` (SI units).

    Needs at least two distinct sizes. Weights are ``1 / t`` (see the module notes).
    """
    xs = [float(s) for s in sizes]
    ts = [float(t) for t in times]
    if len(xs) != len(ts) or len(set(xs)) < 2:
        raise ValueError("the alpha-beta fit needs timings at two or more distinct sizes")
    if min(ts) <= 0:
        raise ValueError("the alpha-beta fit needs positive times")
    w = [1.0 / t for t in ts]
    # numpy weighs the residuals, not their squares: sqrt(1/t) minimises sum (r**2 / t).
    slope, alpha = (float(v) for v in numpy.polyfit(xs, ts, 1, w=[math.sqrt(wi) for wi in w]))
    mt = sum(wi * t for wi, t in zip(w, ts)) / sum(w)
    clamped = alpha < 0
    if clamped:
        # A latency below zero means nothing (a token-bucket burst makes mid sizes look
        # faster than the asymptote): fit the slope through the origin instead.
        alpha = 0.0
        slope = sum(wi * x * t for wi, x, t in zip(w, xs, ts)) / sum(wi * x * x for wi, x in zip(w, xs))
    ss_res = sum(wi * (t - alpha - slope * x) ** 2 for wi, x, t in zip(w, xs, ts))
    ss_tot = sum(wi * (t - mt) ** 2 for wi, t in zip(w, ts))
    r2 = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    beta = 1.0 / slope if slope > 0 else math.inf
    return Fit(alpha, beta, r2, len(xs), clamped)


def ring_rounds(n: int) -> list[list[tuple[int, int]]]:
    """Pairs ``(i, i + 1 mod n)`` grouped into rounds in which no rank appears twice."""
    if n < 2:
        raise ValueError("ping-pong needs at least two ranks")
    pairs = [(0, 1)] if n == 2 else [(i, (i + 1) % n) for i in range(n)]
    rounds: list[list[tuple[int, int]]] = []
    for pair in pairs:
        for r in rounds:
            if not any(set(pair) & set(p) for p in r):
                r.append(pair)
                break
        else:
            rounds.append([pair])
    return rounds


def _bounce(comm, buf: torch.Tensor, peer: int, initiator: bool, count: int) -> list[float]:
    """``count`` round trips with ``peer``; the initiator returns one-way times (s)."""
    out = []
    for _ in range(count):
        if initiator:
            t0 = time.perf_counter()
            comm.send(buf, peer)
            comm.recv(buf, peer)
            comm.sync()
            out.append((time.perf_counter() - t0) / 2)
        else:
            comm.recv(buf, peer)
            comm.send(buf, peer)
    return out


def pingpong(comm, sizes, iters: int, warmup: int, fixed: bool, progress=None) -> list[dict]:
    """Rows (valid on rank 0) of one-way time and bandwidth per size over all pairs."""
    rounds = ring_rounds(comm.size)
    rows = []
    for size in sizes:
        n_iter, n_warm = iterations(size, iters, warmup, fixed)
        buf = torch.zeros(size, dtype=torch.uint8, device=comm.device)
        mine = []
        for pairs in rounds:
            comm.barrier()
            for a, b in pairs:
                if comm.rank in (a, b):
                    initiator = comm.rank == a
                    peer = b if initiator else a
                    _bounce(comm, buf, peer, initiator, n_warm)
                    times = _bounce(comm, buf, peer, initiator, n_iter)
                    if initiator:
                        mine.append({"pair": [a, b], "avg_s": sum(times) / len(times), "min_s": min(times)})
            if progress is not None:
                progress.advance((n_iter + n_warm) * (size + 4096), f"link {size} B")
        per_pair = [p for part in comm.allgather_object(mine) for p in part]
        per_pair.sort(key=lambda p: p["pair"])
        lat = [p["avg_s"] for p in per_pair]
        bw = [size / t for t in lat]
        t_avg = sum(lat) / len(lat)
        rows.append(
            {
                "op": "pingpong",
                "method": "p2p",
                "bytes": size,
                "iters": n_iter,
                "warmup": n_warm,
                "time_us": t_avg * 1e6,
                "time_us_min": min(lat) * 1e6,
                "time_us_max": max(lat) * 1e6,
                "best_us": min(p["min_s"] for p in per_pair) * 1e6,
                "algbw_GBps": size / t_avg / 1e9,
                "busbw_GBps": size / t_avg / 1e9,
                "bw_GBps_min": min(bw) / 1e9,
                "bw_GBps_max": max(bw) / 1e9,
                "wire_bytes": size,
                "ratio": 1.0,
                "codec_us": 0.0,
                "wire_us": t_avg * 1e6,
                "vnmse": None,
                "pairs": [{"pair": p["pair"], "time_us": p["avg_s"] * 1e6} for p in per_pair],
            }
        )
    return rows


def fit_rows(rows) -> Fit:
    """The alpha-beta fit of ``pingpong`` rows (average over pairs per size)."""
    return fit_alpha_beta([r["bytes"] for r in rows], [r["time_us"] * 1e-6 for r in rows])
