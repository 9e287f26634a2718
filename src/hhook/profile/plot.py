r"""``--plot PATH.png``: the profiler's figures (matplotlib, Agg backend).

Each panel is a function of the JSON results, so a figure can also be redrawn later
from saved ``--json`` files (``model --link-json L --allreduce-json A --plot P``
draws the link, busbw, time-breakdown and speedup panels together).
"""

from __future__ import annotations

from .units import format_size

# One colour per method in every panel and figure: the kinds fixed, THC variants by bits.
_METHOD_COLORS = {"fp32": "black", "thc": "tab:red", "fp16": "tab:blue", "bf16": "tab:cyan", "zlib": "tab:brown",
                  "p2p": "black"}
_AGREED_COLORS = {2: "indigo", 4: "maroon", 8: "darkgreen"}
_THC_BITS_COLORS = {1: "tab:pink", 2: "tab:purple", 3: "tab:olive", 4: "tab:red", 5: "tab:cyan", 6: "tab:orange",
                    7: "tab:gray", 8: "tab:green"}
SERIES = ["tab:red", "tab:orange", "tab:purple", "tab:green", "tab:pink", "tab:olive", "tab:blue", "tab:brown",
           "tab:cyan", "black", "tab:gray", "gold"]
#: One marker per method of a panel, in the order the methods come: shapes tell series apart
#: where colours are close (or printed in grey).
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p")
#: A title wider than this many characters is wrapped (a panel is 6.4 inches wide).
TITLE_CHARS = 60


def method_color(method: str) -> str:
    """One colour per method in every panel: ``fp32`` black, ``fp16`` blue, ``bf16`` cyan,
    ``powersgd`` green, ``zlib`` brown, ``thc:B`` a colour per B (``thc:B:agreed`` a darker one)."""
    if method in _METHOD_COLORS:
        return _METHOD_COLORS[method]
    kind, _, arg = method.partition(":")
    bits, _, mode = arg.partition(":")
    if kind == "thc" and bits.isdigit():
        return _AGREED_COLORS.get(int(bits), "maroon") if mode == "agreed" else _THC_BITS_COLORS.get(int(bits), "tab:red")
    if kind == "powersgd":
        return "tab:green"
    if kind in ("sbc", "lgc"):  # hhook.baselines
        return "darkorange" if kind == "sbc" else "olive"
    return "tab:gray"


def styles(methods) -> dict:
    """``method -> (colour, marker)`` for the methods of one panel: each its
    :func:`method_color` unless an earlier method took it (the next free colour of the
    series then), and each its own marker, so no two series look alike."""
    out, taken = {}, set()
    for i, m in enumerate(dict.fromkeys(methods)):
        color = method_color(m)
        if color in taken:
            color = next((c for c in SERIES if c not in taken), color)
        taken.add(color)
        out[m] = (color, MARKERS[i % len(MARKERS)])
    return out


