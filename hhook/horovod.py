r"""Horovod integration: THC compression for ``hvd.DistributedOptimizer``.

Two ways in, each a one-line change::

    # 1. Horovod's own optimizer with the hhook compressor (op must be Sum):
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hhook.horovod.Compression.thc, op=hvd.Sum)
    # 2. The drop-in, which sets op=Sum and the compressor itself:
    opt = hhook.horovod.DistributedOptimizer(opt, named_parameters=model.named_parameters(), bits=4)

Horovod calls ``compress(grad)`` from each gradient's backward hook, allreduces what it
returns with ``op``, and calls ``decompress(result, ctx)`` in ``step()``. The DDP hook
agrees on the scales with a MAX allreduce first; inside ``compress`` that would block
the backward pass once per tensor, and it could deadlock, since Horovod's
``synchronize()`` compresses the gradients a backward pass left out in set order, which
differs between ranks. So ``compress`` never communicates: the scales are **predicted**,
and everything the next step needs travels inside the one SUM allreduce.

1. Warm-up (the first ``warmup_steps`` steps of each tensor, and any step after one
   where the tensor was zero on every rank): the float32 gradient itself, behind a
   header and each rank's block maxima of the rotated gradient as small integers
   (``ceil(8 log2 max)`` and a non-zero count; their sums give the geometric mean of
   the ranks' non-zero maxima, exactly, whatever order the reduction adds them in).
   Exact, as the DDP hook's first plain-allreduce iterations.
2. Otherwise the block scales are those predicted at the end of the previous step.
   They come from integer sums only, turned into floats by the same elementwise
   operations on every rank, so every rank holds them bit for bit (a digest of them is
   checked, see 4). Each rank sends ``[1, non-finite flag, fingerprint, fingerprint2 |
   block maxima | codes]`` in the codec's lane word type: the block maxima are this
   rank's ``max |y|`` per rotated block in fixed point relative to the scale in use
   (``2**-6`` resolution, saturating at 16x), packed in lanes like the codes, so their
   sum gives the mean of the ranks' block maxima. Values beyond the predicted scale are
   clamped (clipped); with ``error_feedback=True`` the clipped mass is carried into the
   tensor's next step.
3. Non-finite gradients: a rank with inf/NaN sets its flag (and sends zero codes); the
   summed flag is non-zero on every rank, and every rank's result is all NaN. Predicted
   scales and residuals stay as they were, as a skipped GradScaler step expects.
4. ``decompress`` checks the summed header: the first word must equal the world size
   (it does not after ``op=Average``, which divides packed lanes, or ``Min``/``Max``:
   :class:`OpMismatchError`); the fingerprints (configuration, tensor length, mode and
   a digest of the predicted scales) must be the sum of equal values
   (:class:`~hhook.codec.ConfigMismatchError`).
5. The codes are decoded into the mean gradient, and the next scales are set to
   ``headroom * (mean over ranks of this step's block maxima)``.

The scale is the *mean* of the ranks' block maxima, not their maximum: a sum cannot
carry a maximum, and clipping slightly below the maximum (as THC does on purpose) was
measured to give a lower error at 2 to 4 bits than the DDP hook's agreed maximum (the
README's Horovod section has the figures). With more bits the clipped tail dominates,
so :func:`default_headroom` grows with ``bits``.

Per-tensor state (predicted scales, residuals) is keyed on the optimizer and the
parameter's name, never on the gradient tensor, which ``zero_grad(set_to_none=True)``
reallocates: the drop-in passes the name to the compressor, and with
``hvd.DistributedOptimizer`` it is read from the caller's frame
(``_allreduce_grad_async(self, p)``). A tensor that cannot be named is sent uncompressed
(float32 behind the header; a warning is logged once).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import sys
import threading

import torch

try:
    import horovod.torch as hvd
except ImportError as exc:  # pragma: no cover - exercised through a subprocess test
    raise ImportError(
        "hhook.horovod needs Horovod with its PyTorch frontend, which could not be imported "
        f"({exc}). Build it against the installed torch: CXX=<g++ wrapper turning -std=c++14 "
        "into -std=c++17> CMAKE_POLICY_VERSION_MINIMUM=3.5 HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 "
        "pip install --no-build-isolation horovod==0.28.1 (the full recipe, wrapper included, is "
        "in hhook's README under 'Installing Horovod'; in a source checkout "
        "`bash ci/install_horovod.sh` runs it). `import hhook` and the DDP hook work without Horovod."
    ) from exc

from . import lanes, rng, rotation
from .codec import HEADER, SUPPORTED_DTYPES, ConfigMismatchError, THCCodec

logger = logging.getLogger(__name__)

__all__ = ["Compression", "DistributedOptimizer", "OpMismatchError", "THCCompressor", "default_headroom"]

#: Words at the front of every compressed tensor: count, non-finite flag, two fingerprints.
WORD_HEADER = 4
#: Fractional bits of the fixed-point block maxima (ratio to the scale in use).
FRAC_BITS = 6
#: A block maximum is clamped at this many times the scale in use: the fastest growth
#: of a predicted scale from one step to the next.
MAX_GROWTH = 16
_QMAX = MAX_GROWTH << FRAC_BITS
#: Blocks whose scale is below this fraction of the tensor's largest one are measured
#: against that floor (a block whose scale was zero would otherwise stay zero forever).
_FLOOR = 2.0**-12
_SALT = 0x54484348  # "THCH"
_DENSE, _PREDICTED = 0x44, 0x50  # modes, folded into the fingerprint
#: Dense steps code block maxima as ceil(_LOG_STEPS * log2(max)), clamped to +-_LOG_RANGE.
_LOG_STEPS = 8
_LOG_RANGE = 1000
_MANTISSAS = torch.tensor([2.0 ** (i / _LOG_STEPS) for i in range(_LOG_STEPS)], dtype=torch.float32)


class OpMismatchError(RuntimeError):
    """The compressed integer words were not combined with a plain ``op=hvd.Sum``."""


_OP_HELP = (
    "hhook THC compression sends packed integer lanes that only a plain sum keeps intact: "
    "use op=hvd.Sum (the division by the world size happens in decompress). "
    "hhook.horovod.DistributedOptimizer sets it for you."
)


def _wrap(value: int, word_bits: int) -> int:
    """``value`` as the two's-complement integer of ``word_bits`` bits that holds it."""
    value &= (1 << word_bits) - 1
    return value - (1 << word_bits) if value >> (word_bits - 1) else value


