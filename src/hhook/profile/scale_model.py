r"""The scale model of ``model --layouts`` (:mod:`hhook.profile.models`): the time of one
update on nodes x ranks per node, flat and two-level, from measured inputs
(:class:`ClusterInputs`), its table and plots, and its check against measured steps."""

from __future__ import annotations

import dataclasses

from ..codec import THCCodec

#: Layouts (nodes, ranks per node) of ``model --layouts`` by default: 1x2 to 128x8.
DEFAULT_LAYOUTS = ((1, 2), (1, 4), (1, 8), (2, 1), (2, 2), (2, 8), (4, 8), (8, 8), (16, 8), (32, 8), (64, 8), (128, 8))
SCALE_METHODS = ("fp32", "bf16", "thc", "thc2")


@dataclasses.dataclass(frozen=True)
class ClusterInputs:
    r"""Measured inputs of the scale model (seconds, bytes, bytes per second).

    ``compute_s``: one rank's step without communication (DDP in a world of one).
    ``model_bytes``: float32 gradient bytes ``W``. ``alpha_inter``/``beta_inter``: the
    link between nodes, per node (``link``'s fit); its NIC is shared by the node's ranks.
    ``alpha_intra``/``beta_intra``: the path between two ranks of one node (NVLink, PCIe,
    loopback). ``codec_Bps``: THC's encode + decode inside the hook, float32 bytes per
    second per rank, plus ``codec_call_s`` per call. ``cast_Bps``: the bf16 hook's casts.
    ``copy_Bps``: memory copies (two-level's shared-memory path on CPUs).
    ``host_cores``: all ranks share this many cores (the emulated cluster on one host):
    CPU work and CPU-borne transfers slow down by ``n / host_cores``; None on a real
    cluster. ``bits``: THC bits, or "auto" (:func:`hhook.codec.error_model.auto_bits` per layout).
    ``intra``: two-level's path inside a node, "shm" (CPU) or "collectives" (NCCL/Gloo).
    ``calls``: tensors reduced per step (DDP's buckets): each pays the latencies and
    ``codec_call_s`` once.
    """

    compute_s: float
    model_bytes: float
    alpha_inter: float
    beta_inter: float
    alpha_intra: float
    beta_intra: float
    codec_Bps: float
    codec_call_s: float = 0.0
    cast_Bps: float = 8e9
    copy_Bps: float = 10e9
    host_cores: float | None = None
    bits: int | str = 4
    block_size: int = 1024
    scales: str = "agreed"
    intra: str = "shm"
    calls: int = 1


def _slowdown(inp: ClusterInputs, n: int) -> float:
    return max(1.0, n / inp.host_cores) if inp.host_cores else 1.0


def layout_ring_s(N: int, k: int, nbytes: float, inp: ClusterInputs, f: float = 1.0) -> float:
    """Ring allreduce of ``nbytes`` per rank over ``N`` nodes of ``k`` ranks placed node by
    node: ``2 (n - 1)`` steps of ``nbytes / n``, each as slow as its slowest edge (one
    edge per node crosses to the next node; inside a node edges are CPU-borne, ``f``)."""
    n = N * k
    if n <= 1:
        return 0.0
    chunk = nbytes / n
    step = 0.0
    if k > 1:
        step = max(step, (inp.calls * inp.alpha_intra + chunk / inp.beta_intra) * f)
    if N > 1:
        step = max(step, inp.calls * inp.alpha_inter + chunk / inp.beta_inter)
    return 2 * (n - 1) * step


def _latency_round_s(N: int, k: int, inp: ClusterInputs, f: float) -> float:
    """One more small allreduce (agreed scales' MAX): latency only."""
    n = N * k
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * inp.calls * max(inp.alpha_intra * f if k > 1 else 0.0, inp.alpha_inter if N > 1 else 0.0)


