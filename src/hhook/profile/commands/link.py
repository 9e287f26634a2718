"""``hhook-profile link``: ping-pong between ring neighbours and the alpha-beta fit
(:mod:`hhook.profile.link`)."""

from __future__ import annotations

import math

from ..common import UsageError, add_comm_options, add_output_options, add_sweep_options, check_backend, \
    check_sweep, run_distributed, say
from ..units import iterations
from ..where import link_label

NEED_RANKS = "link needs at least 2 ranks (ping-pong between neighbours)"


def add_parser(sub) -> None:
    sp = sub.add_parser("link", help="ping-pong between ring neighbours; alpha-beta fit",
                        description="Ping-pong between ring neighbours over a size sweep; "
                        "latency and bandwidth per size and a fitted t(S) = alpha + S / beta.")
    add_sweep_options(sp, "1", "16M", 2.0, 50, 5)
    add_output_options(sp)
    add_comm_options(sp)


def check(args, env) -> dict:
    check_backend(args.backend)
    sizes = check_sweep(args, float32=False)
    if env.world_size < 2:
        raise UsageError(f"{NEED_RANKS}; launch with mpirun -np N, N >= 2")
    return {"sizes": sizes}


def run(args, cfg) -> int:
    return run_distributed(args, lambda args, comm: _measure(args, cfg, comm), min_ranks=(2, NEED_RANKS))


def _measure(args, cfg, comm) -> tuple[dict, list[dict]]:
    from .. import link, plot, report
    from ..progress import Progress

    sizes = cfg["sizes"]
    rounds = link.ring_rounds(comm.size)
    total = sum((sum(iterations(s, args.iters, args.warmup, args.fixed_iters)) * (s + 4096)) * len(rounds)
                for s in sizes)
    progress = Progress(total, enabled=comm.rank == 0 and not args.quiet)
    rows = link.pingpong(comm, sizes, args.iters, args.warmup, args.fixed_iters, progress)
    progress.close()
    fit = link.fit_rows(rows)
    for r in rows:
        r["fit_us"] = fit.predict(r["bytes"]) * 1e6 if math.isfinite(fit.beta_Bps) else None
    extra = {"fit": fit.as_dict(), "pairs": [list(p) for rr in rounds for p in rr], "rounds": len(rounds)}
    if comm.rank == 0:
        n_pairs = sum(len(r) for r in rounds)
        say(f"# ping-pong: {n_pairs} neighbour pair(s) in {len(rounds)} round(s); one-way time = round trip / 2")
        say(report.link_table(rows))
        say(report.fit_line(extra["fit"], n_pairs))
        if args.plot:
            plot.save(args.plot, [lambda ax: plot.link_panel(ax, rows, extra["fit"])], link=link_label(comm.size))
    return extra, rows
