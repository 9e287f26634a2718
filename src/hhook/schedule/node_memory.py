r"""Node-shared memory for two-level THC on CPUs: the regions where the ranks of a node
meet (:mod:`hhook.schedule.two_level`), within a budget, and never left behind.

A region is one file of :data:`SHM_DIR` (tmpfs), ``(k + 1) x numel`` elements: the
``k`` ranks' rows and the node's result. Every rank of a node asks for the same regions
in the same order (the same calls, the same keys), so the decisions below, taken on each
rank alone from the same sequence, agree inside the node without a message:

* **A budget.** tmpfs pages are allocated when first touched: a region larger than what
  is free (Docker's and Kubernetes' default ``/dev/shm`` is 64 MB) kills the process with
  SIGBUS mid-step. At detection the group agrees (MIN) on a budget, each rank proposing
  :func:`budget_bytes` (half its free space, capped by ``HHOOK_SHM_MB``, default 1024);
  every region is reserved with ``posix_fallocate`` before it is mapped, so a tmpfs that
  filled up since is an ``OSError`` naming the fix, never a signal. A region larger than
  the budget is not made (that call goes through collectives); keyed regions beyond it
  are evicted, least recently used first. So a rank maps at most about the budget.
* **Nothing left behind.** A file's name exists only while a process of the job holds
  it: each rank takes a shared ``flock`` on the file before its name appears (made under
  a temporary name, locked, then linked) and unlinks it before it lets go, as soon as
  every rank of the node has mapped it (after the first barrier), when that barrier
  fails, and at exit. So a job whose processes are killed (SIGKILL, or SIGTERM from a
  launcher tearing the job down) leaves at most a file that was being made at that
  moment, and at start :func:`sweep_stale` removes the files no process holds (a
  temporary name only once its maker's process is gone: another job may be making it).
"""

from __future__ import annotations

import atexit
import collections
import fcntl
import logging
import math
import os
import re

import torch

logger = logging.getLogger(__name__)

#: Where node-local shared memory lives.
SHM_DIR = "/dev/shm"
#: Upper bound of the budget in MB (environment ``HHOOK_SHM_MB``).
DEFAULT_CAP_MB = 1024
#: Share of the free space of :data:`SHM_DIR` a job may map.
FREE_SHARE = 0.5
_FILE = re.compile(r"^hhook-[0-9a-f]{16}-node\d+-")  # a job's files (and earlier versions' lock files)
_TEMPORARY = re.compile(r"\.(\d+)$")  # a name being made: <file>.<pid of its maker> (_open_held)


def unlink_quietly(path: str) -> None:
    """Remove a node-shared file; another rank of the node may have removed it already."""
    try:
        os.unlink(path)
    except OSError:
        pass


def free_bytes(directory: str = SHM_DIR) -> int:
    """Bytes an unprivileged process may still allocate in ``directory`` (0 if unknown)."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def budget_bytes(free: int, environ=None) -> int:
    """This rank's proposal: :data:`FREE_SHARE` of ``free``, at most ``HHOOK_SHM_MB``
    (ValueError naming it where it is not a finite number of MB, 0 or more)."""
    environ = os.environ if environ is None else environ
    said = environ.get("HHOOK_SHM_MB", str(DEFAULT_CAP_MB))
    try:
        cap_mb = float(said)
    except ValueError:
        cap_mb = math.nan
    if not 0 <= cap_mb < math.inf:
        raise ValueError(f"hhook: HHOOK_SHM_MB={said!r} is not a number of MB (0 or more): set it to the most "
                         "node shared memory a job may map, or unset it (default 1024)")
    return max(0, min(int(FREE_SHARE * free), int(cap_mb * 2**20)))


def sweep_stale(directory: str = SHM_DIR) -> list[str]:
    """Remove the files of hhook jobs on this machine that no live process holds (each
    can be locked exclusively); returns the removed paths. A temporary name whose maker
    is alive is left alone: it exists unlocked for a moment (:func:`_open_held`), and
    removing it there failed another job's probe or region (a dead maker's, or one whose
    pid was taken again since, goes once that pid is free)."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        if not _FILE.match(name) or _maker_alive(name):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(fd).st_ino == os.stat(path).st_ino:  # still the file that was locked
                unlink_quietly(path)
                removed.append(path)
        except OSError:  # a live process of that job holds it (or it went meanwhile)
            pass
        finally:
            os.close(fd)
    return removed


