"""Correlated against independent rounding, simulated (docs/codec.md, issue 28).

For each number of ranks n, bits and kind of gradients: the vNMSE of the mean with each
rounding mode at the same bits on the wire (agreed scales, hhook.simulation, mean over a
few calls), their ratio, and the largest error relative to the RMS error (how spread the
error is over the coordinates); then what ``bits="auto"`` picks with each mode and the
wire bits per coordinate that costs. Writes a JSON file and prints a table.

    PYTHONPATH=. python measure/measure_rounding.py --json bench/rounding.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from hhook.codec import THCCodec
from hhook.simulation import KINDS, ranks_like, simulate_allreduce, vnmse
from hhook.codec.error_model import auto_bits, predicted_vnmse, wire_bits_per_coord

def measure(n: int, bits: int, x: torch.Tensor, calls: int) -> dict:
    row = {}
    for rounding in ("independent", "correlated"):
        codec = THCCodec(bits, 1024, 0, n, rounding)
        errs, peaks = [], []
        for call in range(calls):
            est = simulate_allreduce(codec, x, call)
            errs.append(vnmse(est, x))
            e = est - x.mean(0)
            peaks.append(float(e.abs().max() / e.pow(2).mean().sqrt()))
        row[rounding] = sum(errs) / calls
        row[f"{rounding}_peak"] = max(peaks)
    row["ratio"] = row["correlated"] / row["independent"]
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,3,4,5,8,16,64,128,1024")
    ap.add_argument("--bits", default="1,2,3,4,8")
    ap.add_argument("--numel", type=int, default=1 << 14)
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows, start = [], time.time()
    print(f"{'ranks':>5} {'kind':>8} {'bits':>4} {'independent':>12} {'correlated':>11} {'ratio':>6} {'peak/rms':>12}")
    for n in (int(v) for v in args.ranks.split(",")):
        for kind in KINDS if n <= 16 else KINDS[:1]:
            x = ranks_like(kind, n, args.numel)
            for bits in (int(v) for v in args.bits.split(",")):
                r = dict(ranks=n, kind=kind, bits=bits, **measure(n, bits, x, args.calls))
                rows.append(r)
                print(f"{n:>5} {kind:>8} {bits:>4} {r['independent']:>12.3e} {r['correlated']:>11.3e} "
                      f"{r['ratio']:>6.2f} {r['independent_peak']:>5.1f} {r['correlated_peak']:>5.1f}", flush=True)
    auto = []
    for n, k in [(2, 1), (4, 1), (8, 1), (16, 1), (64, 1), (128, 1), (1024, 1), (2, 2), (8, 8), (128, 8)]:
        for rounding in ("independent", "correlated"):
            b = auto_bits(n, k, rounding=rounding)
            auto.append(dict(nodes=n, ranks_per_node=k, rounding=rounding, bits=b,
                             wire_bits=wire_bits_per_coord(b, n), predicted_vnmse=predicted_vnmse(b, n, k, rounding=rounding)))
    print(f"\n{'layout':>9} {'rounding':>11} {'auto bits':>9} {'wire bits/coord':>15} {'predicted vNMSE':>15}")
    for a in auto:
        print(f"{a['nodes']:>5} x {a['ranks_per_node']:<1} {a['rounding']:>11} {a['bits']:>9} {a['wire_bits']:>15.2f} "
              f"{a['predicted_vnmse']:>15.2e}")
    print(f"# {time.time() - start:.0f} s; numel {args.numel}, {args.calls} calls per point, agreed scales, block 1024")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"numel": args.numel, "calls": args.calls, "rows": rows, "auto_bits": auto}, f, indent=1)


if __name__ == "__main__":
    main()
