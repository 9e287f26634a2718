r"""Which ranks are alive: a rank that died (killed, out of memory, preempted) is told
within a second from one that stopped and from one that left normally, without the rank
saying anything as it dies.

A process's death closes its sockets at once (the kernel sends FIN or RST), while a
stopped process's stay open: so every rank of the default group listens on a TCP socket
whose address it publishes in the job's store, and holds one connection to every other
rank (the higher rank connects; Gloo keeps a full mesh as well). A connection that reads
end-of-file, or an address that refuses it, is a rank that ended. A rank that ends its
default group or its process normally first sends :data:`BYE` on each connection: its
peers read that it left, not that it died (it then waits, at most :data:`BYE_WAIT_S`,
for them to close their ends: a socket closed with unread data sends a reset). A
heartbeat byte each :data:`BEAT_S` from a thread of each rank tells a stopped rank
(silent for :data:`QUIET_S`) from one that runs elsewhere: a heartbeat in the store could
not tell death from a stop quickly. A full mesh rather than a star around rank 0: each
rank learns every death from its own sockets, with no relay through the store (whose
host may be the rank that died). It costs a descriptor per peer, as Gloo's own mesh does.

Everything is keyed by the process-group instance (:func:`instance`: the launcher's
attempt and how many default groups this process has made), so what a rank said in an
earlier ``init_process_group`` of the same processes (notebooks, test fixtures) or an
earlier attempt of torchrun's store is never read.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import select
import socket
import struct
import threading
import time

import torch.distributed as dist

from .. import errors

#: Seconds between heartbeats; a peer silent for QUIET_S is stopped (or far behind).
BEAT_S, QUIET_S = 1.0, 4.0
#: What a rank that leaves normally sends before it closes its connections.
BYE = b"B"
#: Longest wait at a normal end for the peers to have read the goodbye (they look 5 times a second).
BYE_WAIT_S = 0.5
DIED, LEFT = "died", "left"
logger = logging.getLogger(__name__)
_lock = threading.RLock()
_mesh: list = []  # the running _Mesh of this process's default group, if any
_made = [0, False]  # default groups this process has started, and whether one is current


def attempt() -> str:
    """The launcher's attempt: torchrun's agents keep their store across restarts, and every
    rank of an attempt holds the same run id and restart count."""
    return f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def instance() -> str:
    """The key of this process-group instance in the job's store (starts the mesh where it
    has not yet: every rank makes one mesh per default group, so the numbers agree)."""
    start()
    return f"{attempt()}/{_made[0]}"


def start() -> None:
    """Publish this rank's address and start connecting to its peers (once per default
    group; nothing in a world of one or without a default group)."""
    with _lock:
        if _made[1] or not dist.is_initialized():
            return
        _made[0], _made[1] = _made[0] + 1, True
        if dist.get_world_size() > 1:
            try:
                _mesh.append(_Mesh(f"hhook/live/{attempt()}/{_made[0]}/"))
            except Exception as exc:  # noqa: BLE001 - no socket, no store: lost ranks read as before
                logger.warning("hhook: no liveness connections (%s): a rank that dies before a handshake is "
                               "told only at the group's timeout", exc)


def stop() -> None:
    """Say goodbye on every connection and close them (the default group ends, or the
    process exits normally)."""
    with _lock:
        mesh, _made[1] = (_mesh.pop() if _mesh else None), False
    if mesh is not None:
        mesh.close()


def ended(ranks) -> dict:
    """``{rank: DIED or LEFT}`` for those of ``ranks`` (global) whose process ended."""
    with _lock:
        mesh = _mesh[0] if _mesh else None
    if mesh is None:
        return {}
    mesh.poll()
    return {rank: mesh.closed[rank] for rank in ranks if rank in mesh.closed}


def quiet(ranks) -> list:
    """Those of ``ranks`` connected and silent for :data:`QUIET_S` (stopped, or far behind)."""
    with _lock:
        mesh = _mesh[0] if _mesh else None
    if mesh is None:
        return []
    mesh.poll()
    now = time.monotonic()
    return [r for r in ranks if r in mesh.heard and r not in mesh.closed and now - mesh.heard[r] > QUIET_S]


def said(rank: int, how: str) -> str:
    """``rank``'s end in words."""
    if how == LEFT:
        return f"rank {rank} left the job normally (its program finished or destroyed its process group)"
    return f"rank {rank} died (killed, out of memory, preempted: its connection closed without a goodbye)"


def store_failed(exc: BaseException, what: str, ranks) -> Exception:
    """:func:`hhook.errors.store_failed` for this rank, the cause told by the connections
    to ``ranks`` (global): the ranks whose process ended, else those silent, else the
    store's host."""
    me = dist.get_rank()
    others = [r for r in ranks if r != me]
    gone, silent = ended(others), quiet(others)
    ranks_said = f"rank {silent[0]} is" if len(silent) == 1 else f"ranks {silent} are"
    cause = "; ".join(said(r, how) for r, how in sorted(gone.items())) or (
        f"{ranks_said} silent (stopped, swapping, or stuck)" if silent else
        "its host (the rank that runs the store, rank 0 unless the launcher's) is gone or does not answer")
    return errors.store_failed(exc, me, what, cause, ended=bool(gone))


@contextlib.contextmanager
def store_calls(what: str, ranks):
    """torch's store and network errors inside (``DistStoreError``, ``DistNetworkError``;
    not a backend's own) raise :func:`store_failed`'s error: hhook's class, this rank, the
    cause."""
    try:
        yield
    except (dist.DistStoreError, dist.DistNetworkError) as exc:
        raise store_failed(exc, what, ranks) from exc


