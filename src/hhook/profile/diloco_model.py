r"""``model --diloco H``: a model (not a measurement) of bytes and wall time per token when
``n`` sites train one model over a wide-area link: DDP's exchange at every step (fp32, or
THC through hhook's hook) against DiLoCo's outer synchronization every ``H`` steps
(fp32 or THC, :mod:`hhook.diloco`), blocking or streamed in ``P`` fragments.

Assumptions, printed with the table:

* ``n`` sites of ``k`` ranks; rank ``j`` of every site meets rank ``j`` of the others in a
  ring (one per local rank), each carrying ``1 / k`` of the model over a link of its own
  of ``beta`` bytes/s with one-way delay ``rtt / 2`` (alpha-beta,
  :func:`hhook.profile.models.ring_allreduce_s`: ``2 (n - 1)`` messages one after the
  other, each paying the delay);
* a step computes for ``compute`` seconds; DDP's exchange is not overlapped with it (an
  upper bound on what it adds); its buckets are pipelined, so each round's delay is paid
  once a step: fp32 one allreduce of the model, THC two rounds (the MAX of the scales, then
  the SUM of the lane words at the width for ``n`` sites, :class:`hhook.codec.THCCodec`),
  plus the codec at ``codec`` bytes/s;
* DiLoCo, blocking: the same exchange once every ``H`` steps, of the whole model; streamed
  (``P`` fragments, ``overlap`` steps): each fragment's exchange is hidden behind
  ``overlap`` steps of compute, only what exceeds them is waited for;
* bytes: what one rank hands to the ring per inner step (``2 (n - 1) / n`` of a message
  crosses its link each way); tokens: the whole job's per step (``n k`` ranks).

Not modelled: congestion, stragglers, losses, the quality of the model at equal tokens
(measured: docs/diloco.md).
"""

from __future__ import annotations

from ..codec import THCCodec
from .models import ring_allreduce_s

SITES = (2, 4, 8, 16, 32, 64)
LINKS_GBIT = (0.1, 1.0, 10.0)


def _thc_exchange(n: int, nbytes: float, alpha: float, beta: float, bits: int,
                  codec_bps: float) -> tuple[float, float]:
    """(seconds, bytes handed to the ring) of THC-averaging ``nbytes`` of float32 over
    ``n`` sites: the MAX round of the scales, the SUM round of the words, the codec."""
    numel = max(1, int(nbytes / 4))
    codec = THCCodec(bits, 1024, 0, n)
    scales = 4 * codec.scales_numel(numel)
    words = codec.wire_bytes(numel) - scales
    seconds = ring_allreduce_s(n, scales, alpha, beta) + ring_allreduce_s(n, words, alpha, beta) + nbytes / codec_bps
    return seconds, scales + words


def rows(W: float, compute_s: float, every: int, fragments: int, overlap: int, bits: int, rtt_s: float,
         tokens_per_rank: int, ranks_per_site: int = 1, codec_bps: float = 2e9, sites=SITES,
         links_gbit=LINKS_GBIT) -> list[dict]:
    """One row per (sites, link): ms and bytes per inner step, and per token, of each way."""
    out = []
    shard = W / ranks_per_site  # what each ring carries
    for n in sites:
        tokens = n * ranks_per_site * tokens_per_rank
        for gbit in links_gbit:
            alpha, beta = rtt_s / 2, gbit * 1e9 / 8
            fp32 = ring_allreduce_s(n, shard, alpha, beta)
            thc, thc_bytes = _thc_exchange(n, shard, alpha, beta, bits, codec_bps)
            frag, frag_bytes = _thc_exchange(n, shard / fragments, alpha, beta, bits, codec_bps)
            exposed = max(0.0, frag - overlap * compute_s)
            ways = {
                "ddp_fp32": (compute_s + fp32, shard),
                "ddp_thc": (compute_s + thc, thc_bytes),
                "diloco_fp32": (compute_s + fp32 / every, shard / every),
                "diloco_thc": (compute_s + thc / every, thc_bytes / every),
                "streaming_thc": (compute_s + fragments * exposed / every, fragments * frag_bytes / every),
            }
            row = {"op": "diloco_model", "sites": n, "link_gbit": gbit, "rtt_ms": rtt_s * 1e3, "every": every,
                   "fragments": fragments, "overlap": overlap, "bits": bits, "lane_bits": THCCodec(bits, 1024, 0, n).layout.width,
                   "tokens_per_step": tokens, "peak_sync_bytes_streaming": frag_bytes, "peak_sync_bytes_diloco": thc_bytes}
            for name, (seconds, nbytes) in ways.items():
                row[f"{name}_ms"] = seconds * 1e3
                row[f"{name}_bytes"] = nbytes
                row[f"{name}_us_per_token"] = seconds / tokens * 1e6
                row[f"{name}_bytes_per_token"] = nbytes / tokens
            row["diloco_thc_vs_ddp_fp32"] = row["ddp_fp32_ms"] / row["diloco_thc_ms"]
            row["diloco_thc_vs_ddp_thc"] = row["ddp_thc_ms"] / row["diloco_thc_ms"]
            out.append(row)
    return out


