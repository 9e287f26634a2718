r"""Learned Gradient Compression, ring-allreduce variant (LGC-RAR), after Abrahamyan,
Chen, Bekoulis, Deligiannis, arXiv 2103.08870.

.. warning:: **Patent notice.** LGC is patented (WO2021245072A1 / EP3920097 /
   US20230222354A1, imec and VUB). This module is a *benchmark baseline only*, so that
   users can measure THC against it in ``hhook-profile train``. It is not exported from
   ``hhook`` nor from ``hhook.baselines``, is never selected by default, and must not be
   adopted for production training without checking the patent's status and terms.

There is no public LGC-RAR code; this is written from the paper and the issue's notes.

Phases (deterministic in the step count, so every rank agrees; ``stats()['phase']``):

``dense`` (``dense_steps``)
    Plain dense allreduce of the gradients, averaged.
``topk`` (``topk_steps``)
    Top-k sparsification with error feedback and a **common mask**: the leader (rank
    ``step % world``, rotating) picks the ``k`` largest-magnitude entries of its
    accumulated gradient and broadcasts their indices; every rank sends its values at
    those indices. The exact sum is formed by an ``all_gather`` of the ``k`` values,
    and the gathered per-rank vectors are kept as training data for the autoencoder.
``ae`` (``ae_steps``)
    As ``topk``, and rank 0 also trains the autoencoder for ``ae_iters`` Adam
    iterations per step on the collected vectors; the training time is inside the
    step (it is charged to the step time). After the last ``ae`` step rank 0
    broadcasts the autoencoder's weights (bytes counted) so every rank holds the same.
``compressed``
    Common top-k mask as above; every rank encodes its ``k`` values to a latent of
    about ``k / 4`` floats, the latents are **summed by a stock** ``all_reduce``, and
    every rank decodes the sum once: ``Dec(sum_i Enc(v_i)) ~ sum_i v_i``.

Autoencoder (the one public port's shapes): 1-D convolutions, encoder 1->64->128->256->64
channels (kernel 3, stride 2, LeakyReLU) then 64->4 (kernel 1), so the latent is
``4 * L / 16 = L / 4`` for ``L`` values (``k`` padded to a multiple of 16); decoder the
mirror with transposed convolutions. Loss ``0.5 * reconstruction + 0.5 * similarity``:
``mse(Dec(sum_i Enc(v_i)), sum_i v_i)`` plus the mean squared distance of each rank's
latent from the ranks' mean latent.

Choices where the paper is unclear (and why):

* Training data for the RAR decoder must contain every rank's vector (to learn
  ``Dec(sum Enc) ~ sum``), so the ``topk``/``ae`` phases use an ``all_gather`` of the
  ``k`` values rather than an allreduce; it costs ``world`` times more during warm-up.
* Scale: gradients are tiny and vary over training, so values are divided by a common
  scale, the maximum magnitude over ranks (an ``all_reduce(MAX)`` of one float), before
  encoding and multiplied back after decoding; a common scale keeps the sum linear.
* Error feedback: everything off the mask stays in a per-rank residual (as in top-k
  with memory); the autoencoder's reconstruction error is not fed back, since the
  decoded result is a sum and no rank knows its own share of the error.
* The autoencoder is trained once (``ae`` phase, ``ae_iters`` Adam iterations per step
  on a random collected step) and then frozen; the leader rotates so that no one rank's
  gradients decide the mask. ``stats()['ae_rel_error']`` is the relative error of the
  decoded sum on the newest collected step before it was trained on (held out).
* The mask's indices are sorted by position, so neighbouring inputs of the convolutions
  are neighbouring parameters: on the MLP task the held-out error after 200 iterations
  was ~0.95 with the values in magnitude order and ~0.6 sorted by position.
* ``k`` is a fraction of all parameters (default 1 %), taken over the flattened model.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

PATENT_NOTICE = ("LGC is patented (WO2021245072A1 / EP3920097 / US20230222354A1, imec and VUB): "
                 "benchmark baseline only, not for adoption")
PHASES = ("dense", "topk", "ae", "compressed")


class Autoencoder(nn.Module):
    """1-D convolutional autoencoder: latent ``4 x L/16`` for input ``1 x L`` (L % 16 == 0)."""

    def __init__(self):
        super().__init__()
        act = lambda: nn.LeakyReLU(0.2)  # noqa: E731
        chans = (1, 64, 128, 256, 64)
        enc: list[nn.Module] = []
        for a, b in zip(chans, chans[1:]):
            enc += [nn.Conv1d(a, b, 3, stride=2, padding=1), act()]
        enc.append(nn.Conv1d(64, 4, 1))
        self.encoder = nn.Sequential(*enc)
        dec: list[nn.Module] = [nn.ConvTranspose1d(4, 64, 1), act()]
        back = chans[::-1]  # 64, 256, 128, 64, 1
        for i, (a, b) in enumerate(zip(back, back[1:])):
            dec.append(nn.ConvTranspose1d(a, b, 3, stride=2, padding=1, output_padding=1))
            if i < len(back) - 2:
                dec.append(act())
        self.decoder = nn.Sequential(*dec)

    def loss(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[world, L]`` rows of one step. 0.5 reconstruction of the sum + 0.5 similarity."""
        z = self.encoder(x.unsqueeze(1))
        rec = self.decoder(z.sum(0, keepdim=True)).squeeze(1)
        target = x.sum(0, keepdim=True)
        reconstruction = torch.mean((rec - target) ** 2)
        similarity = torch.mean((z - z.mean(0, keepdim=True)) ** 2)
        return 0.5 * reconstruction + 0.5 * similarity


