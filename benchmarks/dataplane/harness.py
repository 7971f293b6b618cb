"""Set-up shared by the data-plane benchmarks: a large synthetic model, real followers in their
own processes (FollowerShard + ZeroMQ DataServer + gRPC control, heartbeating like
``dips launch``'s), the real leader with its gRPC service in this process, and the raw-TCP
reference measured on the same machine in the same run.

The model is ``n_layers`` square ``nn.Linear(width, width)`` blocks (one layer each): the
data plane only sees named FP32 tensors grouped in layers, so a transformer of the same size
would move the same bytes through the same code (building a 100M-parameter HF model costs
tens of seconds here for nothing the benchmark measures).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import struct
import time
from pathlib import Path
from typing import Any

import torch

MP = mp.get_context("spawn")


def layer_of(name: str) -> str:
    return ".".join(name.split(".")[:2])


def synthetic_model(n_layers: int, width: int, seed: int) -> torch.nn.Module:
    """``n_layers`` blocks ``blocks.i`` of Linear(width, width): 4·width·(width+1) bytes each."""
    with torch.device("meta"):
        model = torch.nn.Module()
        model.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(n_layers))
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for k, (n, p) in enumerate(model.named_parameters()):
            p.copy_(init_param(seed, k, p.shape))
    return model


def init_param(seed: int, k: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Parameter ``k`` of the synthetic model (its own generator: followers make only theirs)."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed * 100003 + k)) * 0.02


def param_shapes(n_layers: int, width: int) -> list[tuple[str, tuple[int, ...]]]:
    return [(f"blocks.{i}.{w}", (width, width) if w == "weight" else (width,))
            for i in range(n_layers) for w in ("weight", "bias")]


def perturb(model: torch.nn.Module, seed: int, scale: float = 1e-3) -> None:
    """Stand-in for H inner steps: moves every parameter a little (deterministic)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g), alpha=scale)


def wire_bytes(model: torch.nn.Module) -> int:
    """Bytes of one BF16 copy of the model (one push, or one pull)."""
    return sum(p.numel() * 2 for p in model.parameters())


def model_layers(spec: tuple) -> list[tuple[str, list[str], int]]:
    """``[(layer, [param names], FP32 bytes)]`` of a model spec: ``("synthetic", n_layers,
    width, seed)`` or ``("llama", ModelConfig fields, seed)`` (:func:`dips.train.model.build_model`)."""
    if spec[0] == "synthetic":
        shapes = param_shapes(spec[1], spec[2])
        return [(f"blocks.{i}", [n for n, _ in shapes if layer_of(n) == f"blocks.{i}"],
                 4 * spec[2] * (spec[2] + 1)) for i in range(spec[1])]
    from dips.spec import ModelConfig
    from dips.train.model import build_model, layer_table

    return [(l, list(n), b) for l, n, b in layer_table(build_model(ModelConfig(**spec[1]), spec[2]))]


def shard_params(spec: tuple, owned: list[str]) -> tuple[dict[str, list[str]], dict[str, torch.Tensor]]:
    """The owned layers and their initial FP32 parameters (equal to a cluster's model)."""
    if spec[0] == "synthetic":
        shapes = param_shapes(spec[1], spec[2])
        layers = {l: [n for n, _ in shapes if layer_of(n) == l] for l in owned}
        return layers, {n: init_param(spec[3], k, s) for k, (n, s) in enumerate(shapes)
                        if layer_of(n) in owned}
    from dips.spec import ModelConfig
    from dips.train.model import build_model, layer_table

    model = build_model(ModelConfig(**spec[1]), spec[2])
    layers = {l: list(n) for l, n, _ in layer_table(model) if l in owned}
    names = {n for ns in layers.values() for n in ns}
    return layers, {n: p.detach().clone() for n, p in model.named_parameters() if n in names}


#: The harness's membership settings (heartbeat interval s, missed heartbeats): the leader's
#: config, and the followers' leader lease (:func:`dips.algo.fencing.lease_seconds`).
HEARTBEAT_S, MISSED_HEARTBEATS = 0.5, 20


