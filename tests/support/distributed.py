"""Run a function on N local processes joined by a Gloo process group."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import pickle
import queue
import random
import socket
import threading
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from multiprocessing.connection import wait as _wait_ready


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SRC = os.path.join(ROOT, "src")  # the package (src layout); ROOT holds tests/


# The tests' rendezvous ports: below hhook.launch's job ports (29500+) and Linux's ephemeral
# range (32768+). A port the OS hands out for bind(0) comes from the ephemeral range, where
# every outgoing connection (each Gloo pair's, each rank's to its store) also takes its local
# port: one picked, released, and taken by a connection before the job's store bound it left
# a job's ranks unable to meet (issue 56). Here each xdist worker hands out its own slice in
# turn, from a random start (other test runs on the host), skipping what is bound now.
PORTS = (20000, 29500)
_turn = {}  # pid -> the next port's index (a forked process starts its own turn)


def port_slice(environ=os.environ) -> range:
    """This process's ports: ``PORTS`` split among ``PYTEST_XDIST_WORKER_COUNT`` workers,
    the slice of ``PYTEST_XDIST_WORKER`` (gwN), the whole range outside xdist."""
    lo, hi = PORTS
    workers = int(environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    worker = int(environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)
    size = (hi - lo) // max(workers, 1)
    return range(lo + worker * size, lo + (worker + 1) * size)


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port of this worker's slice (:func:`port_slice`), free now, for a rendezvous the
    caller starts right away; the next call hands out the next port."""
    ports, pid = port_slice(), os.getpid()
    _turn.setdefault(pid, random.SystemRandom().randrange(len(ports)))  # not a test's seeded random
    for _ in range(len(ports)):
        port = ports[_turn[pid] % len(ports)]
        _turn[pid] += 1
        if _bindable(port):
            return port
    raise RuntimeError(f"no free port in {ports}")


def subprocess_env(**extra) -> dict:
    """The environment for a launched job that imports this checkout's hhook."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([SRC, ROOT, env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    # Ranks share two cores: yield instead of busy-polling while waiting.
    env["OMPI_MCA_mpi_yield_when_idle"] = "1"
    env.update(extra)
    return env


# Ranks start from a fork server that has imported torch and hhook once, not each from a
# fresh interpreter (spawn) that imports them again: about 1.8 s a process here, a few
# hundred worlds in the suite. The server is an interpreter of its own (no thread of this
# one is forked); each rank takes the test's environment and working directory as they are
# at the call (the server keeps those of its start), imports the test's function only
# then, and ends as an interpreter does: a forked child leaves by os._exit, which skips
# the atexit handlers (hhook's release of node shared memory among them), so _worker
# runs them.
# The server imports hhook before any test runs, from its own sys.path: this checkout's
# src/ must be on its PYTHONPATH (pyproject's pythonpath reaches pytest's interpreter
# only), or every rank runs the installed hhook instead of the code under test.
os.environ["PYTHONPATH"] = os.pathsep.join(
    [SRC, ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in (SRC, ROOT)])
_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "hhook"])


# Worlds start from several threads at once (test_exit runs four jobs at a time), and
# multiprocessing's poll of a forkserver child is not thread-safe: two threads that both see
# the child's sentinel readable both read it, one gets the exit code, the other EOF, which
# CPython records as exit code 255. Process.start() polls every child of this process (its
# _cleanup), so one thread's start raced another's join: a CI run saw a rank that exited 0
# reported as 255. Every start and poll takes this lock; a wait only watches the sentinel.
_POLL = threading.Lock()


def _start(procs) -> None:
    with _POLL:
        for p in procs:
            p.start()


def _alive(p) -> bool:
    with _POLL:
        return p.is_alive()


def _join(p, timeout: float):
    """``p``'s exit code once it ended within ``timeout`` seconds; else kill it and None."""
    _wait_ready([p.sentinel], timeout)
    with _POLL:
        if p.exitcode is not None:
            return p.exitcode
        p.kill()
        p.join()
    return None


def _worker(rank, world_size, port, backend, cuda, job, environ, cwd, results, pg_timeout_s=None):
    """One rank: ``pg_timeout_s`` (None: torch's default) is the default group's timeout."""
    import datetime

    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    torch.set_num_threads(1)  # N ranks share two cores
    try:
        fn, args = pickle.loads(job)
        if cuda:
            # Gloo ranks share GPU 0; NCCL refuses two ranks on one GPU, so rank r takes GPU r.
            torch.cuda.set_device(rank if backend == "nccl" else 0)
        timeout = {} if pg_timeout_s is None else {"timeout": datetime.timedelta(seconds=pg_timeout_s)}
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, **timeout
        )
        # Plain pickle copies tensors by value. The queue's own pickler would send a tensor
        # as a shared-memory handle, which dies with this process: under load the parent
        # read it after the exit and failed at random (issue 11, item 6).
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        # The answer is on the pipe before teardown: Gloo's teardown sometimes aborts the
        # process (torch 2.13, with or without hhook), and a put still in the queue's
        # feeder thread died with it (a CI run lost a rank's answer that way).
        results.close()
        results.join_thread()
        if dist.is_initialized():
            dist.destroy_process_group()
        atexit._run_exitfuncs()


