"""Old against new: the codec's kernels and host path of two checkouts, side by side in one run.

The same measurements run in child processes of each checkout, alternating old, new, old,
new (``--rounds``), and the medians are printed side by side with new / old:

* on a GPU (the default when one is there): THCCodec's encode + decode of a bucket
  (allocations included), each stage alone, the host's time to issue one bucket, the fp16
  hook's casts and a copy of the bucket (``hhook.profile.codec_bench``'s timers, CUDA
  events), and FSDP2's all-gather codec (``WeightCodec``, 8 bits, blocks of 256);
* ``--host-only`` (anywhere): CPU tensors through the CUDA path with the kernel launches
  stubbed out, the Python time per bucket of prepare + quantize + decode (the host's work
  without the GPU's).

The old checkout: ``--old-tree DIR`` (a directory holding ``hhook/`` or ``src/hhook/``), or ``--old REV``
exported with ``git archive`` (default ``main``)::

    python measure/kernel_ab.py                          # on a GPU: main against this checkout
    python measure/kernel_ab.py --host-only --rounds 5   # anywhere
    python measure/kernel_ab.py --old-tree /tmp/old --sizes 25,100 --json ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r'''
import json, statistics, sys, time
import torch
from hhook.codec import THCCodec
from hhook.profile import codec_bench as bench

args = json.loads(sys.argv[1])
out = {}
codec = THCCodec(bits=4, block_size=1024, seed=1, world_size=16)
if args["host_only"]:
    from hhook.codec import codec as codec_module
    from hhook.codec.kernels import cuda as cuda_kernels
    codec_module.fused_backend = lambda x, block: cuda_kernels
    cuda_kernels._launch = lambda launch, device: None
    for mb in args["sizes"]:
        x = torch.zeros(int(mb * 1e6) // 4)
        out_t = torch.empty_like(x)
        p = codec.prepare(x)
        agreed = p.scales.clone()
        agreed[3] += 1
        def bucket():
            q = codec.prepare(x)
            codec.decode(q, agreed, codec.quantize(q, agreed, 7), out_t)
        for _ in range(20):
            bucket()
        times = []
        for _ in range(args["iters"]):
            t0 = time.perf_counter()
            bucket()
            times.append(time.perf_counter() - t0)
        out[f"host_us_stubbed_{mb}MB"] = statistics.median(times) * 1e6
else:
    from hhook.codec.weights import WeightCodec
    for mb in args["sizes"]:
        for name in args["dtypes"]:
            dtype = getattr(torch, name)
            x = torch.randn(int(mb * 1e6) // dtype.itemsize, device="cuda").to(dtype)
            tag = f"{mb}MB_{name}"
            out[f"thc_ms_{tag}"] = bench.roundtrip_seconds(codec, x, args["iters"]) * 1e3
            for k, v in bench.stage_times(codec, x, args["iters"]).items():
                out[f"{k[:-2]}_ms_{tag}"] = v * 1e3
            out[f"fp16_hook_ms_{tag}"] = bench.fp16_hook_seconds(x, args["iters"], 16) * 1e3
            out[f"host_us_{tag}"] = bench.host_time_per_bucket(codec, x, args["iters"]) * 1e6
            del x
        n = int(mb * 1e6) // 4 // 256 * 256
        w = bench.weight_codec_times(WeightCodec(8, 256), torch.randn(n, device="cuda"), args["iters"])
        out.update({f"allgather_{k[:-2]}_ms_{mb}MB": v * 1e3 for k, v in w.items() if k.endswith("_s")})
        torch.cuda.empty_cache()
    out["device"] = torch.cuda.get_device_name()
print("RESULT " + json.dumps(out))
'''


def export(rev: str) -> Path:
    """``hhook/`` at git revision ``rev``, in a temporary directory (``src/hhook/`` since the
    src layout, ``hhook/`` before it)."""
    folder = Path(tempfile.mkdtemp(prefix="hhook-old-"))
    archive = folder / "old.tar"
    src = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{rev}:src/hhook"]).returncode == 0
    subprocess.run(["git", "-C", str(ROOT), "archive", "-o", str(archive), rev, "src/hhook" if src else "hhook"],
                   check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(folder)
    archive.unlink()
    return folder


def run_child(tree: Path, args: dict, timeout: float) -> dict:
    package = tree / "src" if (tree / "src" / "hhook").is_dir() else tree  # the src layout, or a tree before it
    env = {**os.environ, "PYTHONPATH": str(package)}
    env.pop("HHOOK_FORCE_REFERENCE", None)
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], cwd=package, env=env, capture_output=True,
                          text=True, timeout=timeout)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"the child in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", default="main", help="git revision of the old kernels (default main)")
    ap.add_argument("--old-tree", type=Path, default=None, help="a directory holding the old hhook/ (or src/hhook/) instead")
    ap.add_argument("--new-tree", type=Path, default=ROOT, help="default: this checkout")
    ap.add_argument("--rounds", type=int, default=2, help="alternations of old and new")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--sizes", default="25,100", help="bucket MB, comma-separated")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--host-only", action="store_true", help="CPU tensors, launches stubbed: the host's Python")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per child")
    ap.add_argument("--json", type=Path, default=None, help="write the medians and ratios here")
    a = ap.parse_args(argv)
    if not a.host_only:
        import torch

        if not torch.cuda.is_available():
            a.host_only = True
            print("# no CUDA device: --host-only", flush=True)
    trees = {"old": a.old_tree or export(a.old), "new": a.new_tree}
    args = {"host_only": a.host_only, "iters": a.iters, "sizes": [float(s) for s in a.sizes.split(",")],
            "dtypes": a.dtypes.split(",")}
    runs = {"old": [], "new": []}
    for r in range(a.rounds):
        for side in ("old", "new"):
            runs[side].append(run_child(trees[side], args, a.timeout))
            print(f"# round {r + 1}: {side} done", flush=True)
    keys = [k for k in runs["new"][0] if k != "device" and k in runs["old"][0]]
    table = {}
    print(f"# {runs['new'][0].get('device', 'cpu (launches stubbed)')}; old: {trees['old']}, new: {trees['new']}; "
          f"medians of {a.rounds} alternating rounds")
    print(f"{'metric':40s} {'old':>10} {'new':>10} {'new/old':>8}")
    for k in keys:
        old = statistics.median(run[k] for run in runs["old"])
        new = statistics.median(run[k] for run in runs["new"])
        table[k] = {"old": old, "new": new, "new_over_old": new / old if old else None}
        print(f"{k:40s} {old:>10.4g} {new:>10.4g} {new / old if old else float('nan'):>7.2f}x")
    result = {"device": runs["new"][0].get("device", "cpu (launches stubbed)"), "rounds": a.rounds, "table": table}
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