def _follower_main(index: int, spec: tuple, owned: list[str], leader_addr: str,
                   ready: Any, stop: Any, pki: str | None = None) -> None:
    """One follower process, as ``dips follower`` runs it (with TLS from ``pki``, else
    insecure): it learns the leader's term, data secret and encryption by registering."""
    import grpc

    from dips.algo import fencing
    from dips.roles.fence import Fence
    from dips.roles.follower import FollowerShard
    from dips.wire.control import make_server
    from dips.wire.dataplane import DataServer
    from dips.wire.keys import Keyring
    from dips.wire.pb import control_pb2 as pb
    from dips.wire.pb import control_pb2_grpc as pbg
    from dips.wire.pki import Identity
    from dips.wire.security import Credentials
    from dips.wire.services import FollowerServicer, leader_client

    torch.set_num_threads(1)
    creds = (Credentials.tls(Path(pki) / f"follower-{index}") if pki
             else Credentials.insecure(Identity.follower(index)))
    layers, params = shard_params(spec, owned)
    shard = FollowerShard(index, layers, params)
    fence = Fence(None, lease_s=fencing.lease_seconds(HEARTBEAT_S, MISSED_HEARTBEATS))
    keyring = Keyring()  # no secret until registered: requests are dropped until then
    data = DataServer(keyring, shard.handle, authorize=shard.authorize).start()
    server = make_server(max_workers=8)
    pbg.add_FollowerServicer_to_server(FollowerServicer(shard, fence), server)
    port = creds.add_port(server, "127.0.0.1:0")
    server.start()
    leader = leader_client(leader_addr, creds)
    layer_bytes = [sum(params[n].numel() * 4 for n in layers[l]) for l in owned]
    incarnation = time.time_ns()
    ready.set()
    while not stop.is_set():  # registration doubles as the heartbeat, as in dips launch
        info = pb.FollowerInfo(index=index, data_endpoint=data.endpoint,
                               control_endpoint=f"127.0.0.1:{port}", layers=owned,
                               layer_bytes=layer_bytes, version=shard.version,
                               incarnation=incarnation, leader_term=fence.term)
        try:
            reply = leader.RegisterFollower(info, timeout=2.0)
            keyring.set_secret(reply.data_secret, reply.encrypt)
            fence.heard(reply.term)
        except grpc.RpcError:
            pass
        stop.wait(HEARTBEAT_S)
    server.stop(0)
    data.stop()
    leader.close()


