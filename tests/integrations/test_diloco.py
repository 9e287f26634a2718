"""hhook.diloco: the outer synchronization across sites (docs/diloco.md), on 2-4 Gloo ranks
over loopback: the outer step against a dense reference (fp32 exchange, THC at 8 bits),
heterogeneous sites, streamed fragments, resume mid-period bit for bit, mismatched
options, a world of one site, torch.compile, sites of two ranks with DDP and with FSDP2,
the program's own subgroups, a stalled site, and the error-feedback claim."""

import io
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hhook
import hhook.diloco
from tests.schedule.test_rounds import counted
from tests.support.distributed import case_values, logged, run_cases, run_outcomes, run_world


def _net(seed: int = 0, width: int = 16, layers: int = 4) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _set_flat(model, flat: torch.Tensor) -> None:
    with torch.no_grad():
        offset = 0
        for p in model.parameters():
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def _pseudo(site: int, numel: int, call: int) -> torch.Tensor:
    """Site ``site``'s pseudo-gradient at outer step ``call``: site 1's 10x the others' (call
    0), every site's but site 0's zero (call 1), all different (call 2)."""
    base = torch.randn(numel, generator=torch.Generator().manual_seed(100 + call)) * 1e-2
    if call == 0:
        return base * (10.0 if site == 1 else 1.0) + site * 1e-3
    if call == 1:
        return base if site == 0 else torch.zeros(numel)
    return base + 1e-2 * torch.randn(numel, generator=torch.Generator().manual_seed(7 * site + call))


def _outer_steps(rank, world, ranks_per_site, steps=3):
    """Every outer step (H = 1): each site moves to outer - d_site, the synchronizer
    averages; per exchange (fp32, THC at 8 bits): this rank's parameters after each step,
    the dense reference's and the stats."""
    sites = hhook.diloco.find_sites(ranks_per_site)
    out = {}
    for bits in (None, 8):
        model = _net(seed=sites.site)  # sites start apart (a site's ranks alike, as DDP makes them): site 0's wins
        outer = hhook.diloco.DiLoCo(model, None, sites, every=1, bits=bits)
        outer.start()  # (no forward here: the common start by hand)
        ref = _flat(model).clone()
        assert torch.equal(ref, _flat(_net(seed=0))), "every site starts from site 0's parameters"
        ref_opt = hhook.diloco.nesterov_sgd([ref])
        got, want = [ref.clone()], [ref.clone()]
        for call in range(steps):
            d = [_pseudo(s, ref.numel(), call) for s in range(sites.n_sites)]
            _set_flat(model, ref - d[sites.site])
            outer.step()
            ref.grad = torch.stack(d).mean(0)
            ref_opt.step()
            got.append(_flat(model).clone())
            want.append(ref.clone())
        out[bits] = got, want, outer.stats()
    return out


@pytest.fixture(scope="module")
def two_sites():
    """``key -> [what each rank returned]``: the 2-rank scenarios of the tests below that
    pass or fail on their own results, in one world (4 worlds -> 1), each with its own
    sites' groups, models and DiLoCo; started by the first test that asks."""
    runs = {}

    def of(key):
        if not runs:
            resumed = [(11, save_at, options, False) for options, save in RESUMED for save_at in (None, save)]
            runs.update(run_cases([("outer_steps", _outer_steps, (1,)), ("streamed", _streamed_all, ()),
                                   ("resumed", _trains, (resumed,)), ("error_feedback", _ef_errors, (8, 30))], 2))
        return case_values(runs[key])

    return of


@pytest.mark.parametrize("world,ranks_per_site", [(2, 1), (4, 2)])
def test_outer_step_against_a_dense_reference_with_heterogeneous_sites(two_sites, world, ranks_per_site):
    """An fp32 exchange gives the reference's outer step to float rounding; THC at 8 bits
    within 2% of how far the step moved, every site the same bits; one site's
    pseudo-gradient 10x the other's, then zero."""
    results = two_sites("outer_steps") if world == 2 else run_world(_outer_steps, world, ranks_per_site)
    for by_bits in results:
        got, want, stats = by_bits[None]
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
        assert stats["syncs"] == 3 and stats["exchange"] == "fp32" and not torch.equal(want[0], want[-1])
        got, want, stats = by_bits[8]
        for g, w in zip(got[1:], want[1:]):
            moved = (w - want[0]).norm()  # compared with how far the outer steps moved
            assert (g - w).norm() < 0.02 * moved, ((g - w).norm(), moved)
        assert stats["wire_bytes"] < stats["dense_bytes"] and stats["exchange"] == "thc:8"
    finals = [r[8][0][-1] for r in results]
    assert all(torch.equal(finals[0], f) for f in finals), "every site holds the same outer parameters"


