"""hhook's one line in the real frameworks (tests/support/framework_jobs.py, 2 CPU ranks, Gloo, 40
steps): the run ends, ``stats()`` counts compressed calls at ratio >= 4.5 (4 bits), the
loss is close to the same run without hhook, and resuming through the framework's own
checkpoint ends bit for bit where the uninterrupted run ends. A framework that is not
installed skips, and fails the suite under ``HHOOK_REQUIRE`` (ci/test.sh)."""

import os
import subprocess
import sys

import pytest
import torch

from tests.support.distributed import ROOT, free_port, subprocess_env

JOB = os.path.join(ROOT, "tests", "support", "framework_jobs.py")


def _require(module: str, name: str) -> None:
    pytest.importorskip(module, reason=f"{name} is not installed (pip install 'hhook[{name}]')")


def _run(framework, out, *args, torchrun=True, timeout=240) -> str:
    cmd = [sys.executable, JOB, framework, str(out), *args]
    if torchrun:
        cmd[1:1] = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    proc = subprocess.run(cmd, env=subprocess_env(GLOO_SOCKET_IFNAME="lo"), capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stderr


def _results(out):
    return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=True) for r in range(2)]


def _check_compressed(thc, plain):
    for r in thc:
        s = r["stats"]
        assert s["compressed_calls"] == 38 and s["dense_calls"] == 2, s  # 40 steps, start_iter=2
        assert s["ratio"] >= 4.5, s
    assert torch.equal(thc[0]["params"], thc[1]["params"])  # the ranks stay in sync
    # 4 bits against fp32 on the same data and seeds (the loss starts near 1.4)
    assert abs(thc[0]["loss"] - plain[0]["loss"]) < 0.05, (thc[0]["loss"], plain[0]["loss"])
    assert thc[0]["loss"] < 0.5


def _check_resume(whole, resumed):
    for a, b in zip(whole, resumed):
        assert torch.equal(a["params"], b["params"])  # against the run that was never interrupted
        assert b["stats"]["compressed_calls"] == a["stats"]["compressed_calls"]


def _trains_and_resumes(framework, tmp_path, *extra):
    """The same job with and without hhook (agreed scales), then the run with predicted
    scales whole and stopped after one epoch and resumed from the framework's checkpoint."""
    _run(framework, tmp_path / "thc", *extra)
    _run(framework, tmp_path / "plain", "--no-hhook", *extra)
    _check_compressed(_results(tmp_path / "thc"), _results(tmp_path / "plain"))
    pred = ("--scales", "predicted", "--ckpt", str(tmp_path / "ckpt"), *extra)
    _run(framework, tmp_path / "whole", *pred[:2], *extra)
    _run(framework, tmp_path / "stop", *pred, "--stop-at", "1")
    _run(framework, tmp_path / "resumed", *pred, "--resume", "1")
    _check_resume(_results(tmp_path / "whole"), _results(tmp_path / "resumed"))


def test_lightning_callback_compresses_and_resumes_from_lightning_checkpoints(tmp_path):
    _require("lightning", "lightning")
    _trains_and_resumes("lightning", tmp_path)


def test_lightning_ddp_strategy_hook_on_cpu_says_nothing_was_compressed(tmp_path):
    """Lightning registers DDPStrategy's ddp_comm_hook on CUDA devices only."""
    _require("lightning", "lightning")
    err = _run("lightning", tmp_path, "--via", "strategy")
    assert err.count("no tensor went through this THCState") == 2, err[-3000:]  # one per rank, at exit
    assert err.count("Lightning's DDPStrategy registers ddp_comm_hook on CUDA devices only") == 2, err[-3000:]


def test_lightning_fabric_register(tmp_path):
    _require("lightning", "lightning")
    _run("lightning", tmp_path / "thc", "--via", "fabric")
    _run("lightning", tmp_path / "plain", "--via", "fabric", "--no-hhook")
    _check_compressed(_results(tmp_path / "thc"), _results(tmp_path / "plain"))


def test_lightning_fabric_save_keeps_every_rank_s_residuals(tmp_path):
    """fabric.save writes on rank 0 only: with state.state_dict() in it rank 1's
    error-feedback residuals started afresh (2e-3 apart). every_rank(state) keeps each
    rank's, and the resumed run ends bit for bit where the uninterrupted one ends."""
    _require("lightning", "lightning")
    feedback = ("--via", "fabric", "--error-feedback", "--ckpt", str(tmp_path / "ckpt"))
    _run("lightning", tmp_path / "whole", *feedback[:3])
    _run("lightning", tmp_path / "stop", *feedback, "--stop-at", "1")
    err = _run("lightning", tmp_path / "resumed", *feedback, "--resume", "1")
    assert "residuals start afresh" not in err, err[-3000:]
    _check_resume(_results(tmp_path / "whole"), _results(tmp_path / "resumed"))


def test_accelerate_register_compresses_and_resumes_from_save_state(tmp_path):
    _require("accelerate", "accelerate")
    _trains_and_resumes("accelerate", tmp_path)


