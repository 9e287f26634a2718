"""``hhook-profile model``: predicted time per update and speedup against the number of
workers (the ring and the paper's model), or with ``--layouts`` the scale model of nodes x
ranks per node, flat and two-level THC; the maths is :mod:`hhook.profile.models`. With
``--gpu-cluster``: the gradient exchange per step on a GPU cluster, THC against the
bf16/fp16 hook and fp32 (:mod:`hhook.profile.gpu_model`, its assumptions printed)."""

from __future__ import annotations

import dataclasses

from ..common import UsageError, _listed, add_output_options, assignment, integer, integer_list, number, rate, \
    run_local, say, size
from ..units import format_size, parse_size


def add_parser(sub) -> None:
    md = sub.add_parser("model", help="predicted speedup against the number of workers",
                        description="Predicted time per update and speedup against M with the alpha-beta "
                        "ring model and the homomorphic-compression paper's T = h C / M + rho M W / chi.")
    md.add_argument("--compute-ms", type=number(0), default=250.0,
                    help="C: compute time of one (global) batch on one worker, ms (default 250)")
    md.add_argument("--model-bytes", type=size, default=parse_size("100MB"), metavar="SIZE",
                    help="W: float32 gradient bytes per update (default 100MB, ResNet-50-sized)")
    md.add_argument("--workers", type=integer_list(1), default=[1, 2, 4, 8, 16, 32, 64], metavar="LIST",
                    help="values of M (default 1,2,4,...,64)")
    md.add_argument("--link-json", metavar="PATH", help="alpha and beta from a `link --json` file")
    md.add_argument("--alpha-us", type=number(0, strict=False),
                    help="latency per message in us (default 50, or --link-json)")
    md.add_argument("--beta", type=rate, metavar="RATE",
                    help="link bandwidth, e.g. 1gbit, 100mbit, 0.117GB/s (default 1gbit, or --link-json)")
    md.add_argument("--allreduce-json", metavar="PATH", action="append", default=[],
                    help="ratios and codec times of every method from an `allreduce --json` file "
                    "(repeatable: results are merged, the size nearest --model-bytes is used)")
    md.add_argument("--ratio", type=assignment(), action="append", default=[], metavar="METHOD=R",
                    help="compression ratio (original/compressed) of a method; repeatable")
    md.add_argument("--codec-ms", type=assignment(strict=False), action="append", default=[], metavar="METHOD=MS",
                    help="codec time per update at W for a method; repeatable")
    md.add_argument("--h", type=assignment(), action="append", default=[], metavar="METHOD=H",
                    help="paper model's overhead factor h for a method (default 1); repeatable")
    md.add_argument("--bits", type=int, default=4, help="THC bits when no allreduce JSON gives them (default 4)")
    md.add_argument("--block-size", type=int, default=1024, help="THC block size for the layout (default 1024)")
    md.add_argument("--fixed-ratio", action="store_true",
                    help="use the measured THC ratio at every M instead of the lane layout at M")
    md.add_argument("--layouts", metavar="LIST",
                    help="the scale model instead: NODESxRANKS layouts, e.g. 1x2,2x2,8x8,128x8 (fp32, bf16, flat "
                    "and two-level THC; docs/topology.md)")
    md.add_argument("--scale-inputs", metavar="PATH",
                    help="measured inputs of the scale model (JSON, bench/topology-inputs.json); with --layouts")
    md.add_argument("--baselines", default="sbc,lgc", metavar="LIST",
                    help="benchmark baselines whose traffic per rank and step against M is predicted next to "
                    "fp32 and THC: sbc[:p=P][:delay=H], lgc[:k=K] (as in train --methods; docs/baselines.md); "
                    "'' for none (default sbc,lgc)")
    md.add_argument("--plot-models", choices=("ring", "paper", "both"), default="ring",
                    help="models drawn in the speedup panel (default ring: the one that applies to "
                    "allreduce, hence to hhook; both tables are printed and in --json either way)")
    md.add_argument("--gpu-cluster", action="store_true",
                    help="instead: a model of the gradient exchange per step on a GPU cluster, THC against the "
                    "bf16/fp16 hook and fp32, 8-512 GPUs at 10/25/100/400 Gbit/s (hhook.profile.gpu_model); "
                    "uses --model-bytes, --bucket-bytes, --alpha-us (default 10 here), --bits, --block-size")
    md.add_argument("--bucket-bytes", type=size, default=parse_size("25MB"), metavar="SIZE",
                    help="--gpu-cluster: float32 bytes per bucket (default 25MB, DDP's)")
    md.add_argument("--from", dest="from_json", metavar="PATH",
                    help="--gpu-cluster: the per-bucket times measured by ci/gpu_check.sh on a GPU, from its JSON "
                    "(the speed stage's float32 row nearest --bucket-bytes: THC's encode + decode, the fp16 hook's "
                    "casts, the host's time to issue a bucket; else the throughput stage's, with --cast-ms)")
    md.add_argument("--diloco", type=integer(1), metavar="H",
                    help="instead: a model of bytes and wall time per token across sites, DDP's exchange at every step "
                    "(fp32, THC) against hhook.diloco's every H steps, 2-64 sites at 0.1/1/10 Gbit/s with round trips "
                    "(hhook.profile.diloco_model); uses --model-bytes, --compute-ms, --bits and the options below")
    md.add_argument("--fragments", type=integer(1), default=4, metavar="P",
                    help="--diloco: fragments of the streamed exchange (default 4)")
    md.add_argument("--overlap", type=integer(0), default=2, metavar="T",
                    help="--diloco: inner steps a streamed fragment's exchange may hide behind (default 2)")
    md.add_argument("--rtt-ms", type=number(0, strict=False), default=100.0, metavar="MS",
                    help="--diloco: round trip between sites, ms (default 100: 50 ms each way)")
    md.add_argument("--sites", type=integer_list(1), default=[2, 4, 8, 16, 32, 64], metavar="LIST",
                    help="--diloco: numbers of sites (default 2,4,...,64)")
    md.add_argument("--links", type=lambda text: _listed(number(0), text), default=[0.1, 1.0, 10.0], metavar="LIST",
                    help="--diloco: link rates between sites in Gbit/s (default 0.1,1,10)")
    md.add_argument("--tokens-per-step", type=integer(1), default=1024, metavar="N",
                    help="--diloco: tokens per rank and inner step (default 1024: the gpt task's 16 x 64)")
    md.add_argument("--ranks-per-site", type=integer(1), default=1, metavar="K",
                    help="--diloco: ranks per site, each on its own ring (default 1)")
    md.add_argument("--codec-gbps", type=number(0), default=2.0, metavar="GB/S",
                    help="--diloco: THC encode + decode throughput, GB/s (default 2: the fused CPU codec, one thread)")
    md.add_argument("--thc-ms", type=number(0, strict=False), metavar="MS",
                    help="--gpu-cluster: THC encode + decode per bucket, ms (default: from --from, else measured on "
                    "this GPU; required without either)")
    md.add_argument("--cast-ms", type=number(0, strict=False), metavar="MS",
                    help="--gpu-cluster: the half-precision hook's casts per bucket, ms (default: from --from, else "
                    "measured on this GPU; required without either)")
    md.add_argument("--host-us", type=number(0, strict=False), metavar="US",
                    help="--gpu-cluster: the host's time to issue THC's bucket, us (default: from --from, else "
                    "measured on this GPU, else 0)")
    add_output_options(md)


