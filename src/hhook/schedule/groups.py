r"""A second communicator over a process group's ranks, made by its members alone.

Agreed scales need two collectives per tensor: the MAX is launched from the hook, in hook
order, and the SUM from the MAX's continuation, in completion order, which differs
between ranks. Launched on one group they would pair unrelated collectives, so the SUMs
go on a second communicator over the same ranks (in hook order, through a
:class:`~hhook.schedule.futures.Sequencer`).

``torch.distributed.new_group`` cannot make it safely from inside a library: without
``use_local_synchronization`` every rank of WORLD must call it, in the same order as
every other ``new_group`` of the program (a DDP model on a subgroup is hooked only on its
members); with it, torch 2.13 hangs in the Gloo constructor once the program has created
any other subgroup (``dist.new_group([1, 2])`` on 3 ranks, then a local-synchronization
group over all three: every rank waits forever). So the backend is built directly, by the
members only, on the default store under a prefix that names the parent group and how
many second communicators this process already made for it: members create them in the
same order (at each state's blocking handshake), so the prefixes match.
"""

from __future__ import annotations

import contextlib
import datetime
import secrets
import threading

import torch
import torch.distributed as dist

from .. import errors
from . import liveness, membership
from .blame import blame, reported

_lock = threading.Lock()
_made: dict = {}  # parent group name -> second communicators made for it in this process
# The second communicators whose backend is alive, held here so that no backend loses its
# last reference inside one of its own worker threads (a continuation holds it: the
# thread would join itself and abort the process, "Resource deadlock avoided"). They end
# in end_second_groups: when their parent group is destroyed and at exit, from a thread
# of the program, before the interpreter finalizes.
_open: list = []


def end_second_groups(parent=None) -> None:
    """End the backends of hhook's second communicators over ``parent`` (None or WORLD:
    every one), from this thread: each backend's last reference goes here, and torch's
    holder releases the GIL while the backend joins its worker threads, so a continuation
    still on one of them finishes first (a collective still in flight waits at most the
    group's timeout). Called before ``destroy_process_group`` and at exit: a worker
    thread that takes the GIL once the interpreter finalizes is ended by Python mid-C++,
    which aborts the process ("terminate called without an active exception"). Never
    from a worker thread of a backend (it would join itself): there, nothing happens.
    :mod:`hhook.schedule.teardown` calls it."""
    if isinstance(threading.current_thread(), threading._DummyThread):  # not a thread of the program
        return
    every = parent is None or parent == dist.GroupMember.WORLD
    name = None if every else getattr(parent, "group_name", None)
    with _lock:
        ending = [g for g in _open if every or g.parent_name == name]
        _open[:] = [g for g in _open if g not in ending]
    for group in ending:
        group.close()


def longest_timeout() -> float | None:
    """The longest collective timeout (s) of the second communicators still open, or None."""
    with _lock:
        return max((g.timeout.total_seconds() for g in _open), default=None)


def timeout_of(group) -> datetime.timedelta:
    """The collective timeout of ``group`` (None: the default group), as the job set it
    (``init_process_group(timeout=...)``, ``new_group(timeout=...)``); a
    :class:`SecondGroup` has its parent's. Falls back to torch's default."""
    if isinstance(group, SecondGroup):
        return group.timeout
    return membership.of(group).timeout


def others_of(group) -> list[int]:
    """The global ranks of ``group`` other than this one ([] where that cannot be told,
    or where they are not ranks of the default group: a :class:`~.membership.Membership`
    that is not ``live``)."""
    if not getattr(group, "live", True):
        return []
    try:
        ranks = group.ranks if isinstance(group, SecondGroup) else dist.get_process_group_ranks(
            group if group is not None else dist.group.WORLD)
        me = dist.get_rank()
    except Exception:  # noqa: BLE001 - not a group of this process
        return []
    return [r for r in ranks if r != me]


