r"""THC inside torchft's fault-tolerant exchange: :func:`enable`.

torchft (``torchft.Manager``, a Lighthouse forming quorums of replica groups) averages
across replica groups with ``Manager.allreduce(tensor, should_quantize=..., reduce_op=AVG)``:
``torchft.local_sgd.DiLoCo`` (its streaming fragments) and ``LocalSGD`` call it, and so
does torchtitan's ``[fault_tolerance]`` section. After :func:`enable`, the calls that ask
for quantization (``should_quantize=True``; every floating-point call with
``quantized_only=False``) go through THC over the current quorum, with torchft's
semantics: the sum over the quorum's replicas (a replica that does not participate
contributes zeros) divided by the participants for AVG, the same bits on every
participant; every other call goes to torchft's own exchange unchanged.

Per quorum (torchft reconfigures its process group on every membership change,
``ProcessGroup.configure``): the quorum is a :class:`~hhook.schedule.membership.Membership`
named for the quorum (``torchft:<quorum id>:<rank in the replica group>``), over the
quorum's own store, with torchft's process group as its transport. At the first exchange
of a new quorum every member rebuilds hhook's state for it, the same on each: the options
handshake and the second communicator under the new name (so a restarted replica and the
survivors meet on the same keys), the rounding counters started at ``quorum id << 32``,
lane widths for the new size; no per-key state crosses a quorum (each exchange agrees on
its scales, and there is no error feedback to carry: a rank that left takes nothing with
it, and a rejoining replica needs nothing of hhook's from torchft's checkpoint).

Errors inside a THC exchange (a lost peer, a timeout, a mismatch) go where torchft's own
go: ``Manager.report_error`` through ``Manager.wrap_future`` (with the manager's
timeout), so the step is discarded (``should_commit`` is False everywhere) and the next
quorum forms; an exchange never hangs past the timeout. A quorum whose exchange failed
here takes no further THC exchange (its communicators may be broken): later calls in it
report an error at once, until the next quorum.

torchft's private pieces used (``tests/integrations/test_torchft.py`` checks them, so a
torchft upgrade that changes them fails there): ``Manager._pg`` (the reconfigurable
process group a Manager holds), ``Manager._timeout``, and the positional order of
``ProcessGroup.configure``'s arguments as ``Manager`` passes them.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions

from .codec.layout import SUPPORTED_DTYPES
from .schedule.allreduce import connect, thc_allreduce_async
from .schedule.futures import attach, completed, new_future, settle
from .schedule.groups import end_second_groups
from .schedule.membership import Membership
from .state import THCState, report

logger = logging.getLogger(__name__)

#: torchft's Manager attributes :func:`enable` reads (private to torchft).
PRIVATE = ("_pg", "_timeout")


class Quorum(Membership):
    """One quorum of torchft's replicas, as hhook's schedule sees it: this replica's rank
    and the quorum's size, torchft's process group (as configured for this quorum) for
    the collectives, the quorum's store (``host:port/prefix`` as torchft's configure got
    it) under ``hhook/``. Ended at the next reconfiguration: a collective launched on an
    ended quorum raises, never goes to the next quorum's group."""

    recovery = ("torchft's Manager reports it and discards this step; the next quorum goes on without that replica, "
                "and a restarted one heals from a live one")

    def __init__(self, pg, store_addr: str, rank: int, size: int, quorum_id: int, group_rank: int,
                 timeout: datetime.timedelta):
        self.pg, self.store_addr, self.rank, self.size = pg, store_addr, rank, size
        self.quorum_id, self.group_rank, self.timeout = quorum_id, group_rank, timeout
        self.name = f"torchft:{quorum_id}:{group_rank}"
        self.ranks = list(range(size))
        self.on_host = self.cuda_over_gloo = "gloo" in pg.getBackendName()
        self.over = False
        self.failed: BaseException | None = None
        self._store = None

    @property
    def store(self):
        """The quorum's store, connected at the first use (a client of its TCPStore)."""
        if self._store is None:
            address, _, prefix = self.store_addr.partition("/")
            host, _, port = address.rpartition(":")
            client = dist.TCPStore(host.strip("[]"), int(port), is_master=False, wait_for_workers=False,
                                   timeout=self.timeout)
            self._store = dist.PrefixStore(f"{prefix}/hhook/", client)
        return self._store

    def _check(self) -> None:
        if self.over:
            raise RuntimeError(f"hhook: quorum {self.quorum_id} of torchft ended (the group was reconfigured)")

    def all_reduce(self, tensor, op):
        self._check()
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        return self.pg.allreduce([tensor], opts)

    def all_gather(self, output, input):
        self._check()
        return self.pg.allgather([list(output.view(-1).chunk(self.size))], [input], AllgatherOptions())


