"""vNMSE of agreed vs predicted scales on simulated ranks (no communication).

A slowly drifting heavy-tailed signal (hhook.simulation.heavy_tailed) over several steps,
with equal ranks, one rank's gradient 10x the others', or one rank's zero; the mean of
the per-step vNMSE after the first step. Run: python examples/scale_policies.py
"""

import argparse
import math

import torch

from hhook.scales import ScalePolicy
from hhook.simulation import heavy_tailed, simulate_policy, vnmse


def run(bits: int, world: int, case: str, steps: int, numel: int) -> dict:
    factors = torch.ones(world)
    if case == "tenfold":
        factors[0] = 10.0
    elif case == "one zero":
        factors[0] = 0.0
    out = {}
    for mode in ("agreed", "predicted"):
        policies = [ScalePolicy(bits, 1024, 0, False, predict=mode == "predicted") for _ in range(world)]
        signal, errors = None, []
        for step in range(steps):
            fresh = heavy_tailed(numel, world, seed=step)
            signal = fresh if signal is None else 0.8 * signal + 0.2 * fresh
            grads = signal * math.exp(0.1 * math.sin(step)) * factors[:, None]
            mean = simulate_policy(policies, grads.clone(), step=step)
            if step > 0:
                errors.append(vnmse(mean, grads))
        out[mode] = sum(errors) / len(errors)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--numel", type=int, default=1 << 16)
    args = p.parse_args()
    print(f"| ranks {args.world} | bits | agreed vNMSE | predicted vNMSE | predicted / agreed |")
    print("|---|---|---|---|---|")
    for case in ("equal", "tenfold", "one zero"):
        for bits in (2, 4, 8):
            r = run(bits, args.world, case, args.steps, args.numel)
            print(f"| {case} | {bits} | {r['agreed']:.3e} | {r['predicted']:.3e} | {r['predicted'] / r['agreed']:.2f} |")


if __name__ == "__main__":
    main()
