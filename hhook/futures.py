"""Futures for the schedules (:mod:`hhook.flat`, :mod:`hhook.two_level`) and the hook:
CUDA-aware where the value lives on a GPU, and exceptions handed to the waiter as they
are (torch wraps an exception raised in a ``then`` callback in a RuntimeError; a
:class:`~hhook.errors.ConfigMismatchError` should stay one)."""

from __future__ import annotations

import torch


def new_future(like: torch.Tensor) -> torch.futures.Future:
    """A future that may hold ``like``'s device (a CUDA result needs a CUDA-aware future)."""
    return torch.futures.Future(devices=[like.device]) if like.is_cuda else torch.futures.Future()


def completed(value: torch.Tensor) -> torch.futures.Future:
    """A future already holding ``value``."""
    fut = new_future(value)
    fut.set_result(value)
    return fut


def settle(result: torch.futures.Future, fn, *args) -> None:
    """Complete ``result`` with ``fn(*args)``, or with the exception it raises, as it is."""
    try:
        value = fn(*args)
    except BaseException as exc:  # noqa: BLE001 - handed to the waiter
        result.set_exception(exc)
        return
    result.set_result(value)


def then(fut: torch.futures.Future, fn, like: torch.Tensor) -> torch.futures.Future:
    """``fut.then(fn)`` where ``fn`` takes ``fut``'s value and its exception (or ``fut``'s)
    reaches the waiter unwrapped."""
    result = new_future(like)
    fut.then(lambda f: settle(result, lambda: fn(f.value())))
    return result
