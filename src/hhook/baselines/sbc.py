r"""Sparse Binary Compression (SBC), Sattler, Wiedemann, Müller, Samek, arXiv 1805.08768.

A benchmark baseline for ``hhook-profile train``; not part of hhook's API.

What is exchanged (the paper's faithful form, not a gradient hook):

1. **Communication delay.** Every rank takes ``delay`` (the paper's ``n``) *local*
   optimizer steps on its own gradients (under DDP: inside ``ddp.no_sync()``, so DDP
   reduces nothing) with its own optimizer and momentum, like PyTorch's
   ``PeriodicModelAverager``. **This changes the optimizer's semantics**: between
   exchanges the replicas drift apart, the momentum buffers stay local and are never
   averaged, and the global model moves once per ``delay`` steps by the averaged,
   sparsified weight update. It is not the same optimizer as synchronous SGD.
2. **Weight update with residual.** At an exchange each rank forms
   ``A = residual + (W - W_ref)``, with ``W_ref`` the last common weights.
3. **Sparse binarisation, per tensor.** ``k = ceil(p * numel)``; ``mu+`` the mean of
   the ``k`` largest entries of ``A``, ``mu-`` the mean magnitude of the ``k`` most
   negative; only the group with the larger mean is kept, as ``+mu+`` (or ``-mu-``) at
   its ``k`` positions. Everything else, including the whole other sign group, stays
   in the residual: ``residual = A - sent``. (Keeping both signs as ternary ``+-mu``
   would be STC, which several public repositories ship under SBC's name.)
4. **Message.** Per tensor a float32 ``mu`` (its sign says which group) and an int32
   count, then the positions of all tensors (in the flattened concatenation of the
   parameters, so gaps run across tensor borders) Golomb-coded with
   ``b* = 1 + floor(log2(log(phi - 1) / log(1 - p)))`` (:mod:`.golomb`): real bit
   packing, ~8.1 bits per position at ``p = 1 %``.
5. **Exchange with stock collectives.** ``all_gather`` of the message lengths (one
   int64 per rank), then ``all_gather`` of the messages padded to the longest. Every
   rank decodes every message, averages the sparse updates, adds the average to
   ``W_ref`` and sets its weights to ``W_ref``. The paper's parameter-server form
   (upload, server averages, download of a dense or re-sparsified update) needs a
   server; the all-gather form needs none and is what a DDP job can run.

Choices where the paper leaves it open (written down as asked):

* The sign test compares ``mu+`` and ``mu-`` computed from the ``k`` largest and ``k``
  most negative entries even if fewer than ``k`` entries have that sign (the paper
  assumes both groups exist; with ``p`` small they do).
* Ties are broken towards the positive group.
* ``delay`` counts optimizer steps; the exchange runs right after the ``delay``-th
  local step and its time is part of that step.

Bytes: :attr:`SBC.step_bytes` holds, per step, the bytes of the tensors this rank hands
to the collectives (8 for the length, then the padded message), the same convention as
``hhook-profile train``'s counter; :meth:`SBC.stats` also gives the rank's own encoded
message bytes and the measured bits per position.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist

from . import golomb

HEADER = np.dtype([("mu", "<f4"), ("count", "<i4")])


def sbc_compress(update: torch.Tensor, p: float) -> tuple[float, torch.Tensor]:
    """``(mu, positions)`` for one tensor: the sign group with the larger mean magnitude
    among the top-``k`` positive and top-``k`` negative entries (``k = ceil(p numel)``),
    ``mu`` signed, positions sorted (flat indices)."""
    flat = update.detach().reshape(-1).float()
    k = max(1, math.ceil(p * flat.numel()))
    top = torch.topk(flat, k, sorted=False)
    bottom = torch.topk(-flat, k, sorted=False)
    mu_pos, mu_neg = top.values.mean().item(), bottom.values.mean().item()
    if mu_pos >= mu_neg:
        return mu_pos, torch.sort(top.indices).values
    return -mu_neg, torch.sort(bottom.indices).values


def encode_message(parts: list[tuple[float, torch.Tensor]], offsets: list[int], b: int) -> np.ndarray:
    """One rank's message: the header (mu, count per tensor), then the Golomb-coded
    positions of all tensors in flat-concatenation coordinates."""
    header = np.zeros(len(parts), dtype=HEADER)
    header["mu"] = [mu for mu, _ in parts]
    header["count"] = [len(idx) for _, idx in parts]
    positions = np.concatenate([idx.cpu().numpy().astype(np.int64) + off for (_, idx), off in zip(parts, offsets)])
    packed, _ = golomb.encode(positions, b)
    return np.concatenate([header.view(np.uint8), packed])


def decode_message(msg: np.ndarray, n_tensors: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    """``(values, positions)`` of a message from :func:`encode_message` (padding ignored)."""
    head = np.frombuffer(msg[: n_tensors * HEADER.itemsize].tobytes(), dtype=HEADER)
    counts = head["count"].astype(np.int64)
    positions = golomb.decode(msg[n_tensors * HEADER.itemsize:], int(counts.sum()), b)
    values = np.repeat(head["mu"].astype(np.float32), counts)
    return values, positions


def allgather_padded(msg: np.ndarray, group=None) -> tuple[list[np.ndarray], int]:
    """Every rank's variable-length uint8 message: lengths first, then the messages padded
    to the longest. Returns the messages and the bytes this rank handed to collectives."""
    world = dist.get_world_size(group)
    length = torch.tensor([msg.size], dtype=torch.int64)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length, group=group)
    longest = int(max(n.item() for n in lengths))
    buf = torch.zeros(longest, dtype=torch.uint8)
    buf[: msg.size] = torch.from_numpy(msg)
    outs = [torch.empty_like(buf) for _ in range(world)]
    dist.all_gather(outs, buf, group=group)
    return [o[: int(n.item())].numpy() for o, n in zip(outs, lengths)], length.nbytes + buf.nbytes


class SBC:
    """SBC over ``params`` (the model's parameters, same order on every rank).

    Call :meth:`after_step` after every local optimizer step; it exchanges every
    ``delay`` steps and then sets the weights to the new common ``W_ref``. See the
    module docstring for the algorithm and the change of optimizer semantics.
    """

    def __init__(self, params, p: float = 0.01, delay: int = 4, group=None):
        if not 0 < p < 1:
            raise ValueError(f"SBC: p must be in (0, 1), got {p}")
        if int(delay) != delay or delay < 1:
            raise ValueError(f"SBC: delay must be an integer >= 1, got {delay}")
        self.params = [q for q in params if q.requires_grad]
        self.p, self.delay, self.group = p, int(delay), group
        self.b = golomb.optimal_b(p)
        with torch.no_grad():
            self.ref = [q.detach().clone() for q in self.params]
            self.residual = [torch.zeros_like(q) for q in self.params]
        sizes = [q.numel() for q in self.params]
        self.offsets = [0] + list(np.cumsum(sizes)[:-1])
        self.numel = int(sum(sizes))
        self.steps = 0
        self.step_bytes: list[int] = []
        self._stats = {"exchanges": 0, "positions": 0, "message_bytes": 0, "golomb_bits": 0, "handed_bytes": 0}
        self.last: dict = {}

    def after_step(self) -> bool:
        """Count one local step; exchange if it is the ``delay``-th. True if it exchanged."""
        self.steps += 1
        if self.steps % self.delay:
            self.step_bytes.append(0)
            return False
        self.step_bytes.append(self.exchange())
        return True

    @torch.no_grad()
    def exchange(self) -> int:
        """Compress, all-gather, decode, average, apply; the bytes handed to collectives."""
        acc = [r + (q.detach() - ref) for r, q, ref in zip(self.residual, self.params, self.ref)]
        parts = [sbc_compress(a, self.p) for a in acc]
        sent = []
        for a, r, (mu, idx) in zip(acc, self.residual, parts):
            s = torch.zeros(a.numel(), dtype=a.dtype, device=a.device)
            s[idx.to(a.device)] = mu
            s = s.view_as(a)
            r.copy_(a - s)
            sent.append(s)
        msg = encode_message(parts, self.offsets, self.b)
        messages, handed = allgather_padded(msg, self.group)
        total = torch.zeros(self.numel, dtype=torch.float32)
        for m in messages:
            values, positions = decode_message(m, len(self.params), self.b)
            total.index_add_(0, torch.from_numpy(positions), torch.from_numpy(values))
        avg = total / len(messages)
        for q, ref, off in zip(self.params, self.ref, self.offsets):
            ref.add_(avg[off: off + q.numel()].view_as(ref).to(ref.device, ref.dtype))
            q.copy_(ref)
        n_pos = sum(len(idx) for _, idx in parts)
        header = len(parts) * HEADER.itemsize
        st = self._stats
        st["exchanges"] += 1
        st["positions"] += n_pos
        st["message_bytes"] += msg.size
        st["golomb_bits"] += (msg.size - header) * 8
        st["handed_bytes"] += handed
        self.last = {"accumulated": acc, "sent": sent, "average": avg, "messages": messages, "parts": parts}
        return handed

    def stats(self) -> dict:
        st = dict(self._stats)
        st.update(method="sbc", p=self.p, delay=self.delay, b=self.b, steps=self.steps,
                  bits_per_position=st["golomb_bits"] / st["positions"] if st["positions"] else None,
                  expected_bits_per_position=golomb.expected_bits_per_position(self.p, self.b))
        return st
