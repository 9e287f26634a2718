r"""Whether the fused CPU codec's compiled library may be loaded, and loading exactly the
file that was checked.

A library in a folder that someone else can change may hold their code, which would run
inside this process (as root, for a root job). So:

* the cache folder must be this user's or root's, not writable by its group or others, and
  so must every folder above it, unless that folder has the sticky bit (``/tmp``: there
  nobody else may rename or remove what is ours); the folders on the path as written and
  on the resolved path are both checked (a symbolic link's folder decides where it points);
* the library is opened **once** (``O_NOFOLLOW``: a link is refused), the *opened* file is
  checked (``fstat``: a regular file of this user or root, not writable by group or
  others) and that very open file is loaded through ``/proc/self/fd/N``. Checking a path
  and then loading the path again loses a race against a folder swapped in between
  (``renameat2(RENAME_EXCHANGE)``); an open file cannot be swapped. No copy is made (a
  ``memfd`` would cost a copy and needs ``/proc`` as well): the mode bits leave the
  checked bytes writable by their owner only, this user or root. The descriptor stays open
  while the library is loaded, so no other file gets the same ``/proc`` name, which the
  dynamic loader would take for the library it already has.

Without ``/proc`` (macOS) the checked path is loaded again after the same checks.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import threading
from pathlib import Path


class Untrusted(OSError):
    """A cache folder or library that someone else could have written."""


def _trusted_owner(uid: int) -> bool:
    return not hasattr(os, "getuid") or uid in (os.getuid(), 0)


def _owner(path, info) -> str | None:
    if _trusted_owner(info.st_uid):
        return None
    return f"{path} belongs to uid {info.st_uid}, not to this user (uid {os.getuid()}) or root"


def not_private(path, info=None) -> str | None:
    """Why ``path`` (the cache folder, or a library: ``info`` is its ``fstat``) may hold
    code planted by someone else, or None."""
    info = os.stat(path) if info is None else info
    foreign = _owner(path, info)
    if foreign:
        return foreign
    if info.st_mode & 0o022:
        return f"{path} is writable by its group or others (mode {info.st_mode & 0o777:o})"
    return None


def _folders_above(folder: Path) -> list[Path]:
    written = Path(os.path.abspath(folder))
    real = Path(os.path.realpath(folder))
    return list(dict.fromkeys([*written.parents, *real.parents]))


def unsafe_folder(folder: Path) -> str | None:
    """Why ``folder`` or a folder above it lets someone else replace what the cache
    holds, or None."""
    problem = not_private(folder)
    if problem:
        return problem
    for above in _folders_above(folder):
        info = os.stat(above)
        foreign = _owner(above, info)
        if foreign:
            return f"{foreign}, above the cache {folder}"
        if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
            return (f"{above}, above the cache {folder}, is writable by its group or others without the "
                    f"sticky bit (mode {info.st_mode & 0o7777:o}): they could swap the cache for their own")
    return None


_loaded: dict = {}  # (st_dev, st_ino) -> (fd kept open, library)
_loaded_lock = threading.Lock()


def load(path: Path) -> ctypes.CDLL:
    """The library at ``path``, opened once, checked as opened, and loaded from that open
    file; raises :class:`Untrusted` naming what is wrong."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Untrusted(f"{path} is a symbolic link") from None
        raise
    try:
        info = os.fstat(fd)
        problem = None if stat.S_ISREG(info.st_mode) else f"{path} is not a regular file"
        problem = problem or not_private(path, info)
        if problem:
            raise Untrusted(problem)
        with _loaded_lock:
            known = _loaded.get((info.st_dev, info.st_ino))
            if known is not None:
                return known[1]
            proc = f"/proc/self/fd/{fd}"
            lib = ctypes.CDLL(proc if os.path.exists(proc) else str(path))
            _loaded[(info.st_dev, info.st_ino)] = (fd, lib)
            fd = -1  # kept open with the library
            return lib
    finally:
        if fd >= 0:
            os.close(fd)