class _Exchange(dist._Work):
    """The Work :meth:`THCManager.allreduce` returns, as torchft's own: ``get_future()``
    holds the tensor (the manager's :meth:`wrap_future` of the exchange: errors reported
    to the manager, the tensor returned) and ``wait()`` returns once the exchange *and
    every callback chained on that future* (torchft's bucketized DiLoCo copies the
    buckets back in one) have run; an error in one of them is reported to the manager
    (False)."""

    def __init__(self, manager, fut: torch.futures.Future):
        super().__init__()
        self.manager, self.fut, self.chained = manager, fut, []

    def wait(self, timeout=None) -> bool:
        try:
            self.fut.wait()
            while self.chained:
                self.chained.pop(0).wait()
        except Exception as exc:  # noqa: BLE001 - torchft's error path, as its _ManagedWork
            self.manager.report_error(exc)
            return False
        return True

    def get_future(self) -> torch.futures.Future:
        return _Chain(self)


class _Chain(torch.futures.Future):
    """The exchange's future, whose ``then`` callbacks its Work's ``wait`` waits for."""

    def __init__(self, exchange: _Exchange):
        super().__init__()
        self.exchange = exchange

    def then(self, callback):
        chained = self.exchange.fut.then(callback)
        self.exchange.chained.append(chained)
        return chained

    def wait(self):
        return self.exchange.fut.wait()

    def value(self):
        return self.exchange.fut.value()

    def done(self) -> bool:
        return self.exchange.fut.done()