def run_world(fn, world_size: int, *args, timeout: float = 180.0, backend: str = "gloo", cuda: bool = False,
              fresh: bool = False) -> list:
    """``[fn(rank, world_size, *args) for each rank]``, each rank in its own process.

    ``backend`` is the process group's; ``cuda`` puts every rank on GPU 0 (NCCL: rank r
    on GPU r); ``fresh`` starts each rank in a new interpreter (spawn), not from the fork
    server: for what a process measures of itself (a forked rank's resident memory counts
    the server's pages only as it touches them, so it grows where a user's would not).

    ``fn`` must be a module-level function; it should return plain Python data (results
    are copied by value, so tensors work, but lists and numbers keep the test's intent
    obvious). A rank's exception fails the call with
    every rank's traceback; a hang fails it after ``timeout`` seconds.
    """
    ctx = mp.get_context("spawn") if fresh else _CONTEXT
    results = ctx.Queue()
    port = free_port()
    job = pickle.dumps((fn, args))
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, backend, cuda, job, dict(os.environ), os.getcwd(),
                                          results), daemon=True)
        for r in range(world_size)
    ]
    _start(procs)
    out, errors = {}, []
    try:
        for _ in range(world_size):
            rank, ok, value = results.get(timeout=timeout)
            if ok:
                out[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank}:\n{value}")
    except queue.Empty:
        errors.append(f"timed out after {timeout}s; ranks that answered: {sorted(out)}")
    finally:
        for p in procs:
            _join(p, 10)
    if errors:
        raise AssertionError("\n".join(errors))
    return [out[r] for r in range(world_size)]


def _cases_worker(rank, world_size, cases, before_each):
    out = {}
    for key, fn, args in cases:
        try:
            if before_each is not None:
                before_each()
            out[key] = (True, fn(rank, world_size, *args))
        except Exception:  # this case fails its own test; the cases after it still run
            out[key] = (False, traceback.format_exc())
    return out


def run_cases(cases, world_size: int, *, before_each=None, timeout: float = 600.0) -> dict:
    """Several independent scenarios in one world, one after another: ``cases`` is a list of
    ``(key, fn, args)``; returns ``key -> [(ok, fn(rank, world_size, *args) or its
    traceback) for each rank]``. For tests that each check one scenario of a module-scoped
    fixture: a world costs its ranks' start, the process group and hhook's handshake, a
    scenario often less. ``before_each`` (module-level, no arguments) runs before each case
    (``torch._dynamo.reset``). A case that raises fails only the test that reads it
    (:func:`case_values`); a hang fails them all."""
    ranks = run_world(_cases_worker, world_size, cases, before_each, timeout=timeout)
    return {key: [r[key] for r in ranks] for key, _, _ in cases}


def case_values(outcomes: list) -> list:
    """What each rank's case of :func:`run_cases` returned; its tracebacks if any raised."""
    failed = [value for ok, value in outcomes if not ok]
    assert not failed, "\n".join(failed)
    return [value for _, value in outcomes]


def shared_worlds(cases: dict):
    """For a module-scoped fixture: ``cases`` maps a world size to its :func:`run_cases`
    list; returns ``of(world, *key)``, what each rank's case ``key`` returned
    (:func:`case_values`), the world of that size run once, by the first test that asks."""
    worlds = {}

    def of(world, *key):
        if world not in worlds:
            worlds[world] = run_cases(cases[world], world)
        return case_values(worlds[world][key])

    return of


def run_outcomes(fn, world_size: int, *args, pg_timeout_s: float = 10.0, timeout: float = 120.0) -> list[dict]:
    """How each rank of ``fn(rank, world_size, *args)`` ended, for jobs whose ranks may fail:
    ``[{"value": what fn returned (None if it raised), "error": its traceback (or None),
    "exitcode": the process's exit code (negative: the signal that ended it; None: still
    running at the deadline, then killed)}]``, over Gloo with a group timeout of
    ``pg_timeout_s``. A rank that never answers has value and error None."""
    results = _CONTEXT.Queue()
    port = free_port()
    job = pickle.dumps((fn, args))
    procs = [_CONTEXT.Process(target=_worker, args=(r, world_size, port, "gloo", False, job, dict(os.environ),
                                                    os.getcwd(), results, pg_timeout_s), daemon=True)
             for r in range(world_size)]
    _start(procs)
    out = [{"value": None, "error": None, "exitcode": None} for _ in range(world_size)]
    answered, deadline, ended = set(), time.monotonic() + timeout, False
    while len(answered) < world_size and time.monotonic() < deadline:
        try:  # until every rank answered, or every one that did not has ended (a killed rank never answers)
            rank, ok, value = results.get(timeout=0.5 if not ended else 0.2)
        except queue.Empty:
            if ended:
                break
            ended = all(not _alive(procs[r]) for r in range(world_size) if r not in answered)
            continue
        answered.add(rank)
        out[rank]["value" if ok else "error"] = pickle.loads(value) if ok else value
    for rank, p in enumerate(procs):
        out[rank]["exitcode"] = _join(p, pg_timeout_s + 30)
    return out


os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


@contextlib.contextmanager
def logged(name: str, level: int = logging.WARNING):
    """Collect the messages of logger ``name`` (and its children) at ``level`` or above."""
    lines: list = []

    class _Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    handler = _Keep(level)
    log = logging.getLogger(name)
    log.addHandler(handler)
    try:
        yield lines
    finally:
        log.removeHandler(handler)
