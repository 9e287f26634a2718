"""``bits="auto"`` with every rank on one host and CPU tensors: hhook.register installs no
hook (no network to save, so nothing can beat DDP's own allreduce), logs why once, and the
state still reports and checkpoints; ``HHOOK_AUTO_ONE_HOST=measure`` on any rank, or ranks
on separate nodes, keep measuring (hhook.decision.hook.one_host)."""

from __future__ import annotations

import io
import logging
import os

import torch

from tests.support.distributed import run_world


def _installed(ddp) -> bool:
    """Whether a comm hook is on ``ddp``: DDP takes one at most, and says so."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    try:
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
    except RuntimeError as exc:
        assert "only be called once" in str(exc), exc
        return True
    return False


def _register(rank, env: dict, **options):
    import hhook

    for name, value in env.items():
        os.environ[name] = value
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("hhook")
    log.addHandler(handler)
    level, log.level = log.level, logging.INFO
    try:
        torch.manual_seed(0)
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
        try:
            state = hhook.register(ddp, **options)
        except ValueError as exc:
            return {"error": str(exc)}
        x = torch.full((2, 8), float(rank + 1))
        ddp(x).sum().backward()
        grad = ddp.module.weight.grad.clone()
        return {"stats": state.stats(), "installed": _installed(ddp), "grad": grad, "state": state,
                "logs": [r.getMessage() for r in records if r.levelno >= logging.INFO],
                "warnings": [r.getMessage() for r in records if r.levelno >= logging.WARNING]}
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        for name in env:
            os.environ.pop(name, None)


def _scenarios(rank, world):
    import hhook
    from hhook.adapters import FrameworkHook

    out = {}
    skipped = _register(rank, {})
    state = skipped.pop("state")
    buf = io.BytesIO()
    torch.save({"hook": state.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)["hook"]
    fresh = hhook.THCState(bits="auto")
    fresh.load_state_dict(saved)
    skipped["saved_decision"] = saved["decision"]
    skipped["stats_after_save"] = state.stats()["decision"]["method"]
    state.load_state_dict(saved)  # a loaded checkpoint keeps the state's report
    skipped["reloaded"] = state.stats()["decision"]["method"]
    out["skip"] = skipped
    # An adapter's end-of-run check does not warn about a state left idle on purpose.
    hook = FrameworkHook("test", bits="auto")
    hook.attach(torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4)))
    out["adapter_warned"] = hook.finish()
    # One rank asking to measure is enough: every rank measures.
    measured = _register(rank, {"HHOOK_AUTO_ONE_HOST": "measure"} if rank == 1 else {})
    measured.pop("state")
    out["measure_on_one_rank"] = measured
    # Separate nodes by the launcher's variables (torchrun's, one rank per node).
    nodes = _register(rank, {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(rank)})
    nodes.pop("state")
    out["two_nodes"] = nodes
    out["bad_value"] = _register(rank, {"HHOOK_AUTO_ONE_HOST": "yes"} if rank == 0 else {})
    return out


def test_auto_on_one_host_with_cpu_tensors_installs_nothing_and_says_why(monkeypatch):
    monkeypatch.delenv("HHOOK_AUTO_ONE_HOST", raising=False)
    for var in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(var, raising=False)
    results = run_world(_scenarios, 2)
    for rank, out in enumerate(results):
        skip = out["skip"]
        assert not skip["installed"], "bits='auto' on one host installed a hook"
        decision = skip["stats"]["decision"]
        assert decision["method"] == "plain" and decision["hook"] is None and decision["phase"] == "not measured"
        assert "one host" in decision["reason"] and "HHOOK_AUTO_ONE_HOST=measure" in decision["reason"]
        assert skip["stats"]["compressed_calls"] == skip["stats"]["dense_calls"] == 0
        # no ratio of the handshake's bytes against none: it says nothing was installed, and why
        assert skip["stats"]["installed"] is False and skip["stats"]["ratio"] is None, skip["stats"]
        assert skip["stats"]["method"].startswith("none: ") and "one host" in skip["stats"]["method"]
        assert "installed" not in out["two_nodes"]["stats"] and out["two_nodes"]["stats"]["ratio"] is not None
        # DDP's own allreduce averaged the gradient: two rows of 1s (rank 0) and of 2s (rank 1): 3s.
        assert torch.allclose(skip["grad"], torch.full((4, 8), 3.0)), skip["grad"]
        assert skip["saved_decision"] == {"not_measured": decision["reason"], "kept": None}
        assert skip["stats_after_save"] == skip["reloaded"] == "plain"
        one_host_lines = [line for line in skip["logs"] if "one host" in line]
        assert len(one_host_lines) == (1 if rank == 0 else 0), skip["logs"]
        # at the default log level: WARNING, saying no hook was installed, why, and what measures anyway
        warned = [line for line in skip["warnings"] if "one host" in line]
        assert len(warned) == (1 if rank == 0 else 0), skip["warnings"]
        assert all("no hook is installed" in w and "HHOOK_AUTO_ONE_HOST=measure" in w for w in warned), warned
        assert out["adapter_warned"] is False
        for case in ("measure_on_one_rank", "two_nodes"):
            measured = out[case]
            assert measured["installed"], case
            assert measured["stats"]["decision"]["phase"] == "explore", (case, measured["stats"]["decision"])
            assert measured["stats"]["dense_calls"] >= 1, case  # DDP's plain first iteration, through the hook
            assert not [line for line in measured["logs"] if "one host" in line], case
        assert "HHOOK_AUTO_ONE_HOST" in out["bad_value"]["error"] and "[0]" in out["bad_value"]["error"]


def _two_level(rank, world):
    out = _register(rank, {}, topology=2)
    out.pop("state")
    return out


def test_a_topology_that_makes_nodes_of_one_host_keeps_measuring(monkeypatch):
    """topology=2 (2 nodes x 2 ranks, here on one host): the user says nodes, bits='auto'
    measures between them."""
    monkeypatch.delenv("HHOOK_AUTO_ONE_HOST", raising=False)
    for out in run_world(_two_level, 4):
        assert out["installed"] and out["stats"]["decision"]["phase"] == "explore", out["stats"].get("decision")


def test_the_profiler_says_no_hook_was_installed():
    from hhook.decision.hook import NotMeasured
    from hhook.profile.commands.train import decision_line

    line = decision_line(NotMeasured("bits='auto': all 2 ranks run on one host").summary())
    assert "one host" in line and "plain allreduce ran" in line and "still measuring" not in line, line