STREAMED = [(4, 0), (4, 2), (2, 1)]  # (fragments, overlap)


def _streamed_all(rank, world):
    sites = hhook.diloco.find_sites(1)
    return [_streamed(rank, sites, fragments, overlap) for fragments, overlap in STREAMED] + [_split(rank, sites)]


def _split(rank, sites):
    """An embedding of 800 values beside a layer of 72, P = 2: cut into two fragments of
    436, the embedding split between them; each site sets its own values, steps one period
    without inner progress; the outer step (SGD, lr 1) leaves every site on their mean."""
    torch.manual_seed(0)
    model = outer_model = nn.Sequential(nn.Embedding(100, 8), nn.Linear(8, 8))
    outer = hhook.diloco.DiLoCo(model, None, sites, every=4, bits=None, fragments=2,
                                outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0))
    outer.start()
    mine = torch.randn(872, generator=torch.Generator().manual_seed(rank))
    _set_flat(model, mine)
    for _ in range(4):
        outer.step()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(100, 8), nn.Linear(8, 8))
    mixed = hhook.diloco.DiLoCo(model, None, sites, every=4, bits=None, fragments=2, alpha=0.25,
                                outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0))
    mixed.start()
    _set_flat(model, mine)
    for _ in range(4):
        mixed.step()
    return {"sizes": [f.numel for f in outer.fragments], "names": [f.names for f in outer.fragments],
            "mine": mine, "params": _flat(outer_model), "alpha": _flat(model)}


