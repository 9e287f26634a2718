"""tests/support/distributed.py's free_port: ports that no other test and no outgoing
connection takes between the pick and the job's bind (issue 56: a job's ranks, run beside
others on xdist workers, never met)."""

import re
import socket
from pathlib import Path

from tests.support.distributed import PORTS, free_port, port_slice


def _ephemeral() -> range:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        lo, hi = map(int, f.read().split())
    return range(lo, hi + 1)


def test_ports_are_outside_the_ephemeral_range_and_hhooks_job_ports():
    """bind(0)'s ports are the ones outgoing connections take too."""
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50  # in turn, not the same port again
    assert not set(ports) & set(_ephemeral()), ports
    assert PORTS[1] <= 29500 and all(PORTS[0] <= p < PORTS[1] for p in ports), ports  # 29500+: hhook.launch.job_port


def test_each_xdist_worker_has_its_own_slice():
    slices = [port_slice({"PYTEST_XDIST_WORKER": f"gw{w}", "PYTEST_XDIST_WORKER_COUNT": "3"}) for w in range(3)]
    assert [len(s) for s in slices] == [len(slices[0])] * 3 and len(slices[0]) > 1000
    assert all(not set(a) & set(b) for i, a in enumerate(slices) for b in slices[i + 1:])
    assert slices[0].start == PORTS[0] and slices[-1].stop <= PORTS[1]
    assert port_slice({}) == range(*PORTS)  # outside xdist: the whole range


def test_a_port_bound_now_is_skipped():
    nxt = free_port() + 1
    if nxt not in port_slice():
        nxt = free_port() + 1
    with socket.socket() as held:
        held.bind(("", nxt))
        held.listen()
        assert free_port() != nxt


def test_no_test_launches_a_job_on_a_fixed_port():
    """A fixed port meets the same test of another run on a shared host (test_example.py's
    torchrun on 29531 and mpirun on 29532 did); a job takes free_port()'s."""
    fixed = re.compile(r"""--master-port["']?\s*,\s*["']\d|MASTER_PORT=["']?\d""")  # torchrun's, mpirun -x's
    root = Path(__file__).resolve().parent
    found = [f"{path.relative_to(root)}:{n}" for path in sorted(root.rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if fixed.search(line)]
    assert found == []
