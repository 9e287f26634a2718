r"""How ``hhook-profile train`` (:mod:`hhook.profile.commands.train`) runs each method: in
child processes, one rank each, watched by the launched ranks.

A hung collective cannot be cancelled in-process (PyTorch's PowerSGD hook waits inside
its callbacks, which hangs or aborts Gloo with 4 ranks), so every method runs in a
child process:

1. The launched ranks form a small *control* channel of their own (mpi4py under an MPI
   launcher, else a Gloo group from the launcher's variables). They exchange only a few
   objects, between methods.
2. For each method, rank 0 picks a free port and broadcasts it; every rank starts a
   child (:func:`child_main` on a spec file) that joins a fresh process group on that
   port, trains, and writes its result to a file. The child beats a heartbeat file
   after every step.
3. A parent kills its child when the heartbeat stood still for ``--timeout`` seconds
   (a hang), then waits for the other ranks without spinning and all ranks exchange
   verdicts: any hung rank makes the row "hung", any failed rank "failed" (the
   message of the rank that failed first in its own right), so every rank prints and
   returns the same thing. A hang costs at most ``--timeout`` seconds; the next method
   still runs.

Measurement conventions: a step is the wall time of forward, backward (DDP's hook
futures are waited on inside it) and the optimizer step, on rank 0; the first
``--warmup`` steps are left out of the step statistics (not out of the training clock).
Rank 0 evaluates the test accuracy every ``--eval-every`` steps and after the last
one while the others wait in a barrier; none of that is charged to the training clock
(the sum of the step times), against which time to accuracy is measured. Bytes are those
of the tensors handed to ``torch.distributed`` collectives (as in
``examples/ddp_train.py``); DDP without a hook reduces in C++, so fp32 is charged its
gradients, 4 bytes per parameter per step. THC's count is checked against its
``state.stats()``.

The methods train can run are :data:`KINDS` (their grammar, :mod:`hhook.profile.methods`)
and :data:`ATTACH` (how the child attaches each kind to DDP).

``--parallel fsdp`` trains with FSDP2 instead of DDP (:func:`attach_fsdp`: ``fully_shard``
on every top-level child with parameters and on the root, one 1-D mesh of every rank):
fp32 is plain FSDP2, bf16 FSDP2 with ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``,
thc ``hhook.fsdp.register``; ``ag=BITS`` adds hhook's compressed parameter all-gather
(``register(all_gather=BITS)``, or ``compress_all_gather`` for fp32 and bf16), ``ag=bf16``
all-gathers bfloat16 parameters (``param_dtype=torch.bfloat16``), ``params=bf16`` sets
``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)`` whatever the
all-gather (``ag=8:params=bf16``: quantized from bfloat16; thc compresses the bfloat16 gradients). Every collective then runs in Python and is counted: the
reduce-scatters' input (hhook's: its messages) and the all-gathers' output separately
(:mod:`hhook.profile.counting`), besides the total; every rank takes part in the
evaluation's forward (its all-gathers), outside the clock and the step's bytes.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time

from . import methods

KINDS = (methods.FP32_AG, methods.FP16, methods.BF16_AG, methods.POWERSGD, methods.THC, methods.SBC, methods.LGC,
         methods.DILOCO)
DEFAULT_METHODS = "fp32,fp16,bf16,powersgd,thc:4"
POLL_S = 0.05
STARTUP_S = 300.0  # allowance until the first step: imports and rendezvous are slow on a loaded machine


def parse_methods(text: str, powersgd_rank: int = 2, diloco: int | None = None,
                  fragments: int | None = None) -> list[methods.Method]:
    r"""``fp32,fp16,bf16,powersgd[:R],thc[:BITS[:MODE]][:chunk=MB],sbc...,lgc...,diloco...`` -> methods
    (any of :data:`KINDS`); ValueError naming the bad entry. ``diloco``, ``fragments``: H and P of
    ``diloco`` entries that do not say (``--diloco H`` without one adds ``diloco:4``)."""
    if diloco is not None and not any(m.strip().lower().startswith("diloco") for m in text.split(",")):
        text = f"{text},diloco:4"
    return methods.parse(text, KINDS, powersgd_rank=powersgd_rank, diloco=diloco, fragments=fragments)


# -- the control channel between the launched ranks ------------------------------------------
def control_channel(timeout_s: float):
    """mpi4py under an MPI launcher (its rendezvous needs no MASTER_ADDR), else a Gloo group."""
    from ..launch import detect_env
    from .comm import MPIComm, TorchComm

    env = detect_env()
    if env.launcher in ("openmpi", "pmi") and importlib.util.find_spec("mpi4py") is not None:
        return MPIComm()
    return TorchComm("gloo", timeout_s)


def quiet_barrier(control) -> None:
    """A barrier that sleeps while waiting (MPI would spin, stealing the children's cores)."""
    if control.backend == "mpi":
        req = control.comm.Ibarrier()
        while not req.Test():
            time.sleep(POLL_S)
    else:
        control.barrier()


def master_addr(control) -> str:
    """Where the children's store lives: MASTER_ADDR, else rank 0's address."""
    if "MASTER_ADDR" in os.environ:
        return os.environ["MASTER_ADDR"]
    if control.backend != "mpi":
        return control.env.master_addr
    hosts = control.allgather_object(socket.gethostname())
    if len(set(hosts)) == 1:
        return "127.0.0.1"
    return control.bcast_object(socket.gethostbyname(socket.gethostname()) if control.rank == 0 else None)


# -- one method on one rank: the parent's side ------------------------------------------
#: What a child runs: the modules are imported (not run as ``__main__``), so this is the
#: same module object, with the same :data:`ATTACH`, that anything imported before sees.
_CHILD = "import sys; from hhook.profile.train_child import child_main; child_main(sys.argv[1])"


def run_child(spec: dict, workdir: str, timeout_s: float, on_beat=None) -> dict:
    """Start the child, watch its heartbeat (each new one also to ``on_beat``, e.g.
    :class:`hhook.profile.progress.Stages`), return its result (or why there is none)."""
    import hhook

    paths = {k: os.path.join(workdir, f"{k}.{spec['method']['name'].replace(':', '_')}")
             for k in ("spec", "result", "beat", "log")}
    spec = {**spec, "result_path": paths["result"], "beat_path": paths["beat"]}
    with open(paths["spec"], "w") as f:
        json.dump(spec, f)
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(hhook.__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    env["OMP_NUM_THREADS"] = str(spec["threads"])
    started = time.monotonic()
    with open(paths["log"], "w") as log:
        proc = subprocess.Popen([sys.executable, "-c", _CHILD, paths["spec"]],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
        last_beat, last_change, hung = None, time.monotonic(), False
        while proc.poll() is None:
            time.sleep(POLL_S)
            try:
                with open(paths["beat"]) as f:
                    beat = f.read().strip()
            except OSError:
                beat = None
            now = time.monotonic()
            if beat != last_beat:
                last_beat, last_change = beat, now
                if on_beat is not None:
                    on_beat(beat)
            elif now - last_change > (timeout_s if (beat or "").startswith("step") else max(timeout_s, STARTUP_S)):
                hung = True
                proc.kill()
                proc.wait()
                break
    wall = time.monotonic() - started
    if hung:
        waited = timeout_s if (last_beat or "").startswith("step") else max(timeout_s, STARTUP_S)
        return {"status": "hung", "message": f"no progress for {waited:g} s after {last_beat or 'start'}",
                "wall_s": wall}
    try:
        with open(paths["result"]) as f:
            result = json.load(f)
    except (OSError, ValueError):
        with open(paths["log"]) as f:
            lines = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
        code = proc.returncode
        ended = f"killed by signal {_signal_name(-code)}" if code < 0 else f"exited with status {code}"
        result = {"status": "failed", "message": f"child {ended}" + (f": {lines[-1]}" if lines else "")}
    result["wall_s"] = wall
    if result["status"] != "ok" and os.environ.get("HHOOK_DEBUG"):
        with open(paths["log"]) as f:
            sys.stderr.write(f.read())
    return result


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def verdict(results: list[dict]) -> tuple[str, str]:
    """One status and message for the row, the same on every rank."""
    statuses = [r["status"] for r in results]
    if all(s == "ok" for s in statuses):
        return "ok", ""
    if "hung" in statuses:
        ranks = [i for i, s in enumerate(statuses) if s == "hung"]
        return "hung", f"hung (timeout): {results[ranks[0]]['message']} on rank{'s' if len(ranks) > 1 else ''} " \
                       f"{','.join(map(str, ranks))}"
    failed = [(i, r) for i, r in enumerate(results) if r["status"] != "ok"]
    # A rank whose peer died reports a connection error: prefer the rank that failed on its own.
    own = [(i, r) for i, r in failed if not _peer_error(r.get("message", ""))] or failed
    i, r = own[0]
    return "failed", f"failed on rank {i}: {r.get('message', '')}"


def _peer_error(message: str) -> bool:
    text = message.lower()
    return any(w in text for w in ("connection closed", "connection reset", "broken pipe", "peer", "timed out"))


# -- the child: one rank of one method ----------------------------------------------------
def bf16_gloo_hook(process_group, bucket):
    r"""torch's ``bf16_compress_hook`` for Gloo: DDP refuses torch's own without CUDA and NCCL
    2.10+, though Gloo sums bfloat16. Same steps: cast, divide by the world size, SUM, copy back."""
    import torch
    import torch.distributed as dist

    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(group.size())

    def decompress(fut):
        return buffer.copy_(fut.value()[0])

    return dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)


def _fp16(method: dict, ddp, seed: int):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)


def _bf16(method: dict, ddp, seed: int):
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp.register_comm_hook(None, default_hooks.bf16_compress_hook if dist.get_backend() == "nccl" else bf16_gloo_hook)


def _powersgd(method: dict, ddp, seed: int):
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=method["rank"],
                                        start_powerSGD_iter=2, random_seed=seed)
    ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def _thc(method: dict, ddp, seed: int):
    import hhook

    options = {"bits": method["bits"], "seed": seed}
    for name in ("scales", "chunk_mb", "topology", "rounding"):  # hhook's defaults unless the method names one
        if method.get(name) is not None:
            options[name] = method[name]
    return hhook.register(ddp, **options)


