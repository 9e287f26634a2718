"""What every ``hhook-profile`` subcommand shares: exit codes, the usage error every rank
raises alike, output checks and printing. Subcommand modules import this, never
:mod:`hhook.profile.cli` (which imports them)."""

from __future__ import annotations

import importlib.util
import os
import sys

EXIT_USAGE = 2
EXIT_FAILURE = 1


class UsageError(Exception):
    """A bad argument or environment: every rank reaches the same verdict."""


def _check_outputs(args) -> str | None:
    """Rank 0's own checks of where it will write; a message, or None."""
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        if path:
            parent = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(parent):
                return f"{flag} {path}: directory {parent} does not exist"
            if not os.access(parent, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
                return f"{flag} {path}: not writable"
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        return '--plot needs matplotlib (pip install "hhook[profile]")'
    return None


def _say(text: str = "") -> None:
    print(text, flush=True)


def _options(args) -> dict:
    skip = {"json", "plot", "quiet", "command"}
    return {k: v for k, v in vars(args).items() if k not in skip}


def _error(msg: str, rank0: bool) -> None:
    if rank0:
        print(f"hhook-profile: error: {msg}", file=sys.stderr, flush=True)
