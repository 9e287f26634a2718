r"""Predicted scales as Horovod's ``compress`` needs them: one round always.

``compress`` may not communicate, so the first call of a key cannot take an agreed round:
:meth:`PredictedScales.encode` sends it dense (float32 behind a small header, exact) with
each rank's block maxima as log2 codes whose sums give the geometric mean of the ranks'
maxima; the first predicted step may clip where ranks' maxima differ by more than 4x, and
the thermometer (:mod:`hhook.scales.thermometer`) takes over from the next one.
"""

from __future__ import annotations

import zlib

import torch

from ..codec import rng
from ..codec.layout import HEADER, SUPPORTED_DTYPES, constant
from ..errors import ConfigMismatchError
from . import message
from .policy import DENSE, Plan, ScalePolicy, advance, unrotated

#: Words (floats) at the front of a dense (warm-up) message: count, flag, two fingerprint halves.
DENSE_HEADER = 4
#: Dense warm-up steps code block maxima as ceil(_LOG_STEPS * log2(max)), clamped to +-_LOG_RANGE.
_LOG_STEPS = 8
_LOG_RANGE = 1000
_MANTISSAS = torch.tensor([2.0 ** (i / _LOG_STEPS) for i in range(_LOG_STEPS)], dtype=torch.float32)