def _nothing(method: dict, ddp, seed: int):
    """fp32: DDP's own allreduce; sbc/lgc: the baseline exchanges by itself (no_sync steps)."""


#: kind -> ``attach(method, ddp, seed)``: registers the kind's hook on ``ddp`` in the child,
#: returns the THC state or None. A kind train runs is in :data:`KINDS` and here.
ATTACH = {"fp32": _nothing, "fp16": _fp16, "bf16": _bf16, "powersgd": _powersgd, "thc": _thc,
          "sbc": _nothing, "lgc": _nothing, "diloco": _nothing}


def attach_diloco(model, ranks_per_site):
    """``(sites, trained)`` of a ``diloco`` method: the sites (:func:`hhook.diloco.find_sites`:
    nodes from the launcher, ``ci/netcluster.sh launch N --ranks-per-node K``, or ``ranks_per_site``)
    and the module the site trains, DDP over the site's ranks (the model itself for sites of one
    rank). The child builds :class:`hhook.diloco.DiLoCo` once the inner optimizer exists."""
    import hhook.diloco
    from torch.nn.parallel import DistributedDataParallel as DDP

    sites = hhook.diloco.find_sites(ranks_per_site or "auto")
    if sites.ranks_per_site == 1:
        return sites, model
    return sites, DDP(model, process_group=sites.site_group)


