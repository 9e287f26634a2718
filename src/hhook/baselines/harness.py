r"""``hhook-profile train`` glue for the baselines: their options and one training step.

Options (in any order, ``name=value``; the grammar is :mod:`hhook.profile.methods`)::

    sbc[:p=FRACTION][:delay=STEPS]                  (defaults p=0.01, delay=4)
    lgc[:k=FRACTION][:dense=N][:topk=N][:ae=N]      (defaults k=0.01, dense=10, topk=10, ae=10)

Both train with DDP's gradient reduction off (``ddp.no_sync()``) and do their own
exchange with stock collectives: SBC after the optimizer step every ``delay`` steps
(weight updates), LGC after ``backward()`` every step (gradients).
"""

from __future__ import annotations

KINDS = ("sbc", "lgc")
OPTIONS = {  # name: (type, default)
    "sbc": {"p": (float, 0.01), "delay": (int, 4)},
    "lgc": {"k": (float, 0.01), "dense": (int, 10), "topk": (int, 10), "ae": (int, 10)},
}
USAGE = {"sbc": "sbc[:p=FRACTION][:delay=STEPS]", "lgc": "lgc[:k=FRACTION][:dense=N][:topk=N][:ae=N]"}


def check(kind: str, values: dict) -> None:
    """The checks of one baseline's options (``values``: every option of ``OPTIONS[kind]``,
    converted); ValueError saying what is wrong."""
    if kind == "sbc":
        if not 0 < values["p"] < 1:
            raise ValueError("p must be in (0, 1)")
        if values["delay"] < 1:
            raise ValueError("delay must be at least 1")
    else:
        if not 0 < values["k"] <= 1:
            raise ValueError("k must be a fraction in (0, 1]")
        if min(values["dense"], values["topk"]) < 0 or values["ae"] < 1:
            raise ValueError("dense and topk must be >= 0, ae >= 1")


class Runner:
    """One step of training with a baseline: forward, backward, exchange, optimizer step."""

    def __init__(self, kind: str, options: dict, ddp, optimizer, seed: int = 0):
        import torch.distributed as dist

        if dist.get_backend() != "gloo":  # both exchange CPU tensors (numpy bit packing)
            raise ValueError(f"{kind} runs on the gloo backend only (got {dist.get_backend()})")
        self.kind, self.ddp, self.opt = kind, ddp, optimizer
        if kind == "sbc":
            from .sbc import SBC

            self.method = SBC(ddp.parameters(), p=options["p"], delay=options["delay"])
        else:
            from .lgc import LGC  # benchmark baseline only: see the patent notice there

            self.method = LGC(ddp.parameters(), k=options["k"], dense_steps=options["dense"],
                              topk_steps=options["topk"], ae_steps=options["ae"], seed=seed)
        self.phases: list[str] = []

    def step(self, loss_fn):
        """``loss_fn()`` computes the loss through ``ddp``; returns the loss."""
        with self.ddp.no_sync():  # every step is local for DDP: the baseline exchanges itself
            self.opt.zero_grad()
            loss = loss_fn()
            loss.backward()
        if self.kind == "lgc":
            self.phases.append(self.method.phase())
            self.method.reduce()
            self.opt.step()
        else:
            self.opt.step()
            self.method.after_step()
        return loss

    @property
    def step_bytes(self) -> list[int]:
        return self.method.step_bytes

    def stats(self) -> dict:
        st = self.method.stats()
        if self.phases:
            st["phase_per_step"] = self.phases
        return st


def phase_line(row: dict) -> str | None:
    """The footer line ``hhook-profile train`` prints for an LGC row (rank 0's stats): steps per
    phase (dense warm-up, top-k, autoencoder training, latent), the autoencoder's training time
    inside those steps and its held-out error; None for any other row."""
    stats = row.get("baseline_stats") or [None]
    st = stats[0]
    if row.get("kind") != "lgc" or row.get("status") != "ok" or not st or "phase_steps" not in st:
        return None
    n = st["phase_steps"]
    err = st.get("ae_rel_error")
    return (f"# {row['method']}: steps per phase: dense warm-up {n['dense']}, top-k {n['topk']}, autoencoder "
            f"training {n['ae']} ({st.get('ae_train_s', 0.0):.2f} s inside the steps, held-out error "
            f"{'-' if err is None else f'{err:.2f}'}), latent {n['compressed']}")
