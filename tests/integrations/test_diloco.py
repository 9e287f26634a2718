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
from tests.support.distributed import logged, run_world


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


def _pseudo(site: int, numel: int, call: int, kind: str) -> torch.Tensor:
    """Site ``site``'s pseudo-gradient at outer step ``call``: heterogeneous on purpose."""
    base = torch.randn(numel, generator=torch.Generator().manual_seed(100 + call)) * 1e-2
    if kind == "10x":
        return base * (10.0 if site == 1 else 1.0) + site * 1e-3
    if kind == "zero":
        return base if site == 0 else torch.zeros(numel)
    return base + 1e-2 * torch.randn(numel, generator=torch.Generator().manual_seed(7 * site + call))


def _outer_steps(rank, world, bits, kind, ranks_per_site, steps=3):
    """Every outer step (H = 1): each site moves to outer - d_site, the synchronizer
    averages; returns (this rank's parameters after each step, the dense reference)."""
    sites = hhook.diloco.find_sites(ranks_per_site)
    model = _net(seed=sites.site)  # sites start apart (a site's ranks alike, as DDP makes them): site 0's wins
    outer = hhook.diloco.DiLoCo(model, None, sites, every=1, bits=bits)
    ref = _flat(model).clone()
    assert torch.equal(ref, _flat(_net(seed=0))), "every site starts from site 0's parameters"
    ref_opt = hhook.diloco.nesterov_sgd([ref])
    got, want = [ref.clone()], [ref.clone()]
    for call in range(steps):
        d = [_pseudo(s, ref.numel(), call, kind) for s in range(sites.n_sites)]
        _set_flat(model, ref - d[sites.site])
        outer.step()
        ref.grad = torch.stack(d).mean(0)
        ref_opt.step()
        got.append(_flat(model).clone())
        want.append(ref.clone())
    return got, want, outer.stats()


@pytest.mark.parametrize("world,ranks_per_site,kind", [(2, 1, "10x"), (2, 1, "zero"), (4, 2, "mixed"), (4, 1, "10x")])
def test_outer_step_with_an_fp32_exchange_is_the_dense_reference(world, ranks_per_site, kind):
    for rank, (got, want, stats) in enumerate(run_world(_outer_steps, world, None, kind, ranks_per_site)):
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)
        assert stats["syncs"] == 3 and stats["exchange"] == "fp32" and not torch.equal(want[0], want[-1])


@pytest.mark.parametrize("world,ranks_per_site,kind", [(2, 1, "10x"), (2, 1, "zero"), (4, 2, "mixed")])
def test_outer_step_through_thc_at_8_bits_is_close_to_the_dense_reference(world, ranks_per_site, kind):
    results = run_world(_outer_steps, world, 8, kind, ranks_per_site)
    for got, want, stats in results:
        for g, w in zip(got[1:], want[1:]):
            moved = (w - want[0]).norm()  # compared with how far the outer steps moved
            assert (g - w).norm() < 0.02 * moved, ((g - w).norm(), moved)
        assert stats["wire_bytes"] < stats["dense_bytes"]
    finals = [r[0][-1] for r in results]
    assert all(torch.equal(finals[0], f) for f in finals), "every site holds the same outer parameters"


def _streamed(rank, world, fragments, overlap, bits):
    """Inner steps that add a site's constant to every parameter; the synchronizer streams
    ``fragments`` at their offsets. Returns what each sync saw and the parameters."""
    sites = hhook.diloco.find_sites(1)
    model = _net(layers=4)
    every = 8
    outer = hhook.diloco.DiLoCo(model, None, sites, every=every, bits=bits, fragments=fragments, overlap=overlap)
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


@pytest.mark.parametrize("fragments,overlap", [(4, 0), (4, 2), (2, 1)])
def test_streaming_syncs_each_fragment_at_its_offset_with_a_fraction_of_the_bytes(fragments, overlap):
    results = run_world(_streamed, 2, fragments, overlap, None)
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


@pytest.mark.parametrize("options,save_at", [
    ({"every": 4, "bits": 4, "fragments": 2, "overlap": 1, "error_feedback": True}, 6),  # fragment 0 in flight
    ({"every": 5, "bits": None}, 7),
])
def test_resume_mid_period_continues_bit_for_bit(options, save_at):
    straight = run_world(_train, 2, 11, None, options)
    resumed = run_world(_train, 2, 11, save_at, options)
    for (a, _, _), (b, in_flight, _) in zip(straight, resumed):
        assert torch.equal(a, b)
    if options.get("overlap"):
        assert resumed[0][1] == 1, "the checkpoint was taken with an exchange in flight"


