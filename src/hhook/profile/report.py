r"""What rank 0 prints and writes: header, tables a person reads at a glance, JSON.

Tables follow nccl-tests: ``#``-prefixed header and footer lines, one row per
measurement in fixed-width columns (easy to read, easy to ``grep -v '^#'``).
Every figure, and more, is also in ``--json``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import sys
from typing import Callable

import numpy as np

from .where import link_label
import torch

from .units import format_size


# Variables mpirun sets for its own plumbing, not choices worth printing.
_MCA_INTERNAL = ("orte_", "ess", "pmix", "initial_wdir", "mpi_oversubscribe", "rmaps_", "shmem_", "hwloc_", "plm_",
                 "mpi_warn_on_fork", "ompi_", "opal_")


# -- meta ---------------------------------------------------------------------
def meta(subcommand: str, comm, hosts: list[dict] | None, options: dict) -> dict:
    """The JSON ``meta`` object: what ran, where, with which libraries and options."""
    from .. import __version__

    m = {
        "tool": "hhook-profile",
        "subcommand": subcommand,
        "argv": sys.argv[1:],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hhook": __version__,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "options": options,
    }
    if comm is not None:
        m.update(backend=comm.backend, world_size=comm.size, library=comm.library())
    else:
        m.update(backend=None, world_size=1, library=None)
    # mpirun --mca NAME VALUE reaches the ranks as OMPI_MCA_NAME: the algorithm and transport choices.
    m["mca"] = {k[len("OMPI_MCA_"):]: v for k, v in sorted(os.environ.items())
                if k.startswith("OMPI_MCA_") and not k[len("OMPI_MCA_"):].startswith(_MCA_INTERNAL)}
    m["hosts"] = hosts or [{"rank": 0, "host": platform.node(), "pid": os.getpid(), "device": "cpu"}]
    m["link"] = link_label(m["world_size"])
    return m


def header(m: dict) -> str:
    """``#`` lines naming the tool, the libraries, the ranks and their hosts."""
    lines = [
        f"# hhook-profile {m['subcommand']} | hhook {m['hhook']} | torch {m['torch']} | "
        f"numpy {m['numpy']} | Python {m['python']}"
    ]
    lib = m.get("library")
    if lib:
        text = f"# backend {m['backend']}: {lib.get('name')}"
        if "mpi_standard" in lib:
            text += f" (MPI {lib['mpi_standard']}) via mpi4py {lib['mpi4py']}"
        if "master" in lib:
            text += f", launcher {lib['launcher']}, rendezvous {lib['master']}"
        lines.append(text)
    if m.get("mca") and m.get("backend") == "mpi":
        lines.append("# MCA: " + " ".join(f"{k}={v}" for k, v in m["mca"].items()))
    hosts = m.get("hosts") or []
    names = sorted({h["host"] for h in hosts})
    lines.append(f"# {len(hosts)} rank{'s' if len(hosts) != 1 else ''} on {len(names)} "
                 f"host{'s' if len(names) != 1 else ''}: {', '.join(names)}")
    for h in hosts:
        extra = f"  threads {h['torch_threads']}" if "torch_threads" in h else ""
        lines.append(f"#   rank {h['rank']:3d}  host {h['host']:<16s} pid {h['pid']:<8d} device {h['device']}{extra}")
    if m.get("link") and m.get("world_size", 1) > 1:
        lines.append(f"# link: {m['link']}")
    return "\n".join(lines)


# -- tables -------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Column:
    top: str  # group label, shared by neighbours (centred over them)
    head: str
    width: int
    fmt: Callable[[dict], str]


