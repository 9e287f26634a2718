r"""The threads and workspaces the fused CPU stages (:mod:`hhook.codec.kernels.cpu`) run
on: ctypes releases the GIL, so a stage's blocks are split over ``torch.get_num_threads()``
Python threads of one shared pool, and its rotated blocks go to recycled float32 buffers
(fresh pages cost page faults on every call)."""

from __future__ import annotations

import concurrent.futures
import threading

import torch

MIN_PER_THREAD = 1 << 16  # coordinates: below this a second thread costs more than it saves
POOL_SIZE = 8  # rotated-block workspaces kept for reuse

_executor: concurrent.futures.ThreadPoolExecutor | None = None
_executor_threads = 0
_executor_lock = threading.Lock()


def parallel(fn, total: int, coords_per_item: int) -> list:
    """Run ``fn(first, last)`` over ``[0, total)`` split across torch's thread count.

    Called from several threads at once (the hook encodes while the transport's threads
    decode). The pool grows by replacement; submitting under the lock that replaces it
    means no call submits to a pool already shut down (whose queued work still runs).
    """
    global _executor, _executor_threads
    parts = min(torch.get_num_threads(), max(1, total * coords_per_item // MIN_PER_THREAD), max(total, 1))
    if parts <= 1:
        return [fn(0, total)]
    bounds = [total * i // parts for i in range(parts + 1)]
    with _executor_lock:
        if _executor is None or _executor_threads < parts:
            if _executor is not None:
                _executor.shutdown(wait=False)
            _executor = concurrent.futures.ThreadPoolExecutor(parts, thread_name_prefix="hhook-cpu")
            _executor_threads = parts
        futures = [_executor.submit(fn, bounds[i], bounds[i + 1]) for i in range(parts)]
    return [f.result() for f in futures]


_pool: list[torch.Tensor] = []
_pool_lock = threading.Lock()


def take_workspace(numel: int) -> torch.Tensor:
    """A float32 buffer of ``numel``: fresh pages cost page faults on every call."""
    with _pool_lock:
        fits = [i for i, b in enumerate(_pool) if b.numel() >= numel]
        if fits:
            best = _pool.pop(min(fits, key=lambda i: _pool[i].numel()))
            return best[:numel]
    return torch.empty(numel, dtype=torch.float32)


def give_workspace(buffer: torch.Tensor) -> None:
    with _pool_lock:
        base = buffer._base if buffer._base is not None else buffer
        _pool.append(base)
        if len(_pool) > POOL_SIZE:
            _pool.pop(min(range(len(_pool)), key=lambda i: _pool[i].numel()))
