r"""Ranks simulated on one process: gradient-like data, the THC allreduce computed
locally (MAX of the scale vectors, SUM of the words), and the error metric.

What the tests, the codec benchmark (``hhook-profile codec``) and the examples use to
measure quality without communication.

Example::

    inputs = heavy_tailed(1 << 20, world_size=4)
    codec = THCCodec(bits=4, world_size=4)
    print(vnmse(simulate_allreduce(codec, inputs), inputs))  # about 4.5e-3 (9e-3 rounding independently)
"""

from __future__ import annotations

import torch

from .codec import THCCodec
from .scales.policy import GATHERED


def heavy_tailed(numel: int, world_size: int, seed: int = 0, device="cpu") -> torch.Tensor:
    """``world_size`` gradient-like vectors: a shared Student-t (df=3) signal with rare
    large outliers, plus independent per-rank noise."""
    g = torch.Generator().manual_seed(seed)
    common = _t_sample(g, numel)
    spikes = torch.rand(numel, generator=g) < 1e-4
    common = common + spikes * torch.randn(numel, generator=g) * 100
    noise = torch.randn(world_size, numel, generator=g) * common.abs().mean()
    return (common + noise).to(device)


#: Kinds of ranks :func:`ranks_like` simulates (correlated rounding is measured on each).
KINDS = ("heavy", "similar", "zero", "tenfold")


def ranks_like(kind: str, world_size: int, numel: int) -> torch.Tensor:
    """``world_size`` gradients of one kind: ``heavy``: :func:`heavy_tailed` (a shared
    signal plus per-rank noise as large as its mean magnitude); ``similar``: one rank's
    gradient plus 5% noise on each; ``zero``: heavy with rank 0's gradient zero;
    ``tenfold``: heavy with rank 0's gradient times 10."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    x = heavy_tailed(numel, world_size, seed=world_size)
    if kind == "similar":
        noise = torch.randn(world_size, numel, generator=torch.Generator().manual_seed(1))
        x = x[:1] + 0.05 * x[:1].abs().mean() * noise
    elif kind == "zero":
        x[0] = 0
    elif kind == "tenfold":
        x[0] *= 10
    return x


def _t_sample(g: torch.Generator, numel: int, df: float = 3.0) -> torch.Tensor:
    z = torch.randn(numel, generator=g)
    chi2 = torch.randn(int(df), numel, generator=g).pow_(2).sum(0)
    return z / (chi2 / df).sqrt_()


def vnmse(estimate: torch.Tensor, inputs: torch.Tensor) -> float:
    """vNMSE: ``||estimate - mean||^2 / mean_i ||x_i||^2``, the error of the mean estimate
    relative to the average squared norm of the ranks' inputs."""
    mean = inputs.mean(0)
    return float((estimate - mean).pow(2).sum() / inputs.pow(2).sum(1).mean())


def simulate_allreduce(codec: THCCodec, inputs: torch.Tensor, step: int = 0) -> torch.Tensor:
    """The mean that THC allreduce of the rows of ``inputs`` decodes on every rank."""
    prepared = [codec.prepare(x) for x in inputs]
    agreed = torch.stack([p.scales for p in prepared]).amax(0)
    words = [codec.quantize(p, agreed, codec.stream(r, step)) for r, p in enumerate(prepared)]
    total = words[0].clone()
    for w in words[1:]:
        total.add_(w)
    return codec.decode(prepared[0], agreed, total, torch.empty_like(inputs[0]))


def simulate_policy(policies: list, inputs: torch.Tensor, key="sim", step: int = 0) -> torch.Tensor:
    """One call of a scale policy (:mod:`hhook.scales`) on each row of ``inputs``, one
    policy object per simulated rank (they carry per-key state between calls, like the
    ranks' own), with the MAX and SUM (or the all-gather) computed locally. Returns the
    decoded mean."""
    world = inputs.shape[0]
    plans = [p.begin(x, key, r, world, step) for r, (p, x) in enumerate(zip(policies, inputs))]
    agreed = None
    if plans[0].max_vector is not None:
        agreed = torch.stack([pl.max_vector for pl in plans]).amax(0)
    words = [p.finish(pl, None if agreed is None else agreed.clone()) for p, pl in zip(policies, plans)]
    if plans[0].kind == GATHERED:  # every rank's message, in rank order
        total = torch.cat(words)
    else:
        total = torch.stack(words).sum(0, dtype=words[0].dtype)
    outs = [p.decode(total, pl, torch.empty_like(inputs[0]))[0] for p, pl in zip(policies, plans)]
    return outs[0]


def simulate_two_level(codec: THCCodec, inputs: torch.Tensor, ranks_per_node: int, step: int = 0) -> torch.Tensor:
    """The mean that two-level THC (:mod:`hhook.schedule.two_level`) decodes: the exact float32
    mean of each node's ``ranks_per_node`` consecutive rows, then THC over the node means
    (``codec`` sized for the number of nodes)."""
    world = inputs.shape[0]
    if world % ranks_per_node:
        raise ValueError(f"{ranks_per_node} ranks per node do not divide {world} ranks")
    node_means = inputs.float().view(world // ranks_per_node, ranks_per_node, -1).mean(1)
    return simulate_allreduce(codec, node_means, step)
