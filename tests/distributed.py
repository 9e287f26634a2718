"""Transitional alias of :mod:`tests.support.distributed` for ci/bucket_path.py, which still
imports ``tests.distributed`` (it belongs to the code side of issue 43): delete this file once
ci/bucket_path.py imports ``tests.support.distributed`` (or, better, nothing of tests/)."""

from tests.support.distributed import *  # noqa: F401,F403
from tests.support.distributed import run_world  # noqa: F401