def _streamed(rank, sites, fragments, overlap):
    """Inner steps that add a site's constant to every parameter; the synchronizer streams
    ``fragments`` at their offsets (fp32 exchange). Returns what each sync sent, what was in
    flight after each step, and the parameters."""
    model = _net(layers=4)
    every = 8
    outer = hhook.diloco.DiLoCo(model, None, sites, every=every, bits=None, fragments=fragments, overlap=overlap)
    outer.start()
    drift = [0.01, 0.03][rank]
    dense, events = [], []
    for t in range(1, 2 * every + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(drift)
        before = outer.stats()["dense_bytes"]
        outer.step()
        dense.append(outer.stats()["dense_bytes"] - before)
        events.append(sorted(outer.pending))
    return {"offsets": outer.offsets, "dense": dense, "events": events, "params": _flat(model),
            "numel": _flat(model).numel()}


def test_streaming_syncs_each_fragment_at_its_offset_with_a_fraction_of_the_bytes(two_sites):
    every_config = two_sites("streamed")
    for (fragments, overlap), results in zip(STREAMED, zip(*every_config)):
        _check_streamed(fragments, overlap, results)
    split = [r[-1] for r in every_config]
    assert split[0]["sizes"] == [436, 436], split[0]["names"]
    assert split[0]["names"][0] == ["0.weight[0:436]"] and split[0]["names"][1][0] == "0.weight[436:800]"
    mean = (split[0]["mine"] + split[1]["mine"]) / 2
    for r in split:
        torch.testing.assert_close(r["params"], mean, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(r["alpha"], 0.25 * r["mine"] + 0.75 * mean, rtol=1e-6, atol=1e-6)  # alpha's mixing


GPT2_SMALL = [("transformer.wte.weight", (50257, 768)), ("transformer.wpe.weight", (1024, 768))] + [
    (f"transformer.h.{i}.{name}", shape) for i in range(12) for name, shape in (
        ("ln_1.weight", (768,)), ("ln_1.bias", (768,)), ("attn.c_attn.weight", (768, 2304)),
        ("attn.c_attn.bias", (2304,)), ("attn.c_proj.weight", (768, 768)), ("attn.c_proj.bias", (768,)),
        ("ln_2.weight", (768,)), ("ln_2.bias", (768,)), ("mlp.c_fc.weight", (768, 3072)), ("mlp.c_fc.bias", (3072,)),
        ("mlp.c_proj.weight", (3072, 768)), ("mlp.c_proj.bias", (768,)))] + [
    ("transformer.ln_f.weight", (768,)), ("transformer.ln_f.bias", (768,))]  # lm_head: tied to wte, listed once


def test_fragments_are_balanced_on_gpt2_small():
    """GPT-2 small's names and shapes (124.4M values, the embedding 31% of them): the
    largest fragment within 1.25x of 1/P for P = 2, 4, 8 (striding alone: 1.30x, 1.92x,
    2.94x); every value in exactly one fragment."""
    from hhook.diloco.fragments import partition

    named = [(n, torch.empty(shape, device="meta")) for n, shape in GPT2_SMALL]
    total = sum(p.numel() for _, p in named)
    assert total == 124_439_808
    for P in (2, 4, 8):
        sizes = [sum(hi - lo for _, _, lo, hi in f) for f in partition(named, P)]
        assert sum(sizes) == total and len(sizes) == P
        assert max(sizes) <= 1.25 * total / P, (P, [s / total for s in sizes])


def _check_streamed(fragments, overlap, results):
    r0 = results[0]
    every, numel = 8, r0["numel"]
    assert r0["offsets"] == [(p + 1) * every // fragments % every for p in range(fragments)]
    syncs = [t for t, b in enumerate(r0["dense"], start=1) if b]
    assert len(syncs) == 2 * fragments  # each fragment once per period
    for b in (b for b in r0["dense"] if b):
        assert b == 4 * numel // fragments, "peak bytes per sync: 1/P of the model"
    launches = {p: [t for t in range(1, 2 * every + 1) if t % every == off] for p, off in enumerate(r0["offsets"])}
    for t, pending in enumerate(r0["events"], start=1):  # each exchange runs behind `overlap` inner steps
        assert pending == sorted(p for p, ts in launches.items() if any(s <= t < s + overlap for s in ts)), t
    # A merged fragment is the common outer value plus each site's own drift since its
    # launch: the sites differ by their drift since the last merged launch, no more.
    gap = (results[1]["params"] - results[0]["params"]).abs()
    assert gap.max() <= 0.02 * (every + overlap) + 1e-5 and gap.min() >= 0.02 * overlap - 1e-5


def _train(rank, world, steps, save_at, options, compiled=False):
    """A small regression on each site's own data (SGD with momentum inside), the
    synchronizer on top; with ``save_at`` the run is checkpointed there into a buffer and
    continued from fresh objects. Returns the final parameters and the checkpoint's step."""
    sites = hhook.diloco.find_sites(1)

    def build():
        net = _net(seed=1, width=8, layers=4)
        run = torch.compile(net, backend="aot_eager") if compiled else net
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        return net, run, opt, hhook.diloco.DiLoCo(run, opt, sites, **options)

    net, run, opt, outer = build()
    in_flight_at_save = None
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * rank + step)
        x = torch.randn(16, 8, generator=g)
        loss = ((run(x) - x.flip(1) * (1 + rank)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        outer.step()
        if step + 1 == save_at:
            in_flight_at_save = outer.in_flight()
            buf = io.BytesIO()
            torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "outer": outer.state_dict()}, buf)
            buf.seek(0)
            saved = torch.load(buf, weights_only=True)
            net, run, opt, outer = build()
            net.load_state_dict(saved["model"])
            opt.load_state_dict(saved["opt"])
            outer.load_state_dict(saved["outer"])
    return _flat(net), in_flight_at_save, loss.item()


def _trains(rank, world, runs):
    """:func:`_train` for each ``(steps, save_at, options, compiled)`` in one world."""
    return [_train(rank, world, *run) for run in runs]


RESUMED = [({"every": 4, "bits": 4, "fragments": 2, "overlap": 1, "error_feedback": True}, 6),  # fragment 0 in flight
           ({"every": 5, "bits": None}, 7)]


def test_resume_mid_period_continues_bit_for_bit(two_sites):
    """THC with error feedback, streamed, saved with an exchange in flight; an fp32 exchange
    saved mid-period: each resumed run ends on the straight run's bits."""
    runs = [(11, save_at, options, False) for options, save in RESUMED for save_at in (None, save)]
    for rank_runs in two_sites("resumed"):
        for i in range(0, len(runs), 2):
            (a, _, _), (b, _, _) = rank_runs[i], rank_runs[i + 1]
            assert torch.equal(a, b), runs[i]
        assert rank_runs[1][1] == 1, "the checkpoint was taken with an exchange in flight"


def test_under_torch_compile_the_same_as_eager():
    options = {"every": 3, "bits": 4, "fragments": 2, "overlap": 1}
    for (a, _, _), (b, _, _) in run_world(_trains, 2, [(7, None, options, False), (7, None, options, True)]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


MISMATCHES = ("every", "bits", "fragments", "width")


def _mismatch(rank, world):
    """Each mismatch in turn, on the last rank (site): every rank's message, or None."""
    messages = []
    for what in MISMATCHES:
        options = {"every": 4, "bits": 4, "fragments": 2}
        width = 16
        if rank == world - 1:
            if what == "width":
                width = 12
            else:
                options[what] = {"every": 6, "bits": 3, "fragments": 4}[what]
        try:
            hhook.diloco.DiLoCo(_net(width=width), None, 1, **options)
            messages.append(None)
        except hhook.ConfigMismatchError as e:
            messages.append(str(e))
    return messages


def test_mismatched_options_or_shapes_raise_on_every_rank():
    """H, bits, fragment counts or a parameter's shape differing on one site: every rank raises."""
    for rank_messages in run_world(_mismatch, 3):
        for what, m in zip(MISMATCHES, rank_messages):
            assert m is not None and "sites disagree" in m and "on rank 2" in m, (what, m)
            assert ("parameters:" in m and "rank 2 has 0.weight [12, 12]" in m) if what == "width" else (f" {what}: " in m), (what, m)


def _asks_differently(rank, world):
    try:
        hhook.diloco.find_sites(1 if rank == 0 else 2)
    except ValueError as e:
        return str(e)


def test_sites_asked_differently_raise_on_every_rank():
    assert all("different sites" in m for m in run_world(_asks_differently, 2))


def test_a_world_of_one_site_trains_locally():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with logged("hhook.diloco") as lines:
        outer = hhook.diloco.DiLoCo(model, opt, every=2)
    assert any("one site" in line for line in lines)
    before = _flat(model).clone()
    for _ in range(4):
        outer.step()
    assert torch.equal(before, _flat(model)) and outer.stats()["syncs"] == 0


def _two_by_two_both(rank, world):
    own = dist.new_group([0, 3])  # the program's own subgroup, made before the sites'
    sites = hhook.diloco.find_sites(2)
    return {fsdp: _two_by_two(rank, own, sites, fsdp) for fsdp in (False, True)}


def _two_by_two(rank, own, sites, fsdp):
    """4 ranks as 2 sites x 2: a subgroup of the program's own beside hhook's groups, DDP
    or FSDP2 inside each site, an fp32 exchange; one outer step (H = 2)."""
    net = _net(seed=0, width=8, layers=2)
    if fsdp:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        mesh = DeviceMesh.from_group(sites.site_group, "cpu")
        for layer in net:
            fully_shard(layer, mesh=mesh)
        model = fully_shard(net, mesh=mesh)
    else:
        model = nn.parallel.DistributedDataParallel(net, process_group=sites.site_group)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = hhook.diloco.DiLoCo(model, opt, sites, every=2, bits=None)
    start = [p.detach().full_tensor().clone() if fsdp else p.detach().clone() for p in net.parameters()]
    for step in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * rank + step))
        loss = (model(x) - sites.site).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank in (0, 3):
            t = torch.ones(1)
            dist.all_reduce(t, group=own)
            assert t.item() == 2
        outer.step()
    full = [p.detach().full_tensor() if fsdp else p.detach() for p in net.parameters()]
    return torch.cat([f.reshape(-1) for f in full]), torch.cat([s.reshape(-1) for s in start]), outer.stats()


def test_sites_of_two_ranks_with_ddp_or_fsdp2_beside_the_program_s_subgroups():
    """After the outer step every rank of every site holds the same parameters, FSDP2's the
    same as DDP's; with DDP each local rank exchanged half of the pseudo-gradient."""
    results = run_world(_two_by_two_both, 4)
    for fsdp in (False, True):
        finals = [r[fsdp][0] for r in results]
        assert all(torch.equal(finals[0], f) for f in finals), "every rank of every site holds the outer parameters"
        assert not torch.equal(finals[0], results[0][fsdp][1]), "the outer step moved them"
    torch.testing.assert_close(results[0][True][0], results[0][False][0], rtol=1e-5, atol=1e-6)
    numel = results[0][False][0].numel()
    for r in results:
        assert r[False][2]["dense_bytes"] == 4 * -(-numel // 2)
        assert 0 < r[True][2]["dense_bytes"] < 4 * numel  # FSDP2: this rank's own shards


def _stall(rank, world, raised):
    """Groups made without timeout=: the default group's (4 s here); rank 1 stalls until
    rank 0 has raised (the file ``raised``; at most 60 s), then goes on."""
    import os

    sites = hhook.diloco.find_sites(1)
    model = _net()
    outer = hhook.diloco.DiLoCo(model, None, sites, every=2, bits=4)
    outer.start()
    t0 = time.monotonic()
    try:
        for step in range(6):
            if rank == 1 and step == 3:
                stalled = time.monotonic()
                while not os.path.exists(raised) and time.monotonic() - stalled < 60:
                    time.sleep(0.1)
            t0 = time.monotonic()
            outer.step()
    except (hhook.PeerTimeoutError, hhook.PeerLostError) as e:
        took = time.monotonic() - t0
        if rank == 0:
            open(raised, "w").close()
        return type(e).__name__, str(e), took
    return None, None, None


def test_a_stalled_site_makes_the_other_raise_naming_it_within_the_default_group_s_timeout(tmp_path):
    """find_sites(1) without timeout= makes groups that wait as long as the default group
    (4 s), not torch's own 30 minutes: the other site raises PeerTimeoutError naming the
    stalled one within about that; the stalled site, going on once it has, learns of it."""
    results = run_outcomes(_stall, 2, str(tmp_path / "raised"), pg_timeout_s=4, timeout=120)
    assert results[0]["value"] is not None, results[0]["error"]
    kind, message, took = results[0]["value"]
    assert kind == "PeerTimeoutError", message
    assert "hhook.diloco: the outer exchange" in message and "rank 1 is in site 1" in message, message
    assert took < 10, took
    assert results[1]["value"] is None or results[1]["value"][0] is not None, "the stalled site learns of it too"


def _ef_errors(rank, world, draws, steps):
    return {ef: _ef_error(rank, world, ef, draws, steps) for ef in (True, False)}


def _ef_error(rank, world, error_feedback, draws, steps):
    """||outer after ``steps`` outer steps - the exact sum||, per draw, at 2 bits; the outer
    optimizer is plain SGD at lr 1, so the outer copy is minus the sum of the decoded means."""
    sites = hhook.diloco.find_sites(1)
    errors = []
    for draw in range(draws):
        model = _net(layers=2, width=32)
        outer = hhook.diloco.DiLoCo(model, None, sites, every=1, bits=2, error_feedback=error_feedback,
                                    seed=draw, outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0))
        outer.start()
        exact = _flat(model).clone()
        for call in range(steps):
            g = torch.Generator().manual_seed(10_000 * draw + 100 * call + rank)
            d = torch.randn(exact.numel(), generator=g) * 1e-2
            mean = d.clone()
            dist.all_reduce(mean)
            _set_flat(model, outer.outer[0] - d)
            outer.step()
            exact -= mean / world
        errors.append(((_flat(model) - exact).norm() / exact.norm()).item())
    return errors


def test_error_feedback_keeps_the_sum_of_outer_steps_on_track(two_sites):
    """Over 30 outer steps at 2 bits, the rounding errors of the decoded means add up
    (about sqrt(30) times one step's) without error feedback; with it the sum tracks the
    exact one to within about one step's error. Averaged over 8 draws per mode."""
    errors = two_sites("error_feedback")[0]
    with_ef, without = sum(errors[True]) / 8, sum(errors[False]) / 8
    assert with_ef < 0.4 * without, (with_ef, without)


def test_a_site_that_dies_makes_the_other_raise_naming_it():
    """Rank 1 (site 1) dies in the middle of a run; rank 0 raises hhook.PeerLostError from the
    outer step, naming site 1, within the group's timeout; nobody hangs."""
    import os
    import re
    import subprocess
    import sys

    from tests.support.distributed import ROOT, free_port, subprocess_env

    port = free_port()
    procs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "tests", "support", "diloco_job.py"), "--die-at", "5"],
                              env=subprocess_env(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                                                 MASTER_PORT=str(port)), cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for r in range(2)]
    try:
        out = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert procs[1].returncode == 9
    found = re.search(r"rank 0: step (\d+): (\w+): (.*)", out[0][1])
    assert procs[0].returncode == 1 and found, out[0][1][-3000:]
    assert found.group(2) in ("PeerLostError", "PeerTimeoutError"), found.group(0)
    assert "hhook.diloco: the outer exchange" in found.group(3) and "site 1" in found.group(3), found.group(0)


