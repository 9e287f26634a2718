"""Bad checkpoints of the hook state (docs/reliability.md): a truncated file, a state of
another world size, codec version, rank, bits or scale mode. Each is a clear error or a
fresh start with one log line, and the gradients that follow are the mean, never silently
wrong; through ``load_state_dict``, ``torch.load`` of a pickled state and
``hhook.register(ddp, state=...)``, in both scale modes, with heterogeneous ranks."""

import io

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import hhook
from hhook.codec import CODEC_VERSION
from hhook.simulation import vnmse
from tests.support.distributed import logged, run_world

MODES = ["agreed", "predicted"]


def _grad(rank: int, step: int, world: int) -> torch.Tensor:
    """Heterogeneous ranks: rank 1's gradient is 10x rank 0's, rank 2's (if any) zero."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    scale = {0: 1.0, 1: 10.0}.get(rank, 0.0)
    return torch.randn(5000, generator=g) * scale


def _mean_error(state, rank, world, step) -> float:
    """vNMSE of one reduction through ``state`` against the exact mean."""
    grads = [_grad(r, step, world) for r in range(world)]
    t = grads[rank].clone()
    hhook.thc_allreduce(t, state, key="w")
    return vnmse(t, torch.stack(grads))


def _saved(rank, world, scales, error_feedback=False):
    """The state_dict and the pickle of a state that reduced a few steps."""
    state = hhook.THCState(bits=4, scales=scales, error_feedback=error_feedback)
    for step in range(3):
        _mean_error(state, rank, world, step)
    buf = io.BytesIO()
    torch.save(state, buf)
    return state.state_dict(), buf.getvalue()


@pytest.fixture(scope="module", params=MODES)
def three_rank_states(request):
    return request.param, run_world(_saved, 3, request.param, timeout=240)


def _other_world_worker(rank, world, scales, saved, pickled):
    out = {}
    # 1. load_state_dict into a state built for this run
    state = hhook.THCState(bits=4, scales=scales)
    with logged("hhook") as lines:
        state.load_state_dict(saved)
        out["load_error"] = _mean_error(state, rank, world, 10)
    out["load_lines"] = lines
    # 2. torch.load of a THCState pickled by the 3-rank run
    with logged("hhook") as lines:
        loaded = torch.load(io.BytesIO(pickled), weights_only=False)
        out["pickle_error"] = _mean_error(loaded, rank, world, 11)
    out["pickle_lines"] = lines
    # 3. hhook.register(ddp, state=...) and DDP steps: gradients identical on every rank and the mean
    torch.manual_seed(0)
    model = nn.Linear(50, 100)
    ddp = nn.parallel.DistributedDataParallel(model)
    resumed = hhook.THCState(bits=4, scales=scales)
    resumed.load_state_dict(saved)
    with logged("hhook") as lines:
        hhook.register(ddp, state=resumed)
        for step in range(4):
            ddp.zero_grad()
            x = _grad(rank, step, world)[:800].view(16, 50)
            ddp(x).pow(2).sum().backward()
    out["ddp_lines"] = lines
    out["ddp_grad"] = model.weight.grad.clone()
    return out


def test_a_state_of_another_world_size_starts_afresh_with_one_line(three_rank_states):
    scales, states = three_rank_states
    saved = [s for s, _ in states]
    res = run_world(_other_world_worker, 2, scales, saved[0], states[0][1], timeout=240)
    for r in res:
        for how in ("load", "pickle", "ddp"):
            afresh = [line for line in r[f"{how}_lines"] if "starts afresh" in line]
            assert len(afresh) == 1 and "saved with 3 ranks" in afresh[0], (how, r[f"{how}_lines"])
        assert r["load_error"] < 0.05 and r["pickle_error"] < 0.05, (r["load_error"], r["pickle_error"])
    assert torch.equal(res[0]["ddp_grad"], res[1]["ddp_grad"])


def _same_world_worker(rank, world, scales, saved):
    out = {}
    # another codec version: afresh, one line
    other = dict(saved[rank], codec_version=CODEC_VERSION + 1)
    state = hhook.THCState(bits=4, scales=scales, error_feedback=True)
    with logged("hhook") as lines:
        state.load_state_dict(other)
        out["version_error"] = _mean_error(state, rank, world, 20)
    out["version_lines"] = lines
    # every rank loads rank 0's file: rank 1's residuals start afresh (rank 0 keeps its own)
    state = hhook.THCState(bits=4, scales=scales, error_feedback=True)
    with logged("hhook") as lines:
        state.load_state_dict(saved[0])
        state.node_layout()  # where the saved rank is compared with this one
        out["residual_kept"] = any(k.residual is not None for p in state.keys.policies.values() for k in p.keys.values())
        out["rank_error"] = _mean_error(state, rank, world, 21)
    out["rank_lines"] = lines
    # the other scale mode's checkpoint loaded into a state of this mode: its options win, said once
    other_mode = "agreed" if scales == "predicted" else "predicted"
    state = hhook.THCState(bits=4, scales=other_mode, error_feedback=True)
    with logged("hhook") as lines:
        state.load_state_dict(saved[rank])
        out["mode_error"] = _mean_error(state, rank, world, 22)
    out["mode_lines"], out["mode"] = lines, state.options.scales
    # ranks resuming from checkpoints of different bits: ConfigMismatchError on every rank
    mine = dict(saved[rank], bits=4 if rank == 0 else 2, policies={})
    ddp = nn.parallel.DistributedDataParallel(nn.Linear(50, 100))
    try:
        hhook.register(ddp, state=_state_of(mine))
        ddp(torch.randn(16, 50)).sum().backward()
        out["bits"] = "no error"
    except hhook.ConfigMismatchError as e:
        out["bits"] = str(e)
    return out


def _pickled(saved: dict) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(saved, buf)
    buf.seek(0)
    return buf


def _state_of(saved: dict) -> hhook.THCState:
    state = hhook.THCState()
    state.load_state_dict(torch.load(_pickled(saved), weights_only=True))
    return state


@pytest.mark.parametrize("scales", MODES)
def test_codec_version_rank_mode_and_bits_of_a_checkpoint(scales):
    saved = [s for s, _ in run_world(_saved, 2, scales, True, timeout=240)]
    res = run_world(_same_world_worker, 2, scales, saved, timeout=240)
    for rank, r in enumerate(res):
        assert [line for line in r["version_lines"] if "codec version" in line] == r["version_lines"]
        assert len(r["version_lines"]) == 1, r["version_lines"]
        rank_lines = [line for line in r["rank_lines"] if "loaded the THC state of rank 0" in line]
        assert len(rank_lines) == (1 if rank == 1 else 0), r["rank_lines"]
        assert r["mode"] == scales and len(r["mode_lines"]) == 1 and f"-> '{scales}'" in r["mode_lines"][0]
        assert r["residual_kept"] == (rank == 0)
        assert r["version_error"] < 0.05, r["version_error"]  # started afresh: one 4-bit rounding
        # kept residuals (error feedback) add earlier steps' rounding errors to this mean;
        # wrong scales or lanes would be errors of order 1
        assert r["rank_error"] < 0.1 and r["mode_error"] < 0.1, (r["rank_error"], r["mode_error"])
        assert "bits: 4 on rank 0, 2 on rank 1" in r["bits"], r["bits"]


def test_a_truncated_checkpoint_is_an_error_never_a_state(tmp_path):
    """A file cut short (a rank killed while writing it without the example's atomic
    rename) fails in torch.load; a dict that is not a state fails in load_state_dict."""
    path = tmp_path / "hook.pt"
    torch.save(hhook.THCState(bits=4).state_dict(), path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(Exception):  # noqa: B017 - torch's own error for a cut zip archive
        torch.load(path, weights_only=True)
    with pytest.raises(ValueError, match="not a THCState.state_dict"):
        hhook.THCState().load_state_dict({"format": 1, "policies": {}})
    assert not dist.is_initialized()