def check(args, env) -> dict:
    """The link, the sizes and every method's ratio and codec time."""
    from ...codec import THCCodec
    from .. import models, report

    if args.gpu_cluster and args.plot:
        raise UsageError("model --gpu-cluster draws no plot: drop --plot (its table and --json hold the figures)")
    try:
        THCCodec(args.bits, args.block_size)
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from None
    gpu_times = _gpu_times(args) if args.gpu_cluster else None
    W = float(args.model_bytes)
    alpha, beta, link_doc, ar_doc = 50e-6, 1e9 / 8, None, None
    try:
        if args.link_json:
            link_doc = report.read_json(args.link_json)
            alpha, beta = models.fit_from_link(link_doc)
        for path in args.allreduce_json:
            doc = report.read_json(path)
            if ar_doc is None:
                ar_doc = {"meta": doc.get("meta", {}), "results": []}
            ar_doc["results"] += doc["results"]
    except (OSError, ValueError, KeyError) as e:
        path = getattr(e, "filename", None) or (args.link_json if link_doc is None and args.link_json
                                                else ", ".join(args.allreduce_json))
        raise UsageError(f"cannot use {path}: {e}") from None
    if args.alpha_us is not None:
        alpha = args.alpha_us * 1e-6
    if args.beta is not None:
        beta = args.beta
    if alpha < 0:
        alpha = 0.0  # a fit may land a hair below zero on a fast link
    methods = {"fp32": models.ModelMethod("fp32", 1.0)}
    if ar_doc is not None:
        try:
            for m in models.methods_from_allreduce(ar_doc, W):
                methods[m.name] = m if m.name != "fp32" else methods["fp32"]
        except (ValueError, KeyError, TypeError) as e:
            raise UsageError(f"cannot use {', '.join(args.allreduce_json)}: {e}") from None
    elif not args.ratio:
        methods["thc"] = models.ModelMethod("thc", 1.0, bits=args.bits, block_size=args.block_size)
        methods["fp16"] = models.ModelMethod("fp16", 2.0)
    for name, ratio in args.ratio:
        old = methods.get(name)
        coll = "allgather" if name.split(":")[0] == "zlib" else "allreduce"
        methods[name] = models.ModelMethod(name, ratio, old.encode_s if old else 0.0, old.decode_s if old else 0.0,
                                           old.n_ref if old else 1, old.collective if old else coll)
    for flag, pairs in (("--codec-ms", args.codec_ms), ("--h", args.h)):
        for name, value in pairs:
            if name not in methods:
                raise UsageError(f"{flag} {name}={value:g}: no method {name!r} (known: {', '.join(methods)})")
            if flag == "--codec-ms":
                methods[name] = dataclasses.replace(methods[name], encode_s=value * 1e-3, decode_s=0.0)
            else:
                methods[name] = dataclasses.replace(methods[name], h=value)
    baselines = []
    if args.baselines.strip():
        from .. import methods as method_kinds

        try:
            baselines = method_kinds.parse(args.baselines, (method_kinds.SBC, method_kinds.LGC))
        except ValueError as e:
            raise UsageError(f"--baselines: {e}") from None
    return {"alpha": alpha, "beta": beta, "W": W, "C": args.compute_ms * 1e-3, "methods": list(methods.values()),
            "link_doc": link_doc, "ar_doc": ar_doc, "rank0": env.rank == 0, "baselines": baselines,
            "gpu_times": gpu_times}


