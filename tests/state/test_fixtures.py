"""Checkpoints saved by earlier hhooks still load (tests/fixtures/, written by
``make_checkpoints.py`` at the commits its ``manifest.json`` names).

Each ``state_dict()`` file loads with its options, counters, every key's residual and
scales, ``bits="auto"``'s decision and widths, and the two-level shards' state, and saves
again as it was, and a resume from it trains on. The next step's float bits depend on the
CPU (torch's matmuls take other code paths on another CPU model), so a resume is held to
runs of the machine the test runs on: the case's run made here by this checkout, saved and
resumed, continues bit for bit; the fixture's resume leaves its state as that resume leaves
its own (counters, keys, shapes, decisions); and where this machine and checkout reproduce
the fixture's saved model and optimizer bit for bit, the fixture's resume gives its recorded
next step exactly. A fixture of another codec version (``CODEC_VERSION``: the files here are of
version 3, before the rotation's specification changed) loads its options and counters, and
its per-key state (residuals, scales, ``bits="auto"``'s decision and widths, the two-level
shards' state) starts afresh with one log line naming both versions: it was computed with
other bits. Each ``torch.save(state)`` pickle names classes by the module paths of its day
(``hhook.state.THCState``; before ``state_dict()`` also ``hhook.scales.ScalePolicy``,
``hhook.scales.KeyState`` and ``hhook.stats.Counters``): they must keep resolving."""

import importlib
import json
import os
import pickletools
import zipfile

import pytest
import torch

import hhook
from hhook.codec import CODEC_VERSION
from tests.support.distributed import logged, run_world
from tests.fixtures.make_checkpoints import CASES, HERE, params, run_case, train_step

MANIFEST = json.load(open(os.path.join(HERE, "manifest.json")))


def _load(case: str, rank: int = 0) -> dict:
    return torch.load(os.path.join(HERE, f"{case}.r{rank}.pt"), weights_only=True)


