r"""Command line of ``hhook-profile`` (``python -m hhook.profile``): a dispatcher.

The parser is built from each subcommand module's ``add_parser``
(:mod:`hhook.profile.commands`); the chosen module's ``check`` validates the arguments
before any communication and its ``run`` does the work. What the subcommands share
(argument types, option groups, output, the rank-0-only and all-ranks run frames) is
:mod:`hhook.profile.common`.

Examples::

    mpirun -np 4 python -m hhook.profile link
    mpirun -np 4 python -m hhook.profile allreduce --sizes 25MB --bits 4 --json ar.json
    python -m hhook.profile model --link-json link.json --allreduce-json ar.json --plot p.png
    python -m hhook.profile codec --sizes 1M,25MB --bits 2,4,8
    torchrun --nproc-per-node 2 -m hhook.profile train --model wide-cnn --methods fp32,fp16,thc:4
"""

from __future__ import annotations

import argparse

from .commands import SUBCOMMANDS
from .common import EXIT_FAILURE, EXIT_USAGE, UsageError, error, launcher_env

__all__ = ["EXIT_FAILURE", "EXIT_USAGE", "build_parser", "main"]


def _env_rank() -> int:
    try:
        return launcher_env().rank
    except UsageError:
        return 0


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of exiting and prints help on rank 0 only."""

    def error(self, message):
        raise UsageError(f"{message} (see: {self.prog} --help)")

    def _print_message(self, message, file=None):
        if _env_rank() == 0:
            super()._print_message(message, file)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="hhook-profile",
        description="Bandwidth profiler that shows what homomorphic (THC) compression saves. "
        "Launch with mpirun -np N (or torchrun for --backend gloo/nccl).",
    )
    sub = p.add_subparsers(dest="command", metavar="{" + ",".join(SUBCOMMANDS) + "}", parser_class=_Parser)
    sub.required = True
    for command in SUBCOMMANDS.values():
        command.add_parser(sub)
    return p


def main(argv=None) -> int:
    rank0 = _env_rank() == 0
    try:
        args = build_parser().parse_args(argv)
        command = SUBCOMMANDS[args.command]
        cfg = command.check(args, launcher_env())
    except UsageError as e:
        error(str(e), rank0)
        return EXIT_USAGE
    except SystemExit as e:  # --help
        return int(e.code or 0)
    return command.run(args, cfg)
