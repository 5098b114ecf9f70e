"""The delay line (tools/link_delay): real TUN devices, a real namespace and real TCP (root, as this project's
machines and CI run). A round trip costs twice the one-way delay, a delay change applies at once, bytes
arrive whole and in order, and nothing is left behind."""
from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
import time

import pytest

from prfaas_sgl.tools import netns
from prfaas_sgl.tools.link_delay import delayed_link

pytestmark = pytest.mark.skipif(netns.root_problem() is not None, reason=f"{netns.root_problem()}")
# Echoes each line's sha256 back: a round trip per line, and a check of every byte that crossed
ECHO = """
import hashlib, socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(); print("up", flush=True)
c, _ = s.accept(); f = c.makefile("rb")
for line in f:
    c.sendall(hashlib.sha256(line).hexdigest().encode() + b"\\n")
"""


def _round_trip(conn: socket.socket, reader, payload: bytes) -> tuple[float, str]:
    start = time.perf_counter()
    conn.sendall(payload)
    answer = reader.readline().strip().decode()
    return time.perf_counter() - start, answer


def test_round_trips_cost_twice_the_one_way_delay_and_bytes_cross_intact():
    with delayed_link("200mbit", one_way_ms=20) as dl:
        link = dl.link
        echo = subprocess.Popen([*link.exec_prefix, sys.executable, "-c", ECHO, link.remote_ip, "5001"],
                                stdout=subprocess.PIPE, text=True)
        try:
            assert echo.stdout.readline().strip() == "up"
            start = time.perf_counter()
            conn = socket.create_connection((link.remote_ip, 5001), timeout=10)
            handshake_s = time.perf_counter() - start
            reader = conn.makefile("rb")
            assert 0.040 <= handshake_s < 0.070  # SYN out, SYN-ACK back: one round trip of 2 x 20 ms
            ping_s, _ = _round_trip(conn, reader, b"x\n")
            assert 0.040 <= ping_s < 0.070
            dl.set_delay(0)
            time.sleep(0.05)  # packets read before the change leave with their old delay
            ping_s, _ = _round_trip(conn, reader, b"y\n")
            assert ping_s < 0.015
            payload = os.urandom(2 << 20).replace(b"\n", b"\0") + b"\n"
            _, digest = _round_trip(conn, reader, payload)
            assert digest == hashlib.sha256(payload).hexdigest()
            conn.close()
        finally:
            echo.kill()
            echo.wait()
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert link.netns not in names
    assert subprocess.run(["ip", "link", "show", link.local_dev], capture_output=True).returncode != 0
    assert dl.forwarder.poll() is not None


def test_the_mtu_is_the_links_on_both_ends():
    with delayed_link("200mbit", mtu=1500) as dl:
        link = dl.link
        local = subprocess.run(["ip", "link", "show", link.local_dev], capture_output=True, text=True).stdout
        remote = subprocess.run([*link.exec_prefix, "ip", "link", "show", link.remote_dev], capture_output=True,
                                text=True).stdout
        assert " mtu 1500 " in local and " mtu 1500 " in remote