def _same(a, b, where="") -> list[str]:
    """Where ``a`` and ``b`` (plain data with tensors) differ."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        return [] if ok else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b):
            return [f"{where}: keys {list(a)} != {list(b)}"]
        return [d for k in a for d in _same(a[k], b[k], f"{where}/{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and type(a) is type(b) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _same(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def _without_origin(saved: dict) -> dict:
    """A state dict less the rank it was saved on (read again from torch.distributed)."""
    out = {k: v for k, v in saved.items() if k != "origin"}
    for name in ("inter",):
        if isinstance(out.get(name), dict):
            out[name] = _without_origin(out[name])
    out["variants"] = {b: _without_origin(v) for b, v in out.get("variants", {}).items()}
    return out


def _keys(state) -> dict:
    """policy name -> key -> (numel, residual, scales) of a live state."""
    return {name: {k: (ks.numel, ks.residual, ks.scales) for k, ks in policy.keys.items()}
            for name, policy in state.keys.policies.items()}


def _saved_keys(saved: dict) -> dict:
    return {name: {k: (ks["numel"], ks["residual"], ks["scales"]) for k, ks in policy["keys"].items()}
            for name, policy in saved["policies"].items()}


CURRENT = sorted(CASES)


def _current(saved: dict) -> bool:
    """Whether ``saved`` was written by this codec version (else its per-key state starts afresh)."""
    return saved.get("codec_version", 0) == CODEC_VERSION


@pytest.mark.parametrize("case", CURRENT)
def test_state_dict_files_load(case):
    ranks, options = MANIFEST[case]["ranks"], MANIFEST[case]["options"]
    for rank in range(ranks):
        saved = _load(case, rank)["hhook"]
        state = hhook.THCState()
        with logged("hhook") as lines:
            state.load_state_dict(saved)
        for name, value in {"bits": "auto", **options}.items():
            assert getattr(state.options, name) == value, (name, getattr(state.options, name))
        assert (state.iter, state.counters.calls) == (saved["iter"], saved["calls"]) and state.iter == MANIFEST[case]["steps"]
        if not _current(saved):
            afresh = [line for line in lines if "starts afresh" in line]
            assert len(afresh) == 1 and f"codec version {saved['codec_version']}, this hhook's is {CODEC_VERSION}" \
                in afresh[0], lines
            assert _keys(state) == {} and state.inter is None and state.variants == {} and state.decision is None
            assert state.counters.state_dict() == saved["_stats"] and state.intra_counters.state_dict() == saved["_intra"]
            continue
        assert state.stats()["compressed_calls"] == state.iter - 2  # one bucket, from start_iter 2 on
        assert not _same(_keys(state), _saved_keys(saved)), _same(_keys(state), _saved_keys(saved))
        assert not _same(_without_origin(state.state_dict()), _without_origin(saved))
        if options.get("error_feedback"):
            holder = state.inter if state.inter is not None else state
            assert any(r is not None for keys in _keys(holder).values() for _, r, _ in keys.values())
        if options.get("scales") == "predicted":
            assert all(s is not None for keys in _keys(state).values() for _, _, s in keys.values())


def test_the_cases_hold_what_they_are_for():
    auto = _load("auto")["hhook"]
    assert auto["decision"]["phase"] == "explore" and sorted(auto["variants"]) == [4, 5]
    assert auto["variants"][4]["bits"] == 4 and _saved_keys(auto["variants"][4])["agreed"]
    two = _load("two_level", 1)["hhook"]
    assert two["layout"]["n_nodes"] == 2 and two["inter"]["error_feedback"] and _saved_keys(two["inter"])["agreed"]
    for saved in (auto, two):  # loaded here: as saved by this codec version, else afresh
        state = hhook.THCState()
        state.load_state_dict(saved)
        if _current(saved):
            assert state.decision == saved["decision"] or state.inter is not None
        else:
            assert state.decision is None and state.variants == {} and state.inter is None


def _pickle_globals(path: str) -> set:
    with zipfile.ZipFile(path) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    return {arg for op, arg, _ in pickletools.genops(data) if op.name == "GLOBAL" and arg.startswith("hhook")}


@pytest.mark.parametrize("case", CURRENT + ["legacy"])
def test_pickles_load(case):
    path = os.path.join(HERE, f"{case}.r0.pickle")
    for name in _pickle_globals(path):
        module, attr = name.split(" ")
        assert getattr(importlib.import_module(module), attr) is not None
    state = torch.load(path, weights_only=False)
    assert isinstance(state, hhook.THCState) and state.process_group is None
    if case != "legacy":
        assert _pickle_globals(path) == {"hhook.state THCState"}
        from_file = hhook.THCState()
        from_file.load_state_dict(_load(case)["hhook"])  # the same dict, through the same load
        assert not _same(_without_origin(state.state_dict()), _without_origin(from_file.state_dict()))
        return
    assert _pickle_globals(path) == {"hhook.state THCState", "hhook.scales ScalePolicy", "hhook.scales KeyState",
                                     "hhook.stats Counters"}
    o = state.options
    assert (o.bits, o.seed, o.error_feedback, o.scales, o.rounding) == (3, 5, True, "agreed", "independent")
    assert (state.counters.calls, state.stats()["compressed_calls"], state.stats()["dense_bytes"]) == (3, 3, 3600)
    assert _keys(state) == {}  # saved before hhook recorded its codec's version: its residual starts afresh


#: Parts of a state that tell how its run went, not only where it stands: bits="auto"'s
#: decision follows measured times (which width a step ran, which samples it kept), and
#: the byte counters follow the decision. Compared by their fields' names and types.
_TRAJECTORY = ("decision", "_stats", "_intra")


def _portable(value):
    """What of a state dict is the same on every CPU: tensors as dtype and shape, floats
    (timings, float results) and digests (of a tensor's bits) as their type, the run's
    trajectory (:data:`_TRAJECTORY`) as its fields' types, the rank it was saved on left out."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape))
    if isinstance(value, float):
        return float
    if isinstance(value, dict):
        return {k: type(v) if k == "digest" else {f: type(x) for f, x in v.items()}
                if k in _TRAJECTORY and isinstance(v, dict) else _portable(v)
                for k, v in value.items() if k != "origin"}
    if isinstance(value, (list, tuple)):
        return type(value)(_portable(v) for v in value)
    return value


def _resume(saved: dict, rank: int):
    """A new model, optimizer and DDP from a checkpoint dict, registered with its hhook
    state, trained one step: the parameters and the state after it."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests.support.ready_order import ReadyOrderMLP

    model = ReadyOrderMLP(inputs=8, hidden=8)
    model.load_state_dict(saved["model"])
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt.load_state_dict(saved["opt"])
    ddp = DDP(model)
    state = hhook.register(ddp, state=saved["hhook"])
    train_step(ddp, opt, rank, saved["step"])
    return params(model), state


def _resume_worker(rank, world, case):
    fixture = _load(case, rank)
    here = run_case(rank, case)  # the case's run on this machine, by this checkout
    resumed_here, state_here = _resume(here, rank)
    resumed, state = _resume(fixture, rank)
    reproduces = not _same(here["model"], fixture["model"]) and not _same(here["opt"], fixture["opt"])
    return {
        "here_continues": torch.equal(resumed_here, here["next_params"]),
        "calls": state.stats()["compressed_calls"],
        "structure": _same(_portable(state.state_dict()), _portable(state_here.state_dict())),
        "reproduces": reproduces,
        "fixture_continues": torch.equal(resumed, fixture["next_params"]),
    }


def check_resume(results: list[dict], current: bool = True) -> None:
    """``current``: the fixture was saved by this codec version (else its per-key state
    started afresh, and neither its next step nor its state's structure is the saved run's)."""
    for r in results:
        assert r["here_continues"], "a checkpoint saved here does not resume bit for bit"
        assert r["calls"] > 0 and (not r["structure"] or not current), r
        assert r["fixture_continues"] or not r["reproduces"] or not current, "same saved bits, another next step"


@pytest.mark.parametrize("case", CURRENT)
def test_resume_trains_the_next_step_as_the_saved_run(case):
    check_resume(run_world(_resume_worker, MANIFEST[case]["ranks"], case, timeout=300), _current(_load(case)["hhook"]))


def test_resume_where_torch_computes_other_bits():
    """The issue's failure, on this machine: torch's CPU kernels on other code paths
    (``ATEN_CPU_CAPABILITY=default``, MKL limited to SSE4.2) change the float bits of every
    step, as another CPU model does (an Intel Sapphire Rapids against the AMD EPYC that
    wrote the fixtures). The resume check must hold there too."""
    import subprocess
    import sys

    from tests.support.distributed import subprocess_env

    script = ("import json\nfrom tests.support.distributed import run_world\n"
              "from tests.state.test_fixtures import _resume_worker\n"
              "if __name__ == '__main__':\n"
              "    print(json.dumps(run_world(_resume_worker, 2, 'fixed_ef', timeout=240)))\n")
    env = subprocess_env(ATEN_CPU_CAPABILITY="default", MKL_ENABLE_INSTRUCTIONS="SSE4_2")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    check_resume(json.loads(done.stdout.strip().splitlines()[-1]), _current(_load("fixed_ef")["hhook"]))