def _digest(values: torch.Tensor) -> int:
    """32-bit hash of the exact bits of a float32 vector."""
    bits = values.contiguous().view(torch.int32).clone()  # uint32 bit patterns, as rng uses
    bits.add_(rng.hash_range(_SALT, 0, bits.numel(), bits.device))
    return int(rng.mix32_(bits).to(torch.int64).sum().item()) & rng.MASK32


@dataclasses.dataclass
class _TensorState:
    """What one named tensor carries from one step to the next (identical on every rank,
    except ``residual``)."""

    numel: int
    world_size: int
    scales: torch.Tensor | None = None  # predicted block scales for the next step
    digest: int = 0  # of ``scales``, folded into the fingerprint
    steps: int = 0
    residual: torch.Tensor | None = None  # this rank's error feedback, rotated domain


@dataclasses.dataclass
class _Ctx:
    tensor: torch.Tensor
    world_size: int
    fingerprints: tuple
    codec: THCCodec | None = None
    state: _TensorState | None = None
    dense: bool = True
    n_meta: int = 0  # words (predicted) or floats (dense) of block maxima after the header
    prepared: object = None
    agreed: torch.Tensor | None = None
    ref: torch.Tensor | None = None
    meta_layout: lanes.LaneLayout | None = None
    new_residual: torch.Tensor | None = None


def default_headroom(bits: int) -> float:
    """Measured best ``headroom`` per bit width: 1 up to 4 bits, then +0.25 per bit.

    Few levels make quantization noise dominate, so clipping a little below the maximum
    pays; with many levels the clipped tail dominates and the scale needs room above
    the mean of the maxima (2 at 8 bits).
    """
    return 1.0 + max(0, bits - 4) / 4