def _gpu_times(args) -> dict | None:
    """``--gpu-cluster``'s per-bucket times as far as the options and ``--from`` give them
    (the options win); None for each one left to measure on this GPU. UsageError where
    one is missing and there is no GPU."""
    from .. import gpu_model

    times = {"codec_s": None, "cast_s": None, "host_s": None, "source": "given"}
    if args.from_json:
        try:
            times = gpu_model.from_check(args.from_json, int(args.bucket_bytes))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UsageError(f"model --from {args.from_json}: {e}") from None
    for key, value, scale in (("codec_s", args.thc_ms, 1e-3), ("cast_s", args.cast_ms, 1e-3),
                              ("host_s", args.host_us, 1e-6)):
        if value is not None:
            times[key] = value * scale
            times["source"] += f"; {key[:-2]} given" if args.from_json else ""
    if times["codec_s"] is None or times["cast_s"] is None:
        import torch

        if not torch.cuda.is_available():
            raise UsageError("model --gpu-cluster: no GPU here to measure the codec on: give --from (a "
                             "ci/gpu_check.sh JSON), or --thc-ms and --cast-ms (e.g. from ci/gpu_check.sh --only speed)"
                             + (" (the file has no fp16 casts: its speed stage did not run)" if args.from_json else ""))
    return times


def run(args, cfg) -> int:
    if args.diloco:
        return run_local(args, lambda args: _diloco(args), cfg["rank0"])
    if args.gpu_cluster:
        return run_local(args, lambda args: _gpu_cluster(args, cfg["gpu_times"]), cfg["rank0"])
    return run_local(args, lambda args: _scale(args, cfg) if args.layouts else _predict(args, cfg), cfg["rank0"])


