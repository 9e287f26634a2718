"""Inputs a rank encodes that could decode finite and wrong (issue 58): an error-feedback
residual holding NaN or inf flags the exchange on every rank (NaN result, counted in
``nonfinite_calls``), and a checkpoint holding one (or 1e30) is refused at load; tensors
and gradients of every shape and layout; uneven inputs, under DDP's join or not. The
table of inputs tried is in docs/reliability.md ("Inputs tried")."""

from __future__ import annotations

import pytest
import torch

import hhook
from tests.support.distributed import run_outcomes, run_world
from tests.support.plain_data import round_trip

MODES = ["agreed", "predicted", "gathered"]
N = 5000


def _inputs(step: int, world: int) -> list[torch.Tensor]:
    return [torch.randn(N, generator=torch.Generator().manual_seed(10 * step + r)) for r in range(world)]


def _residual_rows(rank: int, world: int) -> dict:
    """Per scale mode: rank 1 loads checkpoints whose residual is NaN, inf or 1e30 (each
    refused), then its live residual is set to NaN, then inf (memory the load never saw),
    then back to zeros; what every rank decoded at each step."""
    rows = {}
    for scales in MODES:
        state = hhook.THCState(bits=4, scales=scales, error_feedback=True)
        refused, steps = [], []
        for step in range(7):
            policy = state.keys.policies.get(scales)
            residual = next(iter(policy.keys.values())).residual if policy and policy.keys else None
            if step == 3 and rank == 1:
                for bad in (float("nan"), float("inf"), 1e30):
                    saved = round_trip(state.state_dict())
                    next(iter(saved["policies"][scales]["keys"].values()))["residual"].fill_(bad)
                    try:
                        state.load_state_dict(saved)
                        refused.append("loaded")
                    except ValueError as exc:
                        refused.append(str(exc))
                residual.fill_(float("nan"))
            if step == 4 and rank == 1:
                residual.fill_(float("inf"))
            if step == 5 and rank == 1:
                residual.zero_()
            inputs = _inputs(step, world)
            t = inputs[rank].clone()
            hhook.thc_allreduce(t, state, key="w")
            mean = torch.stack(inputs).mean(0)
            error = float(((t - mean) ** 2).sum() / (mean**2).sum()) if t.isfinite().all() else None
            steps.append((bool(t.isnan().all()), error, state.stats()["nonfinite_calls"]))
        rows[scales] = {"refused": refused, "steps": steps}
    return rows


def test_a_nonfinite_residual_flags_the_exchange_on_every_rank_and_a_checkpoint_holding_one_is_refused(world):
    for rank, rows in enumerate(world):
        for scales, row in rows["residual"].items():
            if rank == 1:
                assert len(row["refused"]) == 3, row["refused"]
                for message, words in zip(row["refused"], ("non-finite", "non-finite", "below 1.84e+19")):
                    assert "nothing was changed" in message and ".residual must be" in message, message
                    assert words in message, message
            nan, errors, counted = zip(*row["steps"])
            # steps 3 and 4: rank 1's residual is NaN, then inf: NaN on every rank, counted
            assert nan == (False, False, False, True, True, False, False), (rank, scales, row["steps"])
            assert counted[-1] == 2 and counted[2] == 0, (rank, scales, counted)
            finite = [e for e in errors if e is not None]
            assert len(finite) == 5 and max(finite) < 0.2, (rank, scales, errors)  # 4 bits, 2 ranks: about 0.03


# -- tensors of every shape and layout --------------------------------------------------------
def _shaped(case: str, rank: int) -> torch.Tensor:
    """Rank ``rank``'s tensor of ``case`` (the same shape and layout on every rank)."""
    g = torch.Generator().manual_seed(rank + 1)
    base = {
        "empty": lambda: torch.empty(0),
        "0-dim": lambda: torch.randn((), generator=g),
        "1 element": lambda: torch.randn(1, generator=g),
        "transposed": lambda: torch.randn(40, 70, generator=g).t(),
        "strided": lambda: torch.randn(3000, generator=g)[::3],
        "channels-last": lambda: torch.randn(4, 8, 5, 6, generator=g).to(memory_format=torch.channels_last),
        "expanded": lambda: torch.randn(1, 300, generator=g).expand(7, 300),
        "expanded on one rank": lambda: torch.randn(1, 300, generator=g).expand(7, 300).contiguous(),
        "NaN on one rank": lambda: torch.randn(2000, generator=g),
        "inf on one rank": lambda: torch.randn(2000, generator=g),
    }[case]()
    if case == "expanded on one rank" and rank == 1:
        base = base[:1].expand(7, 300)
    if case == "NaN on one rank" and rank == 1:
        base[17] = float("nan")
    if case == "inf on one rank" and rank == 1:
        base[3] = float("inf")
    return base


