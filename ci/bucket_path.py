r"""Which hhook modules one DDP bucket passes through, from the hook ``hhook.register``
installs to the wire and back (docs/design.md, "A bucket's life").

Two ranks on this host (Gloo) train a small MLP under DDP; after ``--warmup`` steps the
hook's own step is profiled on rank 0: every Python call made by the hook and by the
continuations hhook attaches to collectives (they run on Gloo's threads, so each
continuation switches the profiler on for its own run). Prints the modules in the order
first entered, how often the path went back into a module it had already left, and the
first-level folders (or modules) of hhook it passed.

    python3 ci/bucket_path.py                 # bits=4, agreed scales (one bucket)
    python3 ci/bucket_path.py --bits auto     # the default, once it holds its choice
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

from tests.support.distributed import run_world  # noqa: E402


def _module_of(filename: str, package: str) -> str | None:
    if not filename.startswith(package):
        return None
    rel = os.path.relpath(filename, os.path.dirname(package))[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


class PathRecorder:
    """Module transitions of profiled calls, from any thread that switched it on."""

    def __init__(self, package: str):
        self.package = package
        self.lock = threading.Lock()
        self.entered: list[str] = []
        self.reentries = 0
        self.functions: dict[str, set] = {}

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
            if module in self.entered:
                self.reentries += 1
            else:
                self.entered.append(module)


def _worker(rank, world, bits, warmup):
    import hhook
    from hhook.schedule import teardown  # where every continuation hhook attaches runs
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 10))
    ddp = DDP(model)
    state = hhook.register(ddp, **({} if bits == "auto" else {"bits": int(bits)}))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)  # ranks' gradients differ (identical ones skip the decode)
    x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()

    for _ in range(warmup):
        step()
    recorder = PathRecorder(os.path.dirname(hhook.__file__))
    original = teardown.Continuation.__call__

    def traced(self, fut):
        sys.setprofile(recorder.profile)
        try:
            return original(self, fut)
        finally:
            sys.setprofile(None)

    if not os.environ.get("MAIN_ONLY"):
        teardown.Continuation.__call__ = traced
    sys.setprofile(recorder.profile)
    try:
        step()
    finally:
        sys.setprofile(None)
        teardown.Continuation.__call__ = original
    method = state.stats().get("decision", {}).get("method", f"thc:{bits}")
    return {"modules": recorder.entered, "reentries": recorder.reentries, "method": method,
            "functions": {m: sorted(f) for m, f in recorder.functions.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bits", default="4", help="an integer, or auto (the default of hhook.register)")
    parser.add_argument("--warmup", type=int, default=0, help="steps before the profiled one (default: 4, auto 300)")
    parser.add_argument("--functions", action="store_true", help="also list the functions run in each module")
    args = parser.parse_args()
    warmup = args.warmup or (300 if args.bits == "auto" else 4)
    out = run_world(_worker, 2, args.bits, warmup, timeout=900)[0]
    modules = [m for m in out["modules"] if m != "hhook"]
    folders = list(dict.fromkeys(m.split(".")[1] for m in modules))  # hhook's first level: a folder or module
    print(json.dumps({"bits": args.bits, "method": out["method"], "modules": len(modules), "path": modules,
                      "reentries": out["reentries"], "folders": len(folders), "folder_path": folders}, indent=1))
    if args.functions:
        for module in modules:
            print(f"{module}: {', '.join(out['functions'][module])}")


if __name__ == "__main__":
    main()
