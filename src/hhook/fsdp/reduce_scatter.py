"""FSDP2's gradient reduce-scatter, compressed: :class:`THCReduceScatter`, a
``ReduceScatter`` comm for ``FSDPModule.set_custom_reduce_scatter`` (the package's
docstring, :mod:`hhook.fsdp`, says how it sums and divides)."""

from __future__ import annotations

import torch

from ..codec.layout import SUPPORTED_DTYPES
from ..scales.message import CallChanged
from ..schedule import load_check
from ..schedule.dense import count, uncompressed
from ..schedule.reduce_scatter import reduce_scatter
from ..state import THCState

try:  # torch >= 2.6
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
except ImportError:  # pragma: no cover
    ReduceScatter = object

#: Why FSDP's reduce-scatter refuses each scale mode but agreed.
SCALES_REFUSED = {
    "predicted": (
        "hhook.fsdp supports scales='agreed' only: predicted scales cannot work for a reduce-scatter "
        "without an extra round. A chunk's next scales come from the summed thermometer counts of its "
        "message, but after the reduce-scatter only rank j holds chunk j's sums, while every rank encodes "
        "chunk j at the next step (broadcasting them would be the round predicted scales exist to save). "
        "Use scales='agreed' or 'auto' (the default: agreed scales there)."
    ),
    "gathered": (
        "hhook.fsdp supports scales='agreed' only: gathered scales hand every rank every rank's whole "
        "message, where a reduce-scatter hands each rank its own shard (n times the bytes). Use "
        "scales='agreed' or 'auto' (the default: agreed scales there)."
    ),
}


class THCReduceScatter(ReduceScatter):
    r"""FSDP2's ``ReduceScatter`` comm, compressed with THC (agreed scales).

    Args:
        state: the :class:`hhook.THCState` (options, per-key state, counters).
        name: this param group's name (its module's name in the model): the first half
            of every chunk's key, ``(name, chunk index)``, stable across steps.
        factor: the user's gradient divide factor (None: FSDP's division is off and the
            comm returns the mean).
        returns_sum: return the sum over the shard group instead of the mean (a user
            factor, or native HSDP, where FSDP divides after its replica all-reduce).

    One call, on every rank of the shard group, blocking:
    :func:`hhook.schedule.reduce_scatter.reduce_scatter` over the state's context of the
    shard group (:meth:`hhook.THCState.context`: made once, after the options handshake,
    which registration ran, and a loaded checkpoint runs again), or FSDP2's own exchange
    where the dtype is not the codec's or ``bits="auto"`` says so (:meth:`_dense`). After a
    checkpoint loaded on some ranks only, every rank raises
    :class:`~hhook.errors.ConfigMismatchError` naming each rank's options
    (:func:`hhook.schedule.load_check.reduce_scattered`).
    """

    def __init__(self, state: THCState, name: str, factor: float | None, returns_sum: bool | None = None,
                 switch=None):
        if not state.options.agreed_unless_gathered():
            raise ValueError(SCALES_REFUSED[state.options.scales])
        self.state = state
        self.name = name
        self.factor = factor
        self.returns_sum = factor is not None if returns_sum is None else bool(returns_sum)
        self.switch = switch  # bits="auto" (hhook.fsdp.auto.Switch): dense while it says so

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op=None, async_op=False):
        switch = self.switch
        if switch is not None:
            switch.reduced = True  # bits="auto" without optimizer steps: the next forward ends the step
        said = load_check.said(self.state, group, "reduce-scatter")  # every rank numbers every call alike
        loaded = self.state.pending_load
        if loaded is not None and group in loaded.shards:  # this rank loaded a checkpoint: did every rank?
            if not self._dense_here(input_tensor):
                load_check.reduce_scattered(self.state, group, output_tensor, input_tensor, self.name, said)
            elif load_check.marks_fit(input_tensor):  # bits="auto"'s dense method, or a dtype THC does not take
                load_check.settled(self.state, group, self._dense(output_tensor, input_tensor, group, mark=True), said)
            else:  # no room for the count: the handshake runs again, as before this check existed
                load_check.handshook(self.state, group)
        if self._dense_here(input_tensor):
            if self._dense(output_tensor, input_tensor, group):  # some rank loaded a checkpoint, this one did not
                raise load_check.named_error(said)
            return None
        ctx = self.state.contexts.get((group, "agreed")) or self.state.context(group, "agreed")
        try:
            nonfinite = reduce_scatter(ctx, output_tensor, input_tensor, self.name)
        except CallChanged:  # only ever a load on some ranks: no other reduce-scatter is marked
            raise load_check.named_error(said) from None
        if not nonfinite and self.returns_sum:
            output_tensor.mul_(ctx.world_size)
        return None

    def _dense_here(self, input_tensor) -> bool:
        """Whether this call is FSDP2's own exchange: a dtype THC does not take, or
        ``bits="auto"``'s method (while a loaded checkpoint waits for its check, the one
        every rank verified)."""
        return input_tensor.dtype not in SUPPORTED_DTYPES or (self.switch is not None and
                                                              self.switch.reduce_scatter_dense)

    def _dense(self, output_tensor, input_tensor, group, mark: bool = False) -> int:
        """Plain FSDP2's reduce-scatter of the same buffer (FSDP's division is off: the mean
        here), counted as the one dense fallback counts (:func:`hhook.schedule.dense.count`);
        ``mark``: this rank says it loaded a checkpoint, counted nowhere. Returns how many
        ranks said so (:func:`hhook.schedule.load_check.dense_reduce_scatter`)."""
        uncompressed(input_tensor)  # said once where it is for its dtype
        loaded = load_check.dense_reduce_scatter(output_tensor, input_tensor, group, mark)
        if not self.returns_sum:
            output_tensor.div_(group.size())
        if not mark:
            count(self.state.counters, input_tensor)
        return loaded
