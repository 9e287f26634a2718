r"""Bit-for-bit comparison of two checkouts of hhook: outputs, counters and call numbers.

Runs the same small jobs (2 ranks over Gloo, 4 for two-level) with each checkout's hhook
and compares everything they record: every gradient or tensor hhook returned, the
parameters after training, ``stats()``, the state's call number (the rounding streams
drawn) and iteration count. The jobs cover bits 4, 2 and ``"auto"`` (the DDP hook's and
FSDP2's decisions on a fake clock, so both checkouts decide alike), agreed and predicted
scales, error feedback, pieces (``chunk_mb``), flat and two-level (``topology=2``),
``thc_allreduce``, the DDP hook and FSDP2 (reduce-scatter, and the compressed
all-gather).

    git archive main | tar -x -C /tmp/base                            # a checkout of main
    python3 ci/compare_checkouts.py --base /tmp/base --handshake-bytes
    python3 ci/compare_checkouts.py --emit base.pt --root /tmp/base    # one checkout's record, kept
    python3 ci/compare_checkouts.py --base-record base.pt --handshake-bytes

Differences are printed by job and field, with both values. Against the ``main`` of
2026-11-28 the handshake's own bytes differ by design (:data:`HANDSHAKE_BYTES`):
``thc_allreduce`` checks each call (8 bytes a call), FSDP2 runs one handshake per shard
group for both of its comms instead of one per module and one for the all-gather;
``--handshake-bytes`` accepts exactly those differences (``wire_bytes``, and the
``ratio`` computed from it) and nothing else. ``--allow`` names other fields that may
differ (a field in every job, or ``JOB:FIELD``); anything else that differs fails
(exit 1).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

HERE = os.path.abspath(__file__)
ROOT = os.path.dirname(os.path.dirname(HERE))


def package_root(root: str) -> str:
    """Where ``root``'s hhook package lives: ``src/`` (the src layout) or, in a checkout
    from before it, the root itself."""
    src = os.path.join(root, "src")
    return src if os.path.isdir(os.path.join(src, "hhook")) else root


# -- the jobs (run inside each rank; hhook is the checkout's under test) -------------------

def _grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def _ddp_job(rank, bits, scales="agreed", error_feedback=False, chunk_mb="auto", topology="flat", steps=6):
    steps = 24 if bits == "auto" else steps  # several widths tried
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hhook

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 600), torch.nn.Tanh(), torch.nn.Linear(600, 40),
                                torch.nn.Tanh(), torch.nn.Linear(40, 7))
    ddp = DDP(model, bucket_cap_mb=0.04)  # three buckets
    options = {"bits": bits, "scales": scales, "error_feedback": error_feedback, "chunk_mb": chunk_mb,
               "topology": topology}
    state = hhook.register(ddp, **options)
    clock = None
    if bits == "auto":
        from hhook.decision import Prober

        costs = {"plain": 0.4, "fp32": 0.4, "bf16": 0.2, "thc:5": 0.12, "thc:4": 0.10, "thc:3": 0.11, "thc:2": 0.13}
        now = [0.0]

        def clock():
            return now[0]

        state.prober = Prober(clock)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(10 + rank)
    out = []
    for step in range(steps):
        x = torch.randn(16, 40, generator=g) * (1 + 9 * rank)
        y = torch.randint(0, 7, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        out.append(_grads(model))
        opt.step()
        if clock is not None:
            now[0] += costs.get(state.prober.method, 0.1)
    stats = state.stats()
    return {"grads": out, "params": [p.detach().clone() for p in model.parameters()], "stats": stats,
            "calls": _calls(state), "iter": state.iter}


def _calls(state):
    """The state's call numbers drawn (its own, and two-level its shards' state's)."""
    calls = getattr(state, "calls", None)
    if not isinstance(calls, int):
        calls = state.counters.calls  # a checkout that keeps the call number with the counters
    inter = getattr(state, "inter", None)
    return calls if inter is None else (calls, _calls(inter))


def _allreduce_job(rank, bits, scales="agreed", error_feedback=False, chunk_mb=0, topology="flat", n=5000):
    import torch

    import hhook

    state = hhook.THCState(bits=bits, scales=scales, error_feedback=error_feedback, chunk_mb=chunk_mb,
                           topology=topology, start_iter=2 if error_feedback else 0)
    g = torch.Generator().manual_seed(20 + rank)
    out = []
    for step in range(4):
        for key, size in (("a", n), ("b", 3 * n + 17)):
            t = torch.randn(size, generator=g) * (1 + rank)
            if step == 2 and key == "b":
                t = t.to(torch.bfloat16)
            hhook.thc_allreduce(t, state, key=key)
            out.append(t.clone())
    keyless = torch.randn(777, generator=g)
    hhook.thc_allreduce(keyless, state)
    out.append(keyless)
    double = torch.randn(100, generator=g, dtype=torch.float64)
    hhook.thc_allreduce(double, state, key="d")
    out.append(double)
    return {"tensors": out, "stats": state.stats(), "calls": _calls(state)}


