r"""Horovod integration: THC compression for ``hvd.DistributedOptimizer``.

Two ways in, each a one-line change::

    # 1. Horovod's own optimizer with the hhook compressor (op must be Sum):
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hhook.horovod.Compression.thc, op=hvd.Sum)
    # 2. The drop-in, which sets op=Sum and the compressor itself:
    opt = hhook.horovod.DistributedOptimizer(opt, named_parameters=model.named_parameters(), bits=4)

Horovod calls ``compress(grad)`` from each gradient's backward hook, allreduces what it
returns with ``op``, and calls ``decompress(result, ctx)`` in ``step()``. The DDP hook's
default agrees on the scales with a MAX allreduce first; inside ``compress`` that would
block the backward pass once per tensor, and it could deadlock, since Horovod's
``synchronize()`` compresses the gradients a backward pass left out in set order, which
differs between ranks. So ``compress`` never communicates: it uses one-round THC with
**predicted** scales (:mod:`hhook.scales`, the same implementation as
``THCState(scales="predicted")``), where everything the next step needs travels inside
the one SUM allreduce. ``op=hvd.Average`` would divide the packed lanes: the first word
of every message counts the ranks, so ``decompress`` catches it
(:class:`OpMismatchError`).

Per-tensor state (predicted scales, residuals) is keyed on the optimizer and the
parameter's name, never on the gradient tensor, which ``zero_grad(set_to_none=True)``
reallocates: the drop-in passes the name to the compressor, and with
``hvd.DistributedOptimizer`` it is read from the caller's frame
(``_allreduce_grad_async(self, p)``). A tensor that cannot be named is sent uncompressed
(float32 behind the header; a warning is logged once).
"""

from __future__ import annotations

import itertools
import logging
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

from .codec import THCCodec
from .codec.error_model import auto_bits
from .errors import OpMismatchError
from .scales import PredictedScales
from .stats import Counters

logger = logging.getLogger(__name__)

__all__ = ["Compression", "DistributedOptimizer", "OpMismatchError", "THCCompressor"]

_OP_HELP = (
    "hhook THC compression sends packed integer lanes that only a plain sum keeps intact: "
    "use op=hvd.Sum (the division by the world size happens in decompress). "
    "hhook.horovod.DistributedOptimizer sets it for you."
)


