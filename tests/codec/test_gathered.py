"""Gathered scales (issue 57's one round): each rank quantizes onto its own block maxima,
every message is all-gathered and summed in rank order. Simulated ranks (one policy
object each, the all-gather done locally) check the statistical claims over many draws,
with ranks of different magnitudes (one 10x another, one all zero)."""

import math

import pytest
import torch

from hhook.scales import ScalePolicy
from hhook.simulation import ranks_like, simulate_policy, vnmse


def _policies(n, bits=4, error_feedback=False, gather=True, rounding="correlated"):
    return [ScalePolicy(bits, 1024, 0, error_feedback, predict=False, gather=gather, rounding=rounding)
            for _ in range(n)]


@pytest.mark.parametrize("kind", ["heavy", "tenfold", "zero"])
@pytest.mark.parametrize("n", [2, 3, 5])
def test_the_mean_of_many_draws_is_the_exact_mean(kind, n):
    """Unbiased: averaged over 200 draws (a fresh rounding stream each), every
    coordinate's mean lies within 4 standard errors of the exact mean, ranks of different
    magnitudes included; a single draw is not exact (it was rounded)."""
    x = ranks_like(kind, n, 3000)
    exact = x.mean(0)
    policies = _policies(n, bits=2)
    draws = torch.stack([simulate_policy(policies, x, None, step) for step in range(200)]).double()
    mean, std = draws.mean(0), draws.std(0)
    assert float(std.max()) > 0
    z = (mean - exact.double()).abs() / (std / math.sqrt(draws.shape[0])).clamp_min(1e-12)
    assert float((z > 4).float().mean()) < 0.002, float(z.max())  # 3000 coordinates: a few past 3.3
    assert abs(float((mean - exact.double()).mean())) < 4 * float(std.mean()) / math.sqrt(200 * 3000)


@pytest.mark.parametrize("kind", ["heavy", "tenfold", "zero", "similar"])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_the_error_is_no_larger_than_agreed_scales(kind, n):
    """Each rank's rounding error is bounded by its own maxima, never above the agreed
    maxima: the mean error over draws is at most agreed scales' (a 5% margin for the draws)."""
    x = ranks_like(kind, n, 1 << 14)
    errors = {}
    for gather in (True, False):
        policies = _policies(n, bits=3, gather=gather)
        errors[gather] = sum(vnmse(simulate_policy(policies, x, None, step), x) for step in range(8))
    assert errors[True] <= 1.05 * errors[False], errors


def test_every_rank_decodes_the_same_bits_and_nonfinite_reaches_every_rank():
    n = 3
    x = ranks_like("tenfold", n, 5000)
    policies = _policies(n)
    plans = [p.begin(xi, "k", r, n, 7) for r, (p, xi) in enumerate(zip(policies, x))]
    gathered = torch.cat([p.finish(pl) for p, pl in zip(policies, plans)])
    outs = [p.decode(gathered.clone(), pl, torch.empty_like(x[0])) for p, pl in zip(policies, plans)]
    assert all(torch.equal(o[0], outs[0][0]) and o[1] is False for o in outs)
    bad = x.clone()
    bad[1, 17] = float("nan")
    plans = [p.begin(xi, "k", r, n, 8) for r, (p, xi) in enumerate(zip(policies, bad))]
    gathered = torch.cat([p.finish(pl) for p, pl in zip(policies, plans)])
    for p, pl in zip(policies, plans):
        out, nonfinite = p.decode(gathered.clone(), pl, torch.empty_like(x[0]))
        assert nonfinite is True and bool(out.isnan().all())


def test_identical_inputs_decode_exactly_and_a_message_is_as_narrow_as_the_bits():
    n, numel = 4, 10_000
    x = torch.randn(numel).expand(n, numel).contiguous()
    policies = _policies(n, bits=4)
    assert torch.equal(simulate_policy(policies, x, "k", 0), x[0])
    # 4-bit codes in 8 lanes of an int32 word, the block maxima as float32, the prefix
    blocks = -(-numel // 1024)
    words = policies[0].finish(policies[0].begin(x[0], None, 0, n, 0))
    assert words.dtype == torch.int32 and words.numel() == 12 + blocks + -(-blocks * 1024 // 8)


def test_error_feedback_carries_each_rank_s_own_rounding_error():
    """With error feedback the sum over steps of the decoded means tracks the sum of the
    exact means far closer than without (each rank carries its own residual)."""
    n, steps = 2, 30
    x = ranks_like("tenfold", n, 4096)
    drift = {}
    for ef in (True, False):
        policies = _policies(n, bits=2, error_feedback=ef)
        total = sum(simulate_policy(policies, x, "k", step) for step in range(steps))
        drift[ef] = float((total - steps * x.mean(0)).norm() / (steps * x.mean(0)).norm())
    assert drift[True] < 0.3 * drift[False], drift


def test_gathered_scales_predict_nothing():
    policy = ScalePolicy(4, predict=True, gather=True)
    assert not policy.predict
    assert ScalePolicy.from_state_dict(policy.state_dict()).gather
