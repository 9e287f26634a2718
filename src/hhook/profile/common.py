r"""What every ``hhook-profile`` subcommand shares, in one place: exit codes and the usage
error every rank raises alike, argument types (argparse ``type=`` validators), the option
groups, output checks and printing, and the two ways a subcommand runs (rank 0 alone,
or every rank over a communicator).

Every argument is checked before any communication, identically on every rank (the
world size comes from the launcher's variables), so a bad argument makes every rank
exit with status 2 and one message from rank 0, never a hang or a traceback. Checks that
only rank 0 can make (can it write ``--json``/``--plot``? is matplotlib there?) are
broadcast from rank 0 before the first measurement. A failure during a measurement
prints the failing rank's traceback and aborts the job (``MPI_Abort`` under ``--backend
mpi``), so no rank is left waiting in a collective.

Subcommand modules (:mod:`hhook.profile.commands`) import this, never
:mod:`hhook.profile.cli` (which imports them).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import traceback

from .units import parse_rate, parse_size, sweep

EXIT_USAGE = 2
EXIT_FAILURE = 1


class UsageError(Exception):
    """A bad argument or environment: every rank reaches the same verdict."""


def launcher_env():
    """The launcher's view of this rank (:func:`hhook.launch.detect_env`); a UsageError if
    its variables contradict each other."""
    from ..launch import detect_env

    try:
        return detect_env()
    except ValueError as e:
        raise UsageError(str(e)) from None


# -- argument types: each returns the value or raises ArgumentTypeError ----------------
def _typed(parse, text: str, what: str):
    try:
        return parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None


def integer(lo: int | None = None, hi: int | None = None):
    """An int in ``lo..hi`` (either bound may be open)."""
    def parse(text: str) -> int:
        value = _typed(int, text, "an integer")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            bound = f"at least {lo}" if hi is None else f"in {lo}..{hi}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse


def number(lo: float, strict: bool = True, hi: float | None = None):
    """A float above ``lo`` (``strict``) or at least ``lo``, and at most ``hi``."""
    def parse(text: str) -> float:
        value = _typed(float, text, "a number")
        if not (value > lo if strict else value >= lo) or (hi is not None and not value <= hi):
            if hi is not None:
                bound = f"in {'(' if strict else '['}{lo:g}, {hi:g}]"
            else:
                bound = "positive" if (lo == 0 and strict) else f"{'above' if strict else 'at least'} {lo:g}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value:g}")
        return value

    return parse


def size(text: str) -> int:
    """A positive size: ``4096``, ``4K``, ``25MB`` (:func:`hhook.profile.units.parse_size`)."""
    try:
        value = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"sizes must be positive, got {value}")
    return value


def _listed(item, text: str) -> list:
    values = [item(t) for t in text.split(",") if t.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return values


def size_list(text: str) -> list[int]:
    """Comma-separated positive sizes."""
    return _listed(size, text)


def integer_list(lo: int | None = None):
    """Comma-separated integers, each at least ``lo``."""
    item = integer(lo)
    return lambda text: _listed(item, text)


def word_list(text: str) -> list[str]:
    return [t.strip().lower() for t in text.split(",") if t.strip()]


def rate(text: str) -> float:
    """A link rate: ``1gbit``, ``100mbit``, ``0.117GB/s`` (bytes per second)."""
    try:
        return parse_rate(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def assignment(lo: float = 0.0, strict: bool = True):
    """``METHOD=NUMBER`` with the number above ``lo`` (``strict``) or at least ``lo``."""
    value_of = number(lo, strict)

    def parse(text: str) -> tuple[str, float]:
        name, sep, value = text.partition("=")
        if not sep or not name.strip():
            raise argparse.ArgumentTypeError(f"expected METHOD=NUMBER, got {text!r}")
        try:
            return name.strip().lower(), value_of(value)
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{text}: {e}") from None

    return parse


def plot_path(text: str) -> str:
    if not text.lower().endswith((".png", ".pdf", ".svg")):
        raise argparse.ArgumentTypeError(f"{text}: the file name must end in .png, .pdf or .svg")
    return text


# -- option groups ---------------------------------------------------------------
def add_output_options(sp) -> None:
    """``--json``, ``--plot``, ``--quiet``: every subcommand's."""
    sp.add_argument("--json", metavar="PATH", help="write every figure as JSON ({meta, results})")
    sp.add_argument("--plot", metavar="PATH.png", type=plot_path, help="draw the figure (matplotlib, Agg)")
    sp.add_argument("--quiet", action="store_true",
                    help="no progress bar (it is drawn on stderr only when that is a terminal)")


