"""Emulated inter-datacenter link with round-trip delay, for kernels without `netem` (this machine's has no
netem, fq or etf qdisc): a network namespace joined to the host by two TUN devices, `tc tbf` on both, and a
userspace delay line between them. Needs root.

    host                                   forwarder (this module, its own process)          namespace
    local_ip  tun pl<tag> --tbf--> read --> held one_way_ms, FIFO --> write --> tun pr<tag>  remote_ip
    local_ip  tun pl<tag> <-- write <-- held one_way_ms, FIFO <-- read <--tbf-- tun pr<tag>  remote_ip

Every IP packet between the two addresses crosses the forwarder: the rate is tbf's (serialization), the
delay the forwarder's (propagation), added once per direction, so RTT = 2 * one_way_ms. Packets keep their
order; a delay change applies to packets read after it. The TUN MTU is 64,000 bytes so that TCP segments
are large and the forwarder handles a few hundred packets per second at 200 Mbit/s (at 1,500 bytes it
would be ~17,000: a Python loop's CPU on shared cores would then be part of what is measured).

    with delayed_link("25mbit", one_way_ms=25) as dl:     # dl.link is a netns.Link (same fields)
        ...; dl.set_delay(0)
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import fcntl
import ipaddress
import os
import select
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from prfaas_sgl.tools import netns

SUBNET = ipaddress.ip_network("10.78.0.0/24")  # apart from tools/netns's veth links (10.77.0.0/24)
MTU = 64000
MAX_HELD_BYTES = 64 << 20  # per direction; past it packets drop, as a full router queue would
_TUNSETIFF = 0x400454CA
_IFF_TUN, _IFF_NO_PI = 0x0001, 0x1000
_CLONE_NEWNET = 0x40000000


@dataclass
class DelayedLink:
    link: netns.Link
    forwarder: subprocess.Popen
    one_way_ms: float

    @property
    def rtt_ms(self) -> float:
        return 2 * self.one_way_ms

    def set_delay(self, one_way_ms: float) -> None:
        """Delay per direction from the next packet on; waits until the forwarder applied it."""
        self.forwarder.stdin.write(f"{one_way_ms}\n")
        self.forwarder.stdin.flush()
        ack = self.forwarder.stdout.readline().strip()
        if ack != f"delay {float(one_way_ms)}":
            raise RuntimeError(f"link_delay forwarder answered {ack!r} to a delay of {one_way_ms} ms")
        self.one_way_ms = one_way_ms


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True)


def _free_pair() -> tuple[str, str]:
    used = _run("ip", "-o", "addr", "show").stdout
    for k in range(64):
        a, b = str(SUBNET[4 * k + 1]), str(SUBNET[4 * k + 2])
        if f" {a} " not in used and f" {a}/" not in used and f" {b} " not in used and f" {b}/" not in used:
            return a, b
    raise RuntimeError(f"no free /30 left in {SUBNET}")


def _devices(link: netns.Link, mtu: int) -> None:
    ns = link.exec_prefix
    _run("ip", "netns", "add", link.netns)
    _run(*ns, "ip", "link", "set", "lo", "up")
    _run("ip", "tuntap", "add", "dev", link.local_dev, "mode", "tun")
    _run(*ns, "ip", "tuntap", "add", "dev", link.remote_dev, "mode", "tun")
    tbf = ["root", "tbf", "rate", link.rate, "burst", netns.BURST, "latency", "50ms"]
    for prefix, dev, ip, peer in ((), link.local_dev, link.local_ip, link.remote_ip), \
                                 (ns, link.remote_dev, link.remote_ip, link.local_ip):
        _run(*prefix, "ip", "addr", "add", ip, "peer", peer, "dev", dev)
        _run(*prefix, "ip", "link", "set", dev, "mtu", str(mtu), "up")
        _run(*prefix, "tc", "qdisc", "add", "dev", dev, *tbf)


def up(rate: str, one_way_ms: float = 0.0, tag: str | None = None, mtu: int = MTU) -> DelayedLink:
    """``mtu`` also sets TCP's segment size, so its initial window (10 segments): 640 KB at the default against
    ~14 KB at 1,500 bytes. Measured at 200 Mbit/s, 50 ms RTT: a 2 MiB send on a fresh connection took 0.41 s
    at 64,000 and 0.46 s at 1,500 (whose forwarder used 2.4x the CPU: 0.33 CPU-s for 22 MiB)."""
    tag = tag or str(os.getpid())
    local_ip, remote_ip = _free_pair()
    link = netns.Link(f"prfaas-d{tag}", f"pdl{tag}"[:15], f"pdr{tag}"[:15], local_ip, remote_ip, rate)
    try:
        _devices(link, mtu)
        fwd = subprocess.Popen(
            [sys.executable, "-m", "prfaas_sgl.tools.link_delay", "forward", "--netns", link.netns,
             "--local-dev", link.local_dev, "--remote-dev", link.remote_dev, "--one-way-ms", str(one_way_ms)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if fwd.stdout.readline().strip() != "ready":
            fwd.kill()
            raise RuntimeError(f"link_delay forwarder did not start (exit {fwd.wait()})")
    except BaseException:
        _down(link)
        raise
    return DelayedLink(link, fwd, one_way_ms)


def _down(link: netns.Link) -> None:
    _run("ip", "link", "del", link.local_dev, check=False)
    _run("ip", "netns", "del", link.netns, check=False)  # takes the namespace's TUN device with it


def down(dl: DelayedLink) -> None:
    if dl.forwarder.poll() is None:
        dl.forwarder.kill()
        dl.forwarder.wait()
    _down(dl.link)


@contextlib.contextmanager
def delayed_link(rate: str, one_way_ms: float = 0.0, tag: str | None = None,
                 mtu: int = MTU) -> Iterator[DelayedLink]:
    dl = up(rate, one_way_ms, tag, mtu)
    try:
        yield dl
    finally:
        down(dl)


# --- the forwarder process -------------------------------------------------------------------------------

def _attach(dev: str) -> int:
    """An fd on the existing TUN device `dev` of this thread's network namespace (one packet per read)."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH22x", dev.encode(), _IFF_TUN | _IFF_NO_PI))
    return fd


