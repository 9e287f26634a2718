r"""Which link a measurement ran on, in words, for every table's header, JSON ``meta`` and
plot: an emulated cluster's rate (``ci/netcluster.sh`` keeps it in its run directory, which
its ranks see), all ranks on one host (loopback or shared memory: no network), or a real
network between hosts whose rate this process cannot know. Read from the environment and
files only: no collective, so any rank may ask at any time."""

from __future__ import annotations

import glob
import os

#: ``ci/netcluster.sh``'s run directories (``HH_PREFIX`` other than ``hh`` adds a suffix).
NETCLUSTER_RUN = "/run/hhook-netcluster*"


def _emulated() -> str | None:
    """The emulated cluster's link (rate, and a held delay), when this process runs in it:
    netcluster sets ``GLOO_SOCKET_IFNAME`` for its ranks and keeps ``rate`` in its run directory."""
    if not os.environ.get("GLOO_SOCKET_IFNAME") and not os.environ.get("OMPI_MCA_btl_tcp_if_include"):
        return None
    for run in sorted(glob.glob(NETCLUSTER_RUN)):
        try:
            with open(os.path.join(run, "rate")) as fh:
                rate = fh.read().strip()
        except OSError:
            continue
        delayed = os.path.exists(os.path.join(run, "delay.pid"))
        shaped = "unshaped" if rate == "none" else f"{rate} per rank"
        return f"emulated cluster (ci/netcluster.sh), {shaped}" + (", packets delayed" if delayed else "")
    return None


def link_label(world_size: int | None = None) -> str:
    """The link this process's ranks talk over, in words (``world_size`` 1 or None with no
    launcher: no network at all)."""
    emulated = _emulated()
    if emulated:
        return emulated
    env = os.environ
    world = int(world_size or env.get("WORLD_SIZE") or env.get("OMPI_COMM_WORLD_SIZE") or 1)
    local = int(env.get("LOCAL_WORLD_SIZE") or env.get("OMPI_COMM_WORLD_LOCAL_SIZE") or world)
    if world <= 1:
        return "none (one process)"
    if local >= world:
        return f"loopback: {world} ranks on one host (no network)"
    return f"network between {-(-world // local)} hosts (rate not known here: hhook-profile link measures it)"
