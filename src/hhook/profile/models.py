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


def broadcast_s(n: int, nbytes: float, alpha: float, beta: float) -> float:
    """Pipelined broadcast of ``nbytes`` from one rank: ``(n - 1) alpha + nbytes / beta``."""
    if n <= 1:
        return 0.0
    return (n - 1) * alpha + nbytes / beta


def baseline_traffic(baselines, workers, W: float, alpha: float, beta: float, bits: int = 4,
                     block_size: int = 1024) -> list[dict]:
    r"""Traffic per rank and step against ``M`` for fp32, THC (``bits``) and the benchmark
    baselines SBC and LGC-RAR (``baselines``: :class:`hhook.profile.methods.Method` of kind
    ``sbc``/``lgc``, options as in ``train --methods``), for ``W`` bytes of float32 gradients.

    Bytes are those one rank **receives** per step under ring collectives, from
    :func:`hhook.baselines.traffic.rows` (SBC's all-gather grows with ``M``; THC's and
    LGC-RAR's allreduce do not, beyond THC's lane width). Communication time per step
    (alpha-beta, as the ring table; codec time not modelled)::

        fp32, thc: ring allreduce of 4 N bytes or of THC's wire bytes at M
        sbc: (allgather(8 B lengths) + allgather(message)) / delay
        lgc: broadcast(mask) + ring allreduce(one float, MAX) + ring allreduce(latents)
    """
    from ..baselines import traffic

    params = max(1, int(W) // 4)
    thc = f"thc:{bits}"
    opts = {b.name: dict(b.options) for b in baselines}
    out = []
    for M in workers:
        words = THCCodec(bits, block_size, 0, M).wire_bytes(params)
        comm = {"fp32": ring_allreduce_s(M, 4 * params, alpha, beta), thc: ring_allreduce_s(M, words, alpha, beta)}
        sent = {"fp32": 4 * params, thc: words}  # payload a rank hands to the collectives per step
        recv = {}
        base = traffic.rows(params, [M], bits=bits, block_size=block_size)[0]
        recv["fp32"], recv[thc] = base["fp32"], base[thc]
        for b in baselines:
            o = b.options
            if b.kind == "sbc":
                recv[b.name] = traffic.rows(params, [M], p=o["p"], delay=o["delay"], bits=bits,
                                            block_size=block_size)[0]["sbc"]
                msg = traffic.sbc_message_bytes(params, o["p"])
                comm[b.name] = (allgather_s(M, 8, alpha, beta) + allgather_s(M, msg, alpha, beta)) / o["delay"]
                sent[b.name] = (8 + msg) / o["delay"]
            elif b.kind == "lgc":
                recv[b.name] = traffic.rows(params, [M], k=o["k"], bits=bits, block_size=block_size)[0]["lgc"]
                mask, latent = traffic.lgc_sizes(params, o["k"])
                comm[b.name] = (broadcast_s(M, mask, alpha, beta) + ring_allreduce_s(M, 4, alpha, beta)
                                + ring_allreduce_s(M, 4 * latent, alpha, beta))
                sent[b.name] = mask + 4 + 4 * latent
            else:
                raise ValueError(f"not a baseline: {b.name!r} (sbc or lgc)")
        for name in comm:
            kind = name.split(":")[0]
            out.append({"op": "traffic", "model": "traffic", "method": name, "workers": M, "bytes": W,
                        "recv_bytes": recv[name], "comm_us": comm[name] * 1e6, "time_us": comm[name] * 1e6,
                        "wire_bytes": sent[name], "ratio": 4 * params / sent[name], "codec_us": None,
                        "algbw_GBps": None, "busbw_GBps": None, "vnmse": None,
                        "collective": {"sbc": "allgather", "lgc": "broadcast+allreduce"}.get(kind, "allreduce"),
                        "options": opts.get(name)})
    return out


def traffic_table(rows: list[dict]) -> str:
    """:func:`baseline_traffic`'s rows as text: per ``M``, MB received per rank and step and
    the communication ms per step of each method."""
    from .report import Column, fnum, sig, table

    rows = [r for r in rows if r["op"] == "traffic"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    by = {(r["workers"], r["method"]): r for r in rows}
    cols = [Column("", "M", 5, lambda r: str(r["M"]))]
    for m in methods:
        w = max(8, len(m))
        cols.append(Column(m, "MB/step", w, lambda r, m=m: sig(by[(r["M"], m)]["recv_bytes"] / 1e6, 4)))
        cols.append(Column(m, "comm ms", w, lambda r, m=m: fnum(by[(r["M"], m)]["comm_us"] / 1e3, ".2f")))
    return table(cols, [{"M": M} for M in dict.fromkeys(r["workers"] for r in rows)])


def methods_from_allreduce(doc: dict, W: float) -> list[ModelMethod]:
    """Model methods from an ``allreduce --json`` document: for each method the row whose
    size is nearest ``W`` (log scale), with its codec time scaled linearly to ``W``. Rows
    of ``thc:...:topology=`` (timed whole, no codec time apart) are not flat methods: skipped."""
    rows = [r for r in doc.get("results", []) if r.get("op") == "allreduce" and r.get("topology") is None]
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
