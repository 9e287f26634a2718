"""hhook-profile: runs under mpirun, writes valid JSON, fits and models match hand values,
and bad arguments end every rank with a clear message."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from tests.support.distributed import free_port, run_world, subprocess_env

from hhook.codec import HEADER, THCCodec
from hhook.profile import cli, models
from hhook.profile.link import fit_alpha_beta, ring_rounds
from hhook.profile.units import iterations, parse_rate, parse_size, sweep

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REQUIRED = ("op", "method", "bytes", "time_us", "algbw_GBps", "busbw_GBps", "wire_bytes", "ratio", "codec_us", "vnmse")

MPIRUN = shutil.which("mpirun")
HAVE_MPI4PY = importlib.util.find_spec("mpi4py") is not None
needs_mpi = pytest.mark.skipif(
    MPIRUN is None or not HAVE_MPI4PY,
    reason="needs Open MPI's mpirun and mpi4py (apt install openmpi-bin libopenmpi-dev; pip install mpi4py)",
)




def mpirun(np_: int, *args: str, timeout: float = 90, **env) -> subprocess.CompletedProcess:
    cmd = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-np", str(np_),
           sys.executable, "-m", "hhook.profile", *args]
    try:
        return subprocess.run(cmd, cwd=ROOT, env=subprocess_env(**env), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"hhook-profile hung (> {timeout}s): {' '.join(cmd)}\n{e.stdout}\n{e.stderr}")


def _ok(proc) -> None:
    assert proc.returncode == 0, f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"


def _load(path) -> dict:
    with open(path) as f:
        doc = json.load(f)
    assert set(doc) == {"meta", "results"}
    assert doc["results"], "no results"
    for r in doc["results"]:
        missing = [k for k in REQUIRED if k not in r]
        assert not missing, f"result lacks {missing}: {r}"
    return doc


# -- under mpirun ---------------------------------------------------------------
@needs_mpi
@pytest.mark.parametrize("np_", [2, 4])
def test_allreduce_writes_json_and_fp32_is_exact(np_, tmp_path):
    out, png = tmp_path / "ar.json", tmp_path / "ar.png"
    methods = "fp32,thc,fp16,zlib" if np_ == 2 else "fp32,thc"
    sizes = "4K,64K" if np_ == 2 else "16K"
    proc = mpirun(np_, "allreduce", "--sizes", sizes, "-n", "2", "-w", "1", "--threads", "1",
                  "--methods", methods, "--json", str(out), "--plot", str(png))
    _ok(proc)
    assert "Out of bounds values : 0 OK" in proc.stdout
    assert f"{np_} ranks on" in proc.stdout and "Open MPI" in proc.stdout
    doc = _load(out)
    meta = doc["meta"]
    assert meta["world_size"] == np_ and meta["backend"] == "mpi" and len(meta["hosts"]) == np_
    rows = doc["results"]
    assert {r["method"] for r in rows} == set(methods.split(","))
    assert {r["bytes"] for r in rows} == ({4096, 65536} if np_ == 2 else {16384})
    for r in rows:
        assert r["op"] == "allreduce" and r["time_us"] > 0
        assert r["time_us_min"] <= r["time_us"] <= r["time_us_max"]
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * 2 * (np_ - 1) / np_)
        assert r["algbw_GBps"] == pytest.approx(r["bytes"] / r["time_us"] / 1e3)
        assert r["time_us"] == pytest.approx(r["codec_us"] + r["wire_us"], rel=1e-6)
        assert r["ratio"] == pytest.approx(r["bytes"] / r["wire_bytes"])
        if r["method"] == "fp32":
            assert r["wrong"] == 0 and r["vnmse"] < 1e-12 and r["codec_us"] == 0
        if r["method"] == "thc":
            codec = THCCodec(4, 1024, 0, np_)
            assert r["wire_bytes"] == codec.wire_bytes(r["bytes"] // 4)
            assert 0 < r["vnmse"] < 0.05  # 4 bits, rotation and per-block scales
            assert r["speedup_wire"] > 0 and r["speedup_total"] > 0
        if r["method"] == "fp16":
            assert r["ratio"] == 2.0 and r["vnmse"] < 1e-6
        if r["method"] == "zlib":
            assert r["vnmse"] < 1e-12  # lossless; only the float32 summation rounds
    assert png.stat().st_size > 10_000


@needs_mpi
@pytest.mark.parametrize("np_", [2, 4])
def test_link_writes_json_with_fit(np_, tmp_path):
    out = tmp_path / "link.json"
    proc = mpirun(np_, "link", "-b", "1", "-e", "16K", "-f", "16", "-n", "3", "-w", "1", "--json", str(out))
    _ok(proc)
    assert "Fit t(S) = alpha + S / beta" in proc.stdout
    doc = _load(out)
    rows = doc["results"]
    assert [r["bytes"] for r in rows] == [1, 16, 256, 4096]
    pairs = 1 if np_ == 2 else np_
    for r in rows:
        assert r["op"] == "pingpong" and len(r["pairs"]) == pairs
        assert r["time_us_min"] <= r["time_us"] <= r["time_us_max"]
    fit = doc["meta"]["fit"]
    assert set(fit) >= {"alpha_us", "beta_GBps", "r2", "points"} and fit["points"] == len(rows)


@needs_mpi
def test_gloo_backend_through_torch_distributed(tmp_path):
    out = tmp_path / "gloo.json"
    proc = mpirun(2, "allreduce", "--backend", "gloo", "--sizes", "16K", "-n", "2", "-w", "1", "--threads", "1",
                  "--methods", "fp32,thc,fp16", "--json", str(out),
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), GLOO_SOCKET_IFNAME="lo")
    _ok(proc)
    doc = _load(out)
    assert doc["meta"]["backend"] == "gloo"
    fp32 = next(r for r in doc["results"] if r["method"] == "fp32")
    assert fp32["wrong"] == 0


@needs_mpi
def test_allreduce_times_thc_allreduce_with_a_topology(tmp_path):
    """thc:BITS:topology=K: hhook.thc_allreduce timed whole; at 2 nodes of 2 the bytes
    between nodes are the shard's (lanes for 2 nodes), the node's copies counted apart."""
    out = tmp_path / "topology.json"
    proc = mpirun(4, "allreduce", "--backend", "gloo", "--sizes", "64K,256K", "-n", "2", "-w", "1", "--threads", "1",
                  "--methods", "fp32,thc:4:topology=flat,thc:4:topology=2", "--json", str(out),
                  "--plot", str(tmp_path / "topology.png"), timeout=180,
                  MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), GLOO_SOCKET_IFNAME="lo")
    _ok(proc)
    assert "B between nodes" in proc.stdout and (tmp_path / "topology.png").stat().st_size > 0
    rows = _load(out)["results"]
    for size in (64 << 10, 256 << 10):
        flat, two = (next(r for r in rows if r["bytes"] == size and r["method"] == f"thc:4:topology={t}")
                     for t in ("flat", "2"))
        assert flat["codec_us"] is None and flat["wire_us"] is None and flat["time_us"] > 0
        assert flat["intra_wire_bytes"] == 0 and two["intra_wire_bytes"] > 0
        assert two["wire_bytes"] < flat["wire_bytes"] / 2, (two["wire_bytes"], flat["wire_bytes"])
        assert flat["vnmse"] < 0.05 and two["vnmse"] < 0.05


@needs_mpi
@pytest.mark.parametrize(
    "np_,args,message",
    [
        (2, ["allreduce", "--methods", "fp32,bogus"], "unknown method 'bogus'"),
        (1, ["link"], "link needs at least 2 ranks"),
    ],
)
def test_bad_arguments_end_every_rank_with_a_message(np_, args, message):
    proc = mpirun(np_, *args, timeout=60)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert proc.stderr.count("hhook-profile: error:") == 1  # rank 0 speaks for all
    assert "Traceback" not in proc.stderr


# -- in process: arguments, fit, models, units -------------------------------------
@pytest.mark.parametrize(
    "args,message",
    [
        (["allreduce", "--methods", "fp32,foo"], "unknown method 'foo'"),
        (["allreduce", "--methods", "thc:9"], "method 'thc:9': bits must be an integer in 1..8"),
        (["allreduce", "--sizes", "0"], "sizes must be positive"),
        (["allreduce", "--sizes", "10"], "not a whole number of float32 elements"),
        (["allreduce", "--sizes", "4Q"], "unknown size unit"),
        (["allreduce", "-b", "1M", "-e", "4K"], "smaller than"),
        (["allreduce", "--bits", "0"], "bits must be an integer in 1..8"),
        (["allreduce", "--block-size", "1000"], "power of two"),
        (["allreduce", "--iters", "0"], "--iters: must be at least 1, got 0"),
        (["allreduce", "--methods", "thc:4:topology=2"], "needs a torch.distributed backend"),
        (["allreduce", "--methods", "thc:4:topology=0"], "topology"),
        (["link"], "link needs at least 2 ranks"),
        (["link", "--sizes", "0"], "sizes must be positive"),
        (["model", "--workers", "0,4"], "--workers: must be at least 1, got 0"),
        (["model", "--compute-ms", "-1"], "--compute-ms: must be positive, got -1"),
        (["model", "--codec-ms", "foo=3"], "no method 'foo'"),
        (["model", "--link-json", "/nonexistent.json"], "cannot use /nonexistent.json"),
        (["model", "--beta", "fast"], "cannot read rate"),
        (["model", "--plot", "/tmp/x.jpg"], "must end in .png"),
        (["frobnicate"], "invalid choice"),
        ([], "required"),
    ],
)
def test_bad_arguments_in_process(args, message, capsys, monkeypatch):
    for var in ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "RANK", "WORLD_SIZE", "PMI_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(var, raising=False)
    assert cli.main(args) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "hhook-profile: error:" in err and message in err, err


def test_other_ranks_stay_silent_on_bad_arguments(capsys, monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    assert cli.main(["allreduce", "--methods", "nope"]) == cli.EXIT_USAGE
    assert capsys.readouterr().err == ""


def test_fit_recovers_alpha_and_beta():
    alpha, beta = 35e-6, 117e6  # 35 us, ~0.94 Gbit/s
    sizes = sweep(1, 16 << 20, 2)
    exact = fit_alpha_beta(sizes, [alpha + s / beta for s in sizes])
    assert exact.alpha_s == pytest.approx(alpha, rel=1e-9)
    assert exact.beta_Bps == pytest.approx(beta, rel=1e-9)
    assert exact.r2 == pytest.approx(1.0)
    # +-3% deterministic "noise": both parameters within a few percent, R^2 still high.
    noisy = [(alpha + s / beta) * (1 + 0.03 * math.sin(7 * i)) for i, s in enumerate(sizes)]
    fit = fit_alpha_beta(sizes, noisy)
    assert fit.alpha_s == pytest.approx(alpha, rel=0.05)
    assert fit.beta_Bps == pytest.approx(beta, rel=0.05)
    assert 0.95 < fit.r2 < 1.0
    with pytest.raises(ValueError):
        fit_alpha_beta([8, 8], [1e-5, 1e-5])


def test_ring_rounds_cover_every_neighbour_pair_once():
    assert ring_rounds(2) == [[(0, 1)]]
    for n in (3, 4, 5, 8):
        rounds = ring_rounds(n)
        pairs = [p for r in rounds for p in r]
        assert sorted(pairs) == sorted((i, (i + 1) % n) for i in range(n))
        for r in rounds:
            ranks = [x for p in r for x in p]
            assert len(ranks) == len(set(ranks))
        assert len(rounds) <= 3


def test_ring_model_matches_hand_computation():
    # 4 workers, 100 MB at 125 MB/s (1 Gbit/s), alpha 50 us.
    assert models.ring_allreduce_s(4, 100e6, 50e-6, 125e6) == pytest.approx(6 * 50e-6 + 1.5 * 0.8)
    assert models.ring_allreduce_s(1, 100e6, 50e-6, 125e6) == 0.0
    assert models.allgather_s(4, 20e6, 50e-6, 125e6) == pytest.approx(3 * (50e-6 + 0.16))
    thc = models.ModelMethod("thc", 5.0, encode_s=0.05, decode_s=0.02)
    t, comm, codec = models.ring_update_s(4, 0.2, 100e6, 50e-6, 125e6, thc)
    assert comm == pytest.approx(6 * 50e-6 + 1.5 * 20e6 / 125e6)
    assert codec == pytest.approx(0.07)
    assert t == pytest.approx(0.05 + comm + 0.07)
    zlib = models.ModelMethod("zlib", 1.07, encode_s=0.3, decode_s=0.4, n_ref=4, collective="allgather")
    t, comm, codec = models.ring_update_s(8, 0.2, 100e6, 0.0, 125e6, zlib)
    assert comm == pytest.approx(7 * 100e6 / 1.07 / 125e6)
    assert codec == pytest.approx(0.3 + 0.4 * 8 / 4)  # decompresses M payloads


def test_paper_model_matches_hand_computation():
    # T = h C / M + rho M W / chi
    assert models.paper_update_s(8, 0.25, 100e6, 125e6, 0.2, 1.0) == pytest.approx(0.25 / 8 + 0.2 * 8 * 0.8)
    assert models.paper_update_s(4, 1.0, 233e6, 125e6, 1 / 1.079, 1.5) == pytest.approx(1.5 / 4 + 4 * 233e6 / 1.079 / 125e6)
    rows = models.predict([models.ModelMethod("fp32", 1.0), models.ModelMethod("thc", 5.0)], [1, 4], 0.1, 125e6, 0.0, 125e6)
    by = {(r["model"], r["method"], r["workers"]): r for r in rows}
    assert by[("paper", "fp32", 4)]["time_us"] == pytest.approx((0.025 + 4.0) * 1e6)
    assert by[("paper", "thc", 4)]["time_us"] == pytest.approx((0.025 + 0.8) * 1e6)
    assert by[("ring", "fp32", 4)]["time_us"] == pytest.approx((0.025 + 1.5) * 1e6)
    assert by[("ring", "thc", 4)]["time_us"] == pytest.approx((0.025 + 0.3) * 1e6)
    assert by[("ring", "thc", 4)]["speedup"] == pytest.approx(0.1 / 0.325)
    assert by[("ring", "thc", 4)]["speedup_vs_fp32"] == pytest.approx(1.525 / 0.325)
    assert by[("ring", "fp32", 1)]["speedup"] == pytest.approx(1.0)


def test_thc_ratio_follows_the_lane_layout():
    # 4 ranks, 4 bits: 6-bit lanes, 5 per int32; 1000 blocks of 1024 -> a header of HEADER
    # floats + 1000 float32 scales.
    W = 4 * 1024 * 1000
    m = models.ModelMethod("thc", 1.0, bits=4, block_size=1024)
    assert m.ratio_at(4, W) == pytest.approx(W / (4 * (HEADER + 1000) + 4 * math.ceil(1024000 / 5)))
    assert m.ratio_at(16, W) < m.ratio_at(4, W)  # wider lanes with more workers
    assert m.ratio_at(16, W, fixed=True) == 1.0


def test_model_cli_json(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("OMPI_COMM_WORLD_RANK", raising=False)
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE", raising=False)
    out, png = tmp_path / "model.json", tmp_path / "model.png"
    rc = cli.main(["model", "--alpha-us", "0", "--beta", "1gbit", "--ratio", "thc=5", "--compute-ms", "100",
                   "--model-bytes", "125MB", "--workers", "1,4", "--json", str(out), "--plot", str(png)])
    assert rc == 0, capsys.readouterr().err
    text = capsys.readouterr().out
    assert "Ring (alpha-beta)" in text and "Paper model" in text
    assert "Which model to believe" in text and "read the ring table" in text
    assert max(len(line) for line in text.splitlines()) <= 120
    doc = _load(out)
    by = {(r["model"], r["method"], r["workers"]): r for r in doc["results"]}
    assert by[("ring", "thc", 4)]["time_us"] == pytest.approx(325e3)
    assert by[("paper", "fp32", 4)]["time_us"] == pytest.approx(4025e3)
    assert png.stat().st_size > 10_000


def test_codec_subcommand_compares_implementations(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("OMPI_COMM_WORLD_RANK", raising=False)
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE", raising=False)
    out = tmp_path / "codec.json"
    assert cli.main(["codec", "--sizes", "64K", "--bits", "4", "--repeats", "1", "--world-size", "4",
                     "--impl", "reference", "--threads", "1,2", "--json", str(out)]) == 0
    rows = _load(out)["results"]
    assert [(r["impl"], r["threads"], r["rounding"]) for r in rows] == [
        ("reference", t, rounding) for t in (1, 2) for rounding in ("correlated", "independent")]
    r = rows[0]
    assert r["op"] == "codec" and r["bytes"] == 65536 and r["copy_GBps"] > 0
    assert r["wire_bytes"] == THCCodec(4, 1024, 0, 4).wire_bytes(16384)
    assert 1e-3 < r["vnmse"] < 3e-2  # a real mean of 4 ranks, not the copy "identical" would give
    assert rows[0]["vnmse"] < 0.6 * rows[1]["vnmse"]  # correlated rounding, same bits on the wire


@pytest.mark.parametrize("bad", [["--bits", "9"], ["--bits", "x"], ["--block-sizes", "1000"],
                                 ["--impl", "fast"], ["--threads", "0"], ["--sizes", "3"], ["--rounding", "shared"]])
def test_codec_subcommand_rejects_bad_values_in_one_line(bad, capsys, monkeypatch):
    monkeypatch.delenv("OMPI_COMM_WORLD_RANK", raising=False)
    assert cli.main(["codec", *bad]) == 2
    err = capsys.readouterr().err
    assert "error" in err and "Traceback" not in err


def _counted(rank, world):
    import torch
    import torch.distributed as dist

    from hhook.profile.counting import collective_bytes

    with collective_bytes() as counter:
        dist.all_reduce(torch.zeros(10))  # 40 B
        dist.all_to_all_single(torch.empty(8), torch.ones(8))  # its input: 32 B (two-level THC inside a node)
    return counter["bytes"]


def test_collective_bytes_counts_the_tensors_handed_to_collectives():
    assert run_world(_counted, 2) == [72, 72]


def test_units():
    assert parse_size("25MB") == 25_000_000
    assert parse_size("4K") == parse_size("4KiB") == 4096
    assert parse_size("1.5MiB") == 1572864
    assert parse_rate("1gbit") == 125e6 and parse_rate("100mbit") == 12.5e6
    assert parse_rate("0.5GB/s") == 0.5e9
    assert sweep(4, 64, 4) == [4, 16, 64]
    assert iterations(1 << 20, 20, 5, False) == (20, 5)
    assert iterations(64 << 20, 20, 5, False) == (3, 1)
    assert iterations(64 << 20, 20, 5, True) == (20, 5)
    with pytest.raises(ValueError):
        parse_size("-3")


# -- what rank 0 prints ------------------------------------------------------------
def _allreduce_row(method, world=4, **extra):
    row = {"op": "allreduce", "method": method, "kind": method.split(":")[0], "bytes": 25_000_000, "world_size": world,
           "iters": 8, "time_us": 12345678.9, "time_us_min": 12000000.0, "time_us_max": 13000000.0,
           "codec_us": 2345678.9, "wire_us": 10000000.0, "algbw_GBps": 0.0123, "busbw_GBps": 0.0185 if world > 1 else None,
           "wire_bytes": 5024828, "ratio": 4.98, "speedup_wire": 5.72, "speedup_total": 2.0, "wrong": None,
           "vnmse": 1.08e-2, "encode_us": 1e6, "decode_us": 1.3e6, "phases_us": {}}
    row.update(extra)
    return row


def test_default_allreduce_table_fits_120_columns():
    from hhook.profile import report

    rows = [_allreduce_row(m) for m in ("fp32", "thc:8", "fp16", "zlib")]
    narrow = report.allreduce_table(rows).splitlines()
    assert len(narrow) == 2 + len(rows)
    assert max(len(line) for line in narrow) <= report.TABLE_WIDTH
    assert narrow[0].split()[1:4] == ["size", "method", "time"] and "(GB/s)" in narrow[1]
    body = narrow[2].split()  # machine-parseable: one token per column, size first
    assert body[0] == "25000000" and body[1] == "fp32" and len(body) == 11
    wide = report.allreduce_table(rows, wide=True).splitlines()
    assert max(len(line) for line in wide) > report.TABLE_WIDTH and "min" in wide[1] and "B/rank" in wide[1]
    footer = report.allreduce_footer(rows).splitlines()
    assert max(len(line) for line in footer) <= report.TABLE_WIDTH + 60  # per-method summaries may run long


def test_one_rank_table_has_no_busbw():
    from hhook.profile import report

    rows = [_allreduce_row("fp32", world=1), _allreduce_row("thc", world=1)]
    body = report.allreduce_table(rows, head=False).splitlines()
    assert all(line.split()[6] == "-" for line in body)  # the busbw column
    assert "not defined for 1 rank" in report.allreduce_footer(rows)


def test_progress_bar_only_on_a_terminal():
    import io

    from hhook.profile.progress import Progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    piped, tty = io.StringIO(), Terminal()
    for stream in (piped, tty):
        bar = Progress(100, stream=stream, delay=0)
        bar.advance(40, "fp32 4096 B")
        bar.tick()
        bar.close()
    assert piped.getvalue() == ""
    assert "40%" in tty.getvalue() and "ETA" in tty.getvalue() and "fp32 4096 B" in tty.getvalue()


def test_eta_keeps_moving_while_one_iteration_runs():
    import io

    from hhook.profile.progress import Progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    bar = Progress(100, stream=stream, delay=0, refresh_s=3600)  # no background redraws: tick by hand
    bar.advance(50)
    bar._bar.start_t -= 10  # ten seconds pass inside one long iteration
    bar.tick()
    first = stream.getvalue().rsplit("\r", 1)[-1]
    bar._bar.start_t -= 20
    bar.tick()
    second = stream.getvalue().rsplit("\r", 1)[-1]
    bar.close()
    assert "00:10 elapsed, ETA 00:10" in first and "00:30 elapsed, ETA 00:30" in second


@needs_mpi
def test_one_rank_says_no_network_and_draws_no_bar(tmp_path):
    out = tmp_path / "one.json"
    proc = mpirun(1, "allreduce", "--sizes", "16K", "-n", "2", "-w", "1", "--threads", "1", "--methods", "fp32,thc",
                  "--json", str(out))
    _ok(proc)
    assert "1 rank: no network is measured" in proc.stdout and "not defined for 1 rank" in proc.stdout
    assert "\r" not in proc.stderr and "ETA" not in proc.stderr  # stderr is a pipe here: no bar
    assert all(r["busbw_GBps"] is None for r in _load(out)["results"])
    table = [line for line in proc.stdout.splitlines() if line and not line.startswith("#")]
    assert len(table) == 2 and all(len(line) <= 120 for line in table)


def test_speedup_plot_draws_the_ring_model_by_default():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hhook.profile import plot

    methods = [models.ModelMethod("fp32", 1.0), models.ModelMethod("thc", 5.0), models.ModelMethod("fp16", 2.0)]
    rows = models.predict(methods, [1, 2, 4, 8], 0.25, 100e6, 50e-6, 125e6)
    for drawn, curves in ((("ring",), 1 + 3), (("ring", "paper"), 1 + 6)):
        fig, ax = plt.subplots()
        plot.speedup_panel(ax, rows, drawn)
        assert len(ax.get_lines()) == curves
        colors = {line.get_label().split(",")[0]: line.get_color() for line in ax.get_lines()}
        assert colors["thc"] == plot.method_color("thc") != plot.method_color("fp16")
        plt.close(fig)


def test_a_missing_profiler_dependency_says_which_extra_installs_it(monkeypatch):
    from hhook.profile.deps import require

    monkeypatch.setitem(sys.modules, "tqdm", None)  # what an uninstalled package looks like to import
    with pytest.raises(ImportError, match=r'pip install "hhook\[profile\]"'):
        require("tqdm", "its progress bar")
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    with pytest.raises(ImportError, match=r'pip install "hhook\[mpi\]"'):
        require("mpi4py.MPI", "MPI runs")


def test_the_core_imports_no_profiler_dependency():
    # Whatever torch itself pulls in does not count; hhook's core must add none of them.
    code = ("import sys, torch; before = set(sys.modules);"
            "import hhook, hhook.scales, hhook.schedule.allreduce, hhook.ddp_hook;"
            "bad = [m for m in ('tqdm', 'matplotlib', 'sklearn', 'mpi4py') if m in sys.modules and m not in before];"
            "print(bad); sys.exit(1 if bad else 0)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_model_predicts_baseline_traffic_against_workers(tmp_path, capsys, monkeypatch):
    """`model` predicts SBC's and LGC-RAR's traffic per rank and step as M grows, from
    hhook.baselines.traffic: SBC's all-gather grows linearly with M, LGC's allreduce and THC's
    stay bounded (THC only by its lane width); bad baseline options are usage errors."""
    from hhook.baselines import traffic

    for var in ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "model.json"
    W = 4 * 1_000_000
    rc = cli.main(["model", "--alpha-us", "0", "--beta", "1gbit", "--model-bytes", str(W), "--workers", "1,2,16,256",
                   "--baselines", "sbc:p=0.01:delay=4,lgc:k=0.01", "--json", str(out)])
    assert rc == 0, capsys.readouterr().err
    text = capsys.readouterr().out
    assert "Traffic per rank and step against M" in text and "grows with M" in text
    assert max(len(line) for line in text.splitlines()) <= 120
    rows = [r for r in _load(out)["results"] if r["op"] == "traffic"]
    by = {(r["method"], r["workers"]): r for r in rows}
    assert {m for m, _ in by} == {"fp32", "thc:4", "sbc:p=0.01:delay=4", "lgc:k=0.01"}
    sbc = {M: by[("sbc:p=0.01:delay=4", M)]["recv_bytes"] for M in (1, 2, 16, 256)}
    lgc = {M: by[("lgc:k=0.01", M)]["recv_bytes"] for M in (1, 2, 16, 256)}
    thc = {M: by[("thc:4", M)]["recv_bytes"] for M in (2, 256)}
    message = 1_000_000 * 0.01 * 8.108 / 8 + 8  # positions x bits per position + header
    assert sbc[1] == 0 and sbc[2] == pytest.approx(message / 4, rel=1e-3)
    assert sbc[256] == pytest.approx(255 * sbc[2])  # all-gather: linear in M
    assert lgc[256] < 1.25 * lgc[2] and thc[256] < 6 * thc[2]  # bounded (THC: lane width only)
    assert sbc[256] > lgc[256]  # where all-gather loses to an allreduce
    ref = {r["n"]: r for r in traffic.rows(1_000_000, [16])}
    assert by[("sbc:p=0.01:delay=4", 16)]["recv_bytes"] == ref[16]["sbc"]  # the same formula, not a copy
    assert by[("thc:4", 16)]["recv_bytes"] == ref[16]["thc:4"]
    # communication time: alpha = 0, so bytes / beta; SBC's two all-gathers once per 4 steps
    assert by[("sbc:p=0.01:delay=4", 16)]["comm_us"] == pytest.approx(15 * (8 + message) / 4 / 125e6 * 1e6, rel=1e-3)
    assert cli.main(["model", "--baselines", "sbc:p=2"]) == cli.EXIT_USAGE
    assert "--baselines" in capsys.readouterr().err
    assert cli.main(["model", "--baselines", "thc"]) == cli.EXIT_USAGE


def test_diloco_model_matches_hand_computation(tmp_path, capsys, monkeypatch):
    """``model --diloco H``: per inner step, DDP fp32 pays a ring allreduce of the model, DiLoCo
    1/H of one; THC's exchanges pay two rounds and move the lane words; the output says
    it is a model and fits 120 columns."""
    from hhook.codec import THCCodec
    from hhook.profile import diloco_model

    W, C, rtt = 4e6, 0.1, 0.1
    rows = diloco_model.rows(W, C, every=50, fragments=4, overlap=1, bits=4, rtt_s=rtt, tokens_per_rank=1000,
                             sites=[2], links_gbit=[1.0])
    (r,) = rows
    ring = 2 * 0.05 + 1 * W / 1.25e8  # 2 (n - 1) alpha + 2 (n - 1) / n W / beta at n = 2
    assert r["ddp_fp32_ms"] == pytest.approx((C + ring) * 1e3)
    assert r["diloco_fp32_ms"] == pytest.approx((C + ring / 50) * 1e3)
    assert r["ddp_fp32_bytes"] == W and r["diloco_fp32_bytes"] == W / 50
    codec = THCCodec(4, 1024, 0, 2)
    assert r["diloco_thc_bytes"] == pytest.approx(codec.wire_bytes(int(W / 4)) / 50)
    assert r["ddp_fp32_us_per_token"] == pytest.approx((C + ring) / 2000 * 1e6)
    assert r["diloco_thc_ms"] < r["ddp_thc_ms"] and r["streaming_thc_bytes"] == pytest.approx(r["diloco_thc_bytes"], rel=1e-2)
    monkeypatch.delenv("OMPI_COMM_WORLD_RANK", raising=False)
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE", raising=False)
    out = tmp_path / "model.json"
    assert cli.main(["model", "--diloco", "50", "--model-bytes", "13.2MB", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "A MODEL, not a measurement" in text and max(len(line) for line in text.splitlines()) <= 120
    doc = json.loads(out.read_text())
    assert {(r["sites"], r["link_gbit"]) for r in doc["results"]} == {(n, g) for n in (2, 4, 8, 16, 32, 64)
                                                                       for g in (0.1, 1.0, 10.0)}


# -- issue 61: a profiler that never flatters, plots a person can read ---------------------
def _local(monkeypatch):
    for name in ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                 "GLOO_SOCKET_IFNAME", "OMPI_MCA_btl_tcp_if_include"):
        monkeypatch.delenv(name, raising=False)


def test_model_without_codec_inputs_says_it_assumed_0_ms(tmp_path, capsys, monkeypatch):
    _local(monkeypatch)
    out = tmp_path / "m.json"
    assert cli.main(["model", "--workers", "1,4", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    note = [line for line in text.splitlines() if "ASSUMED 0 ms" in line]
    assert note and "thc" in note[0] and "fp16" in note[0] and "--allreduce-json" in text, text
    assert json.loads(out.read_text())["meta"]["codec_assumed_zero"] == ["thc", "fp16"]
    assert cli.main(["model", "--workers", "1,4", "--ratio", "thc=5", "--codec-ms", "thc=3", "--json", str(out)]) == 0
    assert "ASSUMED" not in capsys.readouterr().out
    assert json.loads(out.read_text())["meta"]["codec_assumed_zero"] == []


def test_model_diloco_writes_its_plot_and_gpu_cluster_refuses_one(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    _local(monkeypatch)
    png = tmp_path / "diloco.png"
    assert cli.main(["model", "--diloco", "50", "--sites", "2,4,8", "--plot", str(png)]) == 0, capsys.readouterr().err
    assert png.stat().st_size > 10_000
    assert cli.main(["model", "--gpu-cluster", "--thc-ms", "1", "--cast-ms", "1", "--plot", str(png)]) == 2
    assert "--gpu-cluster draws no plot" in capsys.readouterr().err


def test_every_series_has_its_own_colour_and_marker():
    from hhook.profile import plot

    look = plot.styles(["fp32", "diloco:4:h=8", "diloco:fp32:h=8", "thc:4", "thc:4"])
    assert len(look) == 4
    assert len({c for c, _ in look.values()}) == 4 and len({m for _, m in look.values()}) == 4, look


def test_the_codec_plot_draws_each_rounding_as_its_own_series():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hhook.profile import plot

    rows = [{"op": "codec", "bits": 4, "block_size": 1024, "impl": "fused", "threads": 1, "rounding": rounding,
             "bytes": size, "algbw_GBps": gbps} for rounding, gbps in (("correlated", 2.0), ("independent", 2.5))
            for size in (2**20, 2**22)]
    fig, ax = plt.subplots()
    plot.codec_panel(ax, rows)
    lines = ax.get_lines()
    assert len(lines) == 2 and {tuple(line.get_ydata()) for line in lines} == {(2.0, 2.0), (2.5, 2.5)}
    assert len({line.get_marker() for line in lines}) == 2 and len({line.get_color() for line in lines}) == 2
    plt.close(fig)


def test_every_plot_names_its_link(tmp_path, monkeypatch):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hhook.profile import plot, where

    _local(monkeypatch)
    assert where.link_label(1) == "none (one process)"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert where.link_label().startswith("loopback")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert where.link_label().startswith("network between 2 hosts")
    drawn = {}
    real = plt.Figure.savefig

    def keep(fig, path, **kw):
        drawn["texts"] = [t.get_text() for t in fig.texts]
        drawn["titles"] = [ax.get_title() for ax in fig.axes]
        return real(fig, path, **kw)

    monkeypatch.setattr(plt.Figure, "savefig", keep)
    long = "a title far too long for one panel of six inches at the default font size, cut off before"
    plot.save(str(tmp_path / "x.png"), [lambda ax: ax.set_title(long)], link="loopback: 2 ranks on one host")
    assert drawn["texts"] == ["link: loopback: 2 ranks on one host"]
    assert all(len(line) <= plot.TITLE_CHARS for line in drawn["titles"][0].splitlines())
    assert (tmp_path / "x.png").exists()


_MODEL = ["model", "--alpha-us", "0", "--beta", "1gbit", "--ratio", "thc=5", "--compute-ms", "100",
          "--model-bytes", "125MB", "--workers", "1,4"]


def test_json_through_a_dangling_symbolic_link_is_written_where_it_points(tmp_path, capsys, monkeypatch):
    """The pre-run check made the link's target and then removed the path it was given:
    the user's link went, an empty file stayed at its target, and the JSON was written
    in place of the link. Now the link is written through and left as it was."""
    monkeypatch.delenv("OMPI_COMM_WORLD_RANK", raising=False)
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE", raising=False)
    target = tmp_path / "results" / "model.json"
    target.parent.mkdir()
    link = tmp_path / "link.json"
    link.symlink_to(target)
    assert cli.main([*_MODEL, "--json", str(link)]) == 0, capsys.readouterr().err
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert _load(target)["results"]


@pytest.mark.parametrize("spelling", ["the same", "./ and plain", "a symbolic link", "a hard link"])
def test_json_and_plot_naming_one_file_are_refused_before_the_run(tmp_path, capsys, monkeypatch, spelling):
    """``--json same.png --plot same.png`` exited 0 with the plot overwritten by JSON."""
    monkeypatch.delenv("OMPI_COMM_WORLD_RANK", raising=False)
    monkeypatch.delenv("OMPI_COMM_WORLD_SIZE", raising=False)
    monkeypatch.chdir(tmp_path)
    plot = tmp_path / "same.png"
    json_path = {"the same": str(plot), "./ and plain": "./same.png", "a symbolic link": "alias.json",
                 "a hard link": "hard.json"}[spelling]
    if spelling == "a symbolic link":
        (tmp_path / "alias.json").symlink_to(plot)
    if spelling == "a hard link":
        plot.write_bytes(b"an earlier plot")
        os.link(plot, tmp_path / "hard.json")
    before = sorted(p.name for p in tmp_path.iterdir())
    assert cli.main([*_MODEL, "--json", json_path, "--plot", "same.png"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "name the same file" in err and "Ring" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before