def thc_bits(inp: ClusterInputs, participants: int, ranks_per_node: int = 1) -> int:
    """The bits THC runs at over ``participants`` (nodes of ``ranks_per_node``)."""
    if inp.bits == "auto":
        from ..codec.error_model import auto_bits

        return auto_bits(participants, ranks_per_node, inp.block_size)
    return int(inp.bits)


def layout_step(N: int, k: int, method: str, inp: ClusterInputs) -> dict:
    r"""Predicted step of ``method`` on ``N`` nodes of ``k`` ranks (no overlap of
    communication with compute; CPU work slowed by the host's sharing)::

        fp32:  f C + ring(W)
        bf16:  f (C + W / cast) + ring(W / 2)
        thc:   f (C + call + W / codec) + ring(words_n(W)) + MAX round
        thc2:  f (C + call + (W / k) / codec) + intra + 2 (N - 1) (alpha_e + words_N(W / k) k / (N beta_e))
               + MAX round between nodes;  intra = f (3 + 2 / k) W / copy  (shared memory)
               or 2 (k - 1) f (alpha_i + (W / k) / beta_i)  (collectives)

    ``words_n`` is what THC hands to the wire over ``n`` participants (lanes for ``n``,
    scales); the ``k`` rings of a node share its NIC. ``thc2`` on one node or one rank per
    node is ``thc``.
    """
    n = N * k
    W = inp.model_bytes
    d = max(1, int(W) // 4)
    f = _slowdown(inp, n)
    C = inp.compute_s
    if method == "thc2" and (N == 1 or k == 1):
        method_eff = "thc"
    else:
        method_eff = method
    bits = None
    if method_eff == "fp32":
        codec, comm, wire_bits = 0.0, layout_ring_s(N, k, W, inp, f), 32.0
    elif method_eff == "bf16":
        codec, comm, wire_bits = f * W / inp.cast_Bps if n > 1 else 0.0, layout_ring_s(N, k, W / 2, inp, f), 16.0
    elif method_eff == "thc":
        bits = thc_bits(inp, n)
        words = THCCodec(bits, inp.block_size, 0, n).wire_bytes(d)
        codec = f * (inp.calls * inp.codec_call_s + W / inp.codec_Bps) if n > 1 else 0.0
        comm = layout_ring_s(N, k, words, inp, f)
        if inp.scales == "agreed":
            comm += _latency_round_s(N, k, inp, f)
        wire_bits = 8 * words / d
    elif method_eff == "thc2":
        bits = thc_bits(inp, N, k)
        shard = -(-d // k)
        words = THCCodec(bits, inp.block_size, 0, N).wire_bytes(shard)
        codec = f * (inp.calls * inp.codec_call_s + W / k / inp.codec_Bps)
        if inp.intra == "shm":  # copy in, k shard reads, shard writes, copy out; two barriers
            intra = f * ((3 + 2 / k) * W / inp.copy_Bps + 4 * (k - 1) * inp.calls * inp.alpha_intra)
        else:
            intra = 2 * (k - 1) * f * (inp.calls * inp.alpha_intra + W / k / inp.beta_intra)
        inter = 2 * (N - 1) * (inp.calls * inp.alpha_inter + words / N * k / inp.beta_inter)
        if inp.scales == "agreed":
            inter += 2 * (N - 1) * inp.calls * inp.alpha_inter
        comm = intra + inter
        wire_bits = 8 * words / shard
    else:
        raise ValueError(f"unknown method {method!r} (known: {', '.join(SCALE_METHODS)})")
    compute = f * C
    return {"nodes": N, "ranks_per_node": k, "workers": n, "method": method, "time_s": compute + codec + comm,
            "compute_s": compute, "codec_s": codec, "comm_s": comm, "wire_bits": wire_bits, "bits": bits,
            "two_level": method_eff == "thc2"}


def scale_rows(inp: ClusterInputs, layouts=DEFAULT_LAYOUTS, methods=SCALE_METHODS) -> list[dict]:
    """One row per layout and method: time per step, speedup against fp32 and bf16 on the
    same layout, wire bits per coordinate on the links between nodes."""
    rows = []
    for N, k in layouts:
        here = {m: layout_step(N, k, m, inp) for m in methods}
        for m, r in here.items():
            r["op"] = "scale"
            r["time_us"] = r["time_s"] * 1e6
            r["speedup_vs_fp32"] = here["fp32"]["time_s"] / r["time_s"] if "fp32" in here else None
            r["speedup_vs_bf16"] = here["bf16"]["time_s"] / r["time_s"] if "bf16" in here else None
            rows.append(r)
    return rows


def scale_table(rows: list[dict]) -> str:
    """The scale model's rows as a text table (one line per layout)."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    head = f"{'layout':>8s} {'ranks':>5s} " + " ".join(f"{m + ' ms':>10s}" for m in methods)
    head += f" {'thc/fp32':>8s} {'thc/bf16':>8s} {'thc2/fp32':>9s} {'thc2/bf16':>9s} {'bits flat':>9s} {'bits 2lvl':>9s}"
    lines = [head]
    for (N, k) in dict.fromkeys((r["nodes"], r["ranks_per_node"]) for r in rows):
        here = {r["method"]: r for r in rows if (r["nodes"], r["ranks_per_node"]) == (N, k)}
        line = f"{f'{N}x{k}':>8s} {N * k:>5d} " + " ".join(f"{here[m]['time_s'] * 1e3:>10.1f}" for m in methods)

        def sp(m, base):
            return f"{here[m]['speedup_vs_' + base]:.2f}x" if m in here and here[m].get("speedup_vs_" + base) else "-"

        def bits(m):
            r = here.get(m)
            return f"{r['wire_bits']:.2f}/{r['bits']}b" if r and r["bits"] else "-"

        line += f" {sp('thc', 'fp32'):>8s} {sp('thc', 'bf16'):>8s} {sp('thc2', 'fp32'):>9s} {sp('thc2', 'bf16'):>9s}"
        line += f" {bits('thc'):>9s} {bits('thc2') if here.get('thc2', {}).get('two_level') else '-':>9s}"
        lines.append(line)
    return "\n".join(lines)


def parse_layouts(text: str) -> list[tuple[int, int]]:
    """``"1x2,2x2,128x8"`` -> ``[(1, 2), (2, 2), (128, 8)]``."""
    out = []
    for part in text.split(","):
        try:
            N, k = (int(v) for v in part.strip().lower().split("x"))
        except ValueError:
            raise ValueError(f"layout {part!r} is not NODESxRANKS (e.g. 2x8)") from None
        if N < 1 or k < 1:
            raise ValueError(f"layout {part!r}: nodes and ranks per node must be positive")
        out.append((N, k))
    return out


#: The JSON of measured inputs (``model --layouts ... --scale-inputs PATH``): friendly units.
_INPUT_KEYS = {
    "compute_ms": ("compute_s", 1e-3), "model_bytes": ("model_bytes", 1.0),
    "alpha_inter_us": ("alpha_inter", 1e-6), "beta_inter_GBps": ("beta_inter", 1e9),
    "alpha_intra_us": ("alpha_intra", 1e-6), "beta_intra_GBps": ("beta_intra", 1e9),
    "codec_GBps": ("codec_Bps", 1e9), "codec_call_ms": ("codec_call_s", 1e-3),
    "cast_GBps": ("cast_Bps", 1e9), "copy_GBps": ("copy_Bps", 1e9),
    "host_cores": ("host_cores", None), "calls": ("calls", None), "intra": ("intra", None),
    "scales": ("scales", None), "block_size": ("block_size", None),
}


def inputs_from_json(doc: dict, **override) -> ClusterInputs:
    """:class:`ClusterInputs` from a measured-inputs JSON (keys of ``_INPUT_KEYS``;
    ``measured`` and ``notes`` are ignored here); ``override`` wins (field names)."""
    fields = {}
    for key, value in doc.items():
        if key in ("measured", "notes", "commands"):
            continue
        if key not in _INPUT_KEYS:
            raise ValueError(f"unknown input {key!r} (known: {', '.join(_INPUT_KEYS)})")
        name, scale = _INPUT_KEYS[key]
        fields[name] = value * scale if scale is not None and value is not None else value
    fields.update({k: v for k, v in override.items() if v is not None})
    missing = {"compute_s", "model_bytes", "alpha_inter", "beta_inter", "alpha_intra", "beta_intra", "codec_Bps"} - set(fields)
    if missing:
        raise ValueError(f"missing inputs: {', '.join(sorted(missing))}")
    return ClusterInputs(**fields)


def validation_rows(inp: ClusterInputs, measured: dict) -> list[dict]:
    """Predicted against measured step times: ``measured`` = ``{"2x2": {"thc": ms, ...}}``."""
    rows = []
    for layout, by_method in measured.items():
        (N, k), = parse_layouts(layout)
        for method, ms in by_method.items():
            if method not in SCALE_METHODS or not isinstance(ms, (int, float)):
                continue
            pred = layout_step(N, k, method, inp)["time_s"] * 1e3
            rows.append({"op": "validation", "layout": layout, "method": method, "measured_ms": ms,
                         "predicted_ms": pred, "error": pred / ms - 1})
    return rows


def _series(rows: list[dict]) -> list[dict]:
    """The rows of the widest nodes (e.g. 1x8 ... 128x8): one series against node count."""
    k = max(r["ranks_per_node"] for r in rows)
    return [r for r in rows if r["ranks_per_node"] == k]


#: The THC series of the scale model's panels: (label, method, auto bits, line and marker,
#: colour), each with its own colour and marker (auto bits: a lighter colour, dotted).
SERIES_STYLES = (("flat, 4 bits", "thc", False, "o-", "tab:red"), ("two-level, 4 bits", "thc2", False, "s-", "tab:purple"),
                 ("flat, auto bits", "thc", True, "D:", "salmon"), ("two-level, auto bits", "thc2", True, "v:", "plum"))


def speedup_panel(ax, rows: list[dict], base: str = "fp32") -> None:
    """Speedup against ``base`` by node count (nodes of the widest layout): flat and
    two-level THC, fixed and auto bits."""
    rows = _series(rows)
    k = rows[0]["ranks_per_node"]
    for (label, method, auto, style, color) in SERIES_STYLES:
        pts = sorted((r["nodes"], r["speedup_vs_" + base]) for r in rows
                     if r["method"] == method and r.get("auto_bits", False) == auto)
        if pts:
            name = label.replace(", 4 bits", "").replace("flat", "flat THC").replace("level", "level THC")
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=name, color=color, ms=4)
    other = "bf16" if base == "fp32" else "fp32"
    pts = sorted((r["nodes"], r["speedup_vs_" + base]) for r in rows
                 if r["method"] == other and not r.get("auto_bits"))
    ax.plot([p[0] for p in pts], [p[1] for p in pts], "^-", color="tab:cyan" if other == "bf16" else "black",
            label=f"{other} hook" if other == "bf16" else "fp32", ms=4)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"nodes of {k} ranks")
    ax.set_ylabel(f"step-time speedup vs {base} (same layout)")
    ax.set_title(f"Scale model: speedup against {base}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)


def bits_panel(ax, rows: list[dict]) -> None:
    """Wire bits per coordinate between nodes by node count."""
    rows = _series(rows)
    k = rows[0]["ranks_per_node"]
    for (label, method, auto, style, color) in SERIES_STYLES:
        pts = sorted((r["nodes"], r["wire_bits"]) for r in rows
                     if r["method"] == method and r.get("auto_bits", False) == auto)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label, color=color, ms=4)
    ax.axhline(16, color="tab:cyan", lw=0.8, label="bf16")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"nodes of {k} ranks")
    ax.set_ylabel("wire bits per coordinate (between nodes)")
    ax.set_title("Lanes: flat THC widens with ranks, two-level with nodes")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