class PS:
    """The leader (in process, real gRPC service) and M follower processes on loopback, with
    insecure credentials, or (``secure``) as ``dips launch`` runs them: mutual TLS from a
    fresh ``dips init`` PKI and the data plane encrypted (AES-GCM per chunk).

    ``owners``: layer -> follower; default contiguous blocks balanced by bytes.
    :attr:`data_secret`: the leader's data secret (:meth:`member_key` derives a key from it,
    as the leader does at a join).
    """

    def __init__(self, spec: tuple, followers: int, *, grace_s: float = 0.0,
                 grace_mode: str = "fixed", grace_max_s: float = 30.0,
                 run_dir: Path | None = None, owners: dict[str, int] | None = None,
                 secure: bool = False) -> None:
        from dips.algo import partition_contiguous
        from dips.roles.leader import FollowerEntry, Leader
        from dips.roles.leader_types import Issued
        from dips.spec import GraceConfig, LeaderConfig, MembershipConfig, PenaltyConfig, Timeouts
        from dips.wire.control import make_server
        from dips.wire.pb import control_pb2_grpc as pbg
        from dips.wire.pki import Identity
        from dips.wire.security import Credentials
        from dips.wire.services import FollowerControlClient, LeaderServicer

        self.secure = secure
        self.pki: str | None = None
        if secure:
            import tempfile

            from dips.wire.pki import init_pki

            self._tmp = tempfile.TemporaryDirectory(prefix="dips-bench-pki-")
            self.pki = self._tmp.name
            init_pki(Path(self.pki), followers, [f"c{i}" for i in range(16)])
        issued = Issued(encrypt=secure)  # term 1, a fresh data secret
        self.data_secret = issued.data_secret
        creds = (Credentials.tls(Path(self.pki) / "leader") if secure
                 else Credentials.insecure(Identity.leader()))
        table = model_layers(spec)
        names = [l for l, _, _ in table]
        if owners is None:
            parts = partition_contiguous([b for _, _, b in table], followers)
            owners = {names[j]: i for i, r in enumerate(parts) for j in r}
        self.owners = owners
        cfg = LeaderConfig(grace=GraceConfig(mode=grace_mode, window_s=grace_s, max_s=grace_max_s),
                           timeouts=Timeouts(push_s=300, pull_s=300),
                           membership=MembershipConfig(heartbeat_interval_s=HEARTBEAT_S,
                                                       missed_heartbeats=MISSED_HEARTBEATS),
                           followers=followers, penalty=PenaltyConfig(enabled=False))
        self.leader = Leader(cfg, lambda e: FollowerControlClient(
            e.control_endpoint, creds, e.index, issued.term, 300.0), run_dir, issued=issued)
        self.grpc = make_server(max_workers=32)
        pbg.add_LeaderServicer_to_server(LeaderServicer(self.leader, lambda info: FollowerEntry(
            info.index, info.data_endpoint, info.control_endpoint, list(info.layers),
            list(info.layer_bytes), info.incarnation, leader_term=info.leader_term)), self.grpc)
        self.addr = f"127.0.0.1:{creds.add_port(self.grpc, '127.0.0.1:0')}"
        self.grpc.start()
        self.leader.start()
        self._stop = MP.Event()
        self.procs = []
        for i in range(followers):
            ready = MP.Event()
            p = MP.Process(target=_follower_main, daemon=True, args=(
                i, spec, [l for l in names if owners[l] == i], self.addr, ready, self._stop,
                self.pki))
            p.start()
            self.procs.append((p, ready))
        deadline = time.monotonic() + 180
        while not self.leader.ready:
            if time.monotonic() > deadline or any(not p.is_alive() for p, _ in self.procs):
                self.close()
                raise RuntimeError("followers did not come up")
            time.sleep(0.1)

    def endpoints(self) -> dict[int, str]:
        return {f.index: f.data_endpoint for f in self.leader.follower_list()}

    def member_key(self, cluster_id: str) -> Any:
        """A data-plane key of cluster ``cluster_id`` (a fresh key id, as a join issues)."""
        from dips.wire.keys import issue
        from dips.wire.pki import Identity

        return issue(self.data_secret, Identity.cluster(cluster_id), self.secure)

    def client(self, cluster_id: str, stages: int, model: torch.nn.Module) -> Any:
        """A joined ClusterClient for a synthetic ``model`` (H = 1: sync() is called directly)."""
        from dips.roles.client import ClusterClient
        from dips.wire.pki import Identity
        from dips.wire.security import Credentials

        creds = (Credentials.tls(Path(self.pki) / f"cluster-{cluster_id}") if self.pki
                 else Credentials.insecure(Identity.cluster(cluster_id)))
        c = ClusterClient(model, self.addr, cluster_id, creds, H=1, stages=stages,
                          layer_of=layer_of, timeout_s=300, admit_timeout_s=300,
                          heartbeat_interval_s=1.0)
        c.join()
        return c

    def close(self) -> None:
        self._stop.set()
        for p, _ in self.procs:
            p.join(15)
            if p.is_alive():
                p.kill()
        self.leader.stop()
        self.grpc.stop(0)
        if self.pki is not None:
            self._tmp.cleanup()


def _raw_receiver(port: Any, nbytes: int, reps: int) -> None:
    buf = bytearray(4 << 20)
    view = memoryview(buf)
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port.value = srv.getsockname()[1]
        conn, _ = srv.accept()
        with conn:
            for _ in range(reps):
                got = 0
                while got < nbytes:
                    n = conn.recv_into(view, min(len(buf), nbytes - got))
                    if not n:
                        return
                    got += n
                conn.sendall(b"k")


def raw_tcp_bytes_per_s(nbytes: int, reps: int = 3) -> float:
    """Best of ``reps`` loopback TCP transfers of ``nbytes`` between two processes (bytes/s)."""
    port = MP.Value("i", 0)
    p = MP.Process(target=_raw_receiver, args=(port, nbytes, reps), daemon=True)
    p.start()
    while not port.value:
        time.sleep(0.01)
    src = bytearray(4 << 20)
    best = float("inf")
    with socket.create_connection(("127.0.0.1", port.value)) as s:
        for _ in range(reps):
            t0 = time.perf_counter()
            sent = 0
            while sent < nbytes:
                n = min(len(src), nbytes - sent)
                s.sendall(memoryview(src)[:n])
                sent += n
            s.recv(1)
            best = min(best, time.perf_counter() - t0)
    p.join(10)
    return nbytes / best


# ----- ZeroMQ alone: the transport ceiling of the data plane -------------------------------
# The same sockets (DEALER on the cluster, ROUTER on the follower, the data plane's options),
# the same framing (``[b"C", meta 20 B, tag 16 B, data]`` per chunk, multipart, ``copy=False``,
# receive without copying), the same chunk size; no conversion, no authentication, no Δ.