def fnum(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-" if value is None else str(value)
    return format(value, spec)


def sig(value, digits: int = 4) -> str:
    """Fixed-point with ``digits`` significant figures (no exponent for table values)."""
    if value is None:
        return "-"
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    decimals = max(0, digits - 1 - int(math.floor(math.log10(abs(value)))))
    return f"{value:.{decimals}f}"


def gbps(value) -> str:
    """A bandwidth in GB/s in at most 8 characters, 4 significant figures."""
    if value is None or not math.isfinite(value):
        return "-" if value is None else str(value)
    if value >= 100:
        return f"{value:.1f}"
    if value >= 1e-3 or value == 0:
        return sig(value, 4)
    return f"{value:.2e}"


def table(columns: list[Column], rows: list[dict], head: bool = True) -> str:
    """Two ``#`` header lines (unless ``head`` is false), then one line per row."""
    body = ["  ".join(c.fmt(r).rjust(c.width) for c in columns) for r in rows]
    if not head:
        return "\n".join(body)
    tops, heads = [], []
    i = 0
    while i < len(columns):
        j = i
        while j + 1 < len(columns) and columns[j + 1].top == columns[i].top:
            j += 1
        span = sum(c.width for c in columns[i : j + 1]) + 2 * (j - i)
        tops.append(columns[i].top.center(span) if j > i else columns[i].top.rjust(span))
        i = j + 1
    heads = [c.head.rjust(c.width) for c in columns]
    return "\n".join(["#" + "  ".join(tops)[1:].rstrip(), "#" + "  ".join(heads)[1:].rstrip()] + body)


TABLE_WIDTH = 120  # nccl-tests' width: the default tables fit a terminal of this many columns


def _busbw(r) -> str:
    return "-" if r.get("world_size") == 1 else gbps(r["busbw_GBps"])


#: allreduce_table's cells, by field: each column shows one of them.
_CELLS = {
    "size": lambda r: str(r["bytes"]),
    "method": lambda r: r["method"],
    "iters": lambda r: str(r["iters"]),
    "time": lambda r: fnum(r["time_us"], ".1f"),
    "time_min": lambda r: fnum(r["time_us_min"], ".1f"),
    "time_max": lambda r: fnum(r["time_us_max"], ".1f"),
    "codec": lambda r: fnum(r["codec_us"], ".1f"),
    "wire": lambda r: fnum(r["wire_us"], ".1f"),
    "algbw": lambda r: gbps(r["algbw_GBps"]),
    "busbw": _busbw,
    "wire_bytes": lambda r: fnum(r["wire_bytes"], ".0f"),
    "ratio": lambda r: fnum(r["ratio"], ".2f"),
    "speedup_wire": lambda r: fnum(r.get("speedup_wire"), ".2f"),
    "speedup": lambda r: fnum(r.get("speedup_total"), ".2f"),
    "wrong": lambda r: "-" if r["wrong"] is None else str(r["wrong"]),
    "vnmse": lambda r: fnum(r["vnmse"], ".2e"),
}

#: (field, group header, header, width): the narrow table's columns, then the wide one's.
_NARROW = (("size", "size", "(B)", 11), ("method", "method", "", 7), ("time", "time", "(us)", 11),
           ("codec", "codec", "(us)", 10), ("wire", "wire", "(us)", 11), ("algbw", "algbw", "(GB/s)", 8),
           ("busbw", "busbw", "(GB/s)", 8), ("ratio", "ratio", "", 6), ("speedup", "speedup", "(x fp32)", 8),
           ("wrong", "#wrong", "", 6), ("vnmse", "vNMSE", "", 8))
_WIDE = (("size", "", "size(B)", 11), ("method", "", "method", 7), ("iters", "", "iters", 5),
         ("time", "time per allreduce (us)", "avg", 11), ("time_min", "time per allreduce (us)", "min", 11),
         ("time_max", "time per allreduce (us)", "max", 11), ("codec", "= codec + wire (us)", "codec", 10),
         ("wire", "= codec + wire (us)", "wire", 11), ("algbw", "GB/s", "algbw", 8), ("busbw", "GB/s", "busbw", 8),
         ("wire_bytes", "wire", "B/rank", 10), ("ratio", "wire", "ratio", 6),
         ("speedup_wire", "faster than fp32", "wire", 6), ("speedup", "faster than fp32", "total", 6),
         ("wrong", "error", "#wrong", 6), ("vnmse", "error", "vNMSE", 8))


def allreduce_table(rows: list[dict], head: bool = True, wide: bool = False) -> str:
    """One line per size and method: name and unit headers, at most :data:`TABLE_WIDTH`
    columns. ``wide`` adds min/max over ranks, wire bytes, the wire-only speedup and
    iterations (every figure is in ``--json`` either way)."""
    cols = [Column(group, header, width, _CELLS[field]) for field, group, header, width in (_WIDE if wide else _NARROW)]
    return table(cols, rows, head)


ONE_RANK_NOTE = ("# 1 rank: no network is measured (each collective returns its own input), so busbw is not "
                 "defined;\n# launch with mpirun -np N (N >= 2) to measure the wire. Codec times are still real.")


def allreduce_footer(rows: list[dict]) -> str:
    methods = list(dict.fromkeys(r["method"] for r in rows))
    avg = ", ".join(
        f"{m} {sum(r['busbw_GBps'] or 0 for r in rows if r['method'] == m) / sum(1 for r in rows if r['method'] == m):.4g}"
        for m in methods
    )
    wrong = sum(r["wrong"] or 0 for r in rows)
    lines = [f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'} (exact fp32 check)"]
    if any(r.get("world_size") == 1 for r in rows):
        lines.append("# Avg bus bandwidth: not defined for 1 rank (no network)")
    else:
        lines.append(f"# Avg bus bandwidth (GB/s, fp32-equivalent): {avg}")
    largest = max(r["bytes"] for r in rows)
    top = [r for r in rows if r["bytes"] == largest and r["kind"] != "fp32" and r.get("speedup_wire")]
    if top:
        parts = [f"{r['method']} collectives {r['speedup_wire']:.2f}x, whole allreduce {r['speedup_total']:.2f}x"
                 for r in top]
        lines.append(f"# At {format_size(largest)} vs fp32 (averages): " + "; ".join(parts))
        parts = [f"{r['method']} collectives {r['speedup_wire_median']:.2f}x, whole allreduce {r['speedup_total_median']:.2f}x"
                 for r in top if r.get("speedup_wire_median")]
        if parts:
            lines.append(f"# At {format_size(largest)} vs fp32 (medians):  " + "; ".join(parts))
        for r in top:
            p = r.get("phases_us", {})
            if "words" in p:
                lines.append(f"#   {r['method']} wire = scales MAX-allreduce {p.get('scales', 0) / 1e3:.2f} ms + words "
                             f"SUM-allreduce {p['words'] / 1e3:.2f} ms; codec = encode {r['encode_us'] / 1e3:.2f} ms "
                             f"+ decode {r['decode_us'] / 1e3:.2f} ms")
    for r in rows:
        if r["bytes"] == largest and r.get("topology") is not None:
            intra = r.get("intra_wire_bytes") or 0
            where = (f"{fnum(r['wire_bytes'], '.0f')} B between nodes, {intra:.0f} B inside the node" if intra
                     else f"{fnum(r['wire_bytes'], '.0f')} B (flat: one node, one rank per node, or topology=flat)")
            lines.append(f"#   {r['method']}: hhook.thc_allreduce timed whole (no codec/wire split); per rank and "
                         f"call {where}")
    lines.append("# time = codec (encode + decode) + wire (collectives, each after a barrier), averaged over ranks; "
                 "algbw = S/time,\n# busbw = algbw*2(n-1)/n with S the fp32 bytes; speedup = fp32 time / time; "
                 "min/max over ranks: --wide or --json")
    return "\n".join(lines)


def link_table(rows: list[dict]) -> str:
    cols = [
        Column("", "size(B)", 11, lambda r: str(r["bytes"])),
        Column("", "iters", 5, lambda r: str(r["iters"])),
        Column("one-way time (us), over pairs", "avg", 11, lambda r: fnum(r["time_us"], ".2f")),
        Column("one-way time (us), over pairs", "min", 11, lambda r: fnum(r["time_us_min"], ".2f")),
        Column("one-way time (us), over pairs", "max", 11, lambda r: fnum(r["time_us_max"], ".2f")),
        Column("bandwidth (GB/s)", "avg", 8, lambda r: gbps(r["algbw_GBps"])),
        Column("bandwidth (GB/s)", "min", 8, lambda r: gbps(r["bw_GBps_min"])),
        Column("bandwidth (GB/s)", "max", 8, lambda r: gbps(r["bw_GBps_max"])),
        Column("fit", "t(us)", 11, lambda r: fnum(r.get("fit_us"), ".2f")),
    ]
    return table(cols, rows)


def fit_line(fit: dict, pairs: int) -> str:
    beta = fit.get("beta_GBps")
    beta_text = f"{beta:.4g} GB/s ({fit['beta_Gbitps']:.4g} Gbit/s)" if beta is not None else "unbounded (no slope)"
    return (f"# Fit t(S) = alpha + S / beta over {fit['points']} sizes ({pairs} pair{'s' if pairs != 1 else ''}): "
            f"alpha = {fit['alpha_us']:.2f} us{' (clamped at 0)' if fit.get('alpha_clamped') else ''}, "
            f"beta = {beta_text}, R^2 = {fit['r2']:.5f}")


def model_table(rows: list[dict], model: str) -> str:
    rows = [r for r in rows if r["model"] == model]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    workers = list(dict.fromkeys(r["workers"] for r in rows))
    by = {(r["workers"], r["method"]): r for r in rows}
    cols = [Column("", "M", 5, lambda r: str(r["M"]))]
    for m in methods:
        cols.append(Column(m, "T(ms)", 9, lambda r, m=m: fnum(by[(r["M"], m)]["time_us"] / 1e3, ".1f")))
        cols.append(Column(m, "speedup", 7, lambda r, m=m: fnum(by[(r["M"], m)]["speedup"], ".2f")))
        if len({round(by[(M, m)]["ratio"], 6) for M in workers}) > 1:  # THC: the lane width grows with M
            cols.append(Column(m, "ratio", 5, lambda r, m=m: fnum(by[(r["M"], m)]["ratio"], ".2f")))
        if m != "fp32":
            cols.append(Column(m, "x fp32", 6, lambda r, m=m: fnum(by[(r["M"], m)]["speedup_vs_fp32"], ".2f")))
    return table(cols, [{"M": M} for M in workers])


MODEL_GUIDE = """\
# Which model to believe (speedup = C / T(M), against one worker that neither communicates nor compresses):
#   ring  applies when every worker has its own link and gradients are averaged by an allreduce (DDP, Horovod,
#         MPI, NCCL: how hhook runs). Each worker sends 2(M-1)/M of the gradient whatever M is.
#   paper is the THC paper's parameter-server form: one server link of rate chi carries all M workers'
#         gradients, so communication grows with M. It applies to a parameter server or one shared link;
#         for an allreduce cluster it is pessimistic at large M, and it ignores latency and codec time."""


def model_disagreement(rows: list[dict]) -> str:
    """One line naming where the two models part ways most for the compressed methods."""
    by = {(r["model"], r["method"], r["workers"]): r for r in rows}
    worst = None
    for (model, method, M), r in by.items():
        other = by.get(("paper", method, M)) if model == "ring" else None
        if other is None or M == 1:
            continue
        gap = max(r["speedup"], other["speedup"]) / max(min(r["speedup"], other["speedup"]), 1e-12)
        if worst is None or gap > worst[0]:
            worst = (gap, method, M, r["speedup"], other["speedup"])
    if worst is None:
        return "#"
    _, method, M, ring, paper = worst
    return (f"# The models differ most for {method} at M = {M}: ring {ring:.2f}x, paper {paper:.2f}x.\n"
            "# For hhook on an allreduce cluster, read the ring table.")


# -- JSON ---------------------------------------------------------------------
def _clean(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return _clean(float(obj))
    return obj


def write_json(path: str, meta_obj: dict, results: list[dict]) -> None:
    """``{"meta": ..., "results": [...]}``; non-finite numbers become ``null``."""
    with open(path, "w") as f:
        json.dump(_clean({"meta": meta_obj, "results": results}), f, indent=1)
        f.write("\n")


def read_json(path: str) -> dict:
    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or "results" not in doc:
        raise ValueError(f"{path} is not an hhook-profile JSON file (no 'results')")
    return doc