SHAPED = ["empty", "0-dim", "1 element", "transposed", "strided", "channels-last", "expanded", "expanded on one rank",
          "NaN on one rank", "inf on one rank"]


def _shaped_rows(rank: int, world: int) -> dict:
    """Each case through thc_allreduce (both scale modes, twice: a predicting key's second
    call), per case: ("mean", vNMSE, shape and strides kept), ("nan", all NaN, kept) or
    ("raised", message)."""
    rows = {}
    for scales in MODES:
        state = hhook.THCState(bits=4, scales=scales)
        for case in SHAPED:
            outcome = None
            for call in range(2):
                t = _shaped(case, rank)
                want = torch.stack([_shaped(case, r) for r in range(world)]).mean(0)
                shape, stride = t.shape, t.stride()
                try:
                    out = hhook.thc_allreduce(t, state, key=case)
                except Exception as exc:  # noqa: BLE001 - what the user reads
                    outcome = ("raised", f"{type(exc).__name__}: {exc}")
                    break
                kept = out is t and t.shape == shape and t.stride() == stride
                if not want.isfinite().all():
                    outcome = ("nan", bool(t.isnan().all()), kept)
                else:
                    error = float(((t - want) ** 2).sum() / (want**2).sum()) if t.numel() else 0.0
                    outcome = ("mean", error, kept)
            rows[(scales, case)] = outcome
    return rows


class _Odd(torch.nn.Module):
    """Parameters of every shape and layout DDP's buckets meet."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
        self.scalar = torch.nn.Parameter(torch.tensor(0.5))  # 0-dim
        self.one = torch.nn.Parameter(torch.ones(1))
        self.empty = torch.nn.Parameter(torch.empty(0))
        self.transposed = torch.nn.Parameter(torch.randn(8, 6).t())  # non-contiguous
        self.strided = torch.nn.Parameter(torch.randn(24)[::3])  # stride 3

    def forward(self, x):
        y = self.conv(x.to(memory_format=torch.channels_last)).mean((2, 3))  # (n, 8)
        return (y @ self.transposed.t()).sum(1) * self.scalar + self.one + self.empty.sum() + y @ self.strided


def _ddp_rows(rank: int, world: int) -> dict:
    """5 steps of DDP with hhook.register(ddp, bits=4) on _Odd against the exact mean of
    the ranks' gradients; at step 2 rank 1's loss is NaN, at step 3 inf. Per step: (all NaN, vNMSE)."""
    import torch.distributed as dist

    rows = {}
    for scales in MODES:
        torch.manual_seed(0)
        model, exact = _Odd(), _Odd()
        exact.load_state_dict(model.state_dict())
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        hhook.register(ddp, bits=4, scales=scales)
        steps = []
        for step in range(5):
            g = torch.Generator().manual_seed(100 * step + rank)
            x = torch.randn(4, 3, 7, 7, generator=g)
            poison = {2: float("nan"), 3: float("inf")}.get(step, 1.0) if rank == 1 else 1.0
            ddp.zero_grad()
            (ddp(x).pow(2).mean() * poison).backward()
            exact.zero_grad()
            (exact(x).pow(2).mean() * poison).backward()
            want = torch.cat([p.grad.reshape(-1) for p in exact.parameters()])
            dist.all_reduce(want)
            want /= world
            got = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
            error = float(((got - want) ** 2).sum() / (want**2).sum()) if want.isfinite().all() else None
            steps.append((bool(got.isnan().all()), error))
        rows[scales] = steps
    return rows


def _uneven_ddp(rank: int, hooked: bool, divide_by_initial_world_size: bool = True, join: bool = True):
    """DDP of a small MLP (hhook.register(ddp, bits=4) where ``hooked``) over uneven inputs:
    rank 0 has 6 batches, rank 1 3, under DDP's ``Join`` unless not ``join``. This rank's
    gradients after each of its steps."""
    from torch.distributed.algorithms.join import Join

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Linear(64, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if hooked:
        hhook.register(ddp, bits=4)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    grads = []
    with Join([ddp], enable=join, divide_by_initial_world_size=divide_by_initial_world_size):
        for x in [torch.randn(8, 32, generator=gen) for _ in range(6 if rank == 0 else 3)]:
            opt.zero_grad()
            ddp(x).pow(2).mean().backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone())
            opt.step()
    return grads


def _join_rows(rank: int, world: int) -> dict:
    """Rank 0's gradients at each step under DDP's join, plain DDP against hhook's, for
    both ``divide_by_initial_world_size``; and hhook's log lines."""
    from tests.support.distributed import logged

    rows = {}
    for initial in (True, False):
        with logged("hhook") as lines:
            hooked = _uneven_ddp(rank, True, initial)
        plain = _uneven_ddp(rank, False, initial)
        errors = [float(((h - p) ** 2).sum() / (p**2).sum()) for h, p in zip(hooked, plain)]
        norms = [float(h.norm() / p.norm()) for h, p in zip(hooked, plain)]
        rows[initial] = {"vnmse": errors, "norms": norms, "said": [line for line in lines if "join" in line]}
    return rows


