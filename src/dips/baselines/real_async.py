"""Real-time decentralized asynchronous DiLoCo: the naive method of §4, with no server.

One process per cluster (``python -m dips.baselines.real_async --run-dir D --rank i``).  Each
cluster keeps its own replica of the global θ and its own Nesterov outer optimizer.  When it
finishes H inner steps it forms Δ_i = θ_i,global − θ_i,local and sends Δ_i point to point to
every peer at once (ZeroMQ DEALER → ROUTER, the HMAC-authenticated raw frames of
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

from dips.algo import nesterov_step
from dips.baselines.real_common import Worker, payload_elems, worker_main
from dips.wire.frames import FrameError, decode, encode

__all__ = ["PeerLinks", "main", "run"]


class PeerLinks:
    """The point-to-point transport of one cluster: a ROUTER inbox and a DEALER per peer.

    A receiver thread decodes each incoming Δ (MAC, dtypes, shapes and finiteness checked by
    :func:`dips.wire.frames.decode`), queues it and acknowledges it; :meth:`broadcast` sends one
    Δ to every peer at once and returns when every peer acknowledged it (or was given up).

    Args:
        worker: this cluster's worker (its address, port, bucket, parameter names/shapes).
        key: the run secret (HMAC key, bytes).
    """

    def __init__(self, worker: Worker, key: bytes) -> None:
        self.w, self.key = worker, key
        self.ctx = zmq.Context()
        self.inbox_sock = self.ctx.socket(zmq.ROUTER)
        self.inbox_sock.setsockopt(zmq.LINGER, 0)
        me = worker.me
        if me.port:
            self.inbox_sock.bind(f"tcp://{me.addr}:{me.port}")
            self.endpoint = f"tcp://{me.addr}:{me.port}"
        else:
            self.endpoint = f"tcp://{me.addr}:{self.inbox_sock.bind_to_random_port(f'tcp://{me.addr}')}"
        self.shapes = {n: tuple(p.shape) for n, p in zip(worker.names, worker.params)}
        self.inbox: list[dict[str, Any]] = []
        self.latest_tokens: dict[str, int] = {}
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.peers: dict[str, zmq.Socket] = {}
        self.thread = threading.Thread(target=self._receive, name="recv", daemon=True)
        self.delivered = self.undelivered = 0
        self._recv_log = open(worker.run_dir / "clusters" / me.id / "recv.jsonl", "a", buffering=1)

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


def run(worker: Worker, key: bytes) -> None:
    """The naive asynchronous loop of one cluster (module docstring) until stopped."""
    spec, w = worker.spec, worker
    H, tpb = spec.inner.H, w.sampler.tokens_per_batch
    theta = [p.detach().clone() for p in w.params]  # this cluster's replica of the global θ
    momenta = [torch.zeros_like(p) for p in theta]
    delta = [torch.zeros_like(p) for p in theta]
    pad_n = payload_elems(spec, w.n_real) - w.n_real
    pad = [("_pad", torch.zeros(pad_n, dtype=torch.bfloat16))] if pad_n > 0 else []
    links = PeerLinks(w, key)
    try:
        go = w.ready_and_wait_go({"endpoint": links.endpoint})
        links.connect(go["endpoints"])
        step = rnd = 0
        while not w.stop.is_set():
            for _ in range(H):
                step += 1
                w.paced_inner_step(step, tpb, spec.inner.grad_clip)
                if w.stop.is_set():
                    break
            if w.stop.is_set():
                break  # a partial round is not sent
            rnd += 1
            t = time.monotonic()
            with torch.no_grad():
                for d, th, p in zip(delta, theta, w.params):
                    torch.sub(th, p, out=d)
            header = {"op": "pseudo_grad", "cluster": w.me.id, "round": rnd, "tokens": step * tpb,
                      "sent_at": round(w.now(), 4)}
            frames = encode(key, header, [(n, d.to(torch.bfloat16)) for n, d in zip(w.names, delta)] + pad)
            comm_s = links.broadcast(frames, rnd)
            peers = links.drain()
            with torch.no_grad():
                for d, name in zip(delta, w.names):
                    for m in peers:
                        d.add_(m["tensors"][name].float())
                    d.div_(1 + len(peers))
            nesterov_step(theta, momenta, delta, spec.outer_lr, spec.outer_momentum)
            with torch.no_grad():
                for p, th in zip(w.params, theta):
                    p.copy_(th)
            with links.lock:
                est = step * tpb + sum(links.latest_tokens.values())
            w.record(event="sync", round=rnd, sync=True, tokens=step * tpb, comm_s=round(comm_s, 4),
                     update_s=round(time.monotonic() - t - comm_s, 4), applied=1 + len(peers),
                     applied_from=[m["from"] for m in peers], bytes=sum(memoryview(f).nbytes for f in frames))
            if w.rank == 0:
                w.maybe_snapshot(theta, est)
        w.maybe_snapshot(theta, step * tpb, force=True, tag="final")
        w.record(event="links", delivered=links.delivered, undelivered=links.undelivered)
    finally:
        links.close()


def main(argv: list[str] | None = None) -> None:
    """Entry point: ``--run-dir`` (holds ``spec.json`` and ``secret``) and ``--rank``."""

    def body(worker: Worker) -> None:
        run(worker, bytes.fromhex((worker.run_dir / "secret").read_text().strip()))

    worker_main("python -m dips.baselines.real_async", argv, body)


if __name__ == "__main__":
    main()