def count_axis(ax, counts) -> None:
    """A log2 x axis labelled at each of ``counts`` (workers, sites): no minor ticks."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(counts)
    ax.set_xticklabels([str(n) for n in counts])
    ax.minorticks_off()


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
    n = rows[0].get("world_size", "?") if rows else "?"
    key = "algbw_GBps" if n == 1 else "busbw_GBps"  # one rank has no bus
    look = styles(methods)
    for m in methods:
        pts = sorted((r["bytes"], r[key]) for r in rows if r["method"] == m and r[key] is not None)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-", marker=look[m][1], color=look[m][0], label=m, ms=4)
    if fit and fit.get("beta_GBps") and n != 1:
        ax.axhline(fit["beta_GBps"], color="gray", ls=":", label=f"link (fit) {fit['beta_GBps']:.3g} GB/s")
    _size_axis(ax, [r["bytes"] for r in rows])
    ax.set_yscale("log")
    if n == 1:
        ax.set_ylabel("algbw (GB/s)")
        ax.set_title("allreduce, 1 rank: codec and local copies only, no network")
    else:
        ax.set_ylabel("busbw, fp32-equivalent (GB/s)")
        ax.set_title(f"allreduce bus bandwidth, {n} ranks")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def breakdown_panel(ax, rows):
    """Wire and codec time of each method at the largest size, side by side on a log
    scale: zlib's seconds and fp16's milliseconds both stay readable."""
    rows = [r for r in rows if r["op"] == "allreduce"]
    size = max(r["bytes"] for r in rows)
    top = [r for r in rows if r["bytes"] == size]
    width = 0.38
    look = styles(r["method"] for r in top)
    for i, r in enumerate(top):
        color = look[r["method"]][0]
        if r["wire_us"] is None:  # thc_allreduce timed whole (topology=): one bar, centred
            parts = ((0.0, r["time_us"], dict(color=color, edgecolor="black")),)
        else:
            parts = ((-width / 2, r["wire_us"], dict(color=color)),
                     (width / 2, r["codec_us"], dict(color=color, alpha=0.35, hatch="//", edgecolor=color)))
        for dx, us, style in parts:
            if us and us > 0:
                ax.bar(i + dx, us / 1e3, width, **style)
        total_ms = r["time_us"] / 1e3
        total = f"{total_ms:.0f}" if total_ms >= 100 else f"{total_ms:.3g}"
        ax.annotate(f"{total} ms\nratio {r['ratio']:.2f}", (i, max(us for _, us, _ in parts) / 1e3),
                    xytext=(0, 3), textcoords="offset points", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(top)))
    ax.set_xticklabels([r["method"] for r in top])
    ax.set_yscale("log")
    ax.set_ylabel("time per allreduce (ms, log scale)")
    ax.set_title(f"where the time goes at {format_size(size)}:\nwire (solid), codec (hatched), "
                 "thc_allreduce whole (outlined)")
    ax.margins(y=0.25)
    ax.grid(True, axis="y", which="both", alpha=0.3)


def speedup_panel(ax, rows, models=("ring",)):
    """Predicted speedup against ``M``: one colour per method; the ring model solid, the
    paper's parameter-server model (when asked for) dashed."""
    rows = [r for r in rows if r["op"] == "model"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    workers = sorted({r["workers"] for r in rows})
    ax.plot(workers, workers, color="lightgray", ls="-", label="ideal (no communication)")
    lines = {"ring": ("-", "ring allreduce"), "paper": ("--", "paper model (parameter server)")}
    look = styles(methods)
    for m in methods:
        for model in models:
            pts = sorted((r["workers"], r["speedup"]) for r in rows if r["method"] == m and r["model"] == model)
            if pts:
                ls, name = lines[model]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], ls, marker=look[m][1], color=look[m][0], ms=4,
                        label=m if len(models) == 1 else f"{m}, {name}")
    count_axis(ax, workers)
    ax.set_xlabel("workers M")
    ax.set_ylabel("predicted speedup C / T(M)")
    if rows:
        r = rows[0]
        which = "ring allreduce model" if tuple(models) == ("ring",) else " and ".join(models) + " models"
        ax.set_title(f"predicted speedup ({which}),\nC = {r['compute_us'] / 1e3:.0f} ms, W = {format_size(r['bytes'])}")
    shown = [r["speedup"] for r in rows if r["model"] in models]
    ax.set_ylim(0, max(1.5, max(shown, default=1.0) * 1.3))  # the ideal line is clipped, the predictions fill the panel
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
    """One series per bits, block, implementation, threads and rounding (each rounding its
    own line: two modes in one series would zig-zag between them)."""
    rows = [r for r in rows if r["op"] == "codec"]

    def key(r):
        return r["bits"], r["block_size"], r.get("impl", ""), r.get("threads", ""), r.get("rounding", "")

    for i, (bits, block, impl, threads, rounding) in enumerate(dict.fromkeys(map(key, rows))):
        pts = sorted((r["bytes"], r["algbw_GBps"]) for r in rows if key(r) == (bits, block, impl, threads, rounding))
        label = (f"bits {bits}, block {block}" + (f", {impl}, {threads} thr" if impl else "")
                 + (f", {rounding}" if rounding else ""))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-", marker=MARKERS[i % len(MARKERS)],
                color=SERIES[i % len(SERIES)], ms=4, label=label)
    copies = {}
    for r in rows:  # measured beside every row: one point per size (the best), not a zig-zag between rows
        if r.get("copy_GBps"):
            copies[r["bytes"]] = max(copies.get(r["bytes"], 0.0), r["copy_GBps"])
    copy = sorted(copies.items())
    if copy:
        ax.plot([c[0] for c in copy], [c[1] for c in copy], ":", color="gray", label="memory copy (best of its runs)")
    _size_axis(ax, [r["bytes"] for r in rows])
    ax.set_yscale("log")
    ax.set_ylabel("encode + decode throughput (GB/s)")
    ax.set_title("THC codec alone")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def _compared(rows) -> list:
    """``hhook-profile train``'s rows with figures to compare (a DiLoCo row that never
    synchronized is local training: left out, its line in the table says so)."""
    return [r for r in rows if r["status"] == "ok" and r.get("synchronized") is not False]