def _diloco(args) -> tuple[dict, list[dict]]:
    """``model --diloco H`` (:mod:`hhook.profile.diloco_model`): the table, its assumptions."""
    from .. import diloco_model

    if args.overlap > args.diloco // args.fragments or args.fragments > args.diloco:
        raise UsageError(f"--fragments {args.fragments} and --overlap {args.overlap} need P <= H and overlap <= H/P "
                         f"(H = {args.diloco})")
    given = dict(W=float(args.model_bytes), compute_s=args.compute_ms * 1e-3, every=args.diloco,
                 fragments=args.fragments, overlap=args.overlap, bits=args.bits, rtt_s=args.rtt_ms * 1e-3,
                 tokens_per_rank=args.tokens_per_step, ranks_per_site=args.ranks_per_site,
                 codec_bps=args.codec_gbps * 1e9)
    rows = diloco_model.rows(**given, sites=sorted(set(args.sites)), links_gbit=sorted(set(args.links)))
    say(diloco_model.assumptions(**given))
    say(diloco_model.table(rows))
    if args.plot:
        from .. import plot

        links = sorted(set(args.links))
        plot.save(args.plot, [lambda ax, g=g: diloco_model.panel(ax, rows, g) for g in links],
                  link=f"modelled: {', '.join(f'{g:g}' for g in links)} Gbit/s between sites, round trip "
                  f"{args.rtt_ms:g} ms (a model, not a measurement)")
    return {"model": "diloco", "labelled": "a model, not a measurement", **given}, rows


def _gpu_cluster(args, times: dict) -> tuple[dict, list[dict]]:
    """``model --gpu-cluster`` (:mod:`hhook.profile.gpu_model`): per-bucket times from
    ``--from``, given, or measured on this GPU, then the modelled exchange per step."""
    from .. import gpu_model

    W, bucket = int(args.model_bytes), int(args.bucket_bytes)
    times = dict(times)
    if times["codec_s"] is None or times["cast_s"] is None:  # _gpu_times made sure a GPU is here
        import torch

        measured = gpu_model.measured_seconds(bucket, args.bits, args.block_size)
        for key in ("codec_s", "cast_s", "host_s"):
            times[key] = measured[key] if times[key] is None else times[key]
        times["source"] = f"measured on {torch.cuda.get_device_name()}" + (
            "" if times["source"] == "given" else f" ({times['source']})")
    host_s = times["host_s"] or 0.0
    alpha = (args.alpha_us if args.alpha_us is not None else 10.0) * 1e-6
    rows = gpu_model.exchange_rows(times["codec_s"], times["cast_s"], bucket, W, alpha, bits=args.bits,
                                   block_size=args.block_size, host_s=host_s)
    say(gpu_model.assumptions(times["codec_s"], times["cast_s"], bucket, W, alpha, args.bits, times["source"], host_s))
    say(gpu_model.table(rows))
    return {"model": "gpu_cluster", "thc_ms_per_bucket": times["codec_s"] * 1e3, "cast_ms_per_bucket": times["cast_s"] * 1e3,
            "host_us_per_bucket": host_s * 1e6, "codec_source": times["source"], "alpha_us": alpha * 1e6,
            "bucket_bytes": bucket, "model_bytes": W}, rows


