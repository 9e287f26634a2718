r"""What the schedule needs of a group of ranks: a :class:`Membership`.

The schedule (the flat allreduce, its call check, the options handshake, the second
communicator) needs of a group only: this rank and the size, a SUM/MAX allreduce (and an
all-gather, to name the fields of ranks that differ) returning a torch ``Work``, a store
for its keys, the collective timeout, and a **name unique per membership**: every
process-wide record of the schedule (handshake arrivals, checked calls, second
communicators) is keyed by that name, so members that meet under a new name start those
records together, whatever each process did before (a restarted process starts at 0,
survivors do not).

:class:`Registered` is a group of ``torch.distributed`` (DDP, FSDP2, ``thc_allreduce``
on a ``ProcessGroup`` or None): every operation is torch's, exactly as before. A group
that ``torch.distributed`` does not know (torchft's reconfigurable one, per quorum:
:mod:`hhook.torchft`) subclasses :class:`Membership`; it is handed to
:class:`~hhook.state.THCState` as its ``process_group``. Its ranks are not the default
group's (``live`` False): hhook's liveness connections and stall reports
(:mod:`hhook.schedule.liveness`, :mod:`hhook.schedule.blame`) do not apply to it; its
owner learns of lost members its own way (torchft: the Lighthouse) and a lost member
fails its collectives.
"""

from __future__ import annotations

import contextlib
import datetime

import torch
import torch.distributed as dist

from .. import errors
from . import liveness


class Membership:
    """The group interface of the schedule. A subclass sets or computes ``name`` (unique
    per membership), ``rank``, ``size``, ``ranks`` (the members as messages name them),
    ``timeout`` (a ``timedelta``), ``on_host`` (it reduces CPU tensors), ``store`` (a
    store for this membership's keys) and ``cuda_over_gloo`` (CUDA tensors go over Gloo:
    the second communicator's backend), and implements :meth:`all_reduce` and
    :meth:`all_gather`. ``live``: ``ranks`` are ranks of this process's default group
    (liveness connections and stall reports apply)."""

    live = False
    cuda_over_gloo = True
    #: What the job does after a member died (the end of a lost peer's error message).
    recovery = errors.RESTART
    #: What keys of records in :attr:`store` start with besides the name: nothing where the
    #: store is the membership's own (a new membership, a new store prefix).
    instance = ""

    @property
    def group_name(self) -> str:
        """The name, where a torch group's name is read (continuation counts, messages)."""
        return self.name

    def all_reduce(self, tensor: torch.Tensor, op) -> dist.Work:
        """Launch an allreduce of ``tensor`` in place with ``op`` (SUM or MAX); its Work."""
        raise NotImplementedError

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> dist.Work:
        """Launch an all-gather of equal-sized ``input`` into flat ``output``; its Work."""
        raise NotImplementedError

    def ended(self, ranks) -> dict:
        """``{rank: how}`` for those of ``ranks`` whose process ended, where liveness applies."""
        return liveness.ended(ranks) if self.live else {}

    def quiet(self, ranks) -> list:
        """Those of ``ranks`` connected and silent (stopped), where liveness applies."""
        return liveness.quiet(ranks) if self.live else []

    def store_failed(self, exc: BaseException, what: str) -> Exception:
        """hhook's error for a failure of :attr:`store` under ``what``."""
        if self.live:
            return liveness.store_failed(exc, what, self.ranks)
        return errors.store_failed(exc, f"{self.rank} of {self.name!r}", what,
                                   "its host is gone or does not answer, or a member stalled")

    @contextlib.contextmanager
    def store_calls(self, what: str):
        """torch's store and network errors inside raise :meth:`store_failed`'s error."""
        try:
            yield
        except (dist.DistStoreError, dist.DistNetworkError) as exc:
            raise self.store_failed(exc, what) from exc


class Registered(Membership):
    """A group of ``torch.distributed`` (None: the default group), through torch's calls."""

    live = True

    def __init__(self, group):
        self.group = group if group is not None else dist.group.WORLD

    name = property(lambda self: self.group.group_name)
    rank = property(lambda self: dist.get_rank(self.group))
    size = property(lambda self: dist.get_world_size(self.group))
    ranks = property(lambda self: dist.get_process_group_ranks(self.group))
    store = property(lambda self: dist.distributed_c10d._get_process_group_store(self.group))
    #: The process-group instance (the launcher's attempt, the default groups made): a job's
    #: store may outlive a group of the same name (:func:`hhook.schedule.liveness.instance`).
    instance = property(lambda self: liveness.instance())

    @property
    def timeout(self) -> datetime.timedelta:
        """As the job set it (``init_process_group(timeout=...)``, ``new_group(timeout=...)``);
        torch's default where the backend does not say."""
        try:
            return self.group._get_backend(torch.device("cpu")).options._timeout
        except Exception:  # noqa: BLE001 - a backend without CPU or without options (MPI)
            pass
        try:
            return self.group._get_backend(torch.device("cuda")).options._timeout
        except Exception:  # noqa: BLE001
            return dist.default_pg_timeout

    @property
    def on_host(self) -> bool:
        """It has a Gloo or MPI backend."""
        backend = str(dist.get_backend(self.group))
        return "gloo" in backend or "mpi" in backend

    @property
    def cuda_over_gloo(self) -> bool:
        """CUDA tensors go over Gloo (ranks sharing one GPU, which NCCL refuses)."""
        config = dict(item.split(":", 1) for item in dist.get_backend_config(self.group).split(",") if ":" in item)
        return config.get("cuda") == "gloo"

    def all_reduce(self, tensor, op):
        return dist.all_reduce(tensor, op, group=self.group, async_op=True)

    def all_gather(self, output, input):
        return all_gather_flat(output, input, group=self.group, async_op=True)


def all_gather_flat(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """All-gather equal-sized ``input`` of every rank of ``group`` (a torch group) into one
    flat ``output``: ``all_gather_single`` where torch has it (2.13),
    ``all_gather_into_tensor`` (the same collective under its older name) where it does
    not (2.11, the GPU machines' torch)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def of(group) -> Membership:
    """``group`` as the schedule sees it: itself where it is a :class:`Membership`, else
    (a torch ``ProcessGroup`` or None) :class:`Registered`."""
    return group if isinstance(group, Membership) else Registered(group)


def registered(group) -> bool:
    """Whether ``group`` is one of ``torch.distributed`` (None, a ``ProcessGroup``)."""
    return not isinstance(group, Membership) or isinstance(group, Registered)

