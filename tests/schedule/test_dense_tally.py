"""The count of ranks that loaded a checkpoint, carried by a dense exchange
(hhook.schedule.dense.tallied_allreduce, read by hhook.schedule.load_check): a marking rank
sends zeros and MARK in the last element; the others' exchange is the plain one, in place.
The count is exact whatever the others' gradients (heterogeneous, zero), an unmarked
exchange gives the plain exchange's bits, and a rank's inf or NaN, or a sum worth more
marks than there are ranks, reads as no mark (the loading rank then asks again at the
next exchange), never as a wrong count."""

import pytest
import torch

from hhook.schedule.dense import MARK, cast_allreduce, marks, plain_allreduce, tallied_allreduce
from hhook.state import THCState
from tests.support.distributed import run_world

WORLD = 3
#: The ranks that mark, per case.
MARKING = [(), (1,), (0, 2), (0, 1, 2)]


def _tensor(rank, dtype, special=None):
    torch.manual_seed(rank)
    x = (torch.randn(4099) * (10 if rank == 2 else 1) * (0 if rank == 1 else 1)).to(dtype)  # heterogeneous, a zero
    if special is not None and rank == 0:
        x[-1] = special
    return x


def _worker(rank, world, dtype, cast):
    state = THCState(bits=4)
    ctx = state.context(device=torch.device("cpu"))
    out = []
    for special in (None, float("inf"), float("nan"), 1e32):  # 1e32 / 3 ranks: 26 marks, more than the ranks
        for marking in MARKING:
            x = _tensor(rank, dtype, special)
            kept = x.clone()
            seen = []

            def check(count):
                seen.append(count)
                if count:
                    raise RuntimeError("marked")

            fut = tallied_allreduce(ctx, x, int(rank in marking), check, cast)
            try:
                fut.wait()
                raised = False
            except Exception:  # noqa: BLE001 - the subject: a count raises where check raises
                raised = True
            if rank in marking and raised:  # (a sum with no mark read is every rank's result)
                assert torch.equal(torch.nan_to_num(x), torch.nan_to_num(kept)), (special, marking)  # untouched
            out.append((special, marking, seen, raised))
            if not marking:  # the plain exchange's bits
                y = _tensor(rank, dtype, special)
                want = (cast_allreduce(ctx, y, cast) if cast is not None else plain_allreduce(y, None, world)).wait()
                out.append(("bits", special, torch.equal(torch.nan_to_num(x), torch.nan_to_num(want))))
    return out


@pytest.mark.parametrize("dtype, cast", [(torch.float32, None), (torch.float32, torch.bfloat16),
                                         (torch.float16, None), (torch.float64, None)],
                         ids=["fp32", "bf16 cast", "fp16 (one element more)", "fp64"])
def test_the_count_rides_in_the_exchange_exactly_and_a_non_finite_sum_counts_none(dtype, cast):
    for results in run_world(_worker, WORLD, dtype, cast, timeout=180):
        for item in results:
            if item[0] == "bits":
                assert item[2], item
                continue
            special, marking, seen, raised = item
            # rank 0's inf, NaN or huge value, sent in the element that carries the marks (not
            # fp16's, which has an element of its own): no mark is read
            sent = special is not None and 0 not in marking and dtype != torch.float16
            want = 0 if sent else len(marking)
            assert seen == [want] and raised == bool(want), (dtype, cast, special, marking, seen)


def test_marks_reads_only_whole_marks():
    assert marks(3 * MARK + 1e20) == 3 and marks(-0.0) == 0 and marks(1e29) == 0
    assert marks(float("inf")) == 0 and marks(float("nan")) == 0
