"""Measure the TCP payload rate between two network namespaces of a :class:`ShapedNetwork`
(used by the shaping tests and ``make bench-shaping``). Source: the receiver counts bytes from
the first to the last one it receives; the sender writes 64 KiB blocks for ``seconds``.
"""

from __future__ import annotations

import subprocess
import sys

from dips.emu.netns import ShapedNetwork

__all__ = ["measure_tcp_bps"]

_SERVER = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5201)); s.listen(1); s.settimeout(20)
c, _ = s.accept(); c.settimeout(20); n = 0; t0 = t1 = None
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    t1 = time.monotonic(); t0 = t0 or t1; n += len(b)
print(n, t1 - t0)
"""
_CLIENT = r"""
import socket, sys, time
for _ in range(50):
    try:
        c = socket.create_connection((sys.argv[1], 5201), timeout=10); break
    except OSError:
        time.sleep(0.1)
buf = b"x" * 65536; end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    c.sendall(buf)
c.close()
"""


def measure_tcp_bps(net: ShapedNetwork, sender: str, receiver: str | None, seconds: float) -> float:
    """TCP payload rate (bits/s) from ``sender``'s namespace to ``receiver``'s (None: the hub)."""
    addr = net.hub_addr if receiver is None else net.addr(receiver)
    srv = subprocess.Popen([*net.exec_prefix(receiver), sys.executable, "-c", _SERVER, addr],
                           stdout=subprocess.PIPE, text=True)
    try:
        subprocess.run([*net.exec_prefix(sender), sys.executable, "-c", _CLIENT, addr, str(seconds)],
                       check=True, timeout=seconds + 30)
        out, _ = srv.communicate(timeout=30)
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait(10)
    nbytes, dt = out.split()
    return int(nbytes) * 8 / float(dt)