def accuracy_panel(ax, rows: list, target: float) -> None:
    """``train``: test accuracy against training wall-clock time, one series per method."""
    ok = _compared(rows)
    look = styles(r["method"] for r in ok)
    for r in ok:
        color, marker = look[r["method"]]
        ax.plot([0.0] + [e["time_s"] for e in r["evals"]], [None] + [e["accuracy"] for e in r["evals"]], "-",
                marker=marker, ms=4, color=color, label=r["method"])
    ax.axhline(target, color="gray", ls=":", label=f"target {target:g}")
    ax.set_xlabel("training time, s (evaluation excluded)")
    ax.set_ylabel("test accuracy")
    ax.set_title("time to accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def step_panel(ax, rows: list) -> None:
    """``train``: median step time per method, with the p90 as a whisker; a marker at each
    bar's top matches the method's series in the accuracy panel."""
    ok = _compared(rows)
    look = styles(r["method"] for r in ok)
    xs = range(len(ok))
    ax.bar(xs, [r["median_ms"] for r in ok], color=[look[r["method"]][0] for r in ok],
           yerr=[[0] * len(ok), [r["p90_ms"] - r["median_ms"] for r in ok]], capsize=3)
    for x, r in zip(xs, ok):
        ax.plot([x], [r["median_ms"]], marker=look[r["method"]][1], color="white", mec="black", ms=6)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r["method"] for r in ok], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("ms per step (median, whisker to p90)")
    ax.set_title("step time")
    ax.grid(axis="y", alpha=0.3)


def save(path: str, panels, link: str) -> None:
    """Draw ``panels`` (callables taking an Axes) side by side, two per row, into ``path``;
    ``link`` (:func:`hhook.profile.where.link_label`, or what a model assumed) is written
    under them, so that no figure leaves its network unsaid. Titles wider than a panel
    are wrapped."""
    import textwrap

    from .deps import require

    require("matplotlib", "plots (--plot)").use("Agg")
    plt = require("matplotlib.pyplot", "plots (--plot)")

    n = len(panels)
    cols = 1 if n == 1 else 2
    nrows = -(-n // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6.4 * cols, 4.6 * nrows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        panel(ax)
        title = ax.get_title()
        if any(len(line) > TITLE_CHARS for line in title.splitlines()):
            ax.set_title("\n".join(textwrap.fill(line, TITLE_CHARS) for line in title.splitlines()), fontsize=10)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    fig.text(0.5, 0.005, textwrap.fill(f"link: {link}", 12 * TITLE_CHARS // 5 * cols), ha="center", va="bottom",
             fontsize=9, color="dimgray")
    fig.tight_layout(rect=(0, 0.045 / nrows, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
