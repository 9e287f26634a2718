r"""Traffic per rank and step as the number of ranks ``n`` grows: the scale argument.

``python -m hhook.baselines.traffic [--params N] [--p P] [--delay H] [--k K] [--bits B]``
prints, for each ``n``, the bytes one rank **receives** per training step (ring
collectives; a ring sends as much as it receives):

* fp32, ring allreduce of ``4 N`` bytes: ``2 (n - 1) / n * 4 N`` (bounded by ``8 N``).
* THC (``bits``), ring allreduce of the codec's wire size at ``n`` ranks
  (:meth:`hhook.codec.THCCodec.wire_bytes`: the lane width grows with ``log2 n``).
* SBC, all-gather of one message per rank every ``delay`` steps: ``(n - 1) * m / delay``
  with ``m`` = positions x bits per position (Golomb formula) / 8 + 8 bytes per tensor
  (one tensor assumed here): **grows linearly with n**.
* LGC-RAR, compressed phase: the common mask (``4 k`` bytes of int32 indices, broadcast)
  plus a ring allreduce of the ``k / 4`` float latents and one float scale: bounded in n.

These are formulas for the collectives' payloads (latency terms left out); the measured
bytes of real runs are in ``hhook-profile train`` (docs/baselines.md).
"""

from __future__ import annotations

import argparse
import math

from . import golomb


def ring_allreduce_bytes(n: int, nbytes: float) -> float:
    return 0.0 if n <= 1 else 2 * (n - 1) / n * nbytes


def sbc_message_bytes(params: int, p: float = 0.01, tensors: int = 1) -> float:
    """One rank's SBC message (formula): ``params p`` positions at the Golomb rate of ``p``,
    plus a float32 mean and an int32 count per tensor."""
    return params * p * golomb.expected_bits_per_position(p) / 8 + 8 * tensors


def lgc_sizes(params: int, k: float = 0.01) -> tuple[int, int]:
    """LGC-RAR's compressed phase: ``(mask bytes, latent floats)``: ``k params`` int32
    indices broadcast by the leader, and the latent of the values padded to a multiple
    of 16 (``L / 4`` floats), summed by an allreduce (plus one float scale)."""
    kk = math.ceil(k * params)
    return 4 * kk, 4 * (16 * math.ceil(kk / 16)) // 16


def rows(params: int, ns, p: float = 0.01, delay: int = 4, k: float = 0.01, bits: int = 4,
         block_size: int = 1024) -> list[dict]:
    from ..codec import THCCodec

    message = sbc_message_bytes(params, p)
    mask, latent = lgc_sizes(params, k)
    out = []
    for n in ns:
        out.append({
            "n": n,
            "fp32": ring_allreduce_bytes(n, 4 * params),
            f"thc:{bits}": ring_allreduce_bytes(n, THCCodec(bits, block_size, 0, n).wire_bytes(params)),
            "sbc": (n - 1) * message / delay,
            "lgc": (mask if n > 1 else 0) + ring_allreduce_bytes(n, 4 * latent + 4),
        })
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hhook.baselines.traffic", description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=5_275_786, help="parameters (default: wide-cnn's 5.3M)")
    ap.add_argument("--p", type=float, default=0.01, help="SBC density (default 0.01)")
    ap.add_argument("--delay", type=int, default=4, help="SBC communication delay (default 4)")
    ap.add_argument("--k", type=float, default=0.01, help="LGC top-k fraction (default 0.01)")
    ap.add_argument("--bits", type=int, default=4, help="THC bits (default 4)")
    ap.add_argument("--workers", default="2,4,8,16,32,64,128,256", help="comma-separated n")
    a = ap.parse_args(argv)
    table = rows(a.params, [int(x) for x in a.workers.split(",")], a.p, a.delay, a.k, a.bits)
    keys = [c for c in table[0] if c != "n"]
    print(f"# MB received per rank per step, {a.params} parameters; sbc p={a.p:g} delay={a.delay}, "
          f"lgc k={a.k:g} (compressed phase), thc {a.bits} bits")
    print(f"{'n':>5s}" + "".join(f"{c:>12s}" for c in keys))
    for r in table:
        print(f"{r['n']:5d}" + "".join(f"{r[c] / 1e6:12.4f}" for c in keys))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