def add_comm_options(sp) -> None:
    """``--backend``, ``--threads``, ``--timeout`` of the subcommands that measure collectives."""
    sp.add_argument("--backend", choices=("mpi", "gloo", "nccl"), default="mpi",
                    help="mpi: mpi4py directly (default); gloo/nccl: torch.distributed, "
                    "initialised from the launcher's variables (MASTER_ADDR default 127.0.0.1, "
                    "MASTER_PORT default derived from the job id); nccl runs on the local GPU")
    sp.add_argument("--threads", type=integer(1), help="torch threads per rank (default: torch's own)")
    sp.add_argument("--timeout", type=number(0), default=300.0, metavar="S",
                    help="torch.distributed timeout in seconds (gloo/nccl; default 300)")


def add_sweep_options(sp, begin: str, end: str, factor: float, iters: int, warmup: int) -> None:
    """The size sweep of ``link`` and ``allreduce`` (nccl-tests' ``-b -e -f -n -w``)."""
    sp.add_argument("--sizes", type=size_list, metavar="LIST",
                    help="explicit sizes, e.g. 4K,1M,25MB (K/M/G = 1024^k, KB/MB/GB = 1000^k); "
                    "overrides -b/-e/-f")
    sp.add_argument("-b", "--begin", type=size, default=parse_size(begin), metavar="SIZE",
                    help=f"smallest size of the sweep (default {begin})")
    sp.add_argument("-e", "--end", type=size, default=parse_size(end), metavar="SIZE",
                    help=f"largest size of the sweep (default {end})")
    sp.add_argument("-f", "--factor", type=number(1.0), default=factor,
                    help=f"multiplication factor between sizes (default {factor:g})")
    sp.add_argument("-n", "--iters", type=integer(1), default=iters,
                    help=f"timed iterations per size (default {iters}; fewer above 4 MiB, "
                    "at least 3, unless --fixed-iters)")
    sp.add_argument("-w", "--warmup", type=integer(0), default=warmup,
                    help=f"untimed warm-up iterations per size (default {warmup})")
    sp.add_argument("--fixed-iters", action="store_true", help="same -n and -w at every size")


# -- checks that need more than one argument or the environment ---------------------
def check_sizes(sizes: list[int], float32: bool) -> list[int]:
    if float32:
        for s in sizes:
            if s % 4:
                raise UsageError(f"size {s} B is not a whole number of float32 elements (use a multiple of 4)")
    return sizes


def check_sweep(args, float32: bool) -> list[int]:
    """The sizes of ``--sizes`` or of the ``-b/-e/-f`` sweep."""
    if args.sizes is not None:
        return check_sizes(list(args.sizes), float32)
    if args.end < args.begin:
        raise UsageError(f"-e/--end ({args.end}) is smaller than -b/--begin ({args.begin})")
    return check_sizes(sweep(args.begin, args.end, args.factor), float32)


def device_of(args) -> str:
    """``--device``, or its default: cuda with the nccl backend, else cpu."""
    device = getattr(args, "device", None)
    return device if device is not None else ("cuda" if args.backend == "nccl" else "cpu")


def check_backend(backend: str, device: str = "cpu") -> None:
    """The backend's library and device are there."""
    if backend == "mpi" and importlib.util.find_spec("mpi4py") is None:
        raise UsageError("--backend mpi needs mpi4py (pip install mpi4py, or hhook[mpi]); "
                         "or use --backend gloo")
    if backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--backend nccl needs a CUDA GPU on every rank; use --backend gloo or mpi on CPU")
    if device == "cuda":
        import torch

        if backend == "mpi" or not torch.cuda.is_available():
            raise UsageError("--device cuda needs a CUDA GPU on every rank and --backend gloo or nccl")


def check_outputs(args) -> str | None:
    """Rank 0's own checks of where it will write; a message, or None."""
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        problem = path and _unwritable(path)
        if problem:
            return f"{flag} {path}: {problem}"
    if args.json and args.plot and _same_file(args.json, args.plot):
        return (f"--json {args.json} and --plot {args.plot} name the same file ({os.path.realpath(args.json)}): "
                "one would overwrite the other; name two files")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        return '--plot needs matplotlib (pip install "hhook[profile]")'
    return None


