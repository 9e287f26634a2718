"""Futures for the schedules (:mod:`hhook.schedule.flat`, :mod:`hhook.schedule.two_level`) and the hook:
CUDA-aware where the value lives on a GPU, and exceptions handed to the waiter as they
are (torch wraps an exception raised in a ``then`` callback in a RuntimeError; a
:class:`~hhook.errors.ConfigMismatchError` should stay one)."""

from __future__ import annotations

import torch

from .groups import explain
from .teardown import UNSAID, attach


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


def value_of(fut: torch.futures.Future, what: str | None = None, group=None):
    """``fut.value()``; where ``what`` names the collective that ``fut`` completes, a
    stalled or lost peer of ``group`` raises as :class:`~hhook.errors.PeerTimeoutError` or
    :class:`~hhook.errors.PeerLostError` saying so (:func:`hhook.schedule.groups.explain`)."""
    try:
        return fut.value()
    except BaseException as exc:  # noqa: BLE001 - re-raised, explained where it can be
        if what is None:
            raise
        explained = explain(exc, what, group)
        if explained is exc:
            raise
        raise explained from exc


def then(fut: torch.futures.Future, fn, like: torch.Tensor, what: str | None = None,
         group=UNSAID) -> torch.futures.Future:
    """``fut.then(fn)`` where ``fn`` takes ``fut``'s value and its exception (or ``fut``'s)
    reaches the waiter unwrapped; ``what`` and ``group`` (None: the default group) as
    :func:`value_of`. Counted until released (:func:`hhook.schedule.teardown.attach`),
    under ``group`` where it is said."""
    result = new_future(like)
    named = None if group is UNSAID else group
    attach(fut, lambda f: settle(result, lambda: fn(value_of(f, what, named))), group)
    return result