def _every_row(rank: int, world: int) -> dict:
    """One world for every test here (each costs about 2 s to start)."""
    return {"residual": _residual_rows(rank, world), "shaped": _shaped_rows(rank, world), "ddp": _ddp_rows(rank, world),
            "join": _join_rows(rank, world)}


@pytest.fixture(scope="module")
def world():
    return run_world(_every_row, 2, timeout=400)


def test_tensors_of_every_shape_and_layout_average_or_raise_on_every_rank(world):
    """thc_allreduce of empty, 0-dim, 1-element, transposed, strided and channels-last
    tensors: the mean within the codec's error, the tensor's shape and strides kept; NaN or
    inf on one rank: NaN on every rank; an expanded tensor (stride 0: one memory location
    for several means) raised torch's "unsupported operation" after the exchange, now
    hhook's ValueError on every rank before it, and ConfigMismatchError when only one rank's is."""
    for rank, rows in enumerate(world):
        for (scales, case), outcome in rows["shaped"].items():
            where = (rank, scales, case, outcome)
            if case == "expanded":
                assert outcome[0] == "raised" and outcome[1].startswith("ValueError: hhook averages the tensor in "
                                                                        "place, but this one is expanded"), where
            elif case == "expanded on one rank":
                assert outcome[0] == "raised" and outcome[1].startswith("ConfigMismatchError"), where
                assert "expanded" in outcome[1], where
            elif "one rank" in case:
                assert outcome == ("nan", True, True), where
            else:
                assert outcome[0] == "mean" and outcome[1] < 0.1 and outcome[2], where


def test_ddp_gradients_of_every_shape_and_layout_average_and_nan_reaches_every_rank(world):
    """hhook.register(ddp, bits=4) over a 0-dim, a 1-element, an empty, a transposed, a
    strided and a channels-last parameter: after the plain iterations the mean within the
    codec's error; one rank's NaN, then inf, gradient makes every rank's NaN, and the next
    step is right again."""
    for rank, rows in enumerate(world):
        for scales, steps in rows["ddp"].items():
            nan, errors = zip(*steps)
            assert nan == (False, False, True, True, False), (rank, scales, steps)
            assert errors[0] == errors[1] == 0.0 and errors[4] < 0.05, (rank, scales, steps)  # 0.005 measured


def test_uneven_inputs_under_ddp_s_join_average_as_plain_ddp_s_join(world):
    """Rank 1 runs out of data after 3 of rank 0's 6 steps, under DDP's ``Join``: its
    shadow backward passes go through hhook's hook with zeros, and rank 0's gradients are
    plain DDP's within the codec's error at every step (start_iter 2: the first two are
    exact). ``divide_by_initial_world_size=False`` (plain DDP then divides the sat-out
    steps by the ranks still training) is not honoured by a comm hook, hhook's or torch's:
    those steps come out at half plain DDP's, and hhook says so in one log line."""
    rows = world[0]["join"]
    same = rows[True]
    assert same["vnmse"][:2] == [0.0, 0.0] and max(same["vnmse"]) < 0.1, same  # 0.02-0.03 measured
    assert same["said"] == [], same["said"]
    halved = rows[False]
    assert max(halved["vnmse"][:3]) < 0.1 and all(0.4 < n < 0.65 for n in halved["norms"][3:]), halved
    assert len(halved["said"]) == 1 and "divide_by_initial_world_size=False" in halved["said"][0], halved["said"]
    assert len(world[1]["join"][False]["said"]) == 1, world[1]["join"]


def _uneven_without_join(rank, world, hooked):
    try:
        _uneven_ddp(rank, hooked, join=False)
        return "finished"
    except Exception as exc:  # noqa: BLE001 - what the user reads
        return f"{type(exc).__name__}: {exc}"


def test_uneven_inputs_without_join_name_the_rank_that_ran_out_of_data():
    """Without DDP's join, rank 1 ends its program after 3 steps while rank 0 trains on:
    rank 0's next backward raises hhook's PeerLostError through DDP, saying rank 1 left
    normally and to use join(); plain DDP raises Gloo's "Connection closed by peer"."""
    out = run_outcomes(_uneven_without_join, 2, True, pg_timeout_s=20, timeout=90)
    said = out[0]["value"]
    assert out[1]["value"] == "finished" and out[1]["exitcode"] == 0, out
    assert said.startswith("RuntimeError: Got the following error when running the callback: PeerLostError: hhook: "), said
    assert "rank 1 left the job normally" in said and "join()" in said, said
