"""Loopback measurement of idle connections (issue 13, review 30; RELIABILITY.md, "Hostile
input"): one certificate (cluster-h, mutual TLS) opens N connections to a control server
(this process) from a process of its own and makes no call on them; prints the server's RSS
and file descriptors before and while they are held, whether another member's new
connection and its connection opened before get an answer, and the same after they closed.

usage (repository root): PYTHONPATH=src python benchmarks/hostile_connections.py N CAP
(CAP: the server's ``connections``; 0: gRPC's default, no limit, as before the limit)."""
import os, sys, time, pathlib, tempfile, subprocess
import grpc
from dips.wire.pki import init_pki, Identity
from dips.wire.security import Credentials

n, cap = int(sys.argv[1]), int(sys.argv[2])
pki = pathlib.Path(tempfile.mkdtemp()) / "pki"
init_pki(pki, 0, ["h", "a"])
if not cap:  # gRPC's default: no limit (the code before the limit)
    real = grpc.aio.server
    def uncapped(*a, options=(), **kw):
        return real(*a, options=[o for o in options
                                 if o[0] != "grpc.max_allowed_incoming_connections"], **kw)
    grpc.aio.server = uncapped
from dips.wire.control_server import SERVER_CONNECTIONS, make_server
from dips.wire.pb import control_pb2_grpc as pbg
from dips.wire.pb import control_pb2 as pb

class S(pbg.LeaderServicer):
    def Heartbeat(self, r, ctx):
        return pb.HeartbeatReply(version=1)

server = make_server(max_workers=4, connections=cap or SERVER_CONNECTIONS)
pbg.add_LeaderServicer_to_server(S(), server)
port = Credentials.tls(pki / "leader").add_port(server, "127.0.0.1:0")
server.start()
addr = f"127.0.0.1:{port}"

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024

def fds():
    return len(os.listdir("/proc/self/fd"))

def call(who):
    ch = Credentials.tls(pki / f"cluster-{who}").channel(addr, Identity.leader(), [])
    try:
        pbg.LeaderStub(ch).Heartbeat(pb.HeartbeatRequest(cluster_id=who), timeout=5)
        return "ok"
    except grpc.RpcError as e:
        return e.code().name
    finally:
        ch.close()

call("a")
kept = Credentials.tls(pki / "cluster-a").channel(addr, Identity.leader(), [("grpc.channel_id", -1)])
kept_stub = pbg.LeaderStub(kept)
kept_stub.Heartbeat(pb.HeartbeatRequest(cluster_id="a"), timeout=5)
time.sleep(1)
base_rss, base_fd = rss(), fds()
code = f"""
import sys, time, grpc, threading
from dips.wire.security import Credentials
from dips.wire.pki import Identity
creds = Credentials.tls({str(pki / 'cluster-h')!r})
chans, ready = [], set()
for i in range({n}):
    ch = creds.channel({addr!r}, Identity.leader(), [("grpc.channel_id", i)])
    ch.subscribe(lambda s, i=i: ready.add(i) if s == grpc.ChannelConnectivity.READY else None,
                 try_to_connect=True)
    chans.append(ch)
    if i % 50 == 49:
        time.sleep(0.05)
time.sleep(25)
print(len(ready), flush=True)
sys.stdin.read()
"""
p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True)
ready = int(p.stdout.readline())
held_rss, held_fd = rss(), fds()
honest = call("a")
try:
    kept_stub.Heartbeat(pb.HeartbeatRequest(cluster_id="a"), timeout=5)
    on_kept = "ok"
except grpc.RpcError as e:
    on_kept = e.code().name
print(f"n={n} cap={cap}: member's connections ready {ready}; server RSS {base_rss:.0f} -> "
      f"{held_rss:.0f} MB (+{held_rss - base_rss:.0f}, {1024 * (held_rss - base_rss) / max(ready, 1):.0f} KB each), "
      f"fds {base_fd} -> {held_fd}; another member's new connection and call: {honest}, its call on the connection it held: {on_kept}", flush=True)
p.stdin.close(); p.wait(timeout=30)
time.sleep(1)
print(f"after the member closed them: RSS {rss():.0f} MB, fds {fds()}; another member: {call('a')}")
os._exit(0)
