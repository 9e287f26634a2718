"""hhook.baselines: the Golomb coder (bits by hand, measured rate against the formula), SBC
(faithful form: one sign group, residual accounting, the exchanged average), LGC-RAR
(phases, latents summed by a stock allreduce, bytes), and their place in hhook-profile train."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.support.distributed import ROOT, free_port, run_world, subprocess_env

from hhook.baselines import golomb
from hhook.baselines.sbc import HEADER, SBC, decode_message, encode_message, sbc_compress


# -- Golomb ------------------------------------------------------------------------------------
def test_optimal_b_and_rate_formula():
    assert golomb.optimal_b(0.01) == 6 and golomb.optimal_b(0.001) == 9
    assert golomb.expected_bits_per_position(0.01) == pytest.approx(8.11, abs=0.005)
    assert golomb.expected_bits_per_position(0.001) == pytest.approx(11.49, abs=0.005)
    with pytest.raises(ValueError):
        golomb.optimal_b(0.0)


def test_hand_coded_example():
    # positions 2, 5, 6, 15 with b = 2 (M = 4): gaps 3, 3, 1, 9 -> d - 1 = 2, 2, 0, 8
    # q = 0, 0, 0, 2 and r = 2, 2, 0, 0: "0 10", "0 10", "0 00", "11 0 00"
    # bits 010 010 000 11000 = 01001000 011000(00) -> 0x48 0x60, 14 bits
    packed, nbits = golomb.encode([2, 5, 6, 15], 2)
    assert nbits == 14 and packed.tolist() == [0x48, 0x60]
    assert golomb.decode(packed, 4, 2).tolist() == [2, 5, 6, 15]
    # b = 0: pure unary of d - 1: positions 0, 3 -> gaps 1, 3 -> "0", "110" -> 0110(0000) = 0x60
    packed, nbits = golomb.encode([0, 3], 0)
    assert nbits == 4 and packed.tolist() == [0x60]
    assert golomb.decode(packed, 2, 0).tolist() == [0, 3]


@pytest.mark.parametrize("b", [0, 1, 3, 6, 9])
def test_round_trip(b):
    rng = np.random.default_rng(b)
    for density in (0.001, 0.05, 0.6):
        pos = np.flatnonzero(rng.random(20000) < density)
        packed, nbits = golomb.encode(pos, b)
        assert len(packed) == math.ceil(nbits / 8)
        assert np.array_equal(golomb.decode(packed, len(pos), b), pos)
    assert golomb.decode(*golomb.encode([], b)[:1], 0, b).size == 0
    with pytest.raises(ValueError):
        golomb.encode([3, 3], b)


def test_measured_rate_at_one_percent_matches_formula():
    rng = np.random.default_rng(0)
    rates = []
    for _ in range(5):
        pos = np.flatnonzero(rng.random(400_000) < 0.01)
        _, nbits = golomb.encode(pos, golomb.optimal_b(0.01))
        rates.append(nbits / len(pos))
    mean = float(np.mean(rates))
    assert abs(mean - 8.11) / 8.11 < 0.10
    assert abs(mean - 8.11) < 0.1  # and in fact much closer: the gaps are geometric


# -- SBC, single process -----------------------------------------------------------------------
def test_sbc_keeps_one_sign_group_not_stc():
    torch.manual_seed(0)
    a = torch.randn(1000)
    a[:5] = 10.0  # positive group dominates
    mu, idx = sbc_compress(a, 0.01)
    assert len(idx) == 10 and mu > 0
    assert mu == pytest.approx(a.topk(10).values.mean().item())
    b = -a
    mu, idx = sbc_compress(b, 0.01)
    assert mu < 0 and torch.all(b[idx] < 0)  # negative group kept; no positive entry sent


def test_sbc_message_bytes_within_10pct_of_formula():
    torch.manual_seed(1)
    tensors = [torch.randn(300_000), torch.randn(200, 500), torch.randn(64)]
    p = 0.01
    parts = [sbc_compress(t, p) for t in tensors]
    offsets = [0, 300_000, 400_000]
    b = golomb.optimal_b(p)
    msg = encode_message(parts, offsets, b)
    positions = sum(len(i) for _, i in parts)
    formula = positions * golomb.expected_bits_per_position(p) / 8 + len(tensors) * HEADER.itemsize
    assert abs(msg.size - formula) / formula < 0.10
    values, pos = decode_message(msg, len(tensors), b)
    want = np.concatenate([i.numpy() + o for (_, i), o in zip(parts, offsets)])
    assert np.array_equal(pos, want) and len(values) == positions


# -- SBC, 2 and 3 ranks ------------------------------------------------------------------------
def _sbc_rank(rank, world):
    torch.manual_seed(0)  # the same initial weights on every rank, as DDP makes them
    params = [torch.nn.Parameter(torch.randn(40, 50)), torch.nn.Parameter(torch.randn(300))]
    torch.manual_seed(100 + rank)  # different local steps
    sbc = SBC(params, p=0.02, delay=3)
    start = [q.detach().clone() for q in params]
    exchanged = []
    for step in range(6):  # two exchanges
        with torch.no_grad():
            for q in params:
                q.add_(torch.randn_like(q) * 0.1)  # a "local step"
        residual_before = [r.clone() for r in sbc.residual]
        ref_before = [r.clone() for r in sbc.ref]
        weights_before = [q.detach().clone() for q in params]
        if sbc.after_step():
            last = sbc.last
            acc = [rb + (w - f) for rb, w, f in zip(residual_before, weights_before, ref_before)]
            exchanged.append({
                "acc_ok": all(torch.allclose(a, b) for a, b in zip(acc, last["accumulated"])),
                "lossless": max((s + r - a).abs().max().item() for s, r, a in zip(last["sent"], sbc.residual, acc)),
                "sent": torch.cat([s.reshape(-1) for s in last["sent"]]),
                "average": last["average"].clone(),
                "weights": torch.cat([q.detach().reshape(-1) for q in params]),
                "ref_delta": torch.cat([(r - rb).reshape(-1) for r, rb in zip(sbc.ref, ref_before)]),
                "bytes": sbc.step_bytes[-1],
            })
    return {"exchanged": exchanged, "step_bytes": sbc.step_bytes, "stats": sbc.stats(), "start": start}


@pytest.mark.parametrize("world", [3])  # odd world: messages of different lengths, padded
def test_sbc_exchange_average_residual_and_sign(world):
    results = run_world(_sbc_rank, world)
    for r in results:
        assert len(r["exchanged"]) == 2 and r["step_bytes"][0] == r["step_bytes"][1] == 0
        assert r["step_bytes"][2] > 0 and r["stats"]["exchanges"] == 2
    for e in range(2):
        sents = [r["exchanged"][e]["sent"] for r in results]
        direct = torch.stack(sents).mean(0)
        for r in results:
            x = r["exchanged"][e]
            assert x["acc_ok"] and x["lossless"] < 1e-6  # sent + residual == accumulated
            assert torch.allclose(x["average"], direct, atol=1e-6)  # decoded average == direct average
            assert torch.allclose(x["ref_delta"], direct, atol=1e-5)  # applied to W_ref ...
        # ... and every rank now holds the same weights
        assert all(torch.equal(r["exchanged"][e]["weights"], results[0]["exchanged"][e]["weights"]) for r in results)
        for s in sents:  # per tensor: one sign group only, one magnitude
            for part in (s[:2000], s[2000:]):
                nz = part[part != 0]
                assert len(nz) == math.ceil(0.02 * len(part))
                assert (nz > 0).all() or (nz < 0).all()
                assert torch.unique(nz).numel() == 1
        # bytes counted: the 8-byte length plus the padded message, every rank the same
        assert len({r["exchanged"][e]["bytes"] for r in results}) == 1
    st = results[0]["stats"]
    assert st["bits_per_position"] > 0 and st["message_bytes"] > 0


def _sbc_handed_rank(rank, world):
    """SBC at p = 1 % through the real exchange; every tensor handed to ``dist.all_gather`` counted."""
    import torch.distributed as dist

    handed = []
    real = dist.all_gather

    def spy(outputs, tensor, *a, **kw):
        handed[-1] += tensor.numel() * tensor.element_size()
        return real(outputs, tensor, *a, **kw)

    dist.all_gather = spy
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(300, 400)), torch.nn.Parameter(torch.randn(50_000)),
              torch.nn.Parameter(torch.randn(64))]
    torch.manual_seed(10 + rank)
    sbc = SBC(params, p=0.01, delay=2)
    exchanges = []
    for step in range(6):  # three exchanges
        with torch.no_grad():
            for q in params:
                q.add_(torch.randn_like(q) * 0.01)
        handed.append(0)
        if sbc.after_step():
            exchanges.append({"handed": handed[-1], "reported": sbc.step_bytes[-1],
                              "positions": sum(len(i) for _, i in sbc.last["parts"]),
                              "lengths": [len(m) for m in sbc.last["messages"]]})
        else:
            assert handed[-1] == 0 and sbc.step_bytes[-1] == 0  # local steps hand nothing over
    dist.all_gather = real
    return {"exchanges": exchanges, "step_bytes": sbc.step_bytes, "tensors": len(params)}


def test_sbc_bytes_handed_per_exchange_within_10pct_of_formula():
    """2 ranks, p = 1 %: the bytes each rank hands to the collectives per exchange (the int64
    length word and the message padded to the longest, counted at ``dist.all_gather``) are
    within 10 % of positions x Golomb bits per position + one float32 mean per tensor."""
    results = run_world(_sbc_handed_rank, 2)
    bits = golomb.expected_bits_per_position(0.01)
    for r in results:
        assert len(r["exchanges"]) == 3
        for x in r["exchanges"]:
            assert x["positions"] == 1200 + 500 + 1  # ceil(p numel) per tensor
            formula = x["positions"] * bits / 8 + 4 * r["tensors"]
            assert x["handed"] == x["reported"]  # what SBC reports is what the collectives got
            assert x["handed"] >= 8 + max(x["lengths"])  # length word + padded message, nothing left out
            assert abs(x["handed"] - formula) / formula < 0.10, (x, formula)
        # bytes per step as hhook-profile train reports them: one exchange in `delay` = 2 steps
        assert sum(r["step_bytes"]) / len(r["step_bytes"]) == pytest.approx(
            sum(x["handed"] for x in r["exchanges"]) / 6)
    # padded to the longest: both ranks hand the same number of bytes in each exchange
    assert [x["handed"] for x in results[0]["exchanges"]] == [x["handed"] for x in results[1]["exchanges"]]


# -- LGC-RAR -----------------------------------------------------------------------------------
def _lgc_rank(rank, world):
    import torch.distributed as dist

    from hhook.baselines.lgc import LGC

    calls = []
    real = dist.all_reduce

    def spy(tensor, *a, **kw):
        calls.append((tuple(tensor.shape), str(kw.get("op", "sum"))))
        return real(tensor, *a, **kw)

    dist.all_reduce = spy
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    lgc = LGC(model.parameters(), k=0.05, dense_steps=2, topk_steps=2, ae_steps=3, ae_iters=2)
    phases, grads = [], []
    gen = torch.Generator().manual_seed(rank)
    for step in range(9):
        model.zero_grad()
        x = torch.randn(16, 32, generator=gen)
        model(x).pow(2).mean().backward()
        phases.append(lgc.stats()["phase"])
        calls.clear()
        lgc.reduce()
        grads.append(torch.cat([q.grad.reshape(-1) for q in model.parameters()]))
        if phases[-1] == "compressed":
            last_calls = list(calls)
    dist.all_reduce = real
    return {"phases": phases, "grads": grads, "bytes": lgc.step_bytes, "stats": lgc.stats(),
            "calls": last_calls, "ae": [t.clone() for t in lgc.ae.state_dict().values()]}


def test_lgc_phases_allreduce_of_latents_and_bytes():
    results = run_world(_lgc_rank, 2)
    r0, r1 = results
    assert r0["phases"] == ["dense"] * 2 + ["topk"] * 2 + ["ae"] * 3 + ["compressed"] * 2
    st = r0["stats"]
    assert st["phase"] == "compressed" and st["phase_steps"]["compressed"] == 2 and st["ae_loss"] is not None
    k, latent = st["k"], st["latent_numel"]
    n = sum(g.numel() for g in r0["grads"][:1])
    assert latent == 4 * (16 * math.ceil(k / 16)) // 16 and latent < k
    # the compressed step: a MAX of one float, then the latents summed by a stock all_reduce
    assert len(r0["calls"]) == 2 and r0["calls"][1][0] == (1, 4, latent // 4)
    # the autoencoder was broadcast: both ranks decode with the same one
    assert all(torch.equal(a, b) for a, b in zip(r0["ae"], r1["ae"]))
    for g0, g1 in zip(r0["grads"], r1["grads"]):  # every rank applies the same averaged gradient
        assert g0.shape == (n,) and torch.isfinite(g0).all() and torch.equal(g0, g1)
    # compressed steps: non-zero only on the k masked entries
    assert (r0["grads"][-1] != 0).sum() <= k
    b = r0["bytes"]
    assert b[0] == 4 * n  # dense
    assert b[2] == 4 * k + 4 * k  # mask indices (int32) + gathered values
    assert b[-1] == 4 * k + 4 + 4 * latent  # mask + scale + latents
    assert b[6] > b[5]  # the autoencoder's weights are broadcast once, after the last ae step


# -- hhook-profile train -----------------------------------------------------------------------
def test_method_grammar():
    from hhook.profile.train import parse_methods

    ms = parse_methods("sbc,sbc:p=0.001:delay=2,lgc,lgc:k=0.02:ae=3")
    assert [m.name for m in ms] == ["sbc", "sbc:p=0.001:delay=2", "lgc", "lgc:k=0.02:ae=3"]
    assert [m.kind for m in ms] == ["sbc", "sbc", "lgc", "lgc"]
    for bad, msg in (("sbc:p=2", "p must be in (0, 1)"), ("sbc:delay=0", "delay must be"),
                     ("sbc:q=1", "expected sbc"), ("lgc:k=x", "k= takes a number"), ("lgc:ae=0", "ae >= 1"),
                     ("sbc:p=0.1:p=0.2", "expected sbc")):
        with pytest.raises(ValueError, match=re_escape(msg)):
            parse_methods(bad)


def re_escape(s):
    import re

    return re.escape(s)


def test_lgc_is_not_exported_from_hhook():
    import hhook
    import hhook.baselines

    assert not hasattr(hhook, "LGC") and not hasattr(hhook.baselines, "LGC")
    from hhook.baselines import lgc

    assert "patented" in lgc.__doc__ and "WO2021245072A1" in lgc.__doc__


def test_two_rank_smoke_run(tmp_path):
    out = tmp_path / "t.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "hhook.profile", "train", "--model", "mlp", "--methods", "sbc:delay=2,lgc:dense=2:topk=2:ae=2",
           "--steps", "12", "--warmup", "2", "--eval-every", "8", "--target-accuracy", "0.3", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["method"]: r for r in json.loads(out.read_text())["results"]}
    assert all(rows[m]["status"] == "ok" for m in rows), rows
    sbc, lgc = rows["sbc:delay=2"], rows["lgc:dense=2:topk=2:ae=2"]
    fp32_bytes = 4 * sbc["params"]
    assert 0 < sbc["bytes_per_step"] < fp32_bytes / 20  # one exchange in two steps, ~1% of positions
    assert 0 < lgc["bytes_per_step"] and lgc["bytes_mismatch"] is None
    st = lgc["baseline_stats"][0]
    assert st["phase"] == "compressed" and st["phase_steps"] == {"dense": 2, "topk": 2, "ae": 2, "compressed": 6}
    assert sbc["baseline_stats"][0]["exchanges"] == 6
    for r in (sbc, lgc):
        assert r["steps"] == 12 and r["final_accuracy"] is not None and math.isfinite(r["median_ms"])
    assert "sbc:delay=2" in proc.stdout and "lgc:dense=2:topk=2:ae=2" in proc.stdout
    # LGC's phases are printed, not only in the JSON
    assert re.search(r"^# lgc:dense=2:topk=2:ae=2: steps per phase: dense warm-up 2, top-k 2, autoencoder "
                     r"training 2 \([0-9.]+ s inside the steps, held-out error [0-9.]+\), latent 6$",
                     proc.stdout, re.M), proc.stdout


def test_lgc_phase_footer_line():
    from hhook.baselines.harness import phase_line
    from hhook.profile.commands.train import footer

    st = {"phase_steps": {"dense": 10, "topk": 10, "ae": 10, "compressed": 170}, "ae_train_s": 1.25,
          "ae_rel_error": 0.587}
    lgc = {"method": "lgc:k=0.001", "kind": "lgc", "status": "ok", "time_to_target_s": None,
           "baseline_stats": [st, dict(st, ae_rel_error=None)]}
    sbc = {"method": "sbc", "kind": "sbc", "status": "ok", "time_to_target_s": 1.0, "baseline_stats": [{"exchanges": 3}]}
    hung = dict(lgc, method="lgc", status="hung", baseline_stats=None)
    args = type("A", (), {"warmup": 5, "target_accuracy": 0.95, "eval_every": 10, "steps": 200})()
    lines = footer([sbc, lgc, hung], args)
    want = ("# lgc:k=0.001: steps per phase: dense warm-up 10, top-k 10, autoencoder training 10 (1.25 s inside "
            "the steps, held-out error 0.59), latent 170")
    assert want in lines
    assert sum("steps per phase" in line for line in lines) == 1  # not for sbc, nor for a method that did not run
    assert phase_line(sbc) is None and phase_line(hung) is None


def test_traffic_model_sbc_grows_with_n_thc_and_lgc_do_not_grow_linearly():
    from hhook.baselines.traffic import rows

    t = {r["n"]: r for r in rows(1_000_000, [2, 4, 64, 128])}
    assert t[128]["sbc"] == pytest.approx(127 * t[2]["sbc"])  # all-gather: linear in n
    assert t[128]["lgc"] < 1.1 * t[4]["lgc"] and t[128]["fp32"] < 2 * t[2]["fp32"]
    assert t[128]["thc:4"] < 6 * t[2]["thc:4"]  # only the lane width grows (log2 n)
