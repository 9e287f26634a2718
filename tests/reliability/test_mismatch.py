"""Ranks that disagree raise a clear error on every rank, within seconds, and no process
ends by a signal (issue "Bad input never kills a job": the handshake's rows).

One row per case, on 2 ranks over Gloo (a group timeout of :data:`PG_TIMEOUT_S`): each
rank runs the case, catches what it raises, and says what (type, message) and when
(seconds from the point where the ranks diverge). Every rank must raise the row's error
with a message naming the cause; every process must exit without a signal; ranks that
run hhook raise within :data:`FAST_S` where every rank is alive and in hhook, and within
the group's timeout where a rank never enters hhook (it cannot say so). Where a rank does
not run hhook at all, what it sees is recorded (Gloo's own error once the hhook rank has
ended) and only its clean exit is asserted.
"""

import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hhook
from tests.support.distributed import run_outcomes

PG_TIMEOUT_S = 10.0
#: A generous bound for the time to raise (the issue asks 5 s; here on 2 shared cores).
FAST_S = 5.0


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.Tanh(), torch.nn.Linear(30, 5))


def _steps(ddp, n=3):
    for _ in range(n):
        ddp(torch.randn(8, 20)).sum().backward()


# -- the cases: each returns after its exchange, or raises ----------------------------------
def case_ddp_bits(rank, start):
    ddp = DDP(_net())
    start()
    hhook.register(ddp, bits=(4, 2)[rank])
    _steps(ddp)


def case_auto_and_fixed(rank, start):
    ddp = DDP(_net())
    start()
    hhook.register(ddp, bits=("auto", 4)[rank])
    _steps(ddp)