def _local_address(store) -> str:
    """The address of this host on the route to the store's host (loopback on one node)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    host = getattr(store, "host", None) or os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            return probe.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class _Mesh:
    """One connection to every peer, read and beaten by a daemon thread."""

    def __init__(self, prefix: str):
        self.store, self.me = dist.distributed_c10d._get_default_store(), dist.get_rank()
        self.prefix, self.todo = prefix, list(range(self.me))
        self.peers: dict = {}  # rank -> socket
        self.heard: dict = {}  # rank -> monotonic time last heard from
        self.closed: dict = {}  # rank -> DIED or LEFT
        self.byes: set = set()
        self.looks, self.next_look, self.connecting = 0, 0.0, threading.Lock()
        self.io = threading.Lock()
        self.listener = socket.create_server((_local_address(self.store), 0), backlog=128)
        self.listener.setblocking(False)
        host, port = self.listener.getsockname()[:2]
        self.store.set(f"{prefix}{self.me}", f"{host}:{port}")
        self._connect()  # the peers already published, from this thread: a loaded host starts threads late
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="hhook-liveness", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        last = 0.0
        while not self.done.wait(0.2):
            self.poll()
            if time.monotonic() - last >= BEAT_S:
                last = time.monotonic()
                self._send(b".")

    def _connect(self) -> None:
        """Connect to the lower ranks whose address is published (the store is asked only
        until every one is connected, never again once it is; less often as time goes:
        a rank that never publishes, a process without hhook, costs a look every 2 s)."""
        with self.connecting:
            if self.todo and time.monotonic() >= self.next_look:
                self._look()

    def _look(self) -> None:
        self.looks += 1
        self.next_look = time.monotonic() + min(2.0, 0.1 * self.looks)
        for rank in list(self.todo):
            try:
                if not self.store.check([f"{self.prefix}{rank}"]):
                    continue
                host, port = self.store.get(f"{self.prefix}{rank}").decode().rsplit(":", 1)
            except Exception:  # noqa: BLE001 - the store's host is gone: no more peers to find
                self.todo.clear()
                return
            self.todo.remove(rank)
            try:
                conn = socket.create_connection((host, int(port)), timeout=2.0)
                conn.sendall(struct.pack("<i", self.me))
            except OSError:  # refused: the rank published its address, then ended
                with self.io:
                    self.closed.setdefault(rank, DIED)
                continue
            self._add(rank, conn)

    def _add(self, rank: int, conn: socket.socket) -> None:
        conn.setblocking(False)
        with self.io:
            self.peers[rank], self.heard[rank] = conn, time.monotonic()

    def poll(self) -> None:
        """Connect to peers now published, accept new ones and read every connection,
        without blocking."""
        self._connect()
        with self.io:
            self._accept()
            for rank, conn in list(self.peers.items()):
                try:
                    while True:
                        data = conn.recv(4096)
                        if not data:
                            raise ConnectionError
                        self.heard[rank] = time.monotonic()
                        if BYE in data:
                            self.byes.add(rank)
                except BlockingIOError:
                    continue
                except OSError:
                    self.closed[rank] = LEFT if rank in self.byes else DIED
                    del self.peers[rank]
                    conn.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, OSError):
                return
            try:
                conn.settimeout(2.0)
                rank = struct.unpack("<i", conn.recv(4, socket.MSG_WAITALL))[0]
            except (OSError, struct.error):
                conn.close()
                continue
            conn.setblocking(False)
            self.peers[rank], self.heard[rank] = conn, time.monotonic()

    def _send(self, data: bytes) -> None:
        with self.io:
            for conn in self.peers.values():
                try:
                    conn.send(data)
                except OSError:  # full or gone: the read says which
                    pass

    def close(self) -> None:
        """Goodbye, then end-of-file, then wait (at most :data:`BYE_WAIT_S`) for each peer
        to close its end: a socket closed with unread data (their heartbeats) sends a reset,
        which may discard the goodbye before the peer reads it."""
        self.done.set()
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=2.0)
        self.next_look = 0.0
        self._connect()  # a peer not yet connected (a short program, a loaded host) hears the goodbye too
        self._send(BYE)
        with self.io:
            conns, self.peers = list(self.peers.values()), {}
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        waiting, deadline = set(conns), time.monotonic() + BYE_WAIT_S
        while waiting and time.monotonic() < deadline:
            for conn in select.select(list(waiting), [], [], max(0.0, deadline - time.monotonic()))[0]:
                try:
                    while conn.recv(4096):
                        pass
                except BlockingIOError:
                    continue
                except OSError:
                    pass
                waiting.discard(conn)  # end-of-file, or reset: the peer has closed
        for conn in conns + [self.listener]:
            conn.close()

    def forget(self) -> None:
        """In a forked child: close this process's copies without a goodbye (the parent's
        stay open), so that the parent's death still closes its connections."""
        for conn in list(self.peers.values()) + [self.listener]:
            conn.close()


def _after_fork() -> None:
    global _lock
    _lock = threading.RLock()
    for mesh in _mesh:
        mesh.forget()
    _mesh.clear()


def _observe_init() -> None:
    """``torch.distributed.init_process_group`` starts the mesh as soon as the group exists,
    so that a rank that dies before its first hhook call is told too."""
    original = dist.init_process_group
    if getattr(original, "_hhook", False):
        return

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        original(*args, **kwargs)
        stop()  # a mesh of a group this process never destroyed through torch
        start()

    init_process_group._hhook = True
    dist.init_process_group = init_process_group
    dist.distributed_c10d.init_process_group = init_process_group


os.register_at_fork(after_in_child=_after_fork)
_observe_init()