RESUME_OPTIONS = {"every": 4, "bits": 4, "fragments": 2, "overlap": 1, "error_feedback": True}
ORDERS = [o for o in __import__("itertools").permutations("MICO") if o.index("C") < o.index("O")]  # 12


def _resume_data(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(16, 8, generator=g)
    return x, x.flip(1) * (1 + rank)


def _resume_steps(net, opt, outer, rank, steps):
    for step in steps:
        x, y = _resume_data(rank, step)
        loss = ((net(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        outer.step()


def _straight(rank, world, path, save_at, steps):
    """The uninterrupted run (sites seeded apart: site 0's start wins), saved at ``save_at``."""
    sites = hhook.diloco.find_sites(1)
    net = _net(seed=rank, width=8, layers=4)
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    outer = hhook.diloco.DiLoCo(net, opt, sites, **RESUME_OPTIONS)
    _resume_steps(net, opt, outer, rank, range(save_at))
    torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "outer": outer.state_dict()}, f"{path}/{rank}.pt")
    _resume_steps(net, opt, outer, rank, range(save_at, steps))
    return _flat(net)


def _resumed_in_every_order(rank, world, path, save_at, steps):
    """Each order of model load (M), inner-optimizer load (I), construction (C) and
    outer.load_state_dict (O), from objects seeded apart from the checkpoint's; then a
    fresh run whose weights are loaded after construction; then a resumed outer state
    over a model never loaded."""
    sites = hhook.diloco.find_sites(1)
    finals = {}
    for order in ORDERS:
        saved = torch.load(f"{path}/{rank}.pt", weights_only=True)  # (a load aliases what it loads)
        net = _net(seed=10 + rank, width=8, layers=4)
        opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
        outer = None
        for what in order:
            if what == "M":
                net.load_state_dict(saved["model"])
            elif what == "I":
                opt.load_state_dict(saved["opt"])
            elif what == "C":
                outer = hhook.diloco.DiLoCo(net, opt, sites, **RESUME_OPTIONS)
            else:
                outer.load_state_dict(saved["outer"])
        _resume_steps(net, opt, outer, rank, range(save_at, steps))
        finals["".join(order)] = _flat(net)
    net = _net(seed=10 + rank, width=8, layers=4)
    outer = hhook.diloco.DiLoCo(net, None, sites, **RESUME_OPTIONS)
    pretrained = _net(seed=7, width=8, layers=4).state_dict()
    net.load_state_dict(pretrained)  # after construction: taken up at the start
    net(torch.zeros(1, 8))
    took_up = torch.equal(torch.cat(outer.outer), torch.cat([f.read() for f in outer.fragments])) and \
        torch.equal(_flat(net), torch.cat([t.reshape(-1) for t in pretrained.values()]))
    net = _net(seed=10 + rank, width=8, layers=4)
    outer = hhook.diloco.DiLoCo(net, None, sites, **RESUME_OPTIONS)
    outer.load_state_dict(saved["outer"])
    try:
        net(torch.zeros(1, 8))
        forgot = None
    except ValueError as e:
        forgot = str(e)
    return finals, took_up, forgot


def test_resume_in_every_order_is_bit_for_bit(tmp_path):
    """Saved mid-period with an exchange in flight (THC, error feedback, 2 fragments,
    overlap 1); resumed in new processes in each of the 12 orders of loads and
    construction: every one ends on the uninterrupted run's bits. Weights loaded after
    construction become the outer copy; an outer state over a model not loaded raises."""
    straight = run_world(_straight, 2, str(tmp_path), 6, 11)
    for rank, (finals, took_up, forgot) in enumerate(run_world(_resumed_in_every_order, 2, str(tmp_path), 6, 11)):
        wrong = [order for order, flat in finals.items() if not torch.equal(flat, straight[rank])]
        assert wrong == [], (rank, wrong, [(finals[o] - straight[rank]).abs().max().item() for o in wrong])
        assert took_up, "weights loaded after construction are the outer copy"
        assert forgot is not None and "load the model's state_dict" in forgot, forgot


def _bad_checkpoints(good: dict) -> dict:
    import copy

    def edit(fn):
        bad = copy.deepcopy(good)
        fn(bad)
        return bad

    return {"options missing": edit(lambda d: d.pop("options")),
            "two outer param groups": edit(lambda d: d["outer_optimizer"]["param_groups"].append(
                copy.deepcopy(d["outer_optimizer"]["param_groups"][0]))),
            "a 2-D shard": edit(lambda d: d["outer"].__setitem__(1, d["outer"][1].view(-1, 1))),
            "counters an int": edit(lambda d: d.__setitem__("counters", 3)),
            "position a string": edit(lambda d: d.__setitem__("position", "6")),
            "pending fragment 7 of 2": edit(lambda d: d["pending"].__setitem__(7, d["pending"][0]))}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _robustness(rank, world):
    """In one world: the outer optimizer's lr differing; sites seeded apart with a frozen
    layer, a bias outside the inner optimizer and a buffer; failed loads of bad
    checkpoints; one site resumed, the other fresh."""
    sites = hhook.diloco.find_sites(1)
    out = {}
    try:
        hhook.diloco.DiLoCo(_net(), None, sites, every=2, outer_optimizer=lambda ps: torch.optim.SGD(
            ps, lr=0.7 if rank == 0 else 0.1, momentum=0.9, nesterov=True))
    except hhook.ConfigMismatchError as e:
        out["lr"] = str(e)
    net = _net(seed=rank, width=8, layers=3)
    net.register_buffer("seen", torch.full((3,), float(rank)))
    net[0].requires_grad_(False)  # frozen
    opt = torch.optim.SGD([net[1].weight, net[2].weight, net[2].bias], lr=0.1)  # net[1].bias outside it
    hhook.diloco.DiLoCo(net, opt, sites, every=2, bits=None)
    net(torch.zeros(1, 8))
    out["start"] = torch.cat([_flat(net), net.seen])
    out["site0"] = torch.cat([_flat(_net(seed=0, width=8, layers=3)), torch.zeros(3)])
    options = {"every": 4, "bits": 4, "fragments": 2, "overlap": 1}
    model = _net(width=8, layers=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    outer = hhook.diloco.DiLoCo(model, opt, sites, **options)
    _resume_steps(model, opt, outer, rank, range(6))
    good = outer.state_dict()
    fresh = hhook.diloco.DiLoCo(_net(width=8, layers=4), None, sites, **options)
    before, out["loads"] = fresh.state_dict(), {}
    for what, bad in _bad_checkpoints(good).items():
        try:
            fresh.load_state_dict(bad)
            out["loads"][what] = "loaded"
        except ValueError as e:
            out["loads"][what] = "same" if _same(before, fresh.state_dict()) else f"changed: {e}"
    if rank == 0:  # one site resumed, the other fresh
        fresh.load_state_dict(good)
    t0 = time.monotonic()
    try:
        fresh.start()
    except hhook.ConfigMismatchError as e:
        out["mixed"] = str(e), time.monotonic() - t0
    outer.finish()  # fragment 0's exchange was in flight: merged, then every fragment once more
    out["finished"] = _flat(model), torch.equal(torch.cat(outer.outer), torch.cat([f.read() for f in outer.fragments]))
    outer = hhook.diloco.DiLoCo(model, None, sites, every=1, bits=4)
    outer.start()
    if rank == 1:
        with torch.no_grad():
            model[2].weight[0, 0] = float("nan")
    try:
        outer.step()
    except FloatingPointError as e:
        out["nan"] = str(e)
    return out


def test_outer_optimizer_parameters_and_checkpoints_are_checked():
    """lr 0.7 against 0.1 raises on every rank naming it; every parameter and buffer starts
    from site 0's; a bad checkpoint raises ValueError and changes nothing; a site resumed
    beside a fresh one raises ConfigMismatchError on every rank within 5 s; finish() leaves
    every site on the same parameters, the outer ones; a NaN on one site is named on every
    site."""
    results = run_world(_robustness, 2)
    for r in results:
        assert "o.lr: 0.7 on rank 0, 0.1 on rank 1" in r.get("lr", ""), r.get("lr")
        assert torch.equal(r["start"], results[0]["site0"]), (r["start"] - results[0]["site0"]).abs().max()
        assert r["loads"] == {what: "same" for what in r["loads"]}, r["loads"]
        message, took = r["mixed"]
        assert "inner steps: 6 on rank 0, 0 on rank 1" in message and took < 5, (message, took)
        assert torch.equal(r["finished"][0], results[0]["finished"][0]) and r["finished"][1], "finish(): one model"
        assert "site 1 (rank 1) holds inf or NaN" in r.get("nan", ""), r.get("nan")


def _uneven(rank, world):
    """Rank 1's data ends after 4 inner steps (it finishes), rank 0's after 10."""
    outer = hhook.diloco.DiLoCo(_net(), None, hhook.diloco.find_sites(1), every=2, bits=None)
    outer.start()
    t0 = time.monotonic()
    try:
        for _ in range(4 if rank == 1 else 10):
            outer.step()
        outer.finish()
    except hhook.ConfigMismatchError as e:
        return str(e), time.monotonic() - t0
    return None, time.monotonic() - t0


def test_a_site_that_finishes_early_says_so():
    """A site that finishes (finish()) after fewer inner steps is reported to the other as
    finished, not as died; it learns that the other trains on; both within the timeout."""
    results = run_outcomes(_uneven, 2, pg_timeout_s=4, timeout=90)
    (m0, t0), (m1, t1) = [r["value"] or (r["error"], None) for r in results]
    assert "site 1 (rank 1) after inner step 4 finished (a clean leave" in m0 and t0 < 12, (m0, t0)
    assert "site 0 (rank 0) not within 4 s: it trains on" in m1 and t1 < 12, (m1, t1)


def _start_alike(rank, world, ranks_per_site):
    """The common start where the sites already hold one model (seeded alike), and where
    site 1 changed one parameter (on each of its ranks alike, as DDP keeps them): the
    broadcasts each start made, the parameters after it and whether the outer copy holds
    them."""
    sites = hhook.diloco.find_sites(ranks_per_site)
    out = {}
    for case in ("alike", "one apart"):
        model = _net(seed=0, layers=4)
        outer = hhook.diloco.DiLoCo(model, None, sites, every=4, bits=4, fragments=2)
        if case == "one apart" and sites.site == 1:
            with torch.no_grad():
                list(model.parameters())[-1].add_(1.0)  # in one rank's shard (ranks_per_site 2: one ring's)
        with counted() as seen:
            outer.start()
        held = torch.cat([f.read() for f in outer.fragments])
        out[case] = (seen.count("broadcast"), _flat(model), torch.equal(torch.cat(list(outer.outer)), held))
    return out


@pytest.mark.parametrize("world,ranks_per_site", [(2, 1), (4, 2)])
def test_sites_that_hold_one_model_start_without_sending_it(world, ranks_per_site):
    """The common start checks, in one small all-gather, whether every site already holds
    site 0's model (every ring alike): then it broadcasts nothing (over a slow link the
    broadcast costs the model's bytes: 1.6 s of a 3.6 s start for 13 MB at 100 Mbit/s +
    50 ms). One parameter apart (one ring's shard) makes every ring broadcast, and every
    site ends on site 0's."""
    results = run_world(_start_alike, world, ranks_per_site, timeout=240)
    site0 = _flat(_net(seed=0, layers=4))
    for rank, out in enumerate(results):
        broadcasts, params, outer_read = out["alike"]
        assert broadcasts == 0 and torch.equal(params, site0) and outer_read, (rank, broadcasts)
        broadcasts, params, outer_read = out["one apart"]
        assert broadcasts > 0 and torch.equal(params, site0) and outer_read, (rank, broadcasts)