def case_one_rank_plain_ddp(rank, start, fp16_hook=False):
    """hhook on rank 0 only; rank 1 runs DDP without a hook (or with torch's fp16 hook)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp = DDP(_net())
    start()
    if rank == 0:
        hhook.register(ddp, bits=4)
    elif fp16_hook:
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    _steps(ddp)


def case_one_rank_fp16_hook(rank, start):
    case_one_rank_plain_ddp(rank, start, fp16_hook=True)


def case_thc_allreduce_and_plain_allreduce(rank, start):
    t = torch.randn(1000)
    start()
    if rank == 0:
        hhook.thc_allreduce(t, hhook.THCState(bits=4))
    else:
        dist.all_reduce(t)


def case_checkpoint_of_other_options(rank, start):
    saved = hhook.THCState(bits=(4, 2)[rank]).state_dict()  # rank 1's checkpoint was saved with bits=2
    ddp = DDP(_net())
    state = hhook.register(ddp, bits=4)
    _steps(ddp)
    start()
    state.load_state_dict(saved)  # every rank resumes from its own file
    _steps(ddp)


def case_register_a_loaded_state_dict(rank, start):
    saved = hhook.THCState(bits=(4, 2)[rank]).state_dict()
    ddp = DDP(_net())
    start()
    hhook.register(ddp, state=saved)
    _steps(ddp)


def case_codec_versions(rank, start):
    from hhook.state import options

    if rank == 1:
        options.CODEC_VERSION += 1  # a rank of another hhook, whose decoded bits differ
    ddp = DDP(_net())
    start()
    hhook.register(ddp, bits=4)
    _steps(ddp)


def case_unequal_sizes_first_call(rank, start):
    start()
    hhook.thc_allreduce(torch.randn(1000 + 1000 * rank), hhook.THCState(bits=4))


def case_unequal_sizes_later_call(rank, start):
    state = hhook.THCState(bits=4)
    hhook.thc_allreduce(torch.randn(5000), state, key="w")
    start()
    hhook.thc_allreduce(torch.randn(5000 + 3000 * rank), state, key="w")


def case_unequal_dtypes(rank, start):
    start()
    hhook.thc_allreduce(torch.randn(1000, dtype=(torch.float32, torch.float64)[rank]), hhook.THCState(bits=4))


def case_int64(rank, start):
    start()
    hhook.thc_allreduce(torch.arange(10), hhook.THCState(bits=4))


def case_register_twice_auto(rank, start):
    ddp = DDP(_net())
    hhook.register(ddp)  # bits="auto": on one host with CPU tensors, no hook is installed
    start()
    hhook.register(ddp)


def case_register_twice_fixed(rank, start):
    ddp = DDP(_net())
    hhook.register(ddp, bits=4)
    start()
    hhook.register(ddp, bits=4)


def _fsdp_model():
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 5))
    for layer in (model[0], model[2]):
        fully_shard(layer)
    return fully_shard(model)


def _fsdp_steps(model, n=2):
    for _ in range(n):
        model(torch.randn(8, 64)).square().mean().backward()


def case_fsdp_bits(rank, start):
    import hhook.fsdp

    model = _fsdp_model()
    start()
    hhook.fsdp.register(model, bits=(4, 2)[rank])
    _fsdp_steps(model)


def case_fsdp_all_gather(rank, start):
    import hhook.fsdp

    model = _fsdp_model()
    start()
    hhook.fsdp.register(model, bits=4, all_gather=(8, 6)[rank])
    _fsdp_steps(model)


def case_fsdp_checkpoint_of_other_options(rank, start):
    import hhook.fsdp

    saved = hhook.THCState(bits=(4, 2)[rank]).state_dict()
    model = _fsdp_model()
    state = hhook.fsdp.register(model, bits=4)
    _fsdp_steps(model)
    start()
    state.load_state_dict(saved)
    _fsdp_steps(model)


# name: (case, the error on every rank that runs hhook, what its message names, how fast:
# "fast" within FAST_S, "timeout" within the group's timeout; ranks that do not run hhook)
CASES = {
    "ddp-bits": (case_ddp_bits, "ConfigMismatchError", "bits: 4 on rank 0, 2 on rank 1", "fast", ()),
    "auto-and-fixed": (case_auto_and_fixed, "ConfigMismatchError", "bits: 'auto' on rank 0, 4 on rank 1", "fast", ()),
    "one-rank-plain-ddp": (case_one_rank_plain_ddp, "ConfigMismatchError",
                           "rank 1 of this group did not reach hhook's options handshake", "timeout", (1,)),
    "one-rank-fp16-hook": (case_one_rank_fp16_hook, "ConfigMismatchError",
                           "rank 1 of this group did not reach hhook's options handshake", "timeout", (1,)),
    "thc-allreduce-and-plain": (case_thc_allreduce_and_plain_allreduce, "ConfigMismatchError",
                                "rank 1 of this group did not reach hhook's options handshake", "timeout", (1,)),
    "checkpoint-of-other-options": (case_checkpoint_of_other_options, "ConfigMismatchError",
                                    "bits: 4 on rank 0, 2 on rank 1", "fast", ()),
    "register-a-loaded-state-dict": (case_register_a_loaded_state_dict, "ConfigMismatchError",
                                     "bits: 4 on rank 0, 2 on rank 1", "fast", ()),
    "codec-versions": (case_codec_versions, "ConfigMismatchError", "codec_version: 4 on rank 0, 5 on rank 1", "fast",
                       ()),
    "unequal-sizes-first-call": (case_unequal_sizes_first_call, "ConfigMismatchError",
                                 "numel: 1000 on rank 0, 2000 on rank 1", "fast", ()),
    "unequal-sizes-later-call": (case_unequal_sizes_later_call, "ConfigMismatchError",
                                 "numel: 5000 on rank 0, 8000 on rank 1", "fast", ()),
    "unequal-dtypes": (case_unequal_dtypes, "ConfigMismatchError", "dtype: 'float32' on rank 0, 'float64' on rank 1",
                       "fast", ()),
    "int64": (case_int64, "TypeError", "float32, float16 and bfloat16 are compressed", "fast", ()),
    "register-twice-auto": (case_register_twice_auto, "RuntimeError", "can be called once per DDP model", "fast", ()),
    "register-twice-fixed": (case_register_twice_fixed, "RuntimeError", "can be called once per DDP model", "fast",
                             ()),
    "fsdp-bits": (case_fsdp_bits, "ConfigMismatchError", "bits: 4 on rank 0, 2 on rank 1", "fast", ()),
    "fsdp-all-gather": (case_fsdp_all_gather, "ConfigMismatchError", "ag_bits: 8 on rank 0, 6 on rank 1", "fast", ()),
    "fsdp-checkpoint-of-other-options": (case_fsdp_checkpoint_of_other_options, "ConfigMismatchError",
                                         "bits: 4 on rank 0, 2 on rank 1", "fast", ()),
}

#: The rows of the quick tier: the handshake's comparison, through DDP registration and a checkpoint.
QUICK = ("ddp-bits", "checkpoint-of-other-options")


def _run_case(rank, world, name):
    """What this rank raised, in its own words, and when: seconds from ``start()``, which
    each case calls after its set-up (a first DDP imports dynamo: seconds on a loaded
    host), right where the ranks diverge, after a barrier."""
    case = CASES[name][0]
    started = []

    def start():
        dist.barrier()
        started.append(time.monotonic())

    try:
        case(rank, start)
    except Exception as exc:  # noqa: BLE001 - the row's subject
        return {"type": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - started[0]}
    return {"type": None, "message": "", "seconds": time.monotonic() - started[0]}


#: The figures of the last run, for the report (``pytest -s`` prints them).
SEEN: dict = {}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.quick) if n in QUICK else n for n in CASES])
def test_a_mismatch_raises_on_every_rank_and_kills_no_process(name):
    _, error, cause, speed, outside = CASES[name]
    outcomes = run_outcomes(_run_case, 2, name, pg_timeout_s=PG_TIMEOUT_S, timeout=PG_TIMEOUT_S + 90)
    SEEN[name] = [(o["value"] or {}).get("seconds") for o in outcomes]
    print(f"\n{name}: " + " | ".join(
        f"rank {r}: {(o['value'] or {}).get('type')} after {(o['value'] or {}).get('seconds', float('nan')):.3f} s, "
        f"exit {o['exitcode']}: {' '.join(str((o['value'] or {}).get('message') or o['error']).split())[:400]}"
        for r, o in enumerate(outcomes)))
    for rank, o in enumerate(outcomes):
        assert o["exitcode"] is not None and o["exitcode"] >= 0, (rank, o)  # no process ended by a signal
        assert o["error"] is None and o["value"] is not None, (rank, o)  # the case ran to its end on every rank
        if rank in outside:  # it runs no hhook: Gloo's own error, once the hhook rank has ended
            assert o["value"]["type"] is not None, (rank, o)
            continue
        got = o["value"]
        assert got["type"] == error and cause in got["message"], (rank, got)
        limit = FAST_S if speed == "fast" else PG_TIMEOUT_S + FAST_S
        assert got["seconds"] < limit, (rank, got["seconds"], limit)
        if speed == "timeout":
            assert "stalled" not in got["message"] and "rank 0 runs hhook here and rank 1 does not" in got["message"]


def _float64_worker(rank, world):
    from tests.support.distributed import logged

    state = hhook.THCState(bits=4)
    with logged("hhook") as lines:
        outs = []
        for _ in range(3):
            t = torch.arange(6, dtype=torch.float64) * (rank + 1)
            hhook.thc_allreduce(t, state)
            outs.append(t.tolist())
    return outs, lines, state.stats()["dense_calls"]


def test_float64_is_averaged_exactly_with_one_log_line_saying_what_is_compressed():
    for o in run_outcomes(_float64_worker, 2, pg_timeout_s=PG_TIMEOUT_S):
        assert o["error"] is None and o["exitcode"] == 0, o
        outs, lines, dense = o["value"]
        assert outs == [[1.5 * i for i in range(6)]] * 3 and dense == 3
        said = [line for line in lines if "float64" in line]
        assert len(said) == 1 and "compresses dense float32, float16 and bfloat16" in said[0], lines
