"""``HHOOK_REQUIRE``: dependencies whose absence fails the suite instead of skipping tests.

A comma-separated list of ``horovod``, ``mpi``, ``lightning``, ``accelerate``,
``transformers``, ``ray`` and ``torchft``. A test (or a test module) that skips
with a reason naming a required dependency fails instead, with that reason. ci/test.sh
installs Open MPI, mpi4py, Horovod and the frameworks and sets ``HHOOK_REQUIRE`` to all of them, so there a
Horovod that does not import (a failed build, an ABI mismatch with torch, an import that
times out) or a missing ``mpirun`` is an error; unset, as on a developer's machine, those
tests skip and ``pytest -rs`` says why.
"""

from __future__ import annotations

import os
import re

import pytest

REQUIRE_ENV = "HHOOK_REQUIRE"

# The suite runs 2-4 ranks on this one host, where hhook.register's bits="auto" installs
# nothing (hhook.decision.hook.one_host): the tests of its measuring measure, as on
# several hosts. Every rank and launched job inherits it; tests/decision/test_one_host.py unsets it.
os.environ.setdefault("HHOOK_AUTO_ONE_HOST", "measure")
#: How a skip's reason names each dependency ("Open MPI", "mpirun", "mpi4py" for mpi).
MENTIONS = {"horovod": re.compile(r"horovod", re.I), "mpi": re.compile(r"\bmpi", re.I),
            # the frameworks of tests/integrations/test_frameworks.py (hhook's adapters; pyproject's extras)
            "lightning": re.compile(r"\blightning", re.I), "accelerate": re.compile(r"\baccelerate", re.I),
            "transformers": re.compile(r"\btransformers", re.I), "ray": re.compile(r"\bray\b", re.I),
            "torchft": re.compile(r"\btorchft", re.I)}  # tests/integrations/test_torchft.py
_REQUIRED = pytest.StashKey[frozenset]()


def required() -> frozenset:
    names = frozenset(n.strip().lower() for n in os.environ.get(REQUIRE_ENV, "").split(",") if n.strip())
    unknown = names - MENTIONS.keys()
    if unknown:
        raise pytest.UsageError(f"{REQUIRE_ENV}: unknown {', '.join(sorted(unknown))} (known: {', '.join(sorted(MENTIONS))})")
    return names


def pytest_configure(config):
    config.stash[_REQUIRED] = required()


def pytest_report_header(config):
    names = config.stash[_REQUIRED]
    return f"{REQUIRE_ENV}={','.join(sorted(names))}: skips for want of these fail" if names else None


def _fail_required_skip(report, names: frozenset) -> None:
    if not report.skipped or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    missing = sorted(name for name in names if MENTIONS[name].search(reason))
    if missing:
        report.outcome = "failed"
        report.longrepr = f"{REQUIRE_ENV}={','.join(sorted(names))} requires {', '.join(missing)}, but: {reason}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    _fail_required_skip(report, item.config.stash[_REQUIRED])
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    _fail_required_skip(report, collector.config.stash[_REQUIRED])
    return report


_SHARED_SCOPES = ("module", "class", "package", "session")


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads the groups off the marks
def pytest_collection_modifyitems(config, items):
    """Under xdist (ci/test.sh: ``--dist loadgroup``) tests go to whichever worker is free,
    except a module whose tests share a fixture wider than one test (a world run once for
    a module, a job cached per module): its tests stay on one worker, which then builds that
    fixture once, not once per worker."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else ()
        if any(d.scope in _SHARED_SCOPES and d.baseid for fixture in defs for d in fixture):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


@pytest.fixture
def no_tf32():
    """TF32 off for the test (the CUDA tests: TF32 switched on by the environment would make
    the reference's matmul inexact)."""
    import torch

    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
