"""Delay with jitter (hence reordering) between the nodes of ``ci/netcluster.sh``, on
kernels without ``tc netem``: a user-space link. Run by ``ci/netcluster.sh delay``.

Each node namespace hhI gets a TUN device ``hhdI``; a route to every other node's address
goes through it (more specific than eth0's /24, so no address changes and Gloo keeps
binding eth0's address). This process holds all the TUN ends: it reads each IPv4 packet a
node sends, holds it ``delay`` +- ``jitter`` ms (uniform, drawn per packet, as netem's
``delay D J``) and writes it into the destination node's TUN, where the kernel receives
it. Packets released in the order of their draws overtake each other: the reordering.

The TUN MTU is 64000 so that a Python loop keeps up at 1 Gbit/s (about 2,000 packets a
second each way instead of 83,000); what the node sends is shaped on ``hhdI`` by tbf at
the cluster's rate (the switch-side shaping of eth0 is off this path). Ending the process
(SIGTERM) removes the devices, and with them the routes: traffic goes back to eth0.
"""

from __future__ import annotations

import argparse
import fcntl
import heapq
import os
import random
import select
import signal
import struct
import subprocess
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
MTU = 64000


def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True)


def plumb(nodes: int, subnet: str, rate: str, burst: str, latency: str, prefix: str = "hh") -> dict[int, int]:
    """One TUN per node, moved into its namespace, with routes to the other nodes through
    it; returns {fd: node}."""
    fds = {}
    for i in range(nodes):
        dev, ns = f"{prefix}d{i}", f"{prefix}{i}"
        fd = open_tun(dev)
        fds[fd] = i
        ip("link", "set", dev, "netns", ns)  # the open fd stays attached to it
        ip("-n", ns, "link", "set", dev, "mtu", str(MTU), "up")
        for j in range(nodes):
            if j != i:
                ip("-n", ns, "route", "replace", f"{subnet}.{j + 1}/32", "dev", dev, "src", f"{subnet}.{i + 1}")
        if rate != "none":
            subprocess.run(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                            rate, "burst", burst, "latency", latency], check=True)
    return fds


def forward(fds: dict[int, int], subnet: str, delay_s: float, jitter_s: float) -> None:
    by_addr = {bytes(int(b) for b in f"{subnet}.{i + 1}".split(".")): fd for fd, i in fds.items()}
    readable = list(fds)
    held: list = []  # (release time, sequence, fd, packet)
    seq = 0
    draw = random.Random(0x5EED).uniform
    while True:
        now = time.monotonic()
        while held and held[0][0] <= now:
            _, _, out, packet = heapq.heappop(held)
            try:
                os.write(out, packet)
            except OSError:
                pass  # the device is going away, or full: a lost packet, as on a wire
        timeout = max(0.0, held[0][0] - now) if held else None
        # select's timeout is in microseconds (epoll's in whole milliseconds, rounded up)
        for fd in select.select(readable, [], [], timeout)[0]:
            while True:
                try:
                    packet = os.read(fd, MTU + 64)
                except (BlockingIOError, InterruptedError):
                    break
                if len(packet) < 20 or packet[0] >> 4 != 4:
                    continue  # IPv4 only, as the cluster
                out = by_addr.get(packet[16:20])
                if out is None:
                    continue
                seq += 1
                release = time.monotonic() + delay_s + draw(-jitter_s, jitter_s)
                heapq.heappush(held, (release, seq, out, packet))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--prefix", default="hh", help="the cluster's names (netcluster.sh's HH_PREFIX)")
    p.add_argument("--subnet", default="10.77.0")
    p.add_argument("--delay-ms", type=float, required=True)
    p.add_argument("--jitter-ms", type=float, default=0.0)
    p.add_argument("--rate", default="none", help="tc rate of each node's sending side, or none")
    p.add_argument("--burst", default="262144")
    p.add_argument("--latency", default="20ms")
    p.add_argument("--pidfile", required=True, help="written once the link is up")
    args = p.parse_args()
    if not 0 <= args.jitter_ms <= args.delay_ms:
        sys.exit("delaylink: the jitter must lie in [0, delay]")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    fds = plumb(args.nodes, args.subnet, args.rate, args.burst, args.latency, args.prefix)
    with open(args.pidfile, "w") as f:
        f.write(f"{os.getpid()}\n")
    forward(fds, args.subnet, args.delay_ms / 1e3, args.jitter_ms / 1e3)


if __name__ == "__main__":
    main()
