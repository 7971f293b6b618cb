"""Loopback measurement of hostile control calls (issue 13, review 25; RELIABILITY.md,
"Hostile input"): a real leader servicer (a fake follower) on a 20-worker control server.

``held C``: one member (claimed identity cluster-h, insecure) opens C connections x 8 calls
that never send their request; ``flood T``: one member calls GetStatus in a loop from T
threads (a process of its own) for 5 s; ``beat T``: the same with Heartbeat (review 30).
One honest client calls Heartbeat back to back with a 1 s deadline for 5 s, before and
during (with ``beat``: every 0.25 s, 4 per heartbeat interval of 1 s, the most the leader
allows); prints (answered, failed).

usage (repository root): PYTHONPATH=src python benchmarks/hostile_calls.py held 20 | flood 6
| beat 6 (runs against an older src too: without RateGate the reads are not limited, without
heartbeat_limit the heartbeats)."""
import os, subprocess, sys, threading, time
import grpc
sys.path.insert(0, os.getcwd())
from dips.wire.control import Client, make_server
from dips.wire.inflight import CallGate
from dips.wire.pb import control_pb2 as pb, control_pb2_grpc as pbg
from dips.wire.pki import Identity
from dips.wire.security import Credentials
from dips.wire.services import LeaderServicer
from tests.roles.test_hostile_leader import make_leader, member
import tempfile, pathlib
try:
    from dips.wire.inflight import RateGate
    reads = RateGate()
except ImportError:
    reads = None
try:
    from dips.algo.ratelimit import heartbeat_limit
    hb = {"heartbeats": RateGate(*heartbeat_limit(1.0), what="membership.heartbeat_interval_s")}
except ImportError:
    hb = {}
mode, n = sys.argv[1], int(sys.argv[2])
tmp = pathlib.Path(tempfile.mkdtemp())
leader, _ = make_leader(tmp)
member(leader, "a"); member(leader, "h")
W = 20
server = make_server(max_workers=W, reads=reads, **hb) if reads else make_server(max_workers=W)
gate = CallGate.for_server(W)
pbg.add_LeaderServicer_to_server(LeaderServicer(leader, None, gate=gate), server)
port = Credentials.insecure(Identity.leader()).add_port(server, "127.0.0.1:0")
server.start()
addr = f"127.0.0.1:{port}"
honest = Client(pbg.LeaderStub, addr, Credentials.insecure(Identity.cluster("a")), Identity.leader())

def beats(seconds):
    ok = bad = 0; end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            honest.Heartbeat(pb.HeartbeatRequest(cluster_id="a"), timeout=1.0); ok += 1
        except grpc.RpcError:
            bad += 1
        if mode == "beat":
            time.sleep(0.25)
    return ok, bad

base = beats(5)
if mode == "held":
    never = threading.Event(); chans, futs = [], []
    def nothing():
        never.wait(); return
        yield
    for c in range(n):
        ch = grpc.insecure_channel(addr, options=[("grpc.use_local_subchannel_pool", 1), ("grpc.channel_id", c)])
        chans.append(ch)
        m = ch.stream_unary("/dips.v1.Leader/Heartbeat", request_serializer=lambda x: x, response_deserializer=lambda b: b)
        futs += [m.future(nothing(), timeout=60, metadata=(("x-dips-identity", "cluster-h"),)) for _ in range(8)]
    time.sleep(1)
    during = beats(5)
    print(f"held {n}x8: honest heartbeats in 5 s: without attack {base}, during {during} (ok, failed)")
    never.set()
else:
    call = ("c.Heartbeat(pb.HeartbeatRequest(cluster_id='h'),timeout=2)" if mode == "beat"
            else "c.GetStatus(pb.StatusRequest(),timeout=2)")
    code = ("import sys,time,grpc;sys.path.insert(0,'.');from dips.wire.control import Client;"
            "from dips.wire.pb import control_pb2 as pb, control_pb2_grpc as pbg;from dips.wire.pki import Identity;"
            "from dips.wire.security import Credentials;import threading\n"
            f"c=Client(pbg.LeaderStub,'{addr}',Credentials.insecure(Identity.cluster('h')),Identity.leader())\n"
            "cnt=[0,0];end=time.monotonic()+5\n"
            "def run():\n while time.monotonic()<end:\n  try: " + call + ";cnt[0]+=1\n  except grpc.RpcError: cnt[1]+=1\n"
            f"ts=[threading.Thread(target=run) for _ in range({n})];[t.start() for t in ts];[t.join() for t in ts];print(cnt[0]/5, cnt[1]/5)")
    t0 = time.process_time(); w0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    during = beats(5)
    out = p.communicate()[0].split()
    cpu = (time.process_time() - t0) / (time.monotonic() - w0)
    print(f"{mode} {n} threads: served/s {out[0]} refused/s {out[1]}; leader process cores {cpu:.2f} "
          f"(includes the honest client); honest heartbeats in 5 s: before {base}, during {during}")
os._exit(0)