def _fsdp_job(rank, bits, all_gather=None, steps=4):
    import torch

    import hhook.fsdp
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 5))
    for i in (0, 2, 4):
        fully_shard(model[i])
    fully_shard(model)
    state = hhook.fsdp.register(model, bits=bits, all_gather=all_gather)
    ag = None
    if bits == "auto":
        from hhook.fsdp.all_gather import find_state

        ag = find_state(model)
        costs = {"rs+ag": 0.10, "rs": 0.11, "dense": 0.12}
        now = [0.0]
        switch = ag.switch if ag is not None else None

        def clock():
            now[0] += costs[switch.method] if switch is not None else 0.1
            return now[0]

        state.prober.clock = clock
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(30 + rank)
    out = []
    for step in range(steps):
        x = torch.randn(8, 64, generator=g) * (1 + 4 * rank)
        opt.zero_grad()
        model(x).square().mean().backward()
        out.append([p.grad.to_local().detach().clone() for p in model.parameters()])
        opt.step()
    record = {"grads": out, "params": [p.to_local().detach().clone() for p in model.parameters()],
              "stats": state.stats(), "calls": _calls(state), "iter": state.iter}
    if all_gather is not None or bits == "auto":
        record["all_gather_stats"] = hhook.fsdp.all_gather_stats(model)
    return record


def _hsdp_job(rank, bits, steps=3):
    import torch

    import hhook.fsdp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 5))
    for i in (0, 2):
        fully_shard(model[i], mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    state, replica = hhook.fsdp.register_hsdp(model, mesh["replicate"].get_group(), bits=bits)
    g = torch.Generator().manual_seed(40 + rank)
    out = []
    for step in range(steps):
        for p in model.parameters():
            p.grad = None
        model(torch.randn(8, 64, generator=g) * (1 + rank)).square().mean().backward()
        out.append([p.grad.to_local().detach().clone() for p in model.parameters()])
    return {"grads": out, "stats": state.stats(), "replica_stats": replica.stats(), "calls": _calls(state),
            "replica_calls": _calls(replica)}


JOBS = {
    2: [
        ("ddp-4-agreed", _ddp_job, (4,)),
        ("ddp-4-predicted-ef", _ddp_job, (4, "predicted", True)),
        ("ddp-2-agreed-pieces", _ddp_job, (2, "agreed", False, 0.01)),
        ("ddp-auto", _ddp_job, ("auto",)),
        ("allreduce-4-agreed", _allreduce_job, (4,)),
        ("allreduce-2-predicted-pieces", _allreduce_job, (2, "predicted", False, 0.005)),
        ("allreduce-auto-ef", _allreduce_job, ("auto", "agreed", True)),
        ("fsdp-4", _fsdp_job, (4,)),
        ("fsdp-2-ag8", _fsdp_job, (2, 8)),
        ("fsdp-auto", _fsdp_job, ("auto",)),
    ],
    4: [
        ("two-level-ddp-4", _ddp_job, (4, "agreed", False, "auto", 2)),
        ("two-level-ddp-2-predicted", _ddp_job, (2, "predicted", False, "auto", 2)),
        ("two-level-allreduce-4", _allreduce_job, (4, "agreed", False, 0, 2)),
        ("two-level-allreduce-auto-pieces", _allreduce_job, ("auto", "agreed", False, 0.005, 2)),
        ("hsdp-4", _hsdp_job, (4,)),
    ],
}


#: head - base of ``wire_bytes`` per job and counters, where the handshake changed (issues
#: 48 and 52): 10 thc_allreduce calls of 8 bytes each; FSDP2's 3 modules' handshakes of 8
#: bytes (and the all-gather's 8) now one of 8 per shard group, in the state's counters;
#: HSDP's 2 modules' one, and its replicas' 6 thc_allreduce calls.
HANDSHAKE_BYTES = {
    "allreduce-4-agreed": {"stats": 80}, "allreduce-2-predicted-pieces": {"stats": 80},
    "allreduce-auto-ef": {"stats": 80}, "two-level-allreduce-4": {"stats": 80},
    "two-level-allreduce-auto-pieces": {"stats": 80},
    "fsdp-4": {"stats": -16}, "fsdp-2-ag8": {"stats": -16, "all_gather_stats": -8},
    "fsdp-auto": {"stats": -16, "all_gather_stats": -8}, "hsdp-4": {"stats": -8, "replica_stats": 48},
}


def _rank(rank, world, port, root, results):
    import pickle
    import traceback

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["HHOOK_AUTO_ONE_HOST"] = "measure"
    out = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        for name, job, args in JOBS[world]:
            out[name] = job(rank, *args)
        results.put((rank, pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - reported by the parent
        results.put((rank, pickle.dumps({"error": traceback.format_exc()})))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def emit(root: str, path: str) -> None:
    """Run every job with the hhook of ``root`` and save what each rank recorded."""
    import socket

    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    record = {}
    for world in JOBS:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        results = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(r, world, port, root, results)) for r in range(world)]
        for p in procs:
            p.start()
        import pickle

        got = dict(results.get(timeout=900) for _ in range(world))
        for p in procs:
            p.join(timeout=60)
        for rank in range(world):
            ranks = pickle.loads(got[rank])
            if "error" in ranks:
                raise SystemExit(f"{root}: world of {world}, rank {rank} failed:\n{ranks['error']}")
            for name, value in ranks.items():
                record.setdefault(name, {})[rank] = value
    torch.save(record, path)


# -- comparison ---------------------------------------------------------------------------

def _diff(a, b, where: str, out: list) -> None:
    import torch

    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.numel() else a,
                                                                           b.view(torch.uint8) if b.numel() else b)
        if not same:
            out.append((where, "tensor differs", None))
    elif isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=str):
            if k not in a or k not in b:
                out.append((f"{where}.{k}", "missing on one side", (a.get(k), b.get(k))))
            else:
                _diff(a[k], b[k], f"{where}.{k}", out)
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            out.append((where, "lengths differ", (len(a), len(b))))
        for i, (x, y) in enumerate(zip(a, b)):
            _diff(x, y, f"{where}[{i}]", out)
    elif isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return  # both NaN
    elif a != b:
        out.append((where, "value differs", (a, b)))


