"""The DDP example runs under torchrun and mpirun and learns with every hook."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.distributed import free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ddp_train.py"


def _run(launcher, hook, tmp_path, *extra):
    out = tmp_path / f"{hook}.json"
    cmd = [*launcher, str(EXAMPLE), "--hook", hook, "--epochs", "8", "--json", str(out), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text())


def torchrun():  # a port of free_port(): a fixed one met another run's job on a shared host
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]


def test_thc_matches_fp32_accuracy_with_fewer_bytes(tmp_path):
    fp32 = _run(torchrun(), "none", tmp_path)
    thc = _run(torchrun(), "thc", tmp_path, "--bits", "4")
    assert fp32["test_accuracy"] > 0.9
    assert thc["test_accuracy"] > fp32["test_accuracy"] - 0.03
    assert thc["wire_bytes"] == thc["thc_stats"]["wire_bytes"]
    # 2 ranks at 4 bits, the default's gathered scales: the all-gather's output is counted, two
    # messages of 4-bit lanes (8.06 bits a coordinate, of which a ring sends one), minus 2 dense steps
    assert thc["ratio"] > 3.5


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="Open MPI's mpirun is not installed (ci/setup.sh --full)")
def test_example_runs_under_mpirun(tmp_path):
    launcher = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", f"MASTER_PORT={free_port()}",
                sys.executable]
    result = _run(launcher, "thc", tmp_path)
    assert result["launcher"] == "openmpi" and result["world_size"] == 2 and result["test_accuracy"] > 0.9


def test_result_header_names_every_field_of_the_result_line():
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--result-header"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    for field in ("hook", "ranks", "launcher", "steps", "test_accuracy", "final_loss", "wire", "dense", "ratio", "time"):
        assert f"  {field} " in proc.stdout or f"; {field}:" in proc.stdout, field