def peers_of(group) -> str:
    """Who can be at fault when a collective of ``group`` fails, for messages: the
    global ranks of the group other than this one."""
    others = others_of(group)
    if not others:
        return ""
    return f"rank {others[0]}" if len(others) == 1 else f"one of ranks {others}"


def explain(exc: BaseException, what: str, group) -> BaseException:
    """:func:`hhook.errors.explain` with ``group``'s timeout and peers, and
    :func:`hhook.schedule.blame.blame` to name the rank that stalled."""
    timeout = timeout_of(group).total_seconds()
    others = others_of(group)
    where = f"{what} on {_label(group)}"
    recovery = group.recovery if isinstance(group, SecondGroup) else membership.of(group).recovery
    return errors.explain(exc, what, timeout, peers_of(group), lambda kind: blame(kind, others, timeout, where),
                          recovery)


def failure_cause(group) -> str:
    """For a rank told by a peer of ``group`` that the peer failed: what the stall reports
    say made it fail (", by the job's reports: rank 2 died ..."), or "" where they do not
    tell. :func:`hhook.schedule.blame.blame` of the peers, as where a peer closed its
    connection."""
    others = others_of(group)
    timeout = timeout_of(group).total_seconds()
    who = blame("lost", others, timeout, f"a collective that a peer failed on {_label(group)}")
    if who is None or not who.culprits or not (who.lost or who.waiting):
        return ""
    if not who.lost:  # a peer waited the timeout for a rank that never reported: it stalled
        return (f"; by the job's reports, a peer ({errors.ranks_text(who.culprits)}) stalled and "
                f"{errors.ranks_text(who.waiting)} waited the timeout for it")
    how = "left the job normally" if set(who.culprits) <= set(who.left) else "died (killed, out of memory, preempted)"
    return f"; by the job's reports, {errors.ranks_text(who.culprits)} {how} and {errors.ranks_text(who.lost)} lost it"


def told_failure_cause(group) -> str:
    """:func:`failure_cause` where there is one to find (a rank of the job died, or a peer
    of ``group`` reported why it gave up), else "" without consulting or writing any
    report (a peer that failed locally, as a rank's own encoding error)."""
    others = others_of(group)
    if not others:
        return ""
    died = liveness.DIED in liveness.ended(range(dist.get_world_size())).values()
    return failure_cause(group) if died or reported(others) else ""


def _label(group) -> str:
    """``group`` as the stall report names it to other ranks (the same on every member)."""
    if isinstance(group, SecondGroup):
        return f"hhook's second communicator of group {group.parent_name!r}"
    group = group if group is not None else dist.group.WORLD
    return f"group {getattr(group, 'group_name', '?')!r}"


@contextlib.contextmanager
def explained(what: str, group):
    """Collectives of ``group`` inside fail as :func:`explain` says (a peer lost or stalled
    reads as :class:`~hhook.errors.PeerLostError` or :class:`~hhook.errors.PeerTimeoutError`)."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - re-raised, explained where it can be
        err = explain(exc, what, group)
        if err is exc:
            raise
        raise err from exc


def agrees(group, fingerprint: float, device, counters=None, dtype: torch.dtype = torch.float32) -> bool:
    """Whether every rank of ``group`` holds ``fingerprint`` (exact in ``dtype``): a blocking
    MAX all-reduce of :func:`pair`, read by :func:`pair_agrees`, so every rank reaches the
    same answer. ``counters`` (:class:`hhook.stats.Counters`) are charged the vector's bytes."""
    vector = pair(fingerprint, device, dtype)
    membership.of(group).all_reduce(vector, dist.ReduceOp.MAX).wait()
    if counters is not None:
        counters.add(None, 0, vector.nbytes)
    return pair_agrees(vector)


