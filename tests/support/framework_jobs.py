"""Training jobs through real frameworks, each with hhook's one line, run by
tests/integrations/test_frameworks.py under torchrun (Ray: its own workers) on CPU with Gloo.

    python -m torch.distributed.run --nproc-per-node 2 tests/support/framework_jobs.py FRAMEWORK OUT [options] \
        [--then OUT [options]]...

Each ``--then`` starts another run in the same processes, after the one before ended (one
launch pays torchrun's, the interpreter's and the framework's start-up once): fresh
framework objects, model, optimizer and hook state, the default process group reused, the
global random state the launch began with. Every rank writes ``OUT/rank{R}.pt``: the hook's ``stats()`` (None without hhook), the
final loss on the whole data set and the final parameters (Ray: under ``OUT/thc`` and
``OUT/plain``, with and without hhook, one after the other in one Ray worker group). ``--stop-at K`` saves a
checkpoint through the framework's own mechanism after K epochs and stops; ``--resume``
continues from it (Transformers: ``--resume-from DIR``, a checkpoint folder anywhere). Rank 1's loss is weighted 10x (heterogeneous gradients).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(_ROOT, "src"), _ROOT]  # src layout: the package, and tests/

import hhook  # noqa: E402
from tests.support.ready_order import ReadyOrderMLP  # noqa: E402

SAMPLES, BATCH, HIDDEN, LR = 640, 16, 384, 0.01  # 20 steps per epoch at 2 ranks; 7.7k parameters


def dataset():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(1)
    return torch.utils.data.TensorDataset(x, y)


def weight() -> float:
    return 10.0 if dist.is_initialized() and dist.get_rank() == 1 else 1.0


def full_loss(model) -> float:
    x, y = dataset().tensors
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(model(x), y).item()


def write(out, model, state):
    rank = dist.get_rank() if dist.is_initialized() else 0
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.save({"stats": state.stats() if state is not None else None, "loss": full_loss(model), "params": params},
               os.path.join(out, f"rank{rank}.pt"))


def options(args) -> dict:
    return {"bits": args.bits, "scales": args.scales, "error_feedback": args.error_feedback}


# -- Lightning ------------------------------------------------------------------
def lightning(args):
    import lightning.pytorch as pl

    import hhook.lightning

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = ReadyOrderMLP(hidden=HIDDEN)

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.cross_entropy(self.net(x), y) * weight()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)

    if args.via == "fabric":
        return fabric(args)
    callbacks = [hhook.lightning.THCCallback(**options(args))] if args.hhook and args.via == "callback" else []
    module = Module()
    strategy = "ddp"
    if args.via == "strategy":  # Lightning's own arguments: its hook runs on CUDA devices only
        strategy = pl.strategies.DDPStrategy(ddp_comm_state=hhook.THCState(**options(args)), ddp_comm_hook=hhook.thc_hook)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=args.stop_at or args.epochs,
                         callbacks=callbacks, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=BATCH)
    ckpt = os.path.join(args.ckpt, "lightning.ckpt")
    trainer.fit(module, loader, ckpt_path=ckpt if args.resume else None)
    if args.stop_at:
        trainer.save_checkpoint(ckpt)
    write(args.out, module.net, callbacks[0].state if callbacks else None)


def fabric(args):
    import lightning as L

    import hhook.lightning

    fab = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fab.launch()
    net = ReadyOrderMLP(hidden=HIDDEN)
    model, opt = fab.setup(net, torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9))
    state = hhook.lightning.register(model, **options(args)) if args.hhook else None
    loader = fab.setup_dataloaders(torch.utils.data.DataLoader(dataset(), batch_size=BATCH))
    ckpt = os.path.join(args.ckpt, "fabric.ckpt")
    # every rank's hook state (fabric.save writes on rank 0 only)
    saved = {"model": model, "opt": opt, **({"hhook": hhook.lightning.every_rank(state)} if state else {})}
    first = 0
    if args.resume:
        fab.load(ckpt, saved)
        first = args.stop_at_resumed
    for _epoch in range(first, args.stop_at or args.epochs):
        for x, y in loader:
            opt.zero_grad()
            fab.backward(torch.nn.functional.cross_entropy(model(x), y) * weight())
            opt.step()
    if args.stop_at:
        fab.save(ckpt, saved)
    write(args.out, net, state)


# -- Accelerate -----------------------------------------------------------------
def accelerate(args):
    from accelerate import Accelerator

    import hhook.accelerate

    accelerator = Accelerator(cpu=True)
    model = ReadyOrderMLP(hidden=HIDDEN)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=BATCH)
    # --compile: the model compiled before prepare wraps it in DDP (Accelerate's own
    # dynamo_backend option compiles the wrapped model the same way)
    ddp, opt, loader = accelerator.prepare(torch.compile(model) if args.compile else model, opt, loader)
    state = hhook.accelerate.register(accelerator, ddp, **options(args)) if args.hhook else None
    ckpt = os.path.join(args.ckpt, "accelerate")
    first = 0
    if args.resume:
        accelerator.load_state(ckpt)
        first = args.stop_at_resumed
    for _epoch in range(first, args.stop_at or args.epochs):
        for x, y in loader:
            opt.zero_grad()
            accelerator.backward(torch.nn.functional.cross_entropy(ddp(x), y) * weight())
            opt.step()
    if args.stop_at:
        accelerator.save_state(ckpt)
    write(args.out, model, state)


# -- Transformers Trainer -------------------------------------------------------
def transformers(args):
    from transformers import Trainer, TrainingArguments

    import hhook.transformers

    class Classifier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = ReadyOrderMLP(hidden=HIDDEN)

        def forward(self, x, labels=None):
            logits = self.net(x)
            return {"loss": torch.nn.functional.cross_entropy(logits, labels) * weight(), "logits": logits}

    class Rows(torch.utils.data.Dataset):
        def __init__(self):
            self.x, self.y = dataset().tensors

        def __len__(self):
            return SAMPLES

        def __getitem__(self, i):
            return {"x": self.x[i], "labels": self.y[i]}

    model = Classifier()
    training = TrainingArguments(
        output_dir=args.ckpt, per_device_train_batch_size=BATCH, num_train_epochs=args.epochs, learning_rate=LR,
        optim="sgd", lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=0, use_cpu=True,
        report_to=[], logging_strategy="no", save_strategy="steps" if args.stop_at else "no",
        save_steps=args.stop_at * SAMPLES // (2 * BATCH) if args.stop_at else 500, save_only_model=False,
        dataloader_drop_last=True, disable_tqdm=True, remove_unused_columns=False, seed=0, ddp_backend="gloo",
        max_steps=(args.stop_at or args.epochs) * SAMPLES // (2 * BATCH),
    )
    trainer = Trainer(model=model, args=training, train_dataset=Rows())
    state = hhook.transformers.register(trainer, **options(args)) if args.hhook else None
    trainer.train(resume_from_checkpoint=args.resume_from or (True if args.resume else None))
    write(args.out, model.net, state)


# -- Ray Train ------------------------------------------------------------------
def ray(args):
    import ray as ray_
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    def loop(config):
        from ray.train.torch import prepare_model

        sys.path[:0] = [os.path.join(config["root"], "src"), config["root"]]
        from tests.support import framework_jobs as jobs

        start = torch.get_rng_state()
        for hooked in (True, False):  # one worker group for both runs: its start-up is the slow part
            torch.set_rng_state(start)  # the same initial model in both
            model = ReadyOrderMLP(hidden=HIDDEN)
            ddp = prepare_model(model)
            state = hhook.register(ddp, **config["options"]) if hooked else None
            opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
            x, y = jobs.dataset().tensors
            rank, world = dist.get_rank(), dist.get_world_size()
            for _epoch in range(config["epochs"]):
                for first in range(rank * BATCH, SAMPLES, world * BATCH):
                    opt.zero_grad()
                    loss = torch.nn.functional.cross_entropy(ddp(x[first:first + BATCH]), y[first:first + BATCH])
                    (loss * jobs.weight()).backward()
                    opt.step()
            jobs.write(os.path.join(config["out"], "thc" if hooked else "plain"), model, state)

    ray_.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for run in ("thc", "plain"):
        os.makedirs(os.path.join(args.out, run), exist_ok=True)
    TorchTrainer(loop, train_loop_config={"root": root, "options": options(args), "epochs": args.epochs,
                                          "out": args.out},
                 scaling_config=ScalingConfig(num_workers=2, use_gpu=False)).fit()
    ray_.shutdown()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("framework", choices=["lightning", "accelerate", "transformers", "ray"])
    p.add_argument("out")
    p.add_argument("--ckpt", default=None)
    p.add_argument("--no-hhook", dest="hhook", action="store_false")
    p.add_argument("--via", default="callback", choices=["callback", "strategy", "fabric"], help="Lightning only")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--scales", default="agreed")
    p.add_argument("--error-feedback", action="store_true")
    p.add_argument("--resume-from", default=None, help="Transformers only: the checkpoint folder to resume from")
    p.add_argument("--compile", action="store_true", help="Accelerate only: torch.compile the model")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--stop-at", type=int, default=0, help="save a checkpoint after this many epochs and stop")
    p.add_argument("--resume", type=int, default=0, dest="stop_at_resumed",
                   help="resume from the checkpoint saved after this many epochs")
    return p


def runs(argv: list[str]) -> list[argparse.Namespace]:
    """``FRAMEWORK OUT [options] [--then OUT [options]]...``: one namespace per run."""
    framework, rest = argv[0], argv[1:]
    segments, cut = [], 0
    for i, word in enumerate(rest + ["--then"]):
        if word == "--then":
            segments.append(rest[cut:i])
            cut = i + 1
    parsed = []
    for segment in segments:
        args = parser().parse_args([framework, *segment])
        args.resume = bool(args.stop_at_resumed)
        args.ckpt = args.ckpt or args.out
        parsed.append(args)
    return parsed


def main():
    torch.set_num_threads(1)
    start = torch.get_rng_state()
    for args in runs(sys.argv[1:]):
        os.makedirs(args.out, exist_ok=True)
        torch.set_rng_state(start)  # each run starts as it would in a process of its own
        globals()[args.framework](args)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # every rank's files written before the next run reads them, as at a process's end
    if dist.is_available() and dist.is_initialized():
        # A Gloo group left to static destruction aborts the process now and then ("terminate
        # called without an active exception", plain DDP too): end it as a program should.
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
