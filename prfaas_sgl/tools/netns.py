"""Emulated inter-datacenter link: a network namespace joined to the host by a veth pair, `tc tbf` on
both ends (see docs/design link-emulation.md). Needs root. Always removed, also on failure.

    with emulated_link(rate="1gbit") as link:      # link.local_ip on the host, link.remote_ip in link.netns
        subprocess.run(link.exec_prefix + ["python3", ...])

CLI: `python -m prfaas_sgl.tools.netns up --rate 5gbit` prints the link as JSON;
`python -m prfaas_sgl.tools.netns down NAME`.
Each link takes a free /30 inside 10.77.0.0/24 and names derived from the pid, so runs don't collide.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import ipaddress
import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

SUBNET = ipaddress.ip_network("10.77.0.0/24")
BURST = "1280kbit"  # >= one 64 KB GSO packet at 1-5 Gbit/s; smaller buckets force software segmentation


@dataclass(frozen=True)
class Link:
    netns: str
    local_dev: str
    remote_dev: str
    local_ip: str
    remote_ip: str
    rate: str

    @property
    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns]


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True)


def root_problem() -> str | None:
    """Why links cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, tc)"
    probe = f"prfaas-probe-{os.getpid()}"
    r = _run("ip", "netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    _run("ip", "netns", "del", probe, check=False)
    return None


def _free_pair() -> tuple[str, str]:
    used = _run("ip", "-o", "addr", "show").stdout
    for k in range(64):
        a, b = SUBNET[4 * k + 1], SUBNET[4 * k + 2]
        if f" {a}/" not in used and f" {b}/" not in used:
            return str(a), str(b)
    raise RuntimeError("no free /30 left in 10.77.0.0/24")


def up(rate: str, tag: str | None = None) -> Link:
    tag = tag or str(os.getpid())
    local_ip, remote_ip = _free_pair()
    link = Link(f"prfaas-{tag}", f"pfl{tag}"[:15], f"pfr{tag}"[:15], local_ip, remote_ip, rate)
    try:
        ns = link.exec_prefix
        _run("ip", "netns", "add", link.netns)
        _run("ip", "link", "add", link.local_dev, "type", "veth", "peer", "name", link.remote_dev)
        _run("ip", "link", "set", link.remote_dev, "netns", link.netns)
        _run("ip", "addr", "add", f"{local_ip}/30", "dev", link.local_dev)
        _run("ip", "link", "set", link.local_dev, "up")
        _run(*ns, "ip", "addr", "add", f"{remote_ip}/30", "dev", link.remote_dev)
        _run(*ns, "ip", "link", "set", link.remote_dev, "up")
        _run(*ns, "ip", "link", "set", "lo", "up")
        tbf = ["root", "tbf", "rate", rate, "burst", BURST, "latency", "50ms"]
        _run("tc", "qdisc", "add", "dev", link.local_dev, *tbf)
        _run(*ns, "tc", "qdisc", "add", "dev", link.remote_dev, *tbf)
    except BaseException:
        down(link)
        raise
    return link


def down(link: Link) -> None:
    """Remove the veth pair (both ends) and the namespace; missing pieces are fine."""
    _run("ip", "link", "del", link.local_dev, check=False)
    _run("ip", "netns", "del", link.netns, check=False)


@contextlib.contextmanager
def emulated_link(rate: str, tag: str | None = None) -> Iterator[Link]:
    link = up(rate, tag)
    try:
        yield link
    finally:
        down(link)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up")
    p_up.add_argument("--rate", default="1gbit")
    p_up.add_argument("--tag", default=None)
    p_down = sub.add_parser("down")
    p_down.add_argument("tag")
    args = parser.parse_args()
    if args.cmd == "up":
        print(json.dumps(dataclasses.asdict(up(args.rate, args.tag))))
    else:
        down(Link(f"prfaas-{args.tag}", f"pfl{args.tag}"[:15], "", "", "", ""))


if __name__ == "__main__":
    main()