class THCCompressor:
    r"""Horovod compressor (``compress``/``decompress``) for THC with predicted scales.

    Use with ``op=hvd.Sum``. ``hhook.horovod.Compression.thc`` is an instance with the
    defaults; build your own for other options.

    Args:
        bits: bits per coordinate before headroom (``2**bits`` levels, 1..8), or
            ``"auto"``: the width of the error rule for the process set's size
            (:func:`hhook.codec.error_model.auto_bits`, as ``THCState(bits="auto")``
            in :func:`hhook.thc_allreduce`: 5 bits at 2 ranks, 4 at 4-16, 3 at 64).
            Nothing is measured: a compressor cannot time steps or agree on a choice
            without communicating.
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
        headroom: the next scale is ``headroom`` times the bound on the maximum over
            ranks of this step's block maxima (:mod:`hhook.scales`); above 1 leaves room
            for growth and quantizes more coarsely. Default:
            :func:`hhook.scales.default_headroom` (1 up to 4 bits, 2 at 8).
        process_set: the Horovod process set, when not used through an optimizer that
            names one.
        rounding: ``"correlated"`` (default) or ``"independent"``, as
            :class:`hhook.THCState`: each rank's place among the strata is its rank in
            the process set; the strata's shift comes from the parameter's name and step
            count, which every rank holds alike whatever order Horovod calls ``compress``
            in. Part of the fingerprint.

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
        rounding: str = "correlated",
    ):
        self._options = (block_size, seed, error_feedback, warmup_steps, headroom, rounding)
        self._widths: dict[int, PredictedScales] = {}  # bits -> its policy: one, or per size with "auto"
        self._policy(4 if bits == "auto" else bits)  # checks the options now
        self.bits = bits
        self.block_size = block_size
        self.seed = seed
        self.error_feedback = bool(error_feedback)
        self.warmup_steps = warmup_steps
        self.rounding = rounding
        self.headroom = self._policy(bits).headroom if bits != "auto" else headroom  # "auto", None: each width's
        self.process_set = process_set
        self._calls = itertools.count()
        self._tokens = itertools.count()
        self._hint = threading.local()
        self._warned_anon = False
        self._stats = Counters()

    def __repr__(self) -> str:
        return (
            f"THCCompressor(bits={self.bits}, block_size={self.block_size}, seed={self.seed}, "
            f"error_feedback={self.error_feedback}, warmup_steps={self.warmup_steps}, headroom={self.headroom}, "
            f"rounding={self.rounding})"
        )

    # -- statistics ---------------------------------------------------------------
    def stats(self) -> dict:
        """Bytes and calls on this rank since creation (or :meth:`reset_stats`).

        ``dense_bytes``: what the same tensors would have sent as float32;
        ``wire_bytes``: what was handed to Horovod. ``dense_calls`` count warm-up steps
        (and tensors compress cannot name), ``compressed_calls`` compressed ones
        (:mod:`hhook.stats`: the same fields as ``THCState.stats()``).
        """
        return self._stats.snapshot()

    def reset_stats(self) -> None:
        self._stats.reset()

    def _policy(self, bits: int) -> PredictedScales:
        policy = self._widths.get(bits)
        if policy is None:
            policy = self._widths[bits] = PredictedScales(bits, *self._options)
        return policy

    def width(self, world_size: int) -> int:
        """The bits of THC over ``world_size`` ranks: ``bits``, or the error rule's for ``"auto"``."""
        return self.bits if self.bits != "auto" else auto_bits(world_size, rounding=self.rounding)

    def predicted_scales(self, optimizer, name: str) -> torch.Tensor | None:
        """The block scales the next compressed step of ``name`` will use (None: warm-up)."""
        key = (optimizer.__dict__.get("_hhook_thc_token"), name)
        return next((s for p in self._widths.values() if (s := p.predicted(key)) is not None), None)

    def reset(self) -> None:
        """Forget every tensor's predicted scales and residual (the next step warms up).

        Call it on every rank or on none: the ranks' states must stay identical.
        """
        for policy in self._widths.values():
            policy.keys.clear()

    def codec(self, world_size: int) -> THCCodec:
        return self._policy(self.width(world_size)).codec(world_size)

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
        return _named_by_caller(tensor, frame)

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
        ps = self._process_set(opt)
        key = None
        if name is not None:
            # Two optimizers may both own a "0.weight": the key includes the optimizer.
            token = opt.__dict__.get("_hhook_thc_token")
            if token is None:
                token = opt.__dict__["_hhook_thc_token"] = next(self._tokens)
            key = (token, name)
        elif not self._warned_anon:
            self._warned_anon = True
            logger.warning(
                "hhook: THC compress() could not tell which parameter a gradient belongs to (it is "
                "called outside a Horovod DistributedOptimizer?): such tensors are sent uncompressed"
            )
        policy = self._policy(self.width(ps.size()))
        words, msg = policy.encode(tensor, key, ps.rank(), ps.size(), next(self._calls), label=name)
        self._stats.add("dense_calls" if msg.dense else "compressed_calls", 4 * tensor.numel(), words.nbytes)
        return words, (policy, msg)

    # -- decompress ---------------------------------------------------------------
    def decompress(self, words: torch.Tensor, ctx) -> torch.Tensor:
        """The mean gradient, shaped and typed like the tensor given to :meth:`compress`.

        Raises :class:`OpMismatchError` if ``words`` was not summed over the ranks and
        :class:`~hhook.codec.ConfigMismatchError` if the ranks' configurations differ.
        """
        policy, plan = ctx
        try:
            out = policy.decode(words, plan)
        except OpMismatchError as e:
            raise OpMismatchError(f"{_OP_HELP} {e}") from None
        if words[1].item():  # the summed non-finite flag
            self._stats.add("nonfinite_calls")
        return out


def _named_by_caller(tensor: torch.Tensor, frame):
    """``(optimizer, name)`` from the frames that called ``compress``, or Nones:
    hvd.DistributedOptimizer calls it from ``_allreduce_grad_async(self, p)`` or, with
    groups, from a comprehension over ``ps`` in ``_grouped_allreduce_grad_async``."""
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
    compression=None,
    backward_passes_per_step: int = 1,
    op=None,
    gradient_predivide_factor: float = 1.0,
    groups=None,
    sparse_as_dense: bool = False,
    process_set=None,
    **options,
):
    r"""``hvd.DistributedOptimizer`` with THC compression: swap it in for Horovod's.

    Sets ``op=hvd.Sum`` and a :class:`THCCompressor` built from ``options`` (its keyword
    arguments: ``bits``, ``block_size``, ``seed``, ``error_feedback``, ``warmup_steps``,
    ``headroom``, ``rounding``), and passes the parameter names to it. The other arguments
    are Horovod's, in Horovod's order. The compressor is
    ``optimizer.thc``: ``optimizer.thc.stats()`` counts the bytes.

    ``compression`` may be a :class:`THCCompressor` of your own, or Horovod's
    ``Compression.none``/``fp16`` for a comparison run (then ``op`` defaults to Average
    and nothing else changes); THC options beside it raise ``TypeError`` (they would
    be ignored).

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
    if compression is not None and options:
        raise TypeError(
            f"DistributedOptimizer got compression={compression!r} and THC options {sorted(options)}: "
            "pass the options to THCCompressor(...) given as compression, or drop compression")
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
        compression = THCCompressor(process_set=process_set, **options)
    dist = hvd.DistributedOptimizer(optimizer, compression=compression, op=hvd.Sum, **common)
    _bind(dist, compression)
    dist.thc = compression
    return dist