def test_under_torch_compile_the_same_as_eager():
    options = {"every": 3, "bits": 4, "fragments": 2, "overlap": 1}
    eager = run_world(_train, 2, 7, None, options)
    compiled = run_world(_train, 2, 7, None, options, True)
    for (a, _, la), (b, _, lb) in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _mismatch(rank, world, what):
    options = {"every": 4, "bits": 4, "fragments": 2}
    width = 16
    if rank == world - 1:
        if what == "width":
            width = 12
        else:
            options[what] = {"every": 6, "bits": 3, "fragments": 4}[what]
    model = _net(width=width)
    try:
        hhook.diloco.DiLoCo(model, None, 1, **options)
    except hhook.ConfigMismatchError as e:
        return str(e)
    return None


@pytest.mark.parametrize("what", ["every", "bits", "fragments", "width"])
def test_mismatched_options_or_shapes_raise_on_every_rank(what):
    messages = run_world(_mismatch, 3, what)
    assert all(m is not None and "disagree" in m for m in messages), messages
    assert "rank 2 (site 2)" in messages[0]


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


def _two_by_two(rank, world, fsdp):
    """4 ranks as 2 sites x 2: a subgroup of the program's own beside hhook's groups, DDP
    or FSDP2 inside each site, an fp32 exchange; after one outer step (H = 2) every rank
    holds the same parameters."""
    own = dist.new_group([0, 3])  # the program's own subgroup, made before the sites'
    sites = hhook.diloco.find_sites(2)
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


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp", "fsdp2"])
def test_sites_of_two_ranks_with_ddp_or_fsdp2_beside_the_program_s_subgroups(fsdp):
    results = run_world(_two_by_two, 4, fsdp)
    finals = [r[0] for r in results]
    assert all(torch.equal(finals[0], f) for f in finals), "every rank of every site holds the outer parameters"
    assert not torch.equal(finals[0], results[0][1]), "the outer step moved them"
    numel = finals[0].numel()
    for _, _, stats in results:  # each local rank exchanged its half of the pseudo-gradient
        assert stats["dense_bytes"] == 4 * -(-numel // 2) or fsdp


def _stall(rank, world):
    import datetime

    sites = hhook.diloco.find_sites(1, timeout=datetime.timedelta(seconds=4))
    model = _net()
    outer = hhook.diloco.DiLoCo(model, None, sites, every=2, bits=4)
    try:
        for step in range(6):
            if rank == 1 and step == 3:
                time.sleep(9)
            outer.step()
    except (hhook.PeerTimeoutError, hhook.PeerLostError) as e:
        return type(e).__name__, str(e)
    return None, None


def test_a_stalled_site_makes_the_other_raise_naming_it():
    results = run_world(_stall, 2, timeout=120)
    kind, message = results[0]
    assert kind == "PeerTimeoutError", message
    assert "hhook.diloco: the outer exchange" in message and "rank 1 is in site 1" in message, message
    assert results[1][0] is not None, "the stalled site learns of it too"


def _ef_error(rank, world, error_feedback, draws, steps):
    """||outer after ``steps`` outer steps - the exact sum||, per draw, at 2 bits; the outer
    optimizer is plain SGD at lr 1, so the outer copy is minus the sum of the decoded means."""
    sites = hhook.diloco.find_sites(1)
    errors = []
    for draw in range(draws):
        model = _net(layers=2, width=32)
        outer = hhook.diloco.DiLoCo(model, None, sites, every=1, bits=2, error_feedback=error_feedback,
                                    seed=draw, outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0))
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


def test_error_feedback_keeps_the_sum_of_outer_steps_on_track():
    """Over 30 outer steps at 2 bits, the rounding errors of the decoded means add up
    (about sqrt(30) times one step's) without error feedback; with it the sum tracks the
    exact one to within about one step's error. Averaged over 8 draws per mode."""
    with_ef = sum(run_world(_ef_error, 2, True, 8, 30)[0]) / 8
    without = sum(run_world(_ef_error, 2, False, 8, 30)[0]) / 8
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
