r"""``--plot PATH.png``: the profiler's figures (matplotlib, Agg backend).

Each panel is a function of the JSON results, so a figure can also be redrawn later
from saved ``--json`` files (``model --link-json L --allreduce-json A --plot P``
draws the link, busbw, time-breakdown and speedup panels together).
"""

from __future__ import annotations

from .units import format_size

_STYLE = {"fp32": "k", "fp16": "tab:blue", "zlib": "tab:brown", "p2p": "k"}


def _color(method: str, i: int):
    if method in _STYLE:
        return _STYLE[method]
    return ["tab:red", "tab:orange", "tab:purple", "tab:green", "tab:pink", "tab:olive"][i % 6]


def _size_axis(ax, sizes):
    ax.set_xscale("log", base=2)
    ticks = sorted(set(sizes))
    if len(ticks) > 8:
        step = -(-len(ticks) // 8)
        ticks = ticks[::step]
    ax.set_xticks(ticks)
    ax.set_xticklabels([format_size(s) for s in ticks], rotation=30, ha="right", fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel("message size (float32 bytes)")


def busbw_panel(ax, rows, fit=None):
    rows = [r for r in rows if r["op"] == "allreduce"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    for i, m in enumerate(methods):
        pts = sorted((r["bytes"], r["busbw_GBps"]) for r in rows if r["method"] == m)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=_color(m, i), label=m, ms=4)
    if fit and fit.get("beta_GBps"):
        ax.axhline(fit["beta_GBps"], color="gray", ls=":", label=f"link (fit) {fit['beta_GBps']:.3g} GB/s")
    _size_axis(ax, [r["bytes"] for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("busbw, fp32-equivalent (GB/s)")
    n = rows[0].get("world_size", "?") if rows else "?"
    ax.set_title(f"allreduce bus bandwidth, {n} ranks")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def breakdown_panel(ax, rows):
    rows = [r for r in rows if r["op"] == "allreduce"]
    size = max(r["bytes"] for r in rows)
    top = [r for r in rows if r["bytes"] == size]
    names = [r["method"] for r in top]
    codec = [r["codec_us"] / 1e3 for r in top]
    wire = [r["wire_us"] / 1e3 for r in top]
    ax.bar(names, wire, color="tab:gray", label="wire (collectives)")
    ax.bar(names, codec, bottom=wire, color="tab:orange", label="codec (encode + decode)")
    for i, r in enumerate(top):
        ax.text(i, (codec[i] + wire[i]) * 1.01, f"ratio {r['ratio']:.1f}", ha="center", va="bottom", fontsize=7)
    ax.set_ylabel("time per allreduce (ms)")
    ax.set_title(f"where the time goes at {format_size(size)}")
    ax.legend(fontsize=8)
    ax.margins(y=0.15)


def speedup_panel(ax, rows):
    rows = [r for r in rows if r["op"] == "model"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    workers = sorted({r["workers"] for r in rows})
    ax.plot(workers, workers, color="lightgray", ls="-", label="ideal")
    for i, m in enumerate(methods):
        for model, ls in (("ring", "o-"), ("paper", "x--")):
            pts = sorted((r["workers"], r["speedup"]) for r in rows if r["method"] == m and r["model"] == model)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], ls, color=_color(m, i), ms=4,
                        label=f"{m} ({'alpha-beta ring' if model == 'ring' else 'paper model'})")
    ax.set_xscale("log", base=2)
    ax.set_xticks(workers)
    ax.set_xticklabels([str(w) for w in workers])
    ax.minorticks_off()
    ax.set_xlabel("workers M")
    ax.set_ylabel("predicted speedup C / T(M)")
    if rows:
        r = rows[0]
        ax.set_title(f"predicted speedup, C = {r['compute_us'] / 1e3:.0f} ms, W = {format_size(r['bytes'])}")
    top = max((r["speedup"] for r in rows), default=1.0)
    ax.set_ylim(0, max(1.5, top * 1.3))  # the ideal line is clipped, the predictions fill the panel
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)


def link_panel(ax, rows, fit=None):
    rows = sorted((r for r in rows if r["op"] == "pingpong"), key=lambda r: r["bytes"])
    sizes = [r["bytes"] for r in rows]
    ax.plot(sizes, [r["algbw_GBps"] for r in rows], "o-", color="k", ms=4, label="ping-pong (avg over pairs)")
    ax.fill_between(sizes, [r["bw_GBps_min"] for r in rows], [r["bw_GBps_max"] for r in rows], color="gray", alpha=0.3)
    if fit and fit.get("beta_GBps"):
        a, b = fit["alpha_us"] * 1e-6, fit["beta_GBps"] * 1e9
        ax.plot(sizes, [s / (a + s / b) / 1e9 for s in sizes], "--", color="tab:red",
                label=f"fit: alpha {fit['alpha_us']:.1f} us, beta {fit['beta_GBps']:.3g} GB/s")
    _size_axis(ax, sizes)
    ax.set_xlabel("message size (bytes)")
    ax.set_yscale("log")
    ax.set_ylabel("one-way bandwidth (GB/s)")
    ax.set_title("link: ping-pong between ring neighbours")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def codec_panel(ax, rows):
    rows = [r for r in rows if r["op"] == "codec"]
    def key(r):
        return r["bits"], r["block_size"], r.get("impl", ""), r.get("threads", "")

    for i, (bits, block, impl, threads) in enumerate(dict.fromkeys(map(key, rows))):
        pts = sorted((r["bytes"], r["algbw_GBps"]) for r in rows if key(r) == (bits, block, impl, threads))
        label = f"bits {bits}, block {block}" + (f", {impl}, {threads} thr" if impl else "")
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=_color("", i), ms=4, label=label)
    copy = sorted({(r["bytes"], r.get("copy_GBps")) for r in rows if r.get("copy_GBps")})
    if copy:
        ax.plot([c[0] for c in copy], [c[1] for c in copy], ":", color="gray", label="memory copy")
    _size_axis(ax, [r["bytes"] for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("encode + decode throughput (GB/s)")
    ax.set_title("THC codec alone")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def save(path: str, panels) -> None:
    """Draw ``panels`` (callables taking an Axes) side by side, two per row, into ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(panels)
    cols = 1 if n == 1 else 2
    nrows = -(-n // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6.4 * cols, 4.6 * nrows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        panel(ax)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