def test_accelerate_register_on_a_compiled_model(tmp_path):
    _require("accelerate", "accelerate")
    _run("accelerate", tmp_path / "thc", "--compile", timeout=400)
    _run("accelerate", tmp_path / "plain", "--no-hhook")
    _check_compressed(_results(tmp_path / "thc"), _results(tmp_path / "plain"))


def test_transformers_trainer_compresses_and_resumes_from_its_checkpoints(tmp_path):
    _require("transformers", "transformers")
    _trains_and_resumes("transformers", tmp_path)


def test_transformers_trainer_resumes_from_a_folder_outside_output_dir(tmp_path):
    """train(resume_from_checkpoint=<a folder elsewhere>): the hook state is read from that
    folder (it was looked for in output_dir/checkpoint-N and started afresh, 4e-3 apart)."""
    _require("transformers", "transformers")
    pred = ("--scales", "predicted")
    _run("transformers", tmp_path / "whole", *pred)
    _run("transformers", tmp_path / "stop", *pred, "--ckpt", str(tmp_path / "first"), "--stop-at", "1")
    (folder,) = [f for f in os.listdir(tmp_path / "first") if f.startswith("checkpoint-")]
    os.rename(tmp_path / "first" / folder, tmp_path / "moved")
    err = _run("transformers", tmp_path / "resumed", *pred, "--ckpt", str(tmp_path / "second"),
               "--resume", "1", "--resume-from", str(tmp_path / "moved"))
    assert "starts afresh" not in err, err[-3000:]
    _check_resume(_results(tmp_path / "whole"), _results(tmp_path / "resumed"))


def test_ray_train_register_after_prepare_model(tmp_path):
    _require("ray.train", "ray")
    _run("ray", tmp_path, torchrun=False, timeout=400)
    _check_compressed(_results(tmp_path / "thc"), _results(tmp_path / "plain"))


def _one_process_worker(rank, world):
    import logging

    import hhook

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("hhook").addHandler(handler)
    model = torch.nn.Linear(4, 2)
    state = hhook.register(model, bits=4)  # a world of one: a warning, nothing to compress
    warned = [r.getMessage() for r in records]
    idle = state.warn_if_idle("the test")
    return warned, idle, [r.getMessage() for r in records][len(warned):]


def test_register_on_a_model_that_is_not_ddp():
    from tests.support.distributed import run_world

    import hhook

    warned, idle, end = run_world(_one_process_worker, 1)[0]
    assert "got a Linear, not a DistributedDataParallel model, in a world of one process" in warned[0]
    assert idle and "no tensor went through this THCState" in end[0]
    with pytest.raises(TypeError, match="pass options or a state"):
        hhook.register(torch.nn.Linear(2, 2), hhook.THCState(), bits=4)


def test_one_process_warning_says_what_to_check(monkeypatch):
    """``accelerate launch --cpu --num_processes 2`` starts one process: the warning said
    to run ``accelerate launch --num_processes N``, what the user had typed."""
    from tests.support.distributed import run_world

    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")  # what accelerate launch's single-process launcher sets
    warned = run_world(_one_process_worker, 1)[0][0][0]
    assert "--mpirun_hostfile" in warned and "accelerate env" in warned, warned
    assert "accelerate launch --num_processes N" not in warned
    monkeypatch.delenv("ACCELERATE_USE_CPU")
    warned = run_world(_one_process_worker, 1)[0][0][0]
    assert "WORLD_SIZE" in warned and "Accelerate" not in warned, warned


def _idle_worker(rank, world, registered):
    import logging

    import hhook

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("hhook").addHandler(handler)
    ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    state = hhook.register(ddp, bits=4) if registered else hhook.THCState(bits=4)  # never handed to DDP
    assert state.warn_if_idle("the program")
    return records[-1].getMessage()


def test_idle_state_warning_fits_the_context():
    """The exit warning for a state that compressed nothing named Lightning's DDPStrategy
    in plain DDP and Accelerate runs too."""
    from tests.support.distributed import run_world

    for message in run_world(_idle_worker, 2, False):
        assert "no tensor went through this THCState" in message
        assert "DDPStrategy" not in message and "hhook.register(ddp_model, state=state)" in message, message
    for message in run_world(_idle_worker, 2, True):
        assert "DDPStrategy" not in message and "no backward pass went through that DDP model" in message, message


def _not_ddp_worker(rank, world):
    import hhook

    try:
        hhook.register(torch.nn.Linear(4, 2), bits=4)
    except TypeError as e:
        return str(e)


def test_register_on_an_unwrapped_model_in_a_world_of_two_raises():
    from tests.support.distributed import run_world

    for message in run_world(_not_ddp_worker, 2):
        assert "needs a torch.nn.parallel.DistributedDataParallel model, got Linear (world of 2" in message


def test_a_changed_framework_api_names_the_framework_and_version():
    from hhook.adapters import require

    with pytest.raises(RuntimeError, match=r"hhook: Lightning .*: object has no 'strategy'"):
        require(object(), "strategy", "Lightning", "lightning", "find the DDP model")