class LGC:
    """LGC-RAR over ``params``; call :meth:`reduce` after ``backward()`` (under
    ``ddp.no_sync()``): it replaces every parameter's ``.grad`` with the averaged
    (dense, sparse or decoded) gradient. See the module docstring (and its patent notice)."""

    def __init__(self, params, k: float = 0.01, dense_steps: int = 10, topk_steps: int = 10, ae_steps: int = 10,
                 ae_iters: int = 20, ae_lr: float = 1e-3, buffer: int = 64, seed: int = 0, group=None):
        if not 0 < k <= 1:
            raise ValueError(f"LGC: k must be a fraction in (0, 1], got {k}")
        for name, v in (("dense_steps", dense_steps), ("topk_steps", topk_steps), ("ae_steps", ae_steps)):
            if int(v) != v or v < 0:
                raise ValueError(f"LGC: {name} must be an integer >= 0, got {v}")
        if ae_steps < 1:
            raise ValueError("LGC: ae_steps must be at least 1 (the autoencoder must be trained)")
        self.params = [q for q in params if q.requires_grad]
        self.numel = sum(q.numel() for q in self.params)
        self.k = max(1, min(self.numel, math.ceil(k * self.numel)))
        self.fraction = k
        self.length = 16 * math.ceil(self.k / 16)
        self.bounds = (dense_steps, dense_steps + topk_steps, dense_steps + topk_steps + ae_steps)
        self.ae_iters, self.buffer, self.group = ae_iters, buffer, group
        torch.manual_seed(seed)
        self.ae = Autoencoder()
        self.opt = torch.optim.Adam(self.ae.parameters(), lr=ae_lr)
        self.samples: list[torch.Tensor] = []
        self.residual = torch.zeros(self.numel)
        self.steps = 0
        self.step_bytes: list[int] = []
        self.phase_steps = {p: 0 for p in PHASES}
        self.ae_loss: float | None = None
        self.ae_train_s = 0.0
        self.ae_rel_error: float | None = None  # ||Dec(sum Enc v_i) - sum v_i|| / ||sum v_i|| on an unseen step (rank 0)
        self.last_error: float | None = None  # relative error of the decoded sum (compressed phase, if measured)

    def phase(self, step: int | None = None) -> str:
        s = self.steps if step is None else step
        return next((p for p, b in zip(PHASES, self.bounds) if s < b), "compressed")

    def _grad(self) -> torch.Tensor:
        return torch.cat([(q.grad if q.grad is not None else torch.zeros_like(q)).reshape(-1).float().cpu()
                          for q in self.params])

    def _set_grad(self, flat: torch.Tensor) -> None:
        off = 0
        for q in self.params:
            n = q.numel()
            g = flat[off: off + n].view_as(q).to(q.device, q.dtype)
            if q.grad is None:
                q.grad = g.clone()
            else:
                q.grad.copy_(g)
            off += n

    @torch.no_grad()
    def _mask(self, acc: torch.Tensor) -> tuple[torch.Tensor, int]:
        world = dist.get_world_size(self.group)
        leader = self.steps % world
        idx = torch.empty(self.k, dtype=torch.int32)
        if dist.get_rank(self.group) == leader:
            # sorted by position: neighbouring values are neighbouring parameters, which the
            # convolutions can exploit (in magnitude order the held-out error stayed ~0.95, sorted ~0.6)
            idx.copy_(torch.sort(torch.topk(acc.abs(), self.k, sorted=False).indices).values.to(torch.int32))
        dist.broadcast(idx, src=dist.get_global_rank(self.group, leader) if self.group is not None else leader,
                       group=self.group)
        return idx.long(), idx.nbytes

    def reduce(self) -> int:
        """Average the gradients by this step's phase; returns the bytes handed to collectives."""
        phase = self.phase()
        world = dist.get_world_size(self.group)
        g = self._grad()
        sent = 0
        if phase == "dense":
            dist.all_reduce(g, group=self.group)
            sent += g.nbytes
            out = g / world
        else:
            acc = self.residual + g
            idx, nb = self._mask(acc)
            sent += nb
            v = acc[idx]
            self.residual = acc
            self.residual[idx] = 0
            out = torch.zeros(self.numel)
            if phase in ("topk", "ae"):
                rows = [torch.empty_like(v) for _ in range(world)]
                dist.all_gather(rows, v, group=self.group)
                sent += v.nbytes
                stacked = torch.stack(rows)
                out[idx] = stacked.sum(0) / world
                self._collect(stacked)
                if phase == "ae":
                    sent += self._train_ae()
            else:
                out[idx] = self._compressed_sum(v) / world
                sent += self._sent_compressed
        self._set_grad(out)
        self.phase_steps[phase] += 1
        self.steps += 1
        self.step_bytes.append(sent)
        return sent

    def _pad(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, self.length - x.shape[-1]))

    def _collect(self, stacked: torch.Tensor) -> None:
        if dist.get_rank(self.group) != 0:
            return
        scale = stacked.abs().max().clamp_min(1e-30)
        self.samples.append(self._pad(stacked / scale))
        del self.samples[: -self.buffer]

    def _train_ae(self) -> int:
        """``ae_iters`` Adam iterations on rank 0; after the last ``ae`` step, broadcast."""
        import time

        t0 = time.perf_counter()
        if dist.get_rank(self.group) == 0:
            gen = torch.Generator().manual_seed(self.steps)
            with torch.no_grad():  # held out: the newest sample, before training on it
                x = self.samples[-1]
                rec = self.ae.decoder(self.ae.encoder(x.unsqueeze(1)).sum(0, keepdim=True)).view(-1)
                target = x.sum(0)
                self.ae_rel_error = ((rec - target).norm() / target.norm().clamp_min(1e-30)).item()
            with torch.enable_grad():
                for _ in range(self.ae_iters):
                    x = self.samples[int(torch.randint(len(self.samples), (1,), generator=gen))]
                    self.opt.zero_grad()
                    loss = self.ae.loss(x)
                    loss.backward()
                    self.opt.step()
                    self.ae_loss = loss.item()
        sent = 0
        if self.steps + 1 == self.bounds[2]:  # last ae step: everyone gets rank 0's autoencoder
            src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
            for t in self.ae.state_dict().values():
                dist.broadcast(t, src=src, group=self.group)
                sent += t.nbytes
            self.samples.clear()
        self.ae_train_s += time.perf_counter() - t0
        return sent

    @torch.no_grad()
    def _compressed_sum(self, v: torch.Tensor) -> torch.Tensor:
        scale = v.abs().max().reshape(1).clamp_min(1e-30)
        dist.all_reduce(scale, op=dist.ReduceOp.MAX, group=self.group)
        z = self.ae.encoder(self._pad(v / scale).view(1, 1, -1))
        dist.all_reduce(z, group=self.group)
        self._sent_compressed = scale.nbytes + z.nbytes
        self.latent_numel = z.numel()
        return self.ae.decoder(z).view(-1)[: self.k] * scale

    def stats(self) -> dict:
        return {"method": "lgc", "phase": self.phase(), "steps": self.steps, "phase_steps": dict(self.phase_steps),
                "k": self.k, "latent_numel": 4 * self.length // 16, "ae_loss": self.ae_loss, "ae_rel_error": self.ae_rel_error,
                "ae_train_s": self.ae_train_s, "patent": PATENT_NOTICE}