class PredictedScales(ScalePolicy):
    r"""The one-round policy as Horovod's ``compress`` needs it: ``encode`` never
    communicates, so a key with no history is sent dense (float32, exact) instead of
    taking an agreed round.

    Args:
        bits, block_size, seed, error_feedback, rounding: as :class:`hhook.THCState`.
        warmup_steps: dense steps of each key before predicted ones (at least 1).
        headroom: as :class:`ScalePolicy`.
    """

    #: Horovod cannot take an agreed round: a key whose blocks left the thermometer's range
    #: follows them (4x down, 8x up per step) rather than fall back to a dense step.
    remeasure = False

    def __init__(self, bits=4, block_size=1024, seed=0, error_feedback=False, warmup_steps=1, headroom=None,
                 rounding="correlated"):
        super().__init__(bits, block_size, seed, error_feedback, True, headroom, rounding)
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"warmup_steps must be an integer >= 1, got {warmup_steps!r}")
        self.warmup_steps = warmup_steps

    def predicted(self, key) -> torch.Tensor | None:
        state = self.keys.get(key)
        if state is None or state.scales is None or state.steps < self.warmup_steps:
            return None
        return state.scales

    def encode(self, tensor: torch.Tensor, key, rank: int, world_size: int, call: int, label: str | None = None):
        """``(words, plan)``: the tensor to SUM-allreduce and what :meth:`decode` needs.
        ``key`` None sends the tensor uncompressed.

        Horovod calls ``compress`` in each rank's own gradient order, so ``call`` may
        differ between ranks: the counter every rank holds alike is the key's: a hash of
        ``label`` (what names it alike on every rank; default ``repr(key)``) and its step
        count, which every rank advances on the same decodes.
        """
        numel = tensor.numel()
        if tensor.dtype in SUPPORTED_DTYPES and numel and key is not None and self.predicted(key) is not None:
            label = repr(key) if label is None else label
            shared = zlib.crc32(label.encode()) << 32 | self.keys[key].steps & rng.MASK32
            plan = self.begin(tensor, key, rank, world_size, call, shared=shared)
            return self.finish(plan), plan
        return self._encode_dense(tensor, key, world_size)

    def decode(self, words: torch.Tensor, plan: Plan, out: torch.Tensor | None = None) -> torch.Tensor:
        """The mean into ``out`` (default: the tensor given to :meth:`encode`, or a
        contiguous copy of it); returns ``out``."""
        tensor = plan.tensor
        if out is None:
            out = tensor if tensor.is_contiguous() else torch.empty_like(tensor, memory_format=torch.contiguous_format)
        if plan.kind == DENSE:
            return self._decode_dense(words, plan, out)
        return super().decode(words, plan, out)[0]

    def _encode_dense(self, tensor, key, world_size):
        """``[1, flag, fp_hi, fp_lo | log2-coded block maxima | tensor]`` in float32/64.

        Every entry but the tensor is a small integer, summed exactly in any order, so
        the scales predicted from it are identical on every rank even where the float
        sums of a reduction differ in their last bits between ranks.
        """
        numel = tensor.numel()
        dtype = torch.float64 if tensor.dtype == torch.float64 else torch.float32
        flat = tensor.detach().reshape(-1).to(dtype)
        codec = self.codec(world_size) if tensor.dtype in SUPPORTED_DTYPES and numel else None
        state = self.key_state(key, numel, world_size) if codec is not None else None
        n_meta, padded = 0, numel
        flag = torch.zeros((), dtype=dtype, device=tensor.device)
        if codec is not None:
            # Padded to whole blocks, like the codes: tensors whose lengths differ within a
            # block make equally long messages, so the fingerprint reports the mismatch.
            padded = codec.n_blocks(numel) * codec.block_for(numel)
            residual = self.residual(state, codec, tensor.device)
            prepared = codec.prepare(tensor.detach(), residual)
            flag = prepared.scales[0].to(dtype)
            maxima = prepared.scales[HEADER:]
            n_meta = 2 * maxima.numel()
            if residual is not None:  # sent exactly now: hand the carried error over too
                back = unrotated(residual, codec, numel)
                flat = flat + back.to(dtype)
            config = codec.fingerprint(numel)
        else:
            config = rng.mix32(rng.mix32(numel ^ 0x54484348) ^ world_size) >> 8
        combined = rng.mix32(config ^ rng.mix32(DENSE)) >> 8  # 24 bits, in two exact halves
        hi, lo = combined >> 12, combined & 0xFFF
        words = torch.zeros(DENSE_HEADER + n_meta + padded, dtype=dtype, device=tensor.device)
        words[:DENSE_HEADER] = constant([1.0, 0.0, float(hi), float(lo)], dtype, tensor.device)
        words[1] = flag
        if n_meta:
            # Per block: 1 if this rank's maximum is non-zero, and ceil(8 log2 max), a
            # 1/8-octave code (0 for a zero maximum). Their sums give the geometric mean
            # of the non-zero maxima.
            nonzero, codes = words[DENSE_HEADER : DENSE_HEADER + n_meta].view(2, -1)
            torch.gt(maxima, 0, out=nonzero)
            torch.log2(maxima.to(dtype), out=codes)
            codes.mul_(_LOG_STEPS).ceil_().clamp_(-_LOG_RANGE, _LOG_RANGE).mul_(nonzero)
        words[DENSE_HEADER + n_meta :][:numel] = flat
        plan = Plan(tensor, world_size, codec, 0, 0, state, kind=DENSE, fps=(world_size * hi, world_size * lo))
        plan.n_meta = n_meta
        return words, plan

    def _decode_dense(self, words, plan, out):
        n = plan.world_size
        count, flag, fp_a, fp_b = words[:DENSE_HEADER].tolist()
        if count != n:
            message.check_prefix(count, 0, 0, 0, (), n, (0, 0), torch.int64, "warm-up step")  # raises OpMismatchError
        if (fp_a, fp_b) != plan.fps:
            what = plan.codec.describe() if plan.codec is not None else "uncompressed"
            raise ConfigMismatchError(
                "hhook: ranks disagree on the THC configuration or the tensor length "
                f"(this rank: {what}, numel={plan.tensor.numel()}, warm-up step). Every rank must use "
                "the same options and run the same steps."
            )
        if flag:
            return out.fill_(float("nan"))
        meta = words[DENSE_HEADER:][: plan.n_meta]
        body = words[DENSE_HEADER + plan.n_meta :]
        out.copy_(body[: out.numel()].div_(n).view(out.shape))
        state = plan.state
        if state is not None:
            # Exact integer sums: floor of the mean code over the ranks whose block was
            # non-zero, then 2**(k/8) from a table and an exact ldexp.
            count, total = meta.view(2, -1)
            k = torch.div(total, count.clamp_min(1), rounding_mode="floor").to(torch.int64)
            mant = _MANTISSAS.to(meta.device)[k.bitwise_and(_LOG_STEPS - 1)]
            scales = torch.ldexp(mant, k.bitwise_right_shift(3).to(torch.float32)).mul_(count > 0)
            if state.residual is not None:
                state.residual.zero_()
            advance(state, scales.mul_(self.headroom))
        return out
