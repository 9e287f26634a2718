"""Rounds per call (issue 57): the per-call check of thc_allreduce rides in the exchange, and
nothing that launches an exchange waits for a peer.

Collectives are counted inside the ranks by wrapping torch.distributed's functions and the
second communicator's ``all_reduce`` and ``all_gather`` (hhook's SUMs and checks go there):
a second round per call cannot creep back in unnoticed.
"""

import contextlib
import time

import pytest
import torch
import torch.distributed as dist

import hhook
import hhook.diloco
from hhook.codec.kernels import backend
from hhook.schedule import groups

from tests.support.distributed import run_world

_NAMES = ("all_reduce", "all_gather_single", "all_gather_into_tensor", "broadcast", "all_gather", "barrier")


@contextlib.contextmanager
def counted():
    """Count every collective this process launches (torch.distributed's and hhook's second
    communicator's) while inside; yields the list of their names."""
    seen, saved = [], {}
    for name in _NAMES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        saved[name] = fn

        def wrapped(*args, _fn=fn, _name=name, **kwargs):
            seen.append(_name)
            return _fn(*args, **kwargs)

        setattr(dist, name, wrapped)
    second, second_gather = groups.SecondGroup.all_reduce, groups.SecondGroup.all_gather

    def second_all_reduce(self, tensor, op=dist.ReduceOp.SUM):
        seen.append("second.all_reduce")
        return second(self, tensor, op)

    def second_all_gather(self, output, input):
        seen.append("second.all_gather")
        return second_gather(self, output, input)

    groups.SecondGroup.all_reduce, groups.SecondGroup.all_gather = second_all_reduce, second_all_gather
    try:
        yield seen
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
        groups.SecondGroup.all_reduce, groups.SecondGroup.all_gather = second, second_gather


def _thc_worker(rank, world, scales):
    state = hhook.THCState(bits=4, scales=scales)
    x = torch.randn(3000, generator=torch.Generator().manual_seed(rank))
    hhook.thc_allreduce(x.clone(), state, key="setup")  # the options handshake, the second communicator
    rounds = []
    for _ in range(5):
        with counted() as seen:
            hhook.thc_allreduce(x.clone(), state, key="w")
        rounds.append(len(seen))
    with counted() as seen:
        hhook.thc_allreduce(x.clone(), state)  # key None: a check round, then the exchange
    return rounds, len(seen)


@pytest.mark.parametrize("scales, steady", [("predicted", 1), ("agreed", 2), ("gathered", 1)])
def test_a_keyed_thc_allreduce_takes_no_check_round_once_verified(scales, steady):
    """The first call of a key: its check round and the exchange (agreed: MAX and SUM;
    gathered: one all-gather); every later call: the exchange alone (predicted: one SUM;
    agreed: the MAX and the SUM; gathered: the all-gather)."""
    first = 2 if scales == "gathered" else 3  # check, then MAX and SUM (predicted: no history yet)
    for rounds, unkeyed in run_world(_thc_worker, 2, scales):
        assert rounds[0] == first, rounds
        assert rounds[2:] == [steady] * 3, rounds
        assert unkeyed == first


def _ddp_worker(rank, world, scales):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(200, 1000), torch.nn.Tanh(), torch.nn.Linear(1000, 500))
    ddp = DDP(net, bucket_cap_mb=0.5)  # several buckets once rebuilt (DDP's first holds 1 MB)
    hhook.register(ddp, bits=4, scales=scales)
    per_step = []
    for _ in range(6):
        with counted() as seen:
            (ddp(torch.randn(8, 200)) * (1 + 9 * rank)).sum().backward()  # rank 1's gradient about 10x rank 0's
        per_step.append(len(seen))
    return per_step