WAYS = (("ddp_fp32", "DDP fp32"), ("ddp_thc", "DDP THC"), ("diloco_fp32", "DiLoCo fp32"),
        ("diloco_thc", "DiLoCo THC"), ("streaming_thc", "streamed THC"))


def assumptions(W: float, compute_s: float, every: int, fragments: int, overlap: int, bits: int, rtt_s: float,
                tokens_per_rank: int, ranks_per_site: int, codec_bps: float) -> str:
    from .units import format_size

    return "\n".join([
        "# A MODEL, not a measurement (hhook.profile.diloco_model): alpha-beta rings between sites, one per",
        f"# local rank; {rtt_s * 500:g} ms one-way delay per message (round trip {rtt_s * 1e3:g} ms); "
        f"{format_size(W)} of float32 parameters,",
        f"# {ranks_per_site} rank(s) per site, {compute_s * 1e3:g} ms of compute and {tokens_per_rank} tokens per rank "
        "and inner step.",
        "# DDP: the exchange at every step, not overlapped, buckets pipelined (THC: a MAX and a SUM round,",
        f"# {bits} bits, lanes for n sites, codec at {codec_bps / 1e9:g} GB/s). DiLoCo: the same once every "
        f"H = {every} steps, blocking;",
        f"# streamed: P = {fragments} fragments, each hidden behind {overlap} step(s) of compute. Per inner step "
        "of the whole job:",
        "# wall time per token (us) and, in brackets, bytes one rank hands to its ring per token.",
    ])


def _n(x: float) -> str:
    """Three significant digits, no exponent (5 characters up to 99999)."""
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def table(rows_: list[dict]) -> str:
    head = f"{'sites':>5} {'Gbit/s':>6} {'lane':>4} " + " ".join(f"{label:>14}" for _, label in WAYS) \
        + f" {'vs DDP fp32':>11} {'vs DDP THC':>10}"
    lines = [head, "-" * len(head)]
    for r in rows_:
        cells = " ".join(f"{_n(r[f'{k}_us_per_token']):>6} ({_n(r[f'{k}_bytes_per_token']):>5})" for k, _ in WAYS)
        lines.append(f"{r['sites']:>5} {r['link_gbit']:>6g} {r['lane_bits']:>4} {cells} "
                     f"{r['diloco_thc_vs_ddp_fp32']:>10.1f}x {r['diloco_thc_vs_ddp_thc']:>9.1f}x")
    return "\n".join(lines)


def panel(ax, rows_: list[dict], link_gbit: float) -> None:
    """``model --diloco H --plot``: wall time per token against the number of sites at
    one link rate, one series (colour and marker) per way."""
    from .plot import MARKERS, SERIES, count_axis

    at = sorted((r for r in rows_ if r["link_gbit"] == link_gbit), key=lambda r: r["sites"])
    sites = [r["sites"] for r in at]
    for i, (key, label) in enumerate(WAYS):
        ax.plot(sites, [r[f"{key}_us_per_token"] for r in at], "-", marker=MARKERS[i], color=SERIES[i], ms=4,
                label=label)
    count_axis(ax, sites)
    ax.set_yscale("log")
    ax.set_xlabel("sites")
    ax.set_ylabel("wall time per token, us (model)")
    r = at[0] if at else {"every": "?", "rtt_ms": 0}
    ax.set_title(f"{link_gbit:g} Gbit/s between sites, RTT {r['rtt_ms']:g} ms, H = {r['every']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
