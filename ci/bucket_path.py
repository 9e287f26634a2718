r"""Which hhook modules one DDP bucket (or one FSDP2 reduce-scatter) passes through, from the
hook ``hhook.register`` installs to the wire and back (docs/design.md, "A bucket's life").

Two ranks on this host (Gloo) train a small MLP under DDP (``--fsdp``: FSDP2 with
``hhook.fsdp.register``); after ``--warmup`` steps one step is profiled on rank 0: every
Python call made by hhook's code and by the continuations hhook attaches to collectives
(they run on Gloo's threads, so each continuation switches the profiler on for its own
run). Prints the modules in the order first entered, and

* ``returns``: the calls by which the way went back up, into a module that imports
  (directly or not) the one calling it and is not on the stack: a callback or a closure
  handed down and called later (a schedule calling into the state that made its
  context, a helper calling back into the schedule). A straight hallway has none. Not
  counted, and listed as ``continuations``: a completed collective running the
  continuation its schedule attached (``futures.Continuation``), the door from the
  collective to the next stage;
* ``reentries``: every call into a module entered before, from another module (the
  stages of one layer, begin, finish and decode, re-enter it by design);
* the first-level folders (or modules) of hhook it passed.

    python3 ci/bucket_path.py                 # bits=4, agreed scales (one bucket)
    python3 ci/bucket_path.py --fsdp          # one step of FSDP2's compressed reduce-scatters
    python3 ci/bucket_path.py --bits auto     # the default, once it holds its choice
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "src"), ROOT]  # src layout: the package, and tests/

import torch  # noqa: E402

from tests.support.distributed import run_world  # noqa: E402
from tests.test_layering import _graph  # noqa: E402


def _module_of(filename: str, package: str) -> str | None:
    if not filename.startswith(package):
        return None
    rel = os.path.relpath(filename, os.path.dirname(package))[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def _imports() -> dict:
    """module -> every hhook module it imports, directly or through others."""
    graph = _graph()
    closed = {}

    def reach(module, seen):
        for dep in graph.get(module, ()):
            if dep not in seen:
                seen.add(dep)
                reach(dep, seen)
        return seen

    for module in graph:
        closed[module] = reach(module, set())
    return closed


class PathRecorder:
    """Module transitions of profiled calls, from any thread that switched it on."""

    def __init__(self, package: str):
        self.package = package
        self.imports = _imports()
        self.lock = threading.Lock()
        self.entered: list[str] = []
        self.reentries = 0
        self.functions: dict[str, set] = {}
        self.returns: dict[str, int] = {}
        self.continuations: dict[str, int] = {}

    def profile(self, frame, event, arg):
        if event != "call":
            return
        module = _module_of(frame.f_code.co_filename, self.package)
        if module is None:
            return
        caller = frame.f_back
        with self.lock:
            self.functions.setdefault(module, set()).add(frame.f_code.co_name)
        came_from = _module_of(caller.f_code.co_filename, self.package) if caller is not None else None
        if came_from == module:
            return
        with self.lock:
            if module not in self.entered:
                self.entered.append(module)
                return
            self.reentries += 1
            if came_from is None or came_from not in self.imports.get(module, ()) or module in self._stack(caller):
                return
            edge = f"{came_from} -> {module}.{frame.f_code.co_name}"
            door = came_from == "hhook.schedule.futures" and caller.f_code.co_name == "__call__"
            table = self.continuations if door else self.returns
            table[edge] = table.get(edge, 0) + 1

    def _stack(self, frame) -> set:
        out = set()
        while frame is not None:
            module = _module_of(frame.f_code.co_filename, self.package)
            if module is not None:
                out.add(module)
            frame = frame.f_back
        return out


def _ddp_step(rank, bits):
    import hhook
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 10))
    ddp = DDP(model)
    # agreed scales: the GPUs' default, its stages the longest path (the CPU default over 2 ranks is gathered's)
    state = hhook.register(ddp, **({} if bits == "auto" else {"bits": int(bits), "scales": "agreed"}))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)  # ranks' gradients differ (identical ones skip the decode)
    x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()

    return state, step


def _fsdp_step(rank, bits):
    import hhook.fsdp
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 10))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    state = hhook.fsdp.register(model, **({} if bits == "auto" else {"bits": int(bits)}))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(32, 64, generator=g)

    def step():
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    return state, step


def _worker(rank, world, bits, warmup, fsdp):
    import hhook
    from hhook.schedule import futures  # where every continuation hhook attaches runs

    state, step = (_fsdp_step if fsdp else _ddp_step)(rank, bits)
    for _ in range(warmup):
        step()
    recorder = PathRecorder(os.path.dirname(hhook.__file__))
    original = futures.Continuation.__call__

    def traced(self, fut):
        sys.setprofile(recorder.profile)
        try:
            return original(self, fut)
        finally:
            sys.setprofile(None)

    futures.Continuation.__call__ = traced
    sys.setprofile(recorder.profile)
    try:
        step()
    finally:
        sys.setprofile(None)
        futures.Continuation.__call__ = original
    method = state.stats().get("decision", {}).get("method", f"thc:{bits}")
    return {"modules": recorder.entered, "reentries": recorder.reentries, "method": method,
            "returns": recorder.returns, "continuations": recorder.continuations,
            "functions": {m: sorted(f) for m, f in recorder.functions.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", default="4", help="an integer, or auto (the default of hhook.register)")
    parser.add_argument("--fsdp", action="store_true", help="FSDP2's reduce-scatters instead of a DDP bucket")
    parser.add_argument("--warmup", type=int, default=0, help="steps before the profiled one (default: 4, auto 300)")
    parser.add_argument("--functions", action="store_true", help="also list the functions run in each module")
    args = parser.parse_args()
    warmup = args.warmup or (300 if args.bits == "auto" else 4)
    out = run_world(_worker, 2, args.bits, warmup, args.fsdp, timeout=900)[0]
    modules = [m for m in out["modules"] if m != "hhook"]
    folders = list(dict.fromkeys(m.split(".")[1] for m in modules))  # hhook's first level: a folder or module
    print(json.dumps({"way": "FSDP2 reduce-scatter" if args.fsdp else "DDP bucket", "bits": args.bits,
                      "method": out["method"], "modules": len(modules), "path": modules,
                      "returns": sum(out["returns"].values()), "returns_by_call": out["returns"],
                      "continuations": out["continuations"], "reentries": out["reentries"], "folders": len(folders),
                      "folder_path": folders}, indent=1))
    if args.functions:
        for module in modules:
            print(f"{module}: {', '.join(out['functions'][module])}")


if __name__ == "__main__":
    main()