@pytest.mark.parametrize("scales", ["predicted", "agreed", "gathered", "auto"])
def test_the_ddp_hook_takes_its_rounds_and_no_more(scales):
    """Per bucket: one plain allreduce before start_iter (the count of ranks that loaded a
    checkpoint rides in it, no round more), then agreed scales' MAX and SUM; predicted
    scales' one SUM once a bucket has history (its first compressed step takes the agreed
    round); gathered scales' one all-gather from the first, as the default's (CPU tensors,
    2 ranks). Counted on every rank, rank 1's gradient about 10x rank 0's."""
    for per_step in run_world(_ddp_worker, 2, scales):
        buckets = per_step[1]  # the plain step after DDP rebuilt its buckets
        assert buckets >= 2, per_step
        if scales in ("gathered", "auto"):  # no MAX, and no second communicator to set up
            assert per_step[2:] == [buckets] * 4, per_step
            continue
        steady = buckets if scales == "predicted" else 2 * buckets
        # the first compressed step: MAX and SUM a bucket, and the second communicator's set-up
        assert per_step[2] == 2 * buckets + 1 and per_step[3:] == [steady] * 3, per_step


def _diloco_worker(rank, world, scales):
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = hhook.diloco.DiLoCo(model, opt, sites=1, every=2, bits=4)
    if scales is not None:  # another scale mode than its default (GPUs: agreed), before the common start
        outer.thc = hhook.THCState(outer.sites.ring, bits=4, scales=scales)
    per_sync = []
    for step in range(8):
        model(torch.randn(4, 20)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        with counted() as seen:
            outer.step()
        if seen:
            per_sync.append(len(seen))
    return per_sync, sorted(outer.thc.runtime.second)


@pytest.mark.parametrize("scales, rounds, second", [(None, 1, []), ("agreed", 2, ["cpu"])],
                         ids=["default (gathered)", "agreed"])
def test_a_diloco_fragment_exchange_takes_one_round(scales, rounds, second):
    """DiLoCo's THC state at its default scales (gathered between 2 sites on CPUs): one
    all-gather a sync, nothing else, from the first (its options check covered the
    fragments: no check round), and no second communicator is made; agreed scales (a
    GPU's default) take their MAX and SUM, the SUM on the second communicator."""
    for per_sync, made in run_world(_diloco_worker, 2, scales):
        assert per_sync == [rounds] * 4 and made == second, (per_sync, made)


def _late_worker(rank, world, keyed):
    state = hhook.THCState(bits=4)
    key = "w" if keyed else None
    hhook.thc_allreduce(torch.randn(50_000), state, key=key)  # the options handshake, the key verified
    dist.barrier()
    if rank == 1:
        time.sleep(1.0)
    start = time.perf_counter()
    fut = hhook.thc_allreduce_async(torch.randn(50_000), state, key=key)
    launched = time.perf_counter() - start
    fut.wait()
    return launched, time.perf_counter() - start


@pytest.mark.parametrize("keyed", [True, False])
def test_a_launch_returns_without_waiting_for_a_late_peer(keyed):
    """Rank 1 calls 1 s late: rank 0's launch returns at once, its wait takes the second."""
    (launched, waited), _ = run_world(_late_worker, 2, keyed)
    print(f"\nlaunch with a peer 1 s late (key {'w' if keyed else None}): {launched * 1e3:.2f} ms, "
          f"wait {waited:.3f} s")
    assert launched < 0.2 and waited > 0.8, (launched, waited)


def _changed_worker(rank, world, scales):
    """Every rank changes what key "w" holds alike: checked and exchanged again, the mean right."""
    state = hhook.THCState(bits=8, scales=scales)
    base = torch.randn(2, 4000, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        hhook.thc_allreduce(base[rank, :3000].clone(), state, key="w")
    y = base[rank].clone()
    hhook.thc_allreduce(y, state, key="w")  # 4000 elements now on every rank
    z = base[rank, :3000].clone().view(30, 100)
    hhook.thc_allreduce(z, state, key="w")  # the same length, another layout
    return (y - base.mean(0)).abs().max().item(), (z.reshape(-1) - base[:, :3000].mean(0)).abs().max().item()


@pytest.mark.parametrize("scales", ["predicted", "agreed", "gathered"])
def test_a_key_that_every_rank_changes_alike_is_checked_again(scales):
    for err_len, err_layout in run_world(_changed_worker, 2, scales):
        assert err_len < 0.05 and err_layout < 0.05, (err_len, err_layout)


def _diloco_late_worker(rank, world):
    torch.manual_seed(0)
    model = torch.nn.Linear(200, 100)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = hhook.diloco.DiLoCo(model, opt, sites=1, every=2, bits=4, overlap=1)
    launches = []
    for step in range(6):
        model(torch.randn(4, 200)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if step % 2 == 1:  # the step whose outer.step() launches the fragment
            dist.barrier()
            if rank == 1:
                time.sleep(1.0)
            start = time.perf_counter()
            outer.step()
            launches.append(time.perf_counter() - start)
        else:
            outer.step()
    outer.finish()
    return launches


def test_a_diloco_launch_does_not_wait_for_a_late_site():
    """With site 1 a second late, site 0's step that launches a fragment's exchange (THC,
    overlap 1: merged a step later) returns at once, the first launch included."""
    launches, _ = run_world(_diloco_late_worker, 2)
    print(f"\nDiLoCo launches with a site 1 s late: {', '.join(f'{t * 1e3:.2f} ms' for t in launches)}")
    assert max(launches) < 0.2, launches


def _codec_loaded_worker(rank, world):
    from hhook.codec.kernels import cpu

    torch.manual_seed(0)
    model = torch.nn.Linear(200, 100)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cpu._library.cache_clear()  # as in a fresh process: nothing loaded yet
    outer = hhook.diloco.DiLoCo(model, opt, sites=1, every=1, bits=4, overlap=1)
    outer.start()
    after_start = cpu._load.cache_info().misses
    model(torch.randn(4, 200)).square().mean().backward()
    opt.step()
    outer.step()  # the first fragment's launch
    launched = cpu._load.cache_info().misses
    outer.finish()
    return after_start, launched


def test_the_common_start_loads_the_codec_so_no_launch_does():
    """The common start (``connect``) builds or loads the fused codec: under gathered scales
    it makes no second communicator, which loaded it before, and the first launch did it
    (8-11 ms with the library cached, a compile's seconds without)."""
    if backend.forced_off():
        pytest.skip("HHOOK_FORCE_REFERENCE=1: no fused codec to load")
    for after_start, launched in run_world(_codec_loaded_worker, 2):
        assert after_start == 1 and launched == 1, (after_start, launched)


def _one_rank_changed_worker(rank, world, scales, change):
    """Rank 1 calls a verified key with another length (or only another shape): the filler of
    the verified size meets rank 0's exchange, and both raise, naming each rank's values."""
    state = hhook.THCState(bits=4, scales=scales)
    for _ in range(2):
        hhook.thc_allreduce(torch.randn(5000), state, key="w")
    x = torch.randn(8000 if change == "numel" else 5000) if rank == 1 else torch.randn(5000)
    if change == "layout" and rank == 1:
        x = x.view(50, 100)
    start = time.monotonic()
    try:
        hhook.thc_allreduce(x, state, key="w")
    except hhook.ConfigMismatchError as exc:
        return str(exc), time.monotonic() - start
    return None, time.monotonic() - start


@pytest.mark.parametrize("change", ["numel", "layout"])
@pytest.mark.parametrize("scales", ["predicted", "agreed", "gathered"])
def test_one_rank_that_changes_a_verified_key_fails_on_every_rank(scales, change):
    for message, took in run_world(_one_rank_changed_worker, 2, scales, change):
        assert message is not None and took < 5.0, (message, took)
        if change == "numel":
            assert "numel: 5000 on rank 0, 8000 on rank 1" in message, message
        else:
            assert "layout_crc32:" in message and "key 'w'" in message, message