def _maker_alive(name: str) -> bool:
    """Whether ``name`` is a temporary name of :func:`_open_held` (``<file>.<pid>``) whose
    process still runs."""
    made = _TEMPORARY.search(name)
    if made is None:
        return False
    try:
        os.kill(int(made.group(1)), 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # alive under another user, or no pid at all
        return True
    return True


def _open_held(path: str) -> int:
    """A descriptor of ``path``, made if absent, holding a shared ``flock`` on it; the
    name never exists unlocked (made under a temporary name, locked, then linked)."""
    tmp = f"{path}.{os.getpid()}"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)  # locked before it has its name: no sweep sees it free
    try:
        os.link(tmp, path)
    except FileExistsError:  # another rank of the node made it first: share that one
        os.close(fd)
        fd = os.open(path, os.O_RDWR)
        fcntl.flock(fd, fcntl.LOCK_SH)
    finally:
        unlink_quietly(tmp)
    return fd


class NodeMemory:
    """The shared-memory regions of one node of one job, as seen by one rank.

    ``prefix`` names the job's files (``hhook-<token>-node<i>-``, the same on every rank
    of the node); ``budget`` is the agreed byte budget (:func:`agreed_budget`); ``ranks``
    the node's size ``k``.
    """

    def __init__(self, prefix: str, ranks: int, budget: int, directory: str = SHM_DIR):
        self.prefix = prefix
        self.ranks = ranks
        self.budget = budget
        self.directory = directory
        self._regions: collections.OrderedDict = collections.OrderedDict()  # key -> (spec, rows, result, bytes)
        self._used = 0
        self._count = 0
        self._held: dict = {}  # path -> descriptor holding its shared flock
        self.evictions = 0
        self.refused = 0

    def path(self, name) -> str:
        return os.path.join(self.directory, f"{self.prefix}{name}")

    # -- the files this process holds ----------------------------------------------
    def open_file(self, name) -> tuple[str, int]:
        """``(path, fd)`` of the node's file ``name``, made if absent and held (a shared
        ``flock``) until :meth:`done`; released at exit at the latest."""
        path = self.path(name)
        fd = _open_held(path)
        if not self._held:
            atexit.register(self.release)  # once: release() is idempotent
        self._held[path] = fd
        return path, fd

    def done(self, path: str) -> None:
        """Every rank of the node has mapped ``path`` (or never will): unlink it, then let
        go of it (the mappings live on)."""
        unlink_quietly(path)
        fd = self._held.pop(path, None)
        if fd is not None:
            os.close(fd)

    def release(self) -> None:
        """Drop the regions and every file this process still holds (unlinked first)."""
        self._regions.clear()
        self._used = 0
        for path in list(self._held):
            self.done(path)

    # -- regions -------------------------------------------------------------------
    def region(self, key, numel: int, dtype: torch.dtype):
        """``(rows, result, path_or_None)`` for ``key``, or None where the region does not
        fit the budget (the caller uses collectives). ``rows`` is ``[k, numel]``,
        ``result`` ``[numel]``; made at the key's first call (or after an eviction, or
        when its length or dtype changed), then reused: a key is never in flight twice.
        ``path`` is returned when the file is new, for :meth:`done` once every rank of the
        node has mapped it. ``key=None`` gets a fresh region each call."""
        spec = (numel, dtype)
        found = self._regions.get(key) if key is not None else None
        if found is not None and found[0] == spec:
            self._regions.move_to_end(key)
            return found[1], found[2], None
        if found is not None:
            self._drop(key)
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = (self.ranks + 1) * numel * itemsize
        if nbytes > self.budget:
            self.refused += 1
            return None
        if key is not None:
            while self._used + nbytes > self.budget and self._regions:
                self._drop(next(iter(self._regions)))
                self.evictions += 1
        self._count += 1
        path, fd = self.open_file(f"r{self._count}")
        try:
            os.posix_fallocate(fd, 0, nbytes)  # reserve now: a full tmpfs is an error here, not SIGBUS later
        except OSError as exc:
            self.done(path)
            raise OSError(
                exc.errno,
                f"hhook: {self.directory} has no room for {nbytes / 2**20:.1f} MB of node-shared memory "
                f"({free_bytes(self.directory) / 2**20:.1f} MB free): enlarge it (docker --shm-size), lower "
                "HHOOK_SHM_MB, or set HHOOK_SHM=0 to reduce inside the node through collectives",
            ) from exc
        storage = torch.UntypedStorage.from_file(path, True, nbytes)
        flat = torch.empty(0, dtype=dtype).set_(storage.untyped(), 0, ((self.ranks + 1) * numel,), (1,))
        rows, result = flat[: self.ranks * numel].view(self.ranks, numel), flat[self.ranks * numel:]
        if key is not None:
            self._regions[key] = (spec, rows, result, nbytes)
            self._used += nbytes
        return rows, result, path

    def _drop(self, key) -> None:
        """Forget ``key``'s region: a call still in flight keeps its own mapping alive."""
        self._used -= self._regions.pop(key)[3]

    @property
    def mapped_bytes(self) -> int:
        """Bytes of the keyed regions this rank holds."""
        return self._used