def diloco_sync(method: dict, trained, opt, sites, seed: int):
    """The method's :class:`hhook.diloco.DiLoCo` over ``trained`` and its inner optimizer."""
    import torch

    import hhook.diloco

    o = method["options"]
    lr = o["outer_lr"]
    return hhook.diloco.DiLoCo(
        trained, opt, sites, every=o["every"], bits=o["bits"], error_feedback=o["error_feedback"],
        fragments=o["fragments"], overlap=o["overlap"], seed=seed,
        outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=lr, momentum=0.9, nesterov=True))


#: Methods ``--parallel fsdp`` runs: plain FSDP2 (fp32 reduce), FSDP2 with a bfloat16 reduce
#: (``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``) and hhook.fsdp (agreed scales, flat).
FSDP_KINDS = ("fp32", "bf16", "thc")


def check_fsdp_method(method) -> None:
    """ValueError (one line) for a method ``--parallel fsdp`` cannot run."""
    if method.kind not in FSDP_KINDS:
        raise ValueError(f"--parallel fsdp runs {', '.join(FSDP_KINDS)} (plain FSDP2, FSDP2 with a bf16 reduce, "
                         f"hhook.fsdp), not {method.name!r}")
    if method.kind == "thc" and method.scales == "predicted":
        raise ValueError(f"{method.name}: hhook.fsdp supports agreed scales only (a reduce-scatter leaves chunk j's "
                         "sums on rank j alone, so predicted scales would need an extra round; see docs/fsdp.md)")
    if method.kind == "thc" and method.topology not in (None, "flat"):
        raise ValueError(f"{method.name}: hhook.fsdp has no two-level reduce-scatter (topology=flat only)")


