"""hhook's one line in the real frameworks (tests/support/framework_jobs.py, 2 CPU ranks, Gloo, 40
steps): the run ends, ``stats()`` counts compressed calls at ratio >= 4.5 (4 bits), the
loss is close to the same run without hhook, and resuming through the framework's own
checkpoint ends bit for bit where the uninterrupted run ends. One launch per framework
runs all of its runs (module-scoped fixtures; Ray: its own workers). A framework that is not
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


def _run(framework, *args, torchrun=True, timeout=240) -> str:
    cmd = [sys.executable, JOB, framework, *map(str, args)]
    if torchrun:
        cmd[1:1] = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    proc = subprocess.run(cmd, env=subprocess_env(GLOO_SOCKET_IFNAME="lo"), capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stderr


def _job(framework, out, runs: dict, timeout) -> str:
    """One torchrun launch for several runs in sequence (framework_jobs.py's ``--then``):
    each run is a folder of ``out`` named by its key. What the tests below check is the
    path through the framework's own checkpoint (a new Trainer, Accelerator or Fabric
    object loads what the stop run saved), not the restart of the process: that start-up
    (torchrun, interpreter, torch and the framework, 10-20 s a launch here) is paid once."""
    words = [str(w) for name, opts in runs.items() for w in ("--then", out / name, *opts)][1:]
    return _run(framework, *words, timeout=timeout)


def _resume_runs(ckpt) -> dict:
    """The same job with and without hhook (agreed scales), then the run with predicted
    scales whole and stopped after one epoch and resumed from the framework's checkpoint."""
    pred = ("--scales", "predicted")
    return {"thc": (), "plain": ("--no-hhook",), "whole": pred,
            "stop": (*pred, "--ckpt", ckpt, "--stop-at", "1"), "resumed": (*pred, "--ckpt", ckpt, "--resume", "1")}


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


def _trains_and_resumes(out):
    _check_compressed(_results(out / "thc"), _results(out / "plain"))
    _check_resume(_results(out / "whole"), _results(out / "resumed"))


@pytest.fixture(scope="module")
def lightning_job(tmp_path_factory):
    """Every Lightning run of the tests below in one launch: the Trainer with the callback,
    with DDPStrategy's own hook arguments, and Fabric."""
    _require("lightning", "lightning")
    out = tmp_path_factory.mktemp("lightning")
    feedback = ("--via", "fabric", "--error-feedback", "--ckpt", out / "fabric_ckpt")
    runs = {**_resume_runs(out / "ckpt"),
            "fabric_thc": ("--via", "fabric"), "fabric_plain": ("--via", "fabric", "--no-hhook"),
            "fabric_whole": feedback[:3], "fabric_stop": (*feedback, "--stop-at", "1"),
            "fabric_resumed": (*feedback, "--resume", "1"),
            # last: its idle state must live to the exit, where it is reported (a run after
            # it would let the garbage collector take the Trainer and the state with it)
            "strategy": ("--via", "strategy")}
    return out, _job("lightning", out, runs, timeout=900)


def test_lightning_callback_compresses_and_resumes_from_lightning_checkpoints(lightning_job):
    _trains_and_resumes(lightning_job[0])


def test_lightning_ddp_strategy_hook_on_cpu_says_nothing_was_compressed(lightning_job):
    """Lightning registers DDPStrategy's ddp_comm_hook on CUDA devices only (the launch's
    other states all compress: the idle one reported at exit is this run's)."""
    err = lightning_job[1]
    assert err.count("no tensor went through this THCState") == 2, err[-3000:]  # one per rank, at exit
    assert err.count("Lightning's DDPStrategy registers ddp_comm_hook on CUDA devices only") == 2, err[-3000:]


def test_lightning_fabric_register(lightning_job):
    out = lightning_job[0]
    _check_compressed(_results(out / "fabric_thc"), _results(out / "fabric_plain"))


def test_lightning_fabric_save_keeps_every_rank_s_residuals(lightning_job):
    """fabric.save writes on rank 0 only: with state.state_dict() in it rank 1's
    error-feedback residuals started afresh (2e-3 apart). every_rank(state) keeps each
    rank's, and the resumed run ends bit for bit where the uninterrupted one ends."""
    out, err = lightning_job
    assert "residuals start afresh" not in err, err[-3000:]
    _check_resume(_results(out / "fabric_whole"), _results(out / "fabric_resumed"))


@pytest.fixture(scope="module")
def accelerate_job(tmp_path_factory):
    _require("accelerate", "accelerate")
    out = tmp_path_factory.mktemp("accelerate")
    # --compile: its counterpart without hhook is the plain run
    return out, _job("accelerate", out, {**_resume_runs(out / "ckpt"), "compiled": ("--compile",)}, timeout=900)


def test_accelerate_register_compresses_and_resumes_from_save_state(accelerate_job):
    _trains_and_resumes(accelerate_job[0])


def test_accelerate_register_on_a_compiled_model(accelerate_job):
    out = accelerate_job[0]
    _check_compressed(_results(out / "compiled"), _results(out / "plain"))


@pytest.fixture(scope="module")
def transformers_job(tmp_path_factory):
    _require("transformers", "transformers")
    out = tmp_path_factory.mktemp("transformers")
    # checkpoint-20: the stop run saves after one epoch, 20 steps; the run that resumes from
    # it has its own output_dir, which holds no checkpoint
    elsewhere = ("--scales", "predicted", "--ckpt", out / "second", "--resume", "1",
                 "--resume-from", out / "ckpt" / "checkpoint-20")
    return out, _job("transformers", out, {**_resume_runs(out / "ckpt"), "elsewhere": elsewhere}, timeout=900)


def test_transformers_trainer_compresses_and_resumes_from_its_checkpoints(transformers_job):
    _trains_and_resumes(transformers_job[0])


def test_transformers_trainer_resumes_from_a_folder_outside_output_dir(transformers_job):
    """train(resume_from_checkpoint=<a folder elsewhere>): the hook state is read from that
    folder (it was looked for in output_dir/checkpoint-N and started afresh, 4e-3 apart)."""
    out, err = transformers_job
    assert [f for f in os.listdir(out / "ckpt") if f.startswith("checkpoint-")] == ["checkpoint-20"]
    assert not os.path.exists(out / "second" / "checkpoint-20")
    assert "starts afresh" not in err, err[-3000:]
    _check_resume(_results(out / "whole"), _results(out / "elsewhere"))


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