class THCManager:
    """What :func:`enable` installed on a ``torchft.Manager``: the THC state (``state``,
    its ``stats()``), the current quorum, and ``rebuilds``: the seconds each quorum's
    rebuild of hhook's state took on this replica (the handshake and second communicator
    of the new quorum, waiting for its members included)."""

    def __init__(self, manager, quantized_only: bool = True, **options):
        missing = [name for name in PRIVATE if not hasattr(manager, name)]
        if missing:
            raise RuntimeError(f"hhook.torchft: this torchft's Manager has no {', '.join(missing)}; hhook.torchft "
                               "was written against torchft 0.2.0 (pip install 'hhook[torchft]')")
        options.setdefault("bits", 4)
        if options.get("topology", "flat") != "flat" or options.get("bits") == "auto":
            raise ValueError("hhook.torchft: topology='flat' and a fixed bits only (the quorum is not a torch group)")
        THCState.validate(**options)
        self.manager, self.pg, self.options = manager, manager._pg, options
        self.quantized_only = quantized_only
        self.state: THCState | None = None
        self.quorum: Quorum | None = None  # the newest quorum torchft configured
        self.rebuilds: list = []
        self._lock = threading.Lock()
        self._fallback = manager.allreduce
        self._configure = self.pg.configure
        self.pg.configure = self._configured
        manager.allreduce = self.allreduce

    def disable(self) -> None:
        """Give the manager back its own exchange."""
        self.manager.allreduce = self._fallback
        self.pg.configure = self._configure

    def _configured(self, store_addr, replica_id, rank, world_size, quorum_id=None, group_rank=None,
                    group_world_size=None, global_ranks=None) -> None:
        """torchft's ``ProcessGroup.configure`` (on its quorum thread), then the new quorum."""
        with self._lock:
            if self.quorum is not None:
                self.quorum.over = True
        self._configure(store_addr, replica_id, rank, world_size, quorum_id, group_rank, group_world_size,
                        global_ranks)
        quorum = Quorum(self.pg, store_addr, rank, world_size, int(quorum_id or 0), int(group_rank or 0),
                        self.manager._timeout)
        with self._lock:
            self.quorum = quorum

    def _follow(self, quorum: Quorum, device: torch.device) -> THCState:
        """The state for ``quorum``: on its first exchange here, rebuilt on every member alike
        (blocking: the options handshake and the second communicator of the quorum)."""
        state = self.state
        if state is not None and state.process_group is quorum:
            return state
        start = time.perf_counter()
        old = state.process_group if state is not None else None
        self.state = THCState(process_group=quorum, **self.options)
        if state is not None:  # the byte counts go on; only the first state is reported idle at exit
            self.state.counters.load_state_dict(state.counters.state_dict())
            report.covered_by_parent(self.state)
        state = self.state
        state.counters.calls = quorum.quorum_id << 32  # every member's first rounding stream of this quorum
        if old is not None:  # its backends end off this thread: one with a dead peer waits out its collective
            threading.Thread(target=end_second_groups, args=(old,), name="hhook-torchft-end", daemon=True).start()
        connect(state, device)
        self.rebuilds.append(time.perf_counter() - start)
        return state

    def takes(self, tensor: torch.Tensor, should_quantize: bool, reduce_op) -> bool:
        """Whether THC carries this call (else torchft's own exchange does)."""
        return ((should_quantize or not self.quantized_only) and reduce_op in (dist.ReduceOp.AVG, dist.ReduceOp.SUM)
                and not tensor.is_sparse and tensor.dtype in SUPPORTED_DTYPES)

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op=dist.ReduceOp.AVG):
        """``Manager.allreduce`` through THC where :meth:`takes` says so: torchft's contract
        (in place; AVG: the quorum's sum over the participants; a non-participating replica
        sends zeros; errors reported to the manager, the Work completes with the tensor)."""
        if not self.takes(tensor, should_quantize, reduce_op):
            return self._fallback(tensor, should_quantize=should_quantize, reduce_op=reduce_op)
        manager = self.manager
        if manager.errored():
            return _Exchange(manager, completed(tensor))
        manager.wait_quorum()
        participants = manager.num_participants()
        if not manager.is_participating():
            tensor.zero_()
        with self._lock:
            quorum = self.quorum
        try:
            if quorum is None:
                raise RuntimeError("hhook.torchft: no quorum was configured (enable before the first start_quorum)")
            if quorum.failed is not None:
                raise RuntimeError(f"hhook.torchft: an earlier THC exchange of quorum {quorum.quorum_id} failed "
                                   f"({quorum.failed}); the next quorum starts afresh")
            state = self._follow(quorum, tensor.device)
            # THC averages over the quorum's size; torchft wants the sum (over the participants, for AVG)
            factor = quorum.size / participants if reduce_op == dist.ReduceOp.AVG else float(quorum.size)
            fut = self._scaled(thc_allreduce_async(tensor.detach(), state), quorum, factor, tensor)
        except Exception as exc:  # noqa: BLE001 - torchft's error path: the step is discarded
            if quorum is not None:
                quorum.failed = exc
            manager.report_error(exc)
            return _Exchange(manager, completed(tensor))
        return _Exchange(manager, manager.wrap_future(fut, tensor))

    @staticmethod
    def _scaled(fut: torch.futures.Future, quorum: Quorum, factor: float, like: torch.Tensor) -> torch.futures.Future:
        """``fut``'s tensor times ``factor``, or its error as it is (hhook's class, not
        wrapped by torch's ``then``), which ends THC in ``quorum``."""
        result = new_future(like)

        def done(f: torch.futures.Future) -> None:
            try:
                tensor = f.value()
            except BaseException as exc:  # noqa: BLE001 - handed to torchft's wrap_future
                quorum.failed = exc
                result.set_exception(exc)
                return
            settle(result, lambda: tensor if factor == 1.0 else tensor.mul_(factor))

        attach(fut, done, quorum)
        return result


def enable(manager, bits: int = 4, quantized_only: bool = True, **options) -> THCManager:
    r"""Route ``manager``'s exchange (``torchft.Manager.allreduce``, as torchft's DiLoCo,
    streaming DiLoCo and LocalSGD call it) through THC; returns the :class:`THCManager`
    (its ``state.stats()``: bytes sent against fp32; ``disable()``).

    Call it once, after building the Manager and before its first quorum
    (``start_quorum``, DiLoCo's first sync). ``bits`` and ``options``: as
    :class:`hhook.THCState` (``block_size``, ``seed``, ``scales``, ``chunk_mb``,
    ``rounding``; ``topology="flat"``). ``quantized_only``: THC takes the calls made with
    ``should_quantize=True`` (DiLoCo's ``should_quantize``, torchtitan's
    ``fault_tolerance.should_quantize``); False: every floating-point AVG/SUM call.

    Example::
        >>> manager = torchft.Manager(pg=torchft.ProcessGroupGloo(), ..., use_async_quorum=False)
        >>> thc = hhook.torchft.enable(manager, bits=4)
        >>> with torchft.local_sgd.DiLoCo(manager, [model], inner, outer, sync_every=100, should_quantize=True):
        ...     train()
    """
    return THCManager(manager, quantized_only=quantized_only, bits=bits, **options)