def hsdp_mesh(device_type: str, ranks_per_node: int | None = None):
    """The ``(replicate, shard)`` mesh of ``--parallel hsdp``: nodes of ``ranks_per_node``
    (default ``LOCAL_WORLD_SIZE``) ranks placed node by node (torchrun, ci/netcluster.sh);
    ValueError where that leaves one node or one rank per node."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    k = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if k < 2 or world % k or world == k:
        raise ValueError(f"--parallel hsdp needs several nodes of several ranks (LOCAL_WORLD_SIZE={k}, "
                         f"world {world})")
    return init_device_mesh(device_type, (world // k, k), mesh_dim_names=("replicate", "shard"))


def attach_fsdp(method: dict, model, seed: int, device, hsdp: bool = False, ranks_per_node: int | None = None):
    """Shard ``model`` with FSDP2 (``fully_shard`` on every top-level child that holds
    parameters, then the root) with the method's reduce, on a 1-D mesh of every rank, or
    with ``hsdp`` on the nodes (:func:`hsdp_mesh`): fp32 and bf16 as native 2-D HSDP, THC
    as 1-D FSDP inside the node plus :func:`hhook.fsdp.register_hsdp` across nodes.
    Returns the THC state or None."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if hsdp:
        mesh2d = hsdp_mesh(device.type, ranks_per_node)
        mesh = mesh2d["shard"] if method["kind"] == "thc" else mesh2d
    else:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    # ag=bf16: bfloat16 parameters (all-gathered so), reduced in float32 unless the method says bf16
    params = torch.bfloat16 if "bf16" in (method.get("all_gather"), method.get("params")) else None
    # params=bf16: the whole bf16 policy (parameters and reduce), as most users set it
    reduce = torch.bfloat16 if "bf16" in (method["kind"], method.get("params")) else torch.float32 if params else None
    mp = MixedPrecisionPolicy(param_dtype=params, reduce_dtype=reduce)
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    import hhook.fsdp

    ag = method.get("all_gather")
    if method["kind"] != "thc":
        if isinstance(ag, int):
            hhook.fsdp.compress_all_gather(model, bits=ag, seed=seed)
        return None
    options = {"bits": method["bits"], "seed": seed}
    if isinstance(ag, int):
        options["all_gather"] = ag
    for name in ("chunk_mb", "rounding"):
        if method.get(name) is not None:
            options[name] = method[name]
    if hsdp:
        return hhook.fsdp.register_hsdp(model, mesh2d["replicate"].get_group(), **options)[0]
    return hhook.fsdp.register(model, **options)