class THCCompressor:
    r"""Horovod compressor (``compress``/``decompress``) for THC with predicted scales.

    Use with ``op=hvd.Sum``. ``hhook.horovod.Compression.thc`` is an instance with the
    defaults; build your own for other options.

    Args:
        bits: bits per coordinate before headroom (``2**bits`` levels, 1..8).
        block_size: rotation and scale block, a power of two.
        seed: shared seed of the rotation's signs; must match on every rank.
        error_feedback: carry each rank's rounding and clipping error into its next step
            (one float32 copy of every gradient). It makes the clipping at the predicted
            scales unbiased over steps, but about doubles the error of each step's mean;
            measured on the digits MLP, accuracy was the same either way, so it is off
            by default, as in :class:`hhook.THCState`.
        warmup_steps: steps of each tensor sent dense (float32, exact) before compressed
            steps with predicted scales take over; at least 1, since the first step has
            nothing to predict from.
        headroom: the next scale is ``headroom`` times the mean over ranks of this
            step's block maxima; above 1 clips less and quantizes more coarsely.
            Default: :func:`default_headroom` of ``bits``.
        process_set: the Horovod process set, when not used through an optimizer that
            names one.

    Example::
        >>> comp = hhook.horovod.THCCompressor(bits=2)
        >>> opt = hvd.DistributedOptimizer(opt, model.named_parameters(), compression=comp, op=hvd.Sum)
        >>> comp.stats()["ratio"]
    """

    def __init__(
        self,
        bits: int = 4,
        block_size: int = 1024,
        seed: int = 0,
        error_feedback: bool = False,
        warmup_steps: int = 1,
        headroom: float | None = None,
        process_set=None,
    ):
        THCCodec(bits, block_size, seed)  # validates
        if not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"warmup_steps must be an integer >= 1, got {warmup_steps!r}")
        if headroom is None:
            headroom = default_headroom(bits)
        if not headroom > 0 or not math.isfinite(headroom):
            raise ValueError(f"headroom must be a positive number, got {headroom!r}")
        self.bits = bits
        self.block_size = block_size
        self.seed = seed
        self.error_feedback = bool(error_feedback)
        self.warmup_steps = warmup_steps
        self.headroom = float(headroom)
        self.process_set = process_set
        self._codecs: dict[int, THCCodec] = {}
        self._tensors: dict[tuple, _TensorState] = {}  # (optimizer token, name)
        self._calls = itertools.count()
        self._tokens = itertools.count()
        self._hint = threading.local()
        self._warned_anon = False
        self._stats = dict.fromkeys(
            ("dense_bytes", "wire_bytes", "predicted_calls", "dense_calls", "nonfinite_calls"), 0
        )

    def __repr__(self) -> str:
        return (
            f"THCCompressor(bits={self.bits}, block_size={self.block_size}, seed={self.seed}, "
            f"error_feedback={self.error_feedback}, warmup_steps={self.warmup_steps}, headroom={self.headroom})"
        )

    # -- statistics ---------------------------------------------------------------
    def stats(self) -> dict:
        """Bytes and calls on this rank since creation (or :meth:`reset_stats`).

        ``dense_bytes``: what the same tensors would have sent as float32;
        ``wire_bytes``: what was handed to Horovod. ``dense_calls`` count warm-up steps
        (and tensors compress cannot name), ``predicted_calls`` compressed ones.
        """
        s = dict(self._stats)
        s["ratio"] = s["dense_bytes"] / s["wire_bytes"] if s["wire_bytes"] else float("nan")
        return s

    def reset_stats(self) -> None:
        for name in self._stats:
            self._stats[name] = 0

    def predicted_scales(self, optimizer, name: str) -> torch.Tensor | None:
        """The block scales the next compressed step of ``name`` will use (None: warm-up)."""
        token = optimizer.__dict__.get("_hhook_thc_token")
        state = self._tensors.get((token, name))
        if state is None or state.scales is None or state.steps < self.warmup_steps:
            return None
        return state.scales

    def reset(self) -> None:
        """Forget every tensor's predicted scales and residual (the next step warms up).

        Call it on every rank or on none: the ranks' states must stay identical.
        """
        self._tensors.clear()

    # -- helpers ------------------------------------------------------------------
    def codec(self, world_size: int) -> THCCodec:
        codec = self._codecs.get(world_size)
        if codec is None:
            codec = self._codecs[world_size] = THCCodec(self.bits, self.block_size, self.seed, world_size)
        return codec

    def _meta_layout(self, codec: THCCodec) -> lanes.LaneLayout:
        width = (codec.world_size * _QMAX).bit_length()
        word_bits = codec.layout.word_bits
        return lanes.LaneLayout(width, word_bits // width, codec.layout.word_dtype)

    def _identify(self, tensor: torch.Tensor, frame):
        """``(optimizer, name)`` of the parameter whose gradient ``tensor`` is, or Nones."""
        hint = getattr(self._hint, "entry", None)
        if hint is not None:
            opt, pairs = hint
            for param, name in pairs:
                if param.grad is tensor or param is tensor:
                    return opt, name
            if len(pairs) == 1 and pairs[0][0].shape == tensor.shape:  # sparse_as_dense
                return opt, pairs[0][1]
        # hvd.DistributedOptimizer calls compress from _allreduce_grad_async(self, p) or,
        # with groups, from a comprehension over ps in _grouped_allreduce_grad_async.
        candidates = []
        for _ in range(4):
            if frame is None:
                break
            local = frame.f_locals
            p = local.get("p")
            if isinstance(p, torch.Tensor):
                candidates.append(p)
            ps = local.get("ps")
            if isinstance(ps, (list, tuple)):
                candidates.extend(x for x in ps if isinstance(x, torch.Tensor))
            opt = local.get("self")
            names = getattr(opt, "_parameter_names", None)
            if isinstance(names, dict):
                for param in candidates:
                    if param.grad is tensor or param is tensor:
                        name = names.get(param)
                        if name is not None:
                            return opt, name
                return opt, None
            frame = frame.f_back
        return None, None

    def _process_set(self, opt):
        ps = getattr(opt, "process_set", None) if opt is not None else None
        if ps is None:
            ps = self.process_set
        return ps if ps is not None else hvd.global_process_set

    # -- compress -----------------------------------------------------------------
    def compress(self, tensor: torch.Tensor):
        """The tensor Horovod SUM-allreduces, and the context :meth:`decompress` needs.

        No communication: integer words with predicted scales, or on warm-up steps the
        float32 tensor itself behind a small header.
        """
        opt, name = self._identify(tensor, sys._getframe(1))
        if opt is not None and getattr(opt, "op", hvd.Sum) != hvd.Sum:
            raise OpMismatchError(f"{_OP_HELP} (this optimizer has op={opt.op!r})")
        world_size = self._process_set(opt).size()
        numel = tensor.numel()
        codec = self.codec(world_size) if tensor.dtype in SUPPORTED_DTYPES and numel else None

        state = None
        if name is not None and codec is not None:
            # Two optimizers may both own a "0.weight": the key includes the optimizer.
            token = opt.__dict__.get("_hhook_thc_token")
            if token is None:
                token = opt.__dict__["_hhook_thc_token"] = next(self._tokens)
            state = self._tensors.get((token, name))
            if state is None or state.numel != numel or state.world_size != world_size:
                state = self._tensors[(token, name)] = _TensorState(numel, world_size)
        elif name is None and not self._warned_anon:
            self._warned_anon = True
            logger.warning(
                "hhook: THC compress() could not tell which parameter a gradient belongs to (it is "
                "called outside a Horovod DistributedOptimizer?): such tensors are sent uncompressed"
            )
        if state is not None and state.scales is not None and state.steps >= self.warmup_steps:
            return self._compress_predicted(tensor, codec, state, opt)
        return self._compress_dense(tensor, codec, state, world_size)

    def _residual(self, state: _TensorState | None, codec: THCCodec, tensor: torch.Tensor):
        if not self.error_feedback or state is None:
            return None
        shape = (codec.n_blocks(state.numel), codec.block_for(state.numel))
        if state.residual is None or state.residual.device != tensor.device:
            state.residual = torch.zeros(shape, dtype=torch.float32, device=tensor.device)
        return state.residual

    def _count(self, kind: str, numel: int, wire: int) -> None:
        self._stats[kind] += 1
        self._stats["dense_bytes"] += 4 * numel
        self._stats["wire_bytes"] += wire

    def _compress_dense(self, tensor, codec, state, world_size):
        """``[1, flag, fp_hi, fp_lo | log2-coded block maxima | tensor]`` in float32/64.

        Every entry but the tensor is a small integer, summed exactly in any order, so
        the scales predicted from it are identical on every rank even where the
        float sums of a reduction differ in their last bits between ranks.
        """
        numel = tensor.numel()
        dtype = torch.float64 if tensor.dtype == torch.float64 else torch.float32
        flat = tensor.detach().reshape(-1).to(dtype)
        n_meta = 0
        flag = 0
        if codec is not None:
            prepared = codec.prepare(tensor)
            flag = int(prepared.scales[0].item() > 0)
            maxima = prepared.scales[HEADER:]
            n_meta = 2 * maxima.numel()
            residual = self._residual(state, codec, tensor)
            if residual is not None:  # sent exactly now: hand the carried error over too
                back = rotation.unrotate(residual, codec.seed).reshape(-1)[:numel]
                flat = flat + back.to(dtype)
            config = codec.fingerprint(numel)
        else:
            config = rng.mix32(rng.mix32(numel ^ _SALT) ^ world_size) >> 8
        combined = rng.mix32(config ^ rng.mix32(_DENSE)) >> 8  # 24 bits, in two exact halves
        hi, lo = combined >> 12, combined & 0xFFF
        words = torch.empty(WORD_HEADER + n_meta + numel, dtype=dtype, device=tensor.device)
        words[:WORD_HEADER] = torch.tensor([1.0, float(flag), float(hi), float(lo)], dtype=dtype)
        if n_meta:
            # Per block: 1 if this rank's maximum is non-zero, and ceil(8 log2 max), a
            # 1/8-octave code (0 for a zero maximum). Their sums give the geometric mean
            # of the non-zero maxima.
            nonzero, codes = words[WORD_HEADER : WORD_HEADER + n_meta].view(2, -1)
            torch.gt(maxima, 0, out=nonzero)
            torch.log2(maxima.to(dtype), out=codes)
            codes.mul_(_LOG_STEPS).ceil_().clamp_(-_LOG_RANGE, _LOG_RANGE).mul_(nonzero)
        words[WORD_HEADER + n_meta :] = flat
        self._count("dense_calls", numel, words.nbytes)
        return words, _Ctx(tensor, world_size, (world_size * hi, world_size * lo), codec, state, True, n_meta)

    def _compress_predicted(self, tensor, codec, state, opt):
        """``[1, flag, fp_a, fp_b | fixed-point block maxima | codes]`` in the lane word type."""
        numel = tensor.numel()
        n_blocks = codec.n_blocks(numel)
        world_size = state.world_size
        residual = self._residual(state, codec, tensor)
        # Written by quantize(), kept by decompress() only if no rank was non-finite.
        new_residual = torch.empty_like(residual) if residual is not None else None
        prepared = codec.prepare(tensor, residual)
        flag = int(prepared.scales[0].item() > 0)
        scales = state.scales
        agreed = torch.cat([codec.header(numel, device=scales.device), scales])
        codes = None
        if not flag:
            stream = rng.stream_key(self.seed, self._process_set(opt).rank(), next(self._calls))
            codes = codec.quantize(prepared, agreed, stream, new_residual)
        if codes is None:
            codes = torch.zeros(codec.words_numel(numel), dtype=codec.layout.word_dtype, device=tensor.device)

        # This rank's block maxima in fixed point, relative to the scale in use.
        ref = torch.maximum(scales, scales.max() * _FLOOR)
        q = prepared.scales[HEADER:] / ref
        q = q.mul_(float(1 << FRAC_BITS)).round_().nan_to_num_(nan=0.0, posinf=_QMAX).clamp_(0, _QMAX)
        meta_layout = self._meta_layout(codec)
        meta_codes = lanes.code_buffer(n_blocks, meta_layout, tensor.device)
        meta_codes[:n_blocks] = q.to(meta_layout.word_dtype)
        meta = lanes.pack(meta_codes, meta_layout)

        word_bits = codec.layout.word_bits
        combined = rng.mix32(codec.fingerprint(numel) ^ rng.mix32(_PREDICTED ^ state.digest))
        fp_a = combined & 0x7FFFFFFF
        fp_b = rng.mix32(combined ^ _SALT) & 0x7FFFFFFF
        header = torch.tensor([1, flag, fp_a, fp_b], dtype=codec.layout.word_dtype, device=tensor.device)
        words = torch.cat([header, meta, codes])
        self._count("predicted_calls", numel, words.nbytes)
        fingerprints = (_wrap(world_size * fp_a, word_bits), _wrap(world_size * fp_b, word_bits))
        ctx = _Ctx(tensor, world_size, fingerprints, codec, state, False, meta.numel())
        ctx.prepared, ctx.agreed, ctx.ref, ctx.meta_layout, ctx.new_residual = prepared, agreed, ref, meta_layout, new_residual
        return words, ctx

    # -- decompress ---------------------------------------------------------------
    def decompress(self, words: torch.Tensor, ctx: _Ctx) -> torch.Tensor:
        """The mean gradient, shaped and typed like the tensor given to :meth:`compress`.

        Raises :class:`OpMismatchError` if ``words`` was not summed over the ranks and
        :class:`~hhook.codec.ConfigMismatchError` if the ranks' configurations differ.
        """
        n = ctx.world_size
        count, flag, fp_a, fp_b = words[:WORD_HEADER].tolist()
        if count != n:
            raise OpMismatchError(
                f"{_OP_HELP} The compressed tensor came back with count word {count:g} instead of "
                f"the world size {n}: it was averaged (op=hvd.Average), or reduced with Min/Max/"
                "Adasum, or over a different set of ranks."
            )
        if (fp_a, fp_b) != ctx.fingerprints:
            what = ctx.codec.describe() if ctx.codec is not None else "uncompressed"
            raise ConfigMismatchError(
                "hhook: ranks disagree on the THC configuration, the tensor length or the predicted "
                f"scales (this rank: {what}, numel={ctx.tensor.numel()}, "
                f"{'dense' if ctx.dense else 'predicted'} step). Every rank must build the "
                "compressor with the same options and run the same steps."
            )
        tensor = ctx.tensor
        out = tensor if tensor.is_contiguous() else torch.empty_like(tensor, memory_format=torch.contiguous_format)
        if flag:
            self._stats["nonfinite_calls"] += 1
            return out.fill_(float("nan"))
        meta = words[WORD_HEADER : WORD_HEADER + ctx.n_meta]
        body = words[WORD_HEADER + ctx.n_meta :]
        state = ctx.state
        if ctx.dense:
            out.view(-1).copy_(body.div_(n))
            if state is not None:
                # Exact integer sums: floor of the mean code over the ranks whose block
                # was non-zero, then 2**(k/8) from a table and an exact ldexp.
                count, total = meta.view(2, -1)
                k = torch.div(total, count.clamp_min(1), rounding_mode="floor").to(torch.int64)
                mant = _MANTISSAS.to(meta.device)[k.bitwise_and(_LOG_STEPS - 1)]
                scales = torch.ldexp(mant, k.bitwise_right_shift(3).to(torch.float32)).mul_(count > 0)
                if state.residual is not None:
                    state.residual.zero_()
                self._advance(state, scales.mul_(self.headroom))
            return out
        ctx.codec.decode(ctx.prepared, ctx.agreed, body, out)
        sums = lanes.unpack(meta, ctx.meta_layout, ctx.ref.numel()).to(torch.float32)
        # Elementwise float32 operations on identical integers: identical on every rank.
        self._advance(state, sums.mul_(self.headroom / (n << FRAC_BITS)).mul_(ctx.ref))
        if ctx.new_residual is not None:
            state.residual = ctx.new_residual
        return out

    @staticmethod
    def _advance(state: _TensorState, scales: torch.Tensor) -> None:
        # All zero (the tensor was zero on every rank): warm up again rather than predict 0.
        state.scales = scales if bool(scales.max() > 0) else None
        state.digest = _digest(scales) if state.scales is not None else 0
        state.steps += 1


class Compression:
    """Horovod-style namespace of compressors: ``compression=hhook.horovod.Compression.thc``.

    ``thc`` needs ``op=hvd.Sum``; ``none`` and ``fp16`` are Horovod's own, for comparison.
    """

    none = hvd.Compression.none
    fp16 = hvd.Compression.fp16
    #: THC at 4 bits, block 1024, no error feedback. One instance serves every optimizer
    #: that uses it: its state is keyed on (optimizer, parameter name).
    thc = THCCompressor()


def _bind(optimizer, compressor: THCCompressor) -> None:
    """Make the optimizer tell the compressor which parameter each gradient belongs to."""
    single = optimizer._allreduce_grad_async
    grouped = getattr(optimizer, "_grouped_allreduce_grad_async", None)
    names = optimizer._parameter_names

    def allreduce_grad_async(p):
        compressor._hint.entry = (optimizer, ((p, names.get(p)),))
        try:
            return single(p)
        finally:
            compressor._hint.entry = None

    def grouped_allreduce_grad_async(ps):
        compressor._hint.entry = (optimizer, tuple((p, names.get(p)) for p in ps))
        try:
            return grouped(ps)
        finally:
            compressor._hint.entry = None

    optimizer._allreduce_grad_async = allreduce_grad_async
    if grouped is not None:
        optimizer._grouped_allreduce_grad_async = grouped_allreduce_grad_async


def DistributedOptimizer(
    optimizer,
    named_parameters=None,
    bits: int = 4,
    block_size: int = 1024,
    seed: int = 0,
    error_feedback: bool = False,
    warmup_steps: int = 1,
    headroom: float | None = None,
    compression=None,
    backward_passes_per_step: int = 1,
    op=None,
    gradient_predivide_factor: float = 1.0,
    groups=None,
    sparse_as_dense: bool = False,
    process_set=None,
):
    r"""``hvd.DistributedOptimizer`` with THC compression: swap it in for Horovod's.

    Sets ``op=hvd.Sum`` and a :class:`THCCompressor` built from ``bits``, ``block_size``,
    ``seed``, ``error_feedback``, ``warmup_steps`` and ``headroom``, and passes the
    parameter names to it. The other arguments are Horovod's. The compressor is
    ``optimizer.thc``: ``optimizer.thc.stats()`` counts the bytes.

    ``compression`` may be a :class:`THCCompressor` of your own, or Horovod's
    ``Compression.none``/``fp16`` for a comparison run (then ``op`` defaults to Average
    and nothing else changes).

    Example::
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> opt = hhook.horovod.DistributedOptimizer(opt, named_parameters=model.named_parameters(), bits=4)
    """
    if process_set is None:
        process_set = hvd.global_process_set
    common = dict(
        named_parameters=named_parameters,
        backward_passes_per_step=backward_passes_per_step,
        groups=groups,
        sparse_as_dense=sparse_as_dense,
        process_set=process_set,
    )
    if compression is not None and not isinstance(compression, THCCompressor):
        return hvd.DistributedOptimizer(
            optimizer,
            compression=compression,
            op=hvd.Average if op is None else op,
            gradient_predivide_factor=gradient_predivide_factor,
            **common,
        )
    if op is not None and op != hvd.Sum:
        raise OpMismatchError(f"{_OP_HELP} (got op={op!r}; leave op unset)")
    if gradient_predivide_factor != 1.0:
        raise ValueError("gradient_predivide_factor applies to op=Average only; THC divides in decompress")
    if compression is None:
        compression = THCCompressor(bits, block_size, seed, error_feedback, warmup_steps, headroom, process_set)
    dist = hvd.DistributedOptimizer(optimizer, compression=compression, op=hvd.Sum, **common)
    _bind(dist, compression)
    dist.thc = compression
    return dist
