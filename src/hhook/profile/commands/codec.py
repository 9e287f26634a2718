"""``hhook-profile codec``: encode/decode throughput and vNMSE of the THC codec alone, fused
beside reference and a copy (:mod:`hhook.profile.codec_bench`); rank 0 only."""

from __future__ import annotations

import argparse

from ..common import UsageError, add_output_options, check_sizes, integer, integer_list, run_local, say, \
    size_list, word_list


def _device(text: str) -> str:
    if text not in ("cpu", "cuda") and not text.startswith("cuda:"):
        raise argparse.ArgumentTypeError(f"must be cpu or cuda, got {text!r}")
    return text


def add_parser(sub) -> None:
    cd = sub.add_parser("codec", help="THC encode/decode throughput, fused beside reference and copy",
                        description="Encode/decode throughput and vNMSE of the codec alone, beside a copy of "
                                    "the same tensor; runs on rank 0 only.")
    cd.add_argument("--sizes", type=size_list, default=[1 << 20, 25 << 20], metavar="LIST",
                    help="float32 bytes per tensor (default 1M,25M)")
    cd.add_argument("--bits", type=integer_list(), default=[4], metavar="LIST", help="bits, e.g. 2,4,8 (default 4)")
    cd.add_argument("--block-sizes", type=integer_list(), default=[1024], metavar="LIST", help="default 1024")
    cd.add_argument("--world-size", type=integer(1),
                    help="lane layout for this many ranks (default: the launcher's, or 4)")
    cd.add_argument("--repeats", type=integer(1), default=5, help="timed cycles, best reported (default 5)")
    cd.add_argument("--device", type=_device, default="cpu", help="cpu or cuda (default cpu)")
    cd.add_argument("--threads", type=integer_list(1), metavar="LIST",
                    help="torch threads, e.g. 1,2 (default: torch's own)")
    cd.add_argument("--impl", type=word_list, metavar="LIST",
                    help="fused,reference (default: both where a fused backend works here)")
    cd.add_argument("--rounding", type=word_list, metavar="LIST", default=["correlated", "independent"],
                    help="correlated,independent (default: both, A/B in one run)")
    add_output_options(cd)


def check(args, env) -> dict:
    from ...codec import ROUNDINGS, THCCodec
    from ..codec_bench import IMPLS, fused_available

    check_sizes(args.sizes, float32=True)
    world = args.world_size if args.world_size is not None else (env.world_size if env.world_size > 1 else 4)
    for bits in args.bits:
        for block in args.block_sizes:
            try:
                THCCodec(bits, block, 0, world)
            except (ValueError, TypeError) as e:
                raise UsageError(str(e)) from None
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device available")
    impls = args.impl if args.impl is not None else [i for i in IMPLS if i != "fused" or fused_available(args.device)]
    bad = [i for i in impls if i not in IMPLS]
    if bad or not impls:
        raise UsageError(f"--impl takes {','.join(IMPLS)}, got {','.join(impls) or 'nothing'}")
    if "fused" in impls and not fused_available(args.device):
        raise UsageError(f"--impl fused: no fused codec backend works for {args.device} here (see the log above)")
    bad = [r for r in args.rounding if r not in ROUNDINGS]
    if bad or not args.rounding:
        raise UsageError(f"--rounding takes {','.join(ROUNDINGS)}, got {','.join(args.rounding) or 'nothing'}")
    return {"world": world, "impls": impls, "threads": args.threads or [None], "rank0": env.rank == 0}


def run(args, cfg) -> int:
    return run_local(args, lambda args: _measure(args, cfg), cfg["rank0"])


def _measure(args, cfg) -> tuple[dict, list[dict]]:
    from ...codec.kernels import cpu as cpu_kernels
    from ...codec import THCCodec
    from .. import codec_bench, plot
    from ..progress import Progress

    total = (len(args.sizes) * len(args.bits) * len(args.block_sizes) * len(cfg["threads"]) * len(cfg["impls"])
             * len(args.rounding))
    progress = Progress(total, enabled=not args.quiet)
    try:
        rows = codec_bench.codec_rows(args.sizes, args.bits, args.block_sizes, cfg["world"], args.repeats,
                                      args.device, cfg["threads"], cfg["impls"], progress, args.rounding)
    finally:
        progress.close()
    if cpu_kernels.build_info:
        b = cpu_kernels.build_info
        how = f"compiled in {b['compile_seconds']:.2f} s" if b.get("compiled") else "loaded from the cache"
        say(f"# fused CPU codec: {how}, ready after {b.get('seconds', 0.0):.3f} s ({b['path']})")
    say(codec_bench.format_table(rows))
    results = []
    for r in rows:
        size, ws = int(r["size_bytes"]), int(r["world_size"])
        wire = THCCodec(int(r["bits"]), int(r["block_size"]), 0, ws).wire_bytes(size // 4)
        t_us = (r["encode_ms"] + r["decode_ms"]) * 1e3
        results.append({**r, "op": "codec", "method": "thc", "bytes": size, "time_us": t_us,
                        "algbw_GBps": r["GBps"], "busbw_GBps": r["GBps"], "wire_bytes": wire,
                        "ratio": size / wire, "codec_us": t_us, "encode_us": r["encode_ms"] * 1e3,
                        "decode_us": r["decode_ms"] * 1e3, "vnmse": r["vnmse"]})
    if args.plot:
        plot.save(args.plot, [lambda ax: plot.codec_panel(ax, results)],
                  link="none: the codec alone, in one process (no network)")
    return {"world_size_layout": cfg["world"], "cpu_build": dict(cpu_kernels.build_info)}, results
