r"""The subcommands of ``hhook-profile``, one module each, in the order ``--help`` lists them.

Each module has ``add_parser(subparsers)`` (its options, with argparse ``type=``
validators from :mod:`hhook.profile.common`), ``check(args, env) -> cfg`` (what needs more
than one argument or the launcher's environment; raises
:class:`~hhook.profile.common.UsageError`, identically on every rank) and
``run(args, cfg) -> exit status``.
"""

from . import allreduce, codec, link, model, train

SUBCOMMANDS = {"link": link, "allreduce": allreduce, "model": model, "codec": codec, "train": train}