def _predict(args, cfg) -> tuple[dict, list[dict]]:
    from .. import models, plot, report

    alpha, beta, C, W = cfg["alpha"], cfg["beta"], cfg["C"], cfg["W"]
    rows = models.predict(cfg["methods"], sorted(set(args.workers)), C, W, alpha, beta, args.fixed_ratio)
    src = f"fit in {args.link_json}" if cfg["link_doc"] and args.alpha_us is None and args.beta is None else "given"
    say(f"# link: alpha = {alpha * 1e6:.2f} us, beta = {beta / 1e9:.4g} GB/s ({beta * 8 / 1e9:.4g} Gbit/s) ({src})")
    say(f"# C = {C * 1e3:g} ms compute per batch on one worker, W = {format_size(W)} of float32 gradients")
    for m in cfg["methods"]:
        ratio = "lane layout at M" if m.bits is not None and not args.fixed_ratio else f"{m.ratio:.3f}"
        say(f"#   {m.name:<7s} ratio {ratio}, codec {m.encode_s * 1e3:.2f} ms encode + {m.decode_s * 1e3:.2f} ms decode"
            f"{f' (x M/{m.n_ref})' if m.collective == 'allgather' else ''}, {m.collective}, h = {m.h:g}")
    unmeasured = [m.name for m in cfg["methods"] if m.name != "fp32" and m.encode_s == 0 and m.decode_s == 0]
    if unmeasured:
        say(f"# NOTE codec time ASSUMED 0 ms for {', '.join(unmeasured)}: not measured, their predictions omit encode\n"
            "#   and decode (give --allreduce-json from `hhook-profile allreduce --json`, or --codec-ms METHOD=MS)")
    say("#")
    say(report.MODEL_GUIDE)
    say("#")
    say("# Ring (alpha-beta): T = C/M + 2(M-1) alpha + 2(M-1)/M (W/ratio)/beta + codec "
        "[allgather: (M-1)(alpha + (W/ratio)/beta)]")
    say(report.model_table(rows, "ring"))
    say("#")
    say("# Paper model: T = h C/M + rho M W/chi, rho = 1/ratio, chi = beta (no latency, no codec time)")
    say(report.model_table(rows, "paper"))
    say(report.model_disagreement(rows))
    if cfg.get("baselines"):
        traffic = models.baseline_traffic(cfg["baselines"], sorted(set(args.workers)), W, alpha, beta, args.bits,
                                          args.block_size)
        say("#")
        say(f"# Traffic per rank and step against M, {int(W) // 4} float32 gradients (hhook.baselines.traffic):")
        say("# MB one rank receives (ring collectives) and communication ms (alpha-beta; codec time not modelled)")
        for b in cfg["baselines"]:
            o = b.options
            if b.kind == "sbc":
                from ...baselines.golomb import expected_bits_per_position

                say(f"#   {b.name}: all-gather every {o['delay']} steps, Golomb-coded positions at "
                    f"{expected_bits_per_position(o['p']):.2f} bits (p = {o['p']:g}): grows with M")
            else:
                say(f"#   {b.name}: LGC-RAR compressed phase (k = {o['k']:g}): mask broadcast + allreduce "
                    "of k/4 latents: bounded (patented)")
        say(f"#   thc:{args.bits}: allreduce of the lane words (lane width grows with log2 M only)")
        say(models.traffic_table(traffic))
        rows = rows + traffic
    if args.plot:
        panels = []
        link_doc, ar_doc = cfg["link_doc"], cfg["ar_doc"]
        fit = None
        if link_doc:
            from ..link import fit_rows

            pings = [r for r in link_doc["results"] if r.get("op") == "pingpong"]
            # Refit with the current fit (as the model does) rather than trusting the file's.
            fit = fit_rows(pings).as_dict() if len({r["bytes"] for r in pings}) >= 2 else link_doc["meta"].get("fit")
            panels.append(lambda ax: plot.link_panel(ax, link_doc["results"], fit))
        if ar_doc:
            panels.append(lambda ax: plot.busbw_panel(ax, ar_doc["results"], fit))
            panels.append(lambda ax: plot.breakdown_panel(ax, ar_doc["results"]))
        drawn = ("ring", "paper") if args.plot_models == "both" else (args.plot_models,)
        panels.append(lambda ax: plot.speedup_panel(ax, rows, drawn))
        measured = f"; measured on: {link_doc['meta']['link']}" if link_doc and link_doc["meta"].get("link") else ""
        plot.save(args.plot, panels, link=f"modelled, alpha {alpha * 1e6:.3g} us, {beta * 8 / 1e9:.4g} Gbit/s ({src})"
                  f"{measured}; codec time assumed 0 ms for {', '.join(unmeasured) or 'none'}")
    extra = {"alpha_us": alpha * 1e6, "beta_GBps": beta / 1e9, "compute_ms": C * 1e3, "model_bytes": W,
             "link_json": args.link_json, "allreduce_json": args.allreduce_json,
             "codec_assumed_zero": unmeasured}
    return extra, rows


