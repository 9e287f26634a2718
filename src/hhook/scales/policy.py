r"""The scale policies: agreed or predicted scales over one per-key state.

Both policies speak one message format (:mod:`hhook.scales.message`) and share one
per-key state (:class:`KeyState`: residual, predicted scales, what the key holds). A
policy never communicates: :meth:`ScalePolicy.begin` prepares a tensor and says whether
it needs a MAX round first (``plan.max_vector``); the schedule (:mod:`hhook.schedule`)
runs the collectives and hands the results to :meth:`~ScalePolicy.finish` (the words to
SUM) and :meth:`~ScalePolicy.decode` (the mean).

* **Agreed** (``THCState(scales="agreed")``): every call MAX-allreduces this step's block
  maxima, then quantizes onto them. The scales never clip: the rounding is unbiased.
* **Predicted** (``"predicted"``): a key's scales for step ``t`` are computed at step
  ``t - 1`` from what every rank received, so each step is **one** SUM allreduce. A key
  with no history (its first call, or after a reset) takes one agreed round instead.
  The next step's scales bound the *maximum* over ranks of this step's block maxima, not
  their mean (a mean clips the rank with the largest gradient every step, which biases
  the average: 0.42 for an exact 0.5 in PyTorch's hook-parity case), carried in the SUM
  as a thermometer (:mod:`hhook.scales.thermometer`). So a key whose blocks do not grow
  by more than the rounding (up to 19%) between two steps never clips, and repeated
  identical inputs average to the exact mean. A block that is zero on every rank decodes
  to exactly zero and keeps its scale (a gradient that pauses comes back on the scale it
  had). A block that grew past the thermometer's top, or shrank below its bottom while
  non-zero, is clipped (with error feedback the clipped mass is carried into the next
  call) or rounded coarsely on that step, and the key's next call takes an agreed round,
  which measures the new maxima exactly (Horovod's
  :class:`~hhook.scales.PredictedScales`, which has no agreed round, follows the block
  instead: 4x down or 8x up per step).
* **Gathered** (``"gathered"``): each rank quantizes onto its own block maxima, which
  travel in its message beside its codes (lanes as narrow as the bits: nothing is summed),
  and one all-gather gives every rank every message; each decodes the sum in rank order.
  One round from the first call, no history, never clips, and every rank's rounding error
  is bounded by its own maxima (no more than agreed scales'), but each rank receives
  ``n - 1`` messages: for the few ranks of a wide-area link, where a round costs more
  than bytes (docs/usage.md, "What a round costs").
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch

from ..codec import THCCodec, rng, rotation
from ..codec.layout import HEADER
from . import gathered, message, thermometer
from .message import PREFIX

logger = logging.getLogger(__name__)

#: Step kinds, folded into the fingerprint: ranks on different kinds of step fail loudly.
#: (``DENSE``: Horovod's warm-up step, :mod:`hhook.scales.one_round`.)
AGREED, PREDICTED, DENSE, GATHERED = 0x41, 0x51, 0x44, 0x47


def default_headroom(bits: int) -> float:
    """The headroom predicted scales multiply the previous maximum by, for ``bits``:
    1 up to 4 bits, then +0.25 per bit (2 at 8). The measurements that chose it:
    docs/horovod.md."""
    return 1.0 + max(0, bits - 4) / 4


@dataclasses.dataclass
class KeyState:
    """What one key carries from one call to the next. Identical on every rank except
    ``residual``."""

    numel: int
    world_size: int
    layout: object = None  # what the key holds (e.g. the shapes of a DDP bucket's parameters)
    scales: torch.Tensor | None = None  # predicted block scales for the next call (predicted policy)
    digest: int = 0  # of ``scales`` (:func:`hhook.codec.rng.digest`), folded into the fingerprint
    steps: int = 0
    residual: torch.Tensor | None = None  # this rank's error feedback, rotated domain


@dataclasses.dataclass
class Plan:
    """One call of one tensor, from :meth:`ScalePolicy.begin` to :meth:`ScalePolicy.decode`."""

    tensor: torch.Tensor
    world_size: int
    codec: THCCodec
    stream: rng.Stream  # this rank's rounding stream
    config: int  # the schedule's options, folded into the fingerprint
    state: KeyState | None = None
    prepared: object = None
    max_vector: torch.Tensor | None = None  # to MAX-allreduce before finish(); None: one round
    kind: int = AGREED
    scales: torch.Tensor | None = None  # the predicted scales in use (one round)
    fps: tuple = (0, 0)
    n_meta: int = 0
    new_residual: torch.Tensor | None = None
    agreed: torch.Tensor | None = None
    header: torch.Tensor | None = None  # this rank's prepared header (flag, digest)
    error: BaseException | None = None  # this rank failed locally; it sends filler
    packer: THCCodec | None = None  # the codec whose lanes carry the codes, where not ``codec`` (gathered)

    @property
    def dense(self) -> bool:
        """A float32 warm-up message (Horovod's first step of a key)."""
        return self.kind == DENSE

    def describe(self) -> str:
        kind = {AGREED: "agreed", PREDICTED: "predicted", DENSE: "warm-up", GATHERED: "gathered"}[self.kind]
        return f"{self.codec.describe()}, numel={self.tensor.numel()}, {kind} step"


def _checked_headroom(headroom):
    if isinstance(headroom, bool) or not isinstance(headroom, (int, float)) or not (
        headroom > 0 and math.isfinite(headroom)
    ):
        raise ValueError(f"headroom must be a positive number, got {headroom!r}")
    return headroom


def unrotated(residual: torch.Tensor, codec: THCCodec, numel: int) -> torch.Tensor:
    """A residual (rotated blocks) back in the tensor's domain, cropped to ``numel``."""
    return rotation.unrotate(residual, codec.seed).reshape(-1)[:numel]


def advance(state: KeyState, scales: torch.Tensor, sync: bool = True) -> None:
    """A predicting key's next scales (and their digest, when ``sync`` may read them)."""
    # All zero (the tensor was zero on every rank): agree again rather than predict 0.
    if sync and not bool(scales.max() > 0):
        state.scales, state.digest = None, 0
    else:
        state.scales = scales
        state.digest = int(rng.digest(scales.contiguous().view(torch.int32))) if sync else 0
    state.steps += 1


class ScalePolicy:
    r"""Encoder and decoder of THC messages with per-key state; ``predict`` picks the policy.

    Args:
        bits, block_size, seed, error_feedback, rounding: as :class:`hhook.THCState`.
        predict: predicted scales (one round once a key has history) or agreed ones.
        headroom: predicted scales are ``headroom`` times the thermometer's bound on the
            maximum; 1 never clips a block that did not grow, more leaves room for growth.
            Default: :func:`default_headroom` of ``bits``.
        gather: each rank's own scales, every message all-gathered (``predict`` is ignored).
    """

    #: A predicted key whose block left the thermometer's range takes an agreed round next
    #: (where the transport has one: not Horovod's, whose first round is a dense step).
    remeasure = True

    def __init__(self, bits=4, block_size=1024, seed=0, error_feedback=False, predict=True, headroom=None,
                 rounding="correlated", gather=False):
        THCCodec(bits, block_size, seed, rounding=rounding)  # validates
        headroom = _checked_headroom(default_headroom(bits) if headroom is None else headroom)
        self.bits, self.block_size, self.seed, self.rounding = bits, block_size, seed, rounding
        self.error_feedback, self.headroom, self.gather = bool(error_feedback), float(headroom), bool(gather)
        self.predict = bool(predict) and not self.gather  # gathered scales predict nothing
        self.keys, self._codecs = {}, {}  # key -> KeyState; world size -> THCCodec

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_codecs"] = {}
        return state

    #: The constructor's arguments, saved with the keys by :meth:`state_dict`.
    OPTIONS = ("bits", "block_size", "seed", "error_feedback", "predict", "headroom", "rounding", "gather")

    def state_dict(self) -> dict:
        """The options and every key's state as plain data (tensors, numbers, tuples):
        loadable with ``torch.load(weights_only=True)``."""
        out = {name: getattr(self, name) for name in self.OPTIONS}
        out["keys"] = {
            key: {f.name: getattr(ks, f.name) for f in dataclasses.fields(KeyState)} for key, ks in self.keys.items()
        }
        return out

    @classmethod
    def from_state_dict(cls, saved: dict) -> "ScalePolicy":
        """The policy :meth:`state_dict` described, with its keys."""
        options = {name: saved[name] for name in cls.OPTIONS if name in saved}
        options.setdefault("rounding", "independent")  # saved before there was a choice: what it ran
        policy = cls(**options)
        policy.keys = {key: KeyState(**fields) for key, fields in saved["keys"].items()}
        return policy

    def __setstate__(self, state):
        state.setdefault("rounding", "independent")  # saved before there was a choice: what it ran
        state.setdefault("gather", False)
        self.__dict__.update(state)

    def codec(self, world_size: int) -> THCCodec:
        codec = self._codecs.get(world_size)
        if codec is None:
            codec = self._codecs[world_size] = THCCodec(self.bits, self.block_size, self.seed, world_size, self.rounding)
        return codec

    def key_state(self, key, numel: int, world_size: int, layout=None) -> KeyState | None:
        """The state of ``key`` (None: no key, nothing carried), started afresh, with one
        log line, when what the key holds changed (length, world, layout)."""
        if key is None:
            return None
        state = self.keys.get(key)
        if state is not None and (state.numel, state.world_size, state.layout) != (numel, world_size, layout):
            logger.info(
                "hhook: key %r now holds a different tensor (numel %d -> %d, layout changed: %s); "
                "its residual and scales start afresh", key, state.numel, numel, state.layout != layout,
            )
            state = None
        if state is None:
            state = self.keys[key] = KeyState(numel, world_size, layout)
        return state

    def predicted(self, key) -> torch.Tensor | None:
        """The block scales the next call of ``key`` will use (None: it needs a MAX round)."""
        state = self.keys.get(key)
        return None if state is None else state.scales

    def release(self, key, numel: int) -> torch.Tensor | None:
        """Forget ``key`` (scales, residual, history) and return its error-feedback residual
        in the tensor's own domain (``numel`` float32 values), or None when it carries none
        or held a tensor of another length."""
        state = self.keys.pop(key, None)
        if state is None or state.residual is None or state.numel != numel:
            return None
        return unrotated(state.residual, self.codec(state.world_size), numel)

    def residual(self, state: KeyState | None, codec: THCCodec, device) -> torch.Tensor | None:
        """``state``'s error feedback (zeros on first use), or None when there is none."""
        if not self.error_feedback or state is None:
            return None
        shape = (codec.n_blocks(state.numel), codec.block_for(state.numel))
        if state.residual is None or state.residual.device != device or state.residual.shape != shape:
            state.residual = torch.zeros(shape, dtype=torch.float32, device=device)
        return state.residual

    # -- sizes ---------------------------------------------------------------------
    @staticmethod
    def message_numel(codec: THCCodec, numel: int, predicted: bool) -> int:
        """Words of a message for a tensor of ``numel`` (one round or agreed)."""
        return PREFIX + (thermometer.words(codec, numel) if predicted else 0) + codec.words_numel(numel)

    # -- stage 1 -------------------------------------------------------------------
    def begin(self, tensor, key, rank: int, world_size: int, call: int, config: int = 0, layout=None,
              error: BaseException | None = None, shared: int | None = None) -> Plan:
        """Prepare ``tensor``; ``plan.max_vector`` is set when it needs a MAX round.

        ``call`` must differ between calls of this rank (it selects the rounding stream);
        ``shared`` (default ``call``) must be the same on every rank for this tensor
        (correlated rounding's strata, :meth:`THCCodec.stream`): the schedules' call
        counters are, since every rank launches the same collectives in the same order.
        ``key`` None carries nothing between calls (an agreed round each time). ``error``:
        this rank already failed before encoding (e.g. a two-level node mean): it sends
        filler, every other rank raises :class:`~hhook.errors.RankFailedError` and this
        one raises ``error`` at :meth:`decode`.
        """
        codec = self.codec(world_size)
        numel = tensor.numel()
        state = self.key_state(key, numel, world_size, layout)
        plan = Plan(tensor, world_size, codec, codec.stream(rank, call, shared), config, state)
        if self.gather:
            plan.kind, plan.packer = GATHERED, self.codec(1)  # lanes as wide as the bits
            plan.n_meta = gathered.maxima_words(plan.packer, numel)
        elif self.predict and state is not None and state.scales is not None:
            plan.kind, plan.scales = PREDICTED, state.scales
            plan.n_meta = thermometer.words(codec, numel)
        digest = state.digest if plan.kind == PREDICTED else 0
        plan.fps = message.fingerprints(codec.fingerprint(numel), config, plan.kind, digest)
        plan.error = error
        try:
            if error is None:
                plan.prepared = codec.prepare(tensor.detach(), self.residual(state, codec, tensor.device))
                # This rank's flag and digest, for the prefix: the MAX round overwrites the scales.
                plan.header = plan.prepared.header
        except Exception as exc:  # noqa: BLE001 - sent on as filler, raised on every rank
            plan.error = exc
        if plan.kind == AGREED:
            if plan.error is None:
                plan.max_vector = plan.prepared.scales
            else:  # a flag no finite rank sends; the SUM's status word says why
                plan.max_vector = torch.zeros(codec.scales_numel(numel), dtype=torch.float32, device=tensor.device)
                plan.max_vector[0] = 2.0
        return plan

    # -- stage 3 -------------------------------------------------------------------
    def finish(self, plan: Plan, agreed: torch.Tensor | None = None) -> torch.Tensor:
        """The words to SUM-allreduce (all-gather: gathered scales): ``agreed`` is the
        MAX-reduced vector of an agreed round (None otherwise). Never raises: a local
        failure sends filler of the same length that makes every rank raise
        :class:`~hhook.errors.RankFailedError`."""
        codec, numel = plan.packer or plan.codec, plan.tensor.numel()
        length = PREFIX + plan.n_meta + codec.words_numel(numel)
        if plan.error is None:
            try:
                return self._encode(plan, agreed, length)
            except Exception as exc:  # noqa: BLE001
                plan.error = exc
        words = torch.zeros(length, dtype=codec.layout.word_dtype, device=plan.tensor.device)
        message.write_prefix(words, plan.fps, None, failed=True)
        return words

    def _encode(self, plan: Plan, agreed, length: int) -> torch.Tensor:
        codec, prepared, numel = plan.codec, plan.prepared, plan.tensor.numel()
        residual = self.residual(plan.state, codec, plan.tensor.device)
        codec = plan.packer or codec
        words = torch.empty(length, dtype=codec.layout.word_dtype, device=plan.tensor.device)
        # Written by quantize(), kept by decode() only if the step was not skipped.
        plan.new_residual = torch.empty_like(residual) if residual is not None else None
        if plan.kind == GATHERED:
            agreed = gathered.own_scales(codec, numel, prepared)
            gathered.write_maxima(words[PREFIX : PREFIX + plan.n_meta], agreed)
        elif plan.kind == PREDICTED:
            # The local header: this rank's flag, digest unknown (never "identical" here).
            agreed = torch.cat([codec.header(numel, prepared.scales[0], device=plan.scales.device), plan.scales])
            words[PREFIX : PREFIX + plan.n_meta] = thermometer.encode(prepared.scales[HEADER:], plan.scales, codec)
        plan.agreed = agreed
        codec.quantize(prepared, agreed, plan.stream, residual, plan.new_residual, out=words[PREFIX + plan.n_meta :],
                       prefix=(words[:PREFIX], plan.fps))
        return words

    # -- stage 5 -------------------------------------------------------------------
    def decode(self, sums: torch.Tensor, plan: Plan, out: torch.Tensor, defer=None) -> torch.Tensor:
        """Write the mean into ``out`` (shaped like the tensor); returns ``(out, nonfinite)``.

        Raises :class:`~hhook.errors.OpMismatchError`, :class:`~hhook.errors.ConfigMismatchError` or
        :class:`~hhook.errors.RankFailedError` (this rank's own exception on the rank
        that failed). On a GPU an agreed round reads nothing on the host: a bad prefix
        writes NaN and ``defer(bad, nonfinite, what)`` gets the device flags, for the
        caller to raise where a read is free; without ``defer`` it reads them here.
        ``nonfinite`` is a bool, or a 0-d tensor on GPUs (``out`` is then NaN everywhere).
        """
        if plan.error is not None:
            raise plan.error
        if plan.kind == GATHERED:
            verdict = gathered.decode(sums, plan.packer, plan.world_size, plan.fps, plan.describe(), plan.prepared,
                                      out)
            if verdict is None and plan.new_residual is not None:  # nothing of its own sent otherwise
                plan.state.residual = plan.new_residual
            return out, verdict is True
        codec = plan.codec
        body = sums[PREFIX + plan.n_meta :]
        if plan.kind == AGREED and defer is not None:
            flags = torch.empty(2, dtype=torch.int32, device=out.device)  # [bad, nonfinite] of the summed prefix
            codec.decode(plan.prepared, plan.agreed, body, out, check=(sums[:PREFIX], plan.world_size, plan.fps, flags))
            bad, nonfinite = flags[0], flags[1]
            defer(bad, nonfinite, plan.describe())
            if plan.new_residual is not None:
                plan.state.residual = plan.new_residual
            self._seed(plan, sync=False)
            return out, nonfinite
        verdict = message.read_prefix(sums, plan.world_size, plan.fps, plan.describe())
        state = plan.state
        if verdict.nonfinite:
            # Scales and residual stay as they were, as a skipped GradScaler step expects.
            return out.fill_(float("nan")), True
        zero = None
        if plan.kind == PREDICTED:
            zero, passed = thermometer.decode(sums[PREFIX : PREFIX + plan.n_meta], codec, plan.scales.numel())
            if zero.any():
                plan.agreed[HEADER:].masked_fill_(zero, 0.0)  # a zero scale decodes to 0
        if verdict.identical:  # every rank sent these bits: they are the mean
            out.copy_(plan.prepared.source.view(out.shape))
        else:
            codec.decode(plan.prepared, plan.agreed, body, out)
        if plan.new_residual is not None:  # quantize kept the old one where the step carried nothing
            if zero is not None and state.residual is not None:  # nothing of a zero block was sent
                plan.new_residual[zero] = state.residual[zero]
            state.residual = plan.new_residual
        if plan.kind == AGREED:
            self._seed(plan)
        else:
            if self.remeasure and bool(thermometer.out_of_range(zero, passed)):
                # A block left the thermometer's range: its maximum is unknown, so measure
                # it with an agreed round at the next call rather than creep towards it.
                state.scales, state.digest = None, 0
                state.steps += 1
            else:
                scales = thermometer.next_scales(passed, plan.scales, self.headroom)
                advance(state, torch.where(zero, plan.scales, scales))
        return out, False

    def _seed(self, plan: Plan, sync: bool = True) -> None:
        """After an agreed round: the next scales of a predicting key are the agreed maxima."""
        if self.predict and plan.state is not None and plan.agreed is not None:
            advance(plan.state, plan.agreed[HEADER:] * self.headroom, sync)
