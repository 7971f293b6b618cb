"""Real-time decentralized asynchronous DiLoCo: the naive method of §4, with no server.

One process per cluster (``python -m dips.baselines.real_async --run-dir D --rank i``).  Each
cluster keeps its own replica of the global θ and its own Nesterov outer optimizer.  When it
finishes H inner steps it forms Δ_i = θ_i,global − θ_i,local (:func:`dips.algo.pseudo_gradient`)
and sends Δ_i point to point to every peer at once (ZeroMQ DEALER → ROUTER, the
HMAC-authenticated raw frames of
:mod:`dips.wire.frames`; never pickle; BF16 padded to ``payload_bytes``); all copies share the
cluster's one uplink (its veth's tbf, or the token bucket of the fallback).  When every peer
has acknowledged receipt it applies, without waiting for anyone else's pseudo-gradient, the
uniform mean of its own Δ_i and every peer Δ_j that has *arrived* since its last outer step,
one Nesterov step (lr 0.7, momentum 0.8, :func:`dips.algo.nesterov_step`, FP32), and restarts
from its new replica.  No penalty, no token weighting, no clipping (§4).  A peer's Δ_j was
formed against the peer's own replica, so mixing them as if they shared a base is what breaks
convergence under heterogeneity.  The same rules as the virtual-time engine
(:mod:`dips.baselines.virtual_async`), where a cluster's sends also end its round.

A cluster runs until the launcher stops it (token budget reached by all clusters together, or
``max_time_s``); it then saves its replica for evaluation (cluster 0's is the reported model).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import torch
import zmq

from dips.baselines.real_common import OuterReplica, Worker, payload_elems, worker_main
from dips.train.trainer import ClusterTrainer, StepResult
from dips.wire.frames import FrameError, decode, encode

__all__ = ["GossipDiLoCo", "PeerLinks", "main", "run"]


class PeerLinks:
    """The point-to-point transport of one cluster: a ROUTER inbox and a DEALER per peer.

    A receiver thread decodes each incoming Δ (MAC, dtypes, shapes and finiteness checked by
    :func:`dips.wire.frames.decode`), queues it and acknowledges it; :meth:`broadcast` sends one
    Δ to every peer at once and returns when every peer acknowledged it (or was given up).

    Args:
        worker: this cluster's worker (its endpoint, bucket, parameter names/shapes).
        key: the run secret (HMAC key, bytes).
    """

    def __init__(self, worker: Worker, key: bytes) -> None:
        self.w, self.key = worker, key
        self.ctx = zmq.Context()
        self.inbox_sock = self.ctx.socket(zmq.ROUTER)
        self.inbox_sock.setsockopt(zmq.LINGER, 0)
        ep = worker.endpoint
        if ep.port:
            self.inbox_sock.bind(f"tcp://{ep.addr}:{ep.port}")
            self.endpoint = f"tcp://{ep.addr}:{ep.port}"
        else:
            self.endpoint = f"tcp://{ep.addr}:{self.inbox_sock.bind_to_random_port(f'tcp://{ep.addr}')}"
        self.shapes = {n: tuple(p.shape) for n, p in zip(worker.names, worker.params)}
        self.inbox: list[dict[str, Any]] = []
        self.latest_tokens: dict[str, int] = {}
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.peers: dict[str, zmq.Socket] = {}
        self.thread = threading.Thread(target=self._receive, name="recv", daemon=True)
        self.delivered = self.undelivered = 0
        self._recv_log = open(worker.run_dir / "clusters" / worker.me.id / "recv.jsonl", "a", buffering=1)

    def connect(self, endpoints: dict[str, str]) -> None:
        """Open a DEALER socket to every peer; start receiving."""
        for peer, ep in endpoints.items():
            if peer != self.w.me.id:
                sock = self.ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(ep)
                self.peers[peer] = sock
        self.thread.start()

    def _receive(self) -> None:
        poller = zmq.Poller()
        poller.register(self.inbox_sock, zmq.POLLIN)
        while not self.done.is_set():
            if not poller.poll(200):
                continue
            frames = self.inbox_sock.recv_multipart(copy=False)
            recv_at = self.w.now()
            try:
                msg = decode(self.key, [f.buffer for f in frames[1:]])
                h = msg.header
                tensors = {n: t for n, t in msg.tensors.items() if n != "_pad"}
                if h.get("op") != "pseudo_grad" or {n: tuple(t.shape) for n, t in tensors.items()} != self.shapes:
                    raise FrameError(f"op {h.get('op')!r} or tensor set/shapes differ from the model")
            except FrameError as exc:
                self._recv_log.write(json.dumps({"error": str(exc), "recv_at": recv_at}) + "\n")
                continue
            with self.lock:
                self.inbox.append({"from": h["cluster"], "round": h["round"], "tensors": tensors})
                self.latest_tokens[h["cluster"]] = max(int(h["tokens"]), self.latest_tokens.get(h["cluster"], 0))
            self.inbox_sock.send_multipart([frames[0].bytes, b"ack", str(h["round"]).encode()])
            self._recv_log.write(json.dumps({"from": h["cluster"], "round": h["round"],
                                             "bytes": sum(f.buffer.nbytes for f in frames[1:]),
                                             "sent_at": h["sent_at"], "recv_at": round(recv_at, 4)}) + "\n")

    def broadcast(self, frames: list, rnd: int) -> float:
        """Send ``frames`` (Δ of round ``rnd``) to every peer; wait for every acknowledgement.

        Under the token-bucket fallback the cluster's uplink is charged for all copies first.
        Gives up on a peer after ``collective_s`` or when the worker is stopped.  Returns the
        seconds from the first send to the last acknowledgement (the cluster's outer
        communication time of this round).
        """
        t = time.monotonic()
        nbytes = sum(memoryview(f).nbytes for f in frames)
        self.w.charge(nbytes * len(self.peers))
        for sock in self.peers.values():
            sock.send_multipart(frames, copy=False)
        poller = zmq.Poller()
        waiting = dict(self.peers)
        for sock in waiting.values():
            poller.register(sock, zmq.POLLIN)
        deadline = t + self.w.spec.collective_s
        while waiting and not self.w.stop.is_set() and time.monotonic() < deadline:
            for sock, _ in poller.poll(200):
                reply = sock.recv_multipart()
                peer = next(p for p, s in waiting.items() if s is sock)
                if reply[:1] == [b"ack"] and reply[1:] == [str(rnd).encode()]:
                    poller.unregister(sock)
                    del waiting[peer]
                    self.delivered += 1
        self.undelivered += len(waiting)
        return time.monotonic() - t

    def drain(self) -> list[dict[str, Any]]:
        """Take every peer Δ that arrived since the last call."""
        with self.lock:
            got, self.inbox = self.inbox, []
        return got

    def close(self) -> None:
        """Stop the receiver and close every socket (unsent messages are dropped)."""
        self.done.set()
        if self.thread.is_alive():
            self.thread.join(5.0)
        for sock in self.peers.values():
            sock.close(0)
        self.inbox_sock.close(0)
        self.ctx.term()
        self._recv_log.close()


class GossipDiLoCo:
    """Naive asynchronous DiLoCo as the sync of :func:`dips.train.run.run_loop` (module docstring).

    Before an inner step, once H steps are done, it sends Δ to every peer, applies the mean
    of its own and every arrived peer Δ and writes the ``sync`` record; a stop request ends
    the loop at once (a partial round is not sent).  :meth:`finish` saves the final replica.

    Args:
        worker: this cluster's process; key: the run secret (HMAC key).
    """

    grad_hook = None

    def __init__(self, worker: Worker, key: bytes) -> None:
        self.w, self.key = worker, key
        self.H = worker.spec.inner.H
        self.outer = OuterReplica(worker.params, worker.spec.outer)  # this cluster's θ replica
        pad_n = payload_elems(worker.spec, worker.n_real) - worker.n_real
        self.pad = [("_pad", torch.zeros(pad_n, dtype=torch.bfloat16))] if pad_n > 0 else []
        self.links = PeerLinks(worker, key)
        self.round = 0
        self.in_round = 0  # inner steps since the last outer step

    def start(self) -> None:
        """The start barrier; then connect to every peer's published inbox."""
        go = self.w.ready_and_wait_go({"endpoint": self.links.endpoint})
        self.links.connect(go["endpoints"])

    def before_step(self, trainer: ClusterTrainer, stop: threading.Event) -> bool:
        """Send and apply after H steps; False once stopped."""
        if stop.is_set():
            return False
        if self.in_round >= self.H:
            self._sync(trainer)
        return not stop.is_set()

    def held(self, trainer: ClusterTrainer, stop: threading.Event) -> None:
        """Never holds: a baseline trains every step (its sync is a barrier of its own)."""
        return None

    def after_step(self, trainer: ClusterTrainer, result: StepResult,
                   stop: threading.Event) -> dict[str, Any]:
        """Count the round's step; nothing to add to the step's record."""
        self.in_round += 1
        return {}

    def starved(self, trainer: ClusterTrainer, stop: threading.Event) -> None:
        """Never: a fixed-assignment sampler cycles through its chunks."""

    def _sync(self, trainer: ClusterTrainer) -> None:
        w, links = self.w, self.links
        self.round += 1
        self.in_round = 0
        t = time.monotonic()
        delta = self.outer.pseudo_gradients(w.params)
        header = {"op": "pseudo_grad", "cluster": w.me.id, "round": self.round,
                  "tokens": trainer.tokens, "sent_at": round(w.now(), 4)}
        frames = encode(self.key, header,
                        [(n, d.to(torch.bfloat16)) for n, d in zip(w.names, delta)] + self.pad)
        comm_s = links.broadcast(frames, self.round)
        peers = links.drain()
        with torch.no_grad():
            for d, name in zip(delta, w.names):
                for m in peers:
                    d.add_(m["tensors"][name].float())
                d.div_(1 + len(peers))
        self.outer.step(delta)
        self.outer.load_into(w.params)
        with links.lock:
            est = trainer.tokens + sum(links.latest_tokens.values())
        w.record(event="sync", round=self.round, sync=True, tokens=trainer.tokens,
                 comm_s=round(comm_s, 4), update_s=round(time.monotonic() - t - comm_s, 4),
                 applied=1 + len(peers), applied_from=[m["from"] for m in peers],
                 bytes=sum(memoryview(f).nbytes for f in frames))
        if w.rank == 0:
            w.maybe_snapshot(self.outer.theta, est)

    def finish(self, trainer: ClusterTrainer) -> None:
        """Save the final replica, record the delivery counts."""
        self.w.maybe_snapshot(self.outer.theta, trainer.tokens, force=True, tag="final")
        self.w.record(event="links", delivered=self.links.delivered,
                      undelivered=self.links.undelivered)


def run(worker: Worker, key: bytes) -> None:
    """The naive asynchronous loop of one cluster (module docstring) until stopped."""
    sync = GossipDiLoCo(worker, key)
    try:
        sync.start()
        worker.train(sync)
        sync.finish(worker.trainer)
    finally:
        sync.links.close()


def main(argv: list[str] | None = None) -> None:
    """Entry point: ``--run-dir`` (holds ``spec.json`` and ``secret``) and ``--rank``."""

    def body(worker: Worker) -> None:
        run(worker, bytes.fromhex((worker.run_dir / "secret").read_text().strip()))

    worker_main("python -m dips.baselines.real_async", argv, body)


if __name__ == "__main__":
    main()