def _same_file(a: str, b: str) -> bool:
    """Whether two paths are one file: spelt otherwise, through symbolic links, or hard links."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one does not exist yet: realpath said it all
        return False


def _unwritable(path: str) -> str | None:
    """Why the run's results could not be written to ``path`` at its end, or None: the
    file is opened for appending now (as root too, where permission bits say nothing),
    and removed again if this made it. A symbolic link is written through at the end, so
    its target is what is checked (and removed again), never the user's link."""
    target = os.path.realpath(path)
    if os.path.isdir(target):
        return "is a directory (name a file)"
    parent = os.path.dirname(target)
    if not os.path.isdir(parent):
        return f"directory {parent} does not exist"
    existed = os.path.lexists(target)
    try:
        with open(target, "a"):
            pass
    except OSError as e:
        return f"not writable ({e.strerror})"
    if not existed:
        os.unlink(target)
    return None


# -- output ----------------------------------------------------------------------
def say(text: str = "") -> None:
    print(text, flush=True)


def options(args) -> dict:
    """The options of the run, as the JSON's ``meta.options``."""
    skip = {"json", "plot", "quiet", "command"}
    return {k: v for k, v in vars(args).items() if k not in skip}


def error(msg: str, rank0: bool) -> None:
    if rank0:
        print(f"hhook-profile: error: {msg}", file=sys.stderr, flush=True)


def set_threads(threads: int | None) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


# -- the two ways a subcommand runs ------------------------------------------------------
def run_local(args, body, rank0: bool) -> int:
    """No communication: rank 0 runs ``body(args) -> (extra meta, rows)``, the others return."""
    from . import report

    if not rank0:
        return 0
    problem = check_outputs(args)
    if problem:
        error(problem, True)
        return EXIT_USAGE
    try:
        m = report.meta(args.command, None, None, options(args))
        say(report.header(m))
        extra, rows = body(args)
        m.update(extra)
        if args.json:
            report.write_json(args.json, m, rows)
    except Exception as e:  # noqa: BLE001 - one clear line, traceback only when asked
        error(f"{type(e).__name__}: {e}", True)
        if os.environ.get("HHOOK_DEBUG"):
            traceback.print_exc()
        return EXIT_FAILURE
    return 0


def run_distributed(args, body, min_ranks: tuple[int, str] | None = None) -> int:
    """Every rank connects (``--backend``) and runs ``body(args, comm) -> (extra meta, rows)``;
    ``min_ranks = (n, message)`` refuses a smaller world with the same verdict on every rank."""
    from . import report
    from .comm import connect

    set_threads(args.threads)
    try:
        comm = connect(args.backend, args.timeout)
    except Exception as e:  # noqa: BLE001
        error(f"cannot start the {args.backend} backend: {type(e).__name__}: {e}", True)
        return EXIT_FAILURE
    rank0 = comm.rank == 0
    try:
        # Same verdict everywhere: the size is known locally, rank 0's file checks are broadcast.
        if min_ranks is not None and comm.size < min_ranks[0]:
            raise UsageError(min_ranks[1])
        problem = comm.bcast_object(check_outputs(args) if rank0 else None)
        if problem:
            raise UsageError(problem)
        hosts = comm.allgather_object(comm.host_info())
        m = report.meta(args.command, comm, hosts, options(args))
        if rank0:
            say(report.header(m))
            say(f"# command: hhook-profile {' '.join(sys.argv[1:])}")
        extra, rows = body(args, comm)
        m.update(extra)
        if rank0 and args.json:
            report.write_json(args.json, m, rows)
        comm.barrier()
    except UsageError as e:
        error(str(e), rank0)
        comm.finalize()
        return EXIT_USAGE
    except BaseException as e:  # noqa: BLE001 - never leave other ranks waiting in a collective
        if isinstance(e, KeyboardInterrupt):
            comm.abort(130)
        sys.stderr.write(f"hhook-profile: rank {comm.rank} failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        comm.abort(EXIT_FAILURE)
        return EXIT_FAILURE
    comm.finalize()
    return 0
