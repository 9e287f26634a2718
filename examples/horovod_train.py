r"""Train a classifier on scikit-learn's bundled handwritten digits with Horovod.

The same task as examples/ddp_train.py, under horovodrun or mpirun::

    horovodrun -np 4 --gloo python examples/horovod_train.py --compression thc --bits 4
    mpirun -np 4 python examples/horovod_train.py --compression thc --bits 4

``--compression none`` and ``fp16`` are Horovod's own (op=Average); ``thc`` is
``hhook.horovod.DistributedOptimizer`` (op=Sum, integer words). Prints test accuracy
and the bytes each rank handed to Horovod's allreduces, counted at Horovod's entry
points (THC's own stats() must agree). ``--report-vnmse`` also measures, on the
gradients of every step, the error of the mean this run's compression produced and
that of the DDP hook's agreed-max scales (a blocking MAX allreduce per tensor).
"""

import argparse
import contextlib
import json
import time

import horovod.torch as hvd
import horovod.torch.optimizer as hvd_optimizer
import torch

import digits  # the shared task, beside this script
import hhook.horovod
from hhook.codec import rng
from hhook.codec import THCCodec


@contextlib.contextmanager
def counting_allreduce_bytes(counter: dict):
    """Count the bytes of every tensor the DistributedOptimizer hands to Horovod."""
    patched = [(hvd_optimizer, "allreduce_async_"), (hvd_optimizer, "grouped_allreduce_async_")]
    originals = [(mod, name, getattr(mod, name)) for mod, name in patched]

    def wrap(fn):
        def counted(tensor, *args, **kwargs):
            if counter["on"]:
                tensors = tensor if isinstance(tensor, (list, tuple)) else [tensor]
                counter["bytes"] += sum(t.nbytes for t in tensors)
            return fn(tensor, *args, **kwargs)

        return counted

    for mod, name, fn in originals:
        setattr(mod, name, wrap(fn))
    try:
        yield counter
    finally:
        for mod, name, fn in originals:
            setattr(mod, name, fn)


def agreed_max_mean(grad: torch.Tensor, codec: THCCodec, name: str, call: int) -> torch.Tensor:
    """What the DDP hook decodes for ``grad``: MAX-allreduced scales, then the codes' SUM."""
    prepared = codec.prepare(grad)
    agreed = hvd.allreduce(prepared.scales, op=hvd.Max, name=f"vnmse.max.{name}")
    words = codec.quantize(prepared, agreed, rng.stream_key(codec.seed, hvd.rank(), call))
    words = hvd.allreduce(words, op=hvd.Sum, name=f"vnmse.sum.{name}")
    return codec.decode(prepared, agreed, words, torch.empty_like(grad))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compression", choices=["none", "fp16", "thc"], default="thc")
    p.add_argument("--bits", type=int, default=4, help="THC bits per coordinate (1..8)")
    p.add_argument("--error-feedback", action="store_true", help="THC error feedback")
    p.add_argument("--headroom", type=float, default=None, help="THC: next scale / bound on the maximum over ranks of the block maxima (default: 1 up to 4 bits, 2 at 8)")
    p.add_argument("--epochs", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--report-vnmse", action="store_true", help="measure vNMSE against the DDP hook's agreed-max scales")
    p.add_argument("--json", help="rank 0 writes its results here")
    args = p.parse_args()

    hvd.init()
    torch.set_num_threads(1)
    rank, world = hvd.rank(), hvd.size()

    x_train, y_train, x_test, y_test, shard = digits.load(rank, world)

    torch.manual_seed(0)
    model = digits.make_model(args.hidden)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    sgd = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if args.compression == "thc":
        options = {} if args.headroom is None else {"headroom": args.headroom}
        opt = hhook.horovod.DistributedOptimizer(
            sgd, named_parameters=model.named_parameters(), bits=args.bits, error_feedback=args.error_feedback, **options
        )
    else:
        compression = {"none": hvd.Compression.none, "fp16": hvd.Compression.fp16}[args.compression]
        opt = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters(), compression=compression)
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    reference = THCCodec(args.bits, 1024, 0, world) if args.report_vnmse else None
    vnmse = {"this_run": [], "agreed_max": []}

    steps, counter = 0, {"bytes": 0, "on": True}
    start = time.perf_counter()
    with counting_allreduce_bytes(counter):
        for idx in digits.batches(shard, args.batch_size, args.epochs):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x_train[idx]), y_train[idx])
            if not args.report_vnmse:
                loss.backward()
                opt.step()
            else:
                # autograd.grad fires no Horovod hook: take the raw gradients, hand them
                # to the optimizer's synchronize() (which compresses and reduces them),
                # and compare both estimates with the exact mean of the same gradients.
                raw = torch.autograd.grad(loss, params)
                for p_, g_ in zip(params, raw):
                    p_.grad = g_.clone()
                opt.synchronize()
                counter["on"] = False
                err = {"this_run": 0.0, "agreed_max": 0.0}
                norm = 0.0
                for k, (name, p_, g_) in enumerate(zip(names, params, raw)):
                    mean = hvd.allreduce(g_, op=hvd.Average, name=f"vnmse.mean.{name}")
                    norm += hvd.allreduce(g_.pow(2).sum(), op=hvd.Average, name=f"vnmse.norm.{name}").item()
                    err["this_run"] += (p_.grad - mean).pow(2).sum().item()
                    est = agreed_max_mean(g_, reference, name, steps * len(params) + k)
                    err["agreed_max"] += (est - mean).pow(2).sum().item()
                if steps > 0:  # step 0 is THC's dense warm-up
                    for key in err:
                        vnmse[key].append(err[key] / norm)
                counter["on"] = True
                with opt.skip_synchronize():
                    opt.step()
            steps += 1
    elapsed = time.perf_counter() - start

    wire = counter["bytes"]
    result = digits.result_of(model, x_test, y_test, steps, loss, elapsed, wire, compression=args.compression,
                              bits=args.bits if args.compression == "thc" else None, world_size=world)
    if args.compression == "thc":
        stats = opt.thc.stats()
        result["thc_stats"] = stats
        result["error_feedback"] = args.error_feedback
        assert stats["wire_bytes"] == wire, f"THC stats ({stats['wire_bytes']}) disagree with the bytes counted ({wire})"
    if args.report_vnmse:
        result["vnmse"] = {k: sum(v) / len(v) for k, v in vnmse.items()}
    if rank == 0:
        label = args.compression + (f" ({args.bits} bits)" if args.compression == "thc" else "")
        print(digits.result_line(label, result))
        if args.report_vnmse:
            v = result["vnmse"]
            print(
                f"vNMSE (mean over steps 1..{steps - 1}): {args.compression}={v['this_run']:.3e} "
                f"agreed-max THC {args.bits} bits (DDP hook)={v['agreed_max']:.3e} "
                f"ratio={v['this_run'] / v['agreed_max']:.2f}"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
