"""One rank of a torchft replica group (of one rank, or of ``--group-size`` with DDP inside) for tests/integrations/test_torchft.py: a Manager on
Gloo joined to the test's Lighthouse, torchft's DiLoCo over a small regression MLP, its
outer exchange through hhook.torchft (``--exchange thc``) or torchft's own (``fp32``).

    python -m tests.support.torchft_replica --replica 0 --lighthouse http://... --out f.jsonl

Writes one JSON line per event to ``--out`` (flushed): ``start``; ``commit`` after every
outer step that committed (manager step, wall time, sha256 of the parameters' bytes, the
mean loss of the inner steps since the last commit, the THC byte counters, the quorum's
size and hhook's rebuild times; with ``--fragments``, each fragment's sha256 too); ``done``. ``--hold-at STEP`` makes the replica sleep (``--fail-at STEP``: raise, once) inside
its first THC exchange at that manager step or later, after the exchange's MAX and before its SUM (a
drill's window to kill it mid-exchange).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist


def digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=8, help="manager steps (outer syncs) to commit")
    ap.add_argument("--sync-every", type=int, default=10)
    ap.add_argument("--exchange", choices=("thc", "fp32"), default="thc")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--inner-sleep", type=float, default=0.02, help="seconds per inner step (time between syncs)")
    ap.add_argument("--min-replicas", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--hold-at", type=int, default=-1)
    ap.add_argument("--fail-at", type=int, default=-1, help="raise inside the THC exchange at this manager step")
    ap.add_argument("--pause-at", type=int, default=-1,
                    help="between syncs at this manager step, wait until --pause-file exists (a restart to rejoin)")
    ap.add_argument("--pause-file", default="")
    ap.add_argument("--group-size", type=int, default=1, help="ranks of this replica group (DDP among them)")
    ap.add_argument("--group-rank", type=int, default=0)
    ap.add_argument("--store-port", type=int, default=0, help="the replica group's store (its rank 0 hosts it)")
    ap.add_argument("--fragments", type=int, default=1, help="streaming DiLoCo: the model in this many fragments")
    ap.add_argument("--sync-delay", type=int, default=0, help="streaming DiLoCo's fragment_sync_delay (overlap)")
    args = ap.parse_args()

    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    import hhook.torchft

    out = open(args.out, "a", buffering=1)

    def say(event: str, **fields) -> None:
        out.write(json.dumps({"event": event, "t": time.time(), "pid": os.getpid(), **fields}) + "\n")

    say("start")
    store = dist.TCPStore("127.0.0.1", args.store_port, is_master=args.group_rank == 0, wait_for_workers=False)
    torch.manual_seed(0)  # every replica starts from the same model
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 1))
    forward = model
    if args.group_size > 1:  # the replica group's own data parallelism (HSDP's inner dimension), as torchtitan
        dist.init_process_group("gloo", store=dist.PrefixStore("inner/", store), rank=args.group_rank,
                                world_size=args.group_size)
        forward = torch.nn.parallel.DistributedDataParallel(model)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    fragments = [model] if args.fragments == 1 else [model[:2], model[2:]][:args.fragments]
    outer = [torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True) for f in fragments]

    def state_dict():
        return {"model": model.state_dict(), "inner": inner.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["inner"])

    timeout = datetime.timedelta(seconds=args.timeout)
    manager = Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict, state_dict=state_dict,
                      min_replica_size=args.min_replicas, use_async_quorum=False, timeout=timeout,
                      quorum_timeout=datetime.timedelta(seconds=60), connect_timeout=timeout, rank=args.group_rank,
                      world_size=args.group_size,
                      store_addr="127.0.0.1", store_port=store.port, lighthouse_addr=args.lighthouse,
                      replica_id=f"replica_{args.replica}", init_sync=False)
    thc = hhook.torchft.enable(manager, bits=args.bits) if args.exchange == "thc" else None
    if thc is not None and max(args.hold_at, args.fail_at) >= 0:  # inside the THC exchange: after its MAX, before its SUM
        import hhook.schedule.flat as flat

        marked, failed = flat._marked, []

        def held(words, changed):
            if 0 <= args.hold_at <= manager.current_step():
                say("holding", step=manager.current_step())
                time.sleep(3600)  # on a Gloo thread, in the MAX's continuation: the peers wait in their SUM
            if 0 <= args.fail_at <= manager.current_step() and not failed:
                failed.append(True)
                say("failing", step=manager.current_step())
                raise RuntimeError("injected: this replica's exchange failed")  # it sends no SUM
            return marked(words, changed)

        flat._marked = held

    truth = torch.Generator().manual_seed(1234)
    w1, w2 = torch.randn(64, 16, generator=truth), torch.randn(16, generator=truth)
    data = torch.Generator().manual_seed(1000 + 10 * args.replica + args.group_rank)
    losses, last_step = [], manager.current_step()
    say("ready")  # the manager is built: the first step asks for a quorum
    with DiLoCo(manager, fragments, inner, outer, sync_every=args.sync_every, should_quantize=True,
                use_bucketization=True, fragment_sync_delay=args.sync_delay):
        while manager.current_step() < args.steps:
            if 0 <= args.pause_at <= manager.current_step() and not os.path.exists(args.pause_file):
                time.sleep(0.05)  # between syncs: the Lighthouse forms no quorum without this replica meanwhile
                continue
            x = torch.randn(32, 64, generator=data)
            y = torch.tanh(x @ w1) @ w2
            loss = torch.nn.functional.mse_loss(forward(x).squeeze(-1), y)
            inner.zero_grad()
            loss.backward()
            losses.append(loss.item())
            inner.step()  # DiLoCo's hook syncs every sync_every inner steps
            time.sleep(args.inner_sleep)
            step = manager.current_step()
            if step != last_step:
                stats = thc.state.stats() if thc is not None else {}
                say("commit", step=step, digest=digest(model), fragments=[digest(f) for f in fragments],
                    loss=sum(losses) / len(losses),
                    participants=manager.num_participants(), dense=stats.get("dense_bytes", 0),
                    wire=stats.get("wire_bytes", 0), calls=stats.get("compressed_calls", 0),
                    numel=sum(p.numel() for p in model.parameters()),
                    rebuilds=list(thc.rebuilds) if thc is not None else [])
                losses, last_step = [], step
    say("done")
    out.close()
    manager.shutdown(wait=False)
    os._exit(0)  # torchft's threads (quorum, checkpoint server) need not be joined


if __name__ == "__main__":
    main()