def _zmq_options(sock: Any, router: bool) -> None:
    import zmq

    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 32)
    sock.setsockopt(zmq.SNDTIMEO, 60_000)
    sock.setsockopt(zmq.RCVTIMEO, 60_000)
    if router:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)


def _zmq_chunks(nbytes: int, chunk: int) -> list[tuple[bytes, int]]:
    """``(meta, size)`` per chunk of a transfer of ``nbytes`` (the data plane's meta layout)."""
    xfer = os.urandom(16)
    return [(struct.pack("<16sI", xfer, k), min(chunk, nbytes - off))
            for k, off in enumerate(range(0, nbytes, chunk))]


def _zmq_receive_stream(sock: Any, router: bool) -> int:
    """Receive chunks (zero-copy frames, dropped at once) until END; returns data bytes."""
    got, skip = 0, 2 if router else 1  # [ident,] kind, meta, tag, data
    while True:
        parts = sock.recv_multipart(copy=False)
        kind = parts[skip - 1].bytes
        if kind == b"E":
            return got
        if kind == b"C":
            got += len(parts[skip + 2])


def _zmq_peer(port: Any, nbytes: int, chunk: int, reps: int) -> None:
    """The follower's side: a ROUTER that takes ``reps`` pushes and serves ``reps`` pulls."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    _zmq_options(sock, router=True)
    port.value = sock.bind_to_random_port("tcp://127.0.0.1")
    src = memoryview(bytearray(chunk))  # touched once, sent by reference like a snapshot
    tag, mac = b"\0" * 16, b"\0" * 32
    try:
        for _ in range(reps):
            _zmq_receive_stream(sock, router=True)       # push
            ident = sock.recv_multipart()[0]              # pull request
            sock.send_multipart([ident, b"M", b"ack"])
            for meta, n in _zmq_chunks(nbytes, chunk):
                sock.send_multipart([ident, b"C", meta, tag, src[:n]], copy=False)
            sock.send_multipart([ident, b"E", b"\0" * 20, mac])
        sock.recv_multipart()  # the client's goodbye: everything sent was received
    finally:
        sock.close(0)
        ctx.term()


def zmq_bytes_per_s(nbytes: int, chunk: int, reps: int = 3) -> tuple[float, float]:
    """Best-of-``reps`` throughput (bytes/s) of a push and of a pull of ``nbytes`` through
    ZeroMQ alone between two processes, framed like the data plane (see above), in chunks of
    ``chunk`` bytes. Raises TimeoutError (zmq.Again) if the peer stops answering for 60 s."""
    import zmq

    port = MP.Value("i", 0)
    p = MP.Process(target=_zmq_peer, args=(port, nbytes, chunk, reps), daemon=True)
    p.start()
    try:
        deadline = time.monotonic() + 60
        while not port.value:
            if time.monotonic() > deadline or not p.is_alive():
                raise RuntimeError("zmq peer did not start")
            time.sleep(0.01)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        _zmq_options(sock, router=False)
        sock.connect(f"tcp://127.0.0.1:{port.value}")
        src = memoryview(bytearray(chunk))
        tag = b"\0" * 16
        push, pull = float("inf"), float("inf")
        try:
            for _ in range(reps):
                t0 = time.perf_counter()
                sock.send_multipart([b"B", b"{}", b"\0" * 32])
                for meta, n in _zmq_chunks(nbytes, chunk):
                    sock.send_multipart([b"C", meta, tag, src[:n]], copy=False)
                sock.send_multipart([b"E", b"\0" * 20, b"\0" * 32])
                sock.send_multipart([b"R", b"{}"])
                if sock.recv_multipart()[0] != b"M":  # the push's ack: every byte is in
                    raise RuntimeError("zmq peer: unexpected reply")
                t1 = time.perf_counter()
                got = _zmq_receive_stream(sock, router=False)
                t2 = time.perf_counter()
                if got != nbytes:
                    raise RuntimeError(f"zmq pull moved {got} of {nbytes} bytes")
                push, pull = min(push, t1 - t0), min(pull, t2 - t1)
            sock.send_multipart([b"X"])
        finally:
            sock.close(0)
            ctx.term()
    finally:
        p.join(10)
        if p.is_alive():
            p.kill()
    return nbytes / push, nbytes / pull