def pair(fingerprint: float, device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``[f, -f]``, to MAX-reduce: its two halves match afterwards only where no rank differs."""
    return torch.tensor([fingerprint, -fingerprint], dtype=dtype, device=device)


def pair_agrees(vector: torch.Tensor) -> bool:
    """Whether a MAX-reduced :func:`pair` says every rank sent the same fingerprint."""
    high, low = vector.tolist()
    return high == -low


def reduce_scatter_flat(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    """SUM-reduce-scatter one flat ``input`` of ``world_size`` equal chunks into ``output``
    (this rank's chunk): ``reduce_scatter_single`` where torch has it (2.13; its old name
    warns there), ``reduce_scatter_tensor`` where it does not (2.11)."""
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def reduces_on_host(group) -> bool:
    """Whether ``group`` reduces CPU tensors (it has a Gloo or MPI backend): small control
    vectors then travel from the host, where reading them costs no device synchronisation."""
    return membership.of(group).on_host


class SecondGroup:
    """``all_reduce(tensor, op, async_op=True)`` on a private backend over ``parent``'s ranks."""

    def __init__(self, parent, device_type: str):
        parent = parent if parent is not None else dist.group.WORLD
        members = membership.of(parent)  # a torch group, or a membership torch does not know (hhook.torchft)
        rank, size, name = members.rank, members.size, members.name
        self.recovery = members.recovery
        with _lock:
            index = _made.get(name, 0)
            _made[name] = index + 1
        # A store may outlive a job's attempt (torchrun's restarts): the keys of this one
        # carry a number rank 0 drew now, so a stale address of a failed attempt is never
        # read as a live peer's. The members are all here (a blocking handshake).
        # On the host wherever the parent has Gloo (CUDA tensors over Gloo too: ranks sharing a GPU).
        nonce = torch.tensor([secrets.randbits(62) if rank == 0 else 0], dtype=torch.int64,
                             device=torch.device("cpu" if members.on_host else device_type))
        with explained("the handshake of hhook's second communicator", parent):
            members.all_reduce(nonce, dist.ReduceOp.MAX).wait()
        self.handshake_bytes = nonce.nbytes  # handed to a collective: the owner counts it
        store = dist.PrefixStore(f"hhook/second/{name}/{index}/{int(nonce.item()):x}/", members.store)
        # The parent's timeout: a stalled peer fails these SUMs when it fails the job's own
        # collectives, not 30 minutes later.
        self.timeout = timeout = members.timeout
        # The backend's ranks meet through the store: its host gone raises hhook's error.
        with members.store_calls(f"the set-up of hhook's second communicator of group {name!r}"):
            if device_type == "cuda" and not members.cuda_over_gloo:
                if not dist.is_nccl_available():
                    raise RuntimeError("hhook: CUDA tensors need NCCL for the agreed-scale SUMs")
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timeout
                self.backend = dist.ProcessGroupNCCL(store, rank, size, options)
            else:
                self.backend = dist.ProcessGroupGloo(store, rank, size, timeout)
        self.parent = parent
        self.parent_name = name
        self.ranks, self.live = members.ranks, members.live
        self.index = index
        with _lock:
            _open.append(self)

    def close(self) -> None:
        """Drop the backend (and the parent group): the backend ends here, from this
        thread, once its collectives in flight have completed or timed out."""
        backend, self.backend, self.parent = self.backend, None, None
        if backend is not None and not isinstance(backend, dist.ProcessGroupGloo):
            try:
                backend.shutdown()  # NCCL: its communicators end before the object
            except Exception:  # noqa: BLE001 - best effort at the end
                pass
        del backend  # the last reference: ~ProcessGroupGloo joins its threads, without the GIL

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM):
        """Launch a SUM (or ``op``) allreduce; returns its Work."""
        if self.backend is None:
            raise RuntimeError(f"hhook: the process group {self.parent_name!r} of this THCState was destroyed "
                               "(torch.distributed.destroy_process_group); build a new THCState for a new one")
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        return self.backend.allreduce([tensor], opts)

    def all_gather(self, output, input):
        """Launch an all-gather of equal-sized ``input`` into flat ``output``; returns its Work."""
        if self.backend is None:
            return self.all_reduce(input)  # raises the destroyed group's error
        return self.backend.allgather([list(output.chunk(len(self.ranks)))], [input])