def _attach_in(ns_name: str, dev: str) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    home = os.open("/proc/self/ns/net", os.O_RDONLY)
    target = os.open(f"/var/run/netns/{ns_name}", os.O_RDONLY)
    try:
        if libc.setns(target, _CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {ns_name}")
        return _attach(dev)  # a TUN fd stays bound to its device's namespace after we leave it
    finally:
        libc.setns(home, _CLONE_NEWNET)
        os.close(home)
        os.close(target)


class _Line:
    """One direction: packets read from `src`, written to `dst` once `delay_s` after their read."""

    def __init__(self, src: int, dst: int):
        self.src, self.dst = src, dst
        self.held: collections.deque[tuple[float, bytes]] = collections.deque()
        self.held_bytes = 0

    def read_all(self, now: float, delay_s: float) -> None:
        while True:
            try:
                pkt = os.read(self.src, 65536)
            except BlockingIOError:
                return
            if self.held_bytes + len(pkt) <= MAX_HELD_BYTES:
                self.held.append((now + delay_s, pkt))
                self.held_bytes += len(pkt)

    def write_due(self, now: float) -> float | None:
        """Writes what is due; returns when the next held packet is due, or None."""
        while self.held and self.held[0][0] <= now:
            _, pkt = self.held.popleft()
            self.held_bytes -= len(pkt)
            with contextlib.suppress(BlockingIOError):  # the kernel refused it: a dropped packet
                os.write(self.dst, pkt)
        return self.held[0][0] if self.held else None


def forward(ns_name: str, local_dev: str, remote_dev: str, one_way_ms: float) -> None:
    local, remote = _attach(local_dev), _attach_in(ns_name, remote_dev)
    lines = {local: _Line(local, remote), remote: _Line(remote, local)}
    delay_s = one_way_ms / 1000
    control, pending = sys.stdin.fileno(), b""
    print("ready", flush=True)
    while True:
        now = time.monotonic()
        due = [d for d in (line.write_due(now) for line in lines.values()) if d is not None]
        timeout = max(0.0, min(due) - time.monotonic()) if due else None
        readable, _, _ = select.select([local, remote, control], [], [], timeout)
        now = time.monotonic()
        for fd in readable:
            if fd == control:
                chunk = os.read(control, 4096)  # raw reads: a buffered readline could hide a 2nd line from select
                if not chunk:
                    return  # the launcher went away
                *commands, pending = (pending + chunk).split(b"\n")
                for text in commands:
                    delay_s = float(text) / 1000
                    print(f"delay {float(text)}", flush=True)
            else:
                lines[fd].read_all(now, delay_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    fw = sub.add_parser("forward", help="the delay line itself (started by up())")
    fw.add_argument("--netns", required=True)
    fw.add_argument("--local-dev", required=True)
    fw.add_argument("--remote-dev", required=True)
    fw.add_argument("--one-way-ms", type=float, default=0.0)
    args = ap.parse_args()
    forward(args.netns, args.local_dev, args.remote_dev, args.one_way_ms)


if __name__ == "__main__":
    main()