def _scale(args, cfg: dict) -> tuple[dict, list[dict]]:
    """``model --layouts``: the scale model's tables (fixed bits and auto), the validation
    against measured step times when the inputs JSON holds them, and the plot."""
    try:
        return _scale_tables(args, cfg)
    except (OSError, ValueError, KeyError) as e:
        raise UsageError(f"model --layouts: {e}") from None


def _scale_tables(args, cfg: dict) -> tuple[dict, list[dict]]:
    import json

    from ..scale_model import bits_panel, inputs_from_json, parse_layouts, scale_rows, scale_table, speedup_panel, \
        validation_rows

    doc = {}
    if args.scale_inputs:
        with open(args.scale_inputs) as fh:
            doc = json.load(fh)
    override = {}
    if args.link_json or args.alpha_us is not None or args.beta is not None or "alpha_inter_us" not in doc:
        override.update(alpha_inter=cfg["alpha"], beta_inter=cfg["beta"])
    if "compute_ms" not in doc:
        override["compute_s"] = cfg["C"]
    if "model_bytes" not in doc:
        override["model_bytes"] = cfg["W"]
    doc = {"alpha_intra_us": 5.0, "beta_intra_GBps": 100.0, "codec_GBps": 20.0, **doc}  # NVLink-class defaults
    inp = inputs_from_json(doc, bits=args.bits, block_size=args.block_size, **override)
    layouts = parse_layouts(args.layouts)
    rows = scale_rows(inp, layouts)
    auto = dataclasses.replace(inp, bits="auto")
    auto_rows = [dict(r, auto_bits=True) for r in scale_rows(auto, layouts) if r["method"] in ("thc", "thc2")]
    f = lambda v: f"{v:.4g}"  # noqa: E731
    say(f"# Scale model (per step, no overlap): C = {inp.compute_s * 1e3:.4g} ms, W = {inp.model_bytes / 1e6:.4g} MB; "
        f"between nodes alpha {f(inp.alpha_inter * 1e6)} us, beta {f(inp.beta_inter / 1e9)} GB/s per node; inside "
        f"alpha {f(inp.alpha_intra * 1e6)} us, beta {f(inp.beta_intra / 1e9)} GB/s; codec {f(inp.codec_Bps / 1e9)} GB/s "
        f"+ {f(inp.codec_call_s * 1e3)} ms x {inp.calls} calls; host cores {inp.host_cores or 'one node each'}; "
        f"two-level intra {inp.intra}")
    say(f"# THC at bits={inp.bits}: wire bits/coord between nodes (and bits used) per layout")
    say(scale_table(rows))
    say("#")
    say('# THC at bits="auto" (hhook.codec.error_model.auto_bits: no worse than 4 bits at 4 ranks)')
    say(scale_table([r for r in rows if r["method"] in ("fp32", "bf16")] + auto_rows))
    rows += auto_rows
    if doc.get("measured"):
        check = validation_rows(inp, doc["measured"])
        say("#")
        say("# Validation against measured step times (ms)")
        for r in check:
            say(f"#   {r['layout']:>5s} {r['method']:<5s} measured {r['measured_ms']:8.1f} predicted "
                f"{r['predicted_ms']:8.1f} ({r['error'] * 100:+.0f}%)")
        rows += check
    if args.plot:
        from .. import plot

        sc = [r for r in rows if r["op"] == "scale"]
        plot.save(args.plot, [lambda ax: speedup_panel(ax, sc, "fp32"), lambda ax: speedup_panel(ax, sc, "bf16"),
                              lambda ax: bits_panel(ax, sc)],
                  link=f"modelled: between nodes alpha {f(inp.alpha_inter * 1e6)} us, {f(inp.beta_inter * 8 / 1e9)} "
                  f"Gbit/s per node; inside alpha {f(inp.alpha_intra * 1e6)} us, {f(inp.beta_intra / 1e9)} GB/s")
    extra = {"scale_inputs": dataclasses.asdict(inp), "layouts": [f"{N}x{k}" for N, k in layouts]}
    return extra, rows
