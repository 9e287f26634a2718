"""``hhook-profile allreduce``: average a float32 buffer with each method, timed phase by
phase (:mod:`hhook.profile.collectives`)."""

from __future__ import annotations

from ..common import UsageError, add_comm_options, add_output_options, add_sweep_options, check_backend, \
    check_sweep, integer, run_distributed, say
from ..collectives import DEFAULT_METHODS
from ..units import iterations
from ..where import link_label


def add_parser(sub) -> None:
    sp = sub.add_parser("allreduce", help="fp32 vs THC vs fp16 vs zlib+allgather",
                        description="Average a float32 buffer with each method; time split into "
                        "codec and wire, algbw/busbw, wire bytes, ratio and error.")
    add_sweep_options(sp, "4K", "16M", 4.0, 20, 3)
    sp.add_argument("--methods", default=DEFAULT_METHODS,
                    help="comma-separated: fp32, thc, thc:BITS, fp16, zlib (default all, thc with --bits); "
                    "thc:BITS:topology=flat|auto|K times hhook.thc_allreduce whole, two-level across nodes "
                    "(with --backend gloo/nccl)")
    sp.add_argument("--bits", type=int, default=4, help="THC bits per coordinate, 1..8 (default 4)")
    sp.add_argument("--block-size", type=int, default=1024,
                    help="THC rotation block, a power of two (default 1024)")
    sp.add_argument("--seed", type=int, default=0, help="THC rotation seed and input seed (default 0)")
    sp.add_argument("--zlib-level", type=integer(0, 9), default=1,
                    help="zlib compression level 0..9 (default 1, fastest)")
    sp.add_argument("--no-check", action="store_true", help="skip #wrong and vNMSE (saves time and memory)")
    sp.add_argument("--no-barrier", action="store_true",
                    help="no barrier before each collective: wire time then includes waiting for slower ranks")
    sp.add_argument("--wide", action="store_true",
                    help="wide table (168 columns): min/max over ranks, wire bytes, wire-only speedup, iterations")
    add_output_options(sp)
    add_comm_options(sp)


def check(args, env) -> dict:
    from ...codec import THCCodec
    from ..collectives import parse_methods

    check_backend(args.backend)
    sizes = check_sweep(args, float32=True)
    try:
        THCCodec(args.bits, args.block_size, args.seed)  # hhook's checks of --bits, --block-size, --seed
        methods = parse_methods(args.methods, args.bits)
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from None
    with_topology = [m.name for m in methods if m.topology is not None]
    if with_topology and args.backend == "mpi":
        raise UsageError(f"{', '.join(with_topology)}: topology= runs hhook.thc_allreduce, which needs a "
                         "torch.distributed backend: add --backend gloo (or nccl)")
    return {"sizes": sizes, "methods": methods}


def run(args, cfg) -> int:
    return run_distributed(args, lambda args, comm: _measure(args, cfg, comm))


def _measure(args, cfg, comm) -> tuple[dict, list[dict]]:
    from .. import collectives, plot, report
    from ..progress import Progress

    sizes, methods = cfg["sizes"], cfg["methods"]
    total = sum(sum(iterations(s, args.iters, args.warmup, args.fixed_iters)) * (s + 4096) * len(methods)
                for s in sizes)
    rank0 = comm.rank == 0
    progress = Progress(total, enabled=rank0 and not args.quiet)
    if rank0:
        thc = [m for m in methods if m.kind == "thc"]
        if thc:
            from ...codec import THCCodec

            for m in thc:
                if m.topology is not None:
                    say(f"# {m.name}: hhook.thc_allreduce on THCState(bits={m.bits}, topology={m.topology!r}): "
                        "two-level on several nodes of several ranks (lanes for the nodes), else flat")
                    continue
                c = THCCodec(m.bits, args.block_size, args.seed, comm.size)
                say(f"# {m.name}: {c!r}, {c.layout.bits_per_code:.2f} bits/coordinate on the wire")
        say(f"# inputs: fp32 multiples of 1/128 (exact sums); others 0.01*N(0,1)*exp(0.5*N(0,1)) per rank, "
            f"seed {args.seed}")
        if comm.size == 1:
            say(report.ONE_RANK_NOTE)
        say(report.allreduce_table([], wide=args.wide))

    def show(size_rows):
        if rank0:
            progress.write(report.allreduce_table(size_rows, head=False, wide=args.wide))

    rows = collectives.measure(
        comm, methods, sizes, iters=args.iters, warmup=args.warmup, fixed=args.fixed_iters, seed=args.seed,
        block_size=args.block_size, zlib_level=args.zlib_level, barrier=not args.no_barrier,
        check=not args.no_check, progress=progress, on_rows=show,
    )
    progress.close()
    if rank0:
        say(report.allreduce_footer(rows))
        if args.plot:
            plot.save(args.plot, [lambda ax: plot.busbw_panel(ax, rows), lambda ax: plot.breakdown_panel(ax, rows)],
                      link=link_label(comm.size))
    return {"methods": [m.name for m in methods]}, rows
