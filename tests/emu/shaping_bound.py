"""What a shaped link delivered, measured so that a busy machine can only understate it.

The TCP payload the receiver got, over the time from the moment the sender starts writing to
the receiver's last byte, both on the one system-wide monotonic clock (network namespaces
share it). Any delay of either process (load) makes the interval longer, never shorter, so
``delivered <= burst + rate x interval`` holds on any machine: the shaping tests check that
bound, plus the configured qdisc. How close to the rate a loaded machine gets is a benchmark's
question (``make bench-shaping``, BENCHMARKS.md), not a test's.
"""

from __future__ import annotations

import subprocess
import sys

from dips.emu.netns import ShapedNetwork

_SERVER = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 5202)); s.listen(1); s.settimeout(60)
c, _ = s.accept(); c.settimeout(60); n = 0; last = None
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    n += len(b); last = time.monotonic()
print(n, last)
"""
_CLIENT = r"""
import socket, sys, time
for _ in range(300):
    try:
        c = socket.create_connection((sys.argv[1], 5202), timeout=10); break
    except OSError:
        time.sleep(0.1)
buf = b"x" * 65536; start = time.monotonic(); end = start + float(sys.argv[2])
print(start, flush=True)
while time.monotonic() < end:
    c.sendall(buf)
c.close()
"""


def delivered(net: ShapedNetwork, sender: str, receiver: str | None,
              seconds: float) -> tuple[int, float]:
    """``(payload bytes received, seconds from the sender's start to the last byte)`` of a
    TCP stream ``sender`` -> ``receiver`` (None: the hub) that writes for ``seconds``."""
    addr = net.hub_addr if receiver is None else net.addr(receiver)
    srv = subprocess.Popen([*net.exec_prefix(receiver), sys.executable, "-c", _SERVER, addr],
                           stdout=subprocess.PIPE, text=True)
    try:
        sent = subprocess.run([*net.exec_prefix(sender), sys.executable, "-c", _CLIENT, addr,
                               str(seconds)], check=True, capture_output=True, text=True,
                              timeout=seconds + 120)
        out, _ = srv.communicate(timeout=120)
    finally:
        if srv.poll() is None:
            srv.kill()
            srv.wait(10)
    nbytes, last = out.split()
    return int(nbytes), float(last) - float(sent.stdout.split()[0])


def assert_at_most(rate_bps: float, burst_bytes: int, got: tuple[int, float], what: str) -> None:
    """The link delivered no more than one burst (plus one 64 KiB write in flight) beyond
    ``rate_bps`` over the interval (1% for the kernel's rate rounding)."""
    nbytes, seconds = got
    assert nbytes > 0 and seconds > 0, f"{what}: nothing delivered ({got})"
    allowed = burst_bytes + 65536 + 1.01 * rate_bps / 8 * seconds
    assert nbytes <= allowed, (f"{what}: {nbytes} B in {seconds:.3f} s = "
                               f"{nbytes * 8 / seconds / 1e6:.1f} Mbit/s over a "
                               f"{rate_bps / 1e6:.0f} Mbit link")
