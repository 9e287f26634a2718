"""The profiler's optional dependencies, imported with a message that says how to get them.

The core (``hhook``: codec, hooks, integrations) needs torch and numpy only; the
profiler's extras install with ``pip install "hhook[profile]"`` (and ``hhook[mpi]`` for
MPI runs).
"""

from __future__ import annotations

import importlib

_EXTRA = {"tqdm": "profile", "matplotlib": "profile", "sklearn": "profile", "mpi4py": "mpi"}
_PACKAGE = {"sklearn": "scikit-learn"}


def require(module: str, purpose: str):
    """``importlib.import_module(module)``, or an ImportError naming the extra to install."""
    top = module.split(".")[0]
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        extra = _EXTRA.get(top, "profile")
        raise ImportError(
            f"hhook-profile needs {_PACKAGE.get(top, top)} for {purpose}: pip install \"hhook[{extra}]\" "
            f"(from a checkout: pip install -e \".[{extra}]\")"
        ) from exc