def _allowed(where: str, allowance: str) -> bool:
    """``allowance``: a field (``stats.wire_bytes``: in every job) or ``JOB:FIELD``."""
    job, _, field = allowance.rpartition(":")
    name = where.lstrip(".").split(".", 1)[0]
    return (not job or job == name) and where.endswith(field)


def _handshake_only(a: dict, b: dict, where: str) -> bool:
    """Whether the difference at ``where`` (``.job.rank.counters.field``) is only the
    handshake's bytes of :data:`HANDSHAKE_BYTES`."""
    parts = where.lstrip(".").split(".")
    if len(parts) != 4 or parts[3] not in ("wire_bytes", "inter_wire_bytes", "ratio"):
        return False
    job, rank, counters = parts[0], int(parts[1]), parts[2]
    delta = HANDSHAKE_BYTES.get(job, {}).get(counters)
    if delta is None:
        return False
    base, head = a[job][rank][counters], b[job][rank][counters]
    if head["wire_bytes"] - base["wire_bytes"] != delta:
        return False
    if parts[3] == "inter_wire_bytes":
        return head["inter_wire_bytes"] - base["inter_wire_bytes"] == delta
    return parts[3] == "wire_bytes" or head["ratio"] == head["dense_bytes"] / head["wire_bytes"]


def compare(base: str, head: str, allowed: set, handshake: bool = False, base_record: str | None = None) -> int:
    """Run both checkouts (``base_record``: what ``--emit`` saved of the base, instead)
    and compare; 0 when identical (``allowed`` fields may differ; ``handshake``: and the
    handshake's bytes of :data:`HANDSHAKE_BYTES`)."""
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"base": base_record}
        for label, root in (("base", base), ("head", head)):
            if paths.get(label):
                continue
            paths[label] = os.path.join(tmp, f"{label}.pt")
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([package_root(root), root]), OMP_NUM_THREADS="1")
            subprocess.run([sys.executable, HERE, "--emit", paths[label], "--root", root], env=env, check=True)
        import torch

        a, b = (torch.load(paths[k], weights_only=False) for k in ("base", "head"))
    found: list = []
    _diff(a, b, "", found)
    bad = [f for f in found if not any(_allowed(f[0], name) for name in allowed)
           and not (handshake and _handshake_only(a, b, f[0]))]
    for where, what, values in found:
        tag = "allowed" if (where, what, values) not in bad else "DIFFERS"
        print(f"{tag}: {where}: {what}" + (f" (base {values[0]!r}, head {values[1]!r})" if values else ""))
    jobs = sorted(a)
    print(f"{len(jobs)} jobs compared ({', '.join(jobs)}): "
          + ("identical" if not found else f"{len(bad)} differences, {len(found) - len(bad)} allowed"))
    return 1 if bad else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="the checkout to compare with (e.g. main, unpacked by git archive)")
    parser.add_argument("--head", default=ROOT, help="the checkout under test (default: this one)")
    parser.add_argument("--emit", help="internal: run the jobs and save the record here")
    parser.add_argument("--root", help="internal: the checkout whose hhook --emit runs")
    parser.add_argument("--base-record", help="the base's record, saved by --emit (instead of running --base)")
    parser.add_argument("--handshake-bytes", action="store_true",
                        help="accept the handshake's byte differences of HANDSHAKE_BYTES (and nothing else)")
    parser.add_argument("--allow", action="append", default=[],
                        help="a field allowed to differ: stats.wire_bytes (every job) or JOB:stats.wire_bytes; "
                             "repeatable")
    args = parser.parse_args()
    if args.emit:
        sys.path[:0] = [package_root(args.root), args.root]
        import hhook

        assert os.path.dirname(os.path.dirname(os.path.abspath(hhook.__file__))) == os.path.abspath(package_root(args.root)), \
            (hhook.__file__, args.root)
        emit(args.root, args.emit)
        return
    if not args.base and not args.base_record:
        parser.error("--base or --base-record is required")
    raise SystemExit(compare(args.base and os.path.abspath(args.base), os.path.abspath(args.head), set(args.allow),
                             args.handshake_bytes, args.base_record))


if __name__ == "__main__":
    main()
