"""A small follower shard, admission tickets and push headers for the hostile-input tests
(issue 13): tests/roles/test_hostile_follower.py, tests/wire/test_hostile_dataplane.py and
the property tests of this directory."""

from __future__ import annotations

import gc
import time
from contextlib import contextmanager
from typing import Iterator

import torch

from dips.roles.follower import FollowerShard
from dips.wire import admission
from dips.wire.admission import Ticket
from dips.wire.dataplane import DataClient, DataServer
from dips.wire.keys import Keyring, MemberKey, issue
from dips.wire.pki import Identity

SECRET = b"s" * 32
ADMIT = admission.admission_key(SECRET)
SHAPES = {"a.w": (40, 30), "a.b": (30,), "b.w": (30, 20)}
LAYERS = {"a": ["a.w", "a.b"], "b": ["b.w"]}


def pid(n: int) -> str:
    """A push id as the leader makes them (16 hex digits)."""
    return f"{n:016x}"


def theta(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def local(seed: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """A cluster's θ_local: θ plus a little noise, in the wire dtype."""
    base, g = theta(), torch.Generator().manual_seed(100 + seed)
    return {n: (t + 1e-2 * torch.randn(t.shape, generator=g)).to(dtype) for n, t in base.items()}


def shard(tmp_path=None, *, key: bytes | None = ADMIT, **kw) -> FollowerShard:
    """A follower of the run's kind: BF16 on the wire, tickets required (checked under ``key``)."""
    s = FollowerShard(0, LAYERS, theta(), wire_dtype="bf16", require_tickets=True,
                      log_dir=tmp_path, **kw)
    if key is not None:
        s.set_admission_key(key)
    return s


def ticket(cluster: str, rnd: int, push_id: str, tokens: int = 100, base: int = 0,
           key: bytes = ADMIT) -> dict[str, str]:
    """The header fields of the leader's ticket for this push."""
    body, mac = admission.sign(key, Ticket(rnd, cluster, push_id, tokens, base))
    return {"ticket": body, "ticket_mac": mac.hex()}


def head(cluster: str = "a", rnd: int = 1, layer: str = "a", push_id: str | None = None,
         tokens: int = 100, base: int = 0, stage: bool = False, key: bytes = ADMIT,
         **extra) -> dict:
    """A push header with a ticket signed under ``key`` (valid under the default);
    ``extra`` overrides or adds fields."""
    push_id = push_id or pid(1)
    h = {"op": "push", "cluster": cluster, "round": 0 if stage else rnd, "layer": layer,
         "push_id": push_id, "tokens": tokens, **ticket(cluster, 0 if stage else rnd, push_id,
                                                       tokens, base, key)}
    if stage:
        h["stage"] = True
    h.update(extra)
    return h


def tensors(layer: str, values: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    return [(n, values[n]) for n in LAYERS[layer]]


def key_of(cluster: str = "a") -> MemberKey:
    return issue(SECRET, Identity.cluster(cluster), False)


@contextmanager
def served(s: FollowerShard) -> Iterator[DataServer]:
    """``s`` behind a real data server on 127.0.0.1 (a random port), stopped afterwards."""
    server = DataServer(Keyring(SECRET), s.handle, authorize=s.authorize).start()
    try:
        yield server
    finally:
        server.stop()


def push_all(client: DataClient, values: dict[str, torch.Tensor], rnd: int, push_id: str,
             cluster: str = "a", tokens: int = 100, single: bool = False) -> None:
    """Every layer of a legitimate push, streamed (or as single messages)."""
    for layer in LAYERS:
        h = head(cluster, rnd, layer, push_id, tokens)
        if single:
            client.request(h, tensors(layer, values))
        else:
            client.push(h, tensors(layer, values), chunk_bytes=1024)


def step(s: FollowerShard, rnd: int, clusters: list[str], tokens: list[int]) -> str:
    """Score, aggregate, apply and commit round ``rnd`` with T_j weights, as the leader
    would; returns the new checksum. Raises AssertionError if a cluster was invalid."""
    scored = s.score(rnd, clusters)
    assert all(valid for _, valid, _, _ in scored), scored
    weights = [t / sum(tokens) for t in tokens]
    s.aggregate(rnd, clusters, weights)
    s.apply(rnd, 1.0, s.version + 1, clusters, weights)
    return s.commit(s.version + 1)[1]


def released(s: FollowerShard, timeout_s: float = 30.0) -> bool:
    """Whether every FP32 push buffer of ``s`` is back in its pool, waiting (up to
    ``timeout_s``) for the server's consumer thread to drop its last reference to a finished
    transfer: the event, not a duration."""
    deadline = time.monotonic() + timeout_s
    while pool_live(s) and time.monotonic() < deadline:
        time.sleep(0.02)
    return pool_live(s) == 0


def pool_live(s: FollowerShard) -> int:
    """FP32 push buffers the shard holds now (after collecting what was dropped)."""
    gc.collect()
    pools = getattr(s, "_pools", None)
    sums = getattr(s, "_sum_pool", None)
    return (pools[0].live if pools else 0) + (sums.live if sums else 0)


def wait_for(predicate, timeout_s: float = 60.0, what: str = "the event") -> None:
    """Wait until ``predicate()`` is true (the event, not a duration: ``timeout_s`` only
    bounds a failing test). Raises AssertionError naming ``what`` if it never is."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s} s")
        time.sleep(0.01)


def big_shard(rows: int = 2048, cols: int = 2048) -> FollowerShard:
    """A follower of one tensor ``w`` (layer ``w``) large enough that a pull of it outgrows
    the kernel's socket buffers (2048 x 2048: 8 MiB in BF16): a peer that does not read
    leaves it unwritten."""
    g = torch.Generator().manual_seed(0)
    return FollowerShard(0, {"w": ["w"]}, {"w": torch.randn(rows, cols, generator=g)},
                         wire_dtype="bf16", require_tickets=True)


def deaf_socket(endpoint: str):
    """A DEALER connected to ``endpoint`` that reads as little as libzmq lets it (RCVHWM 1,
    RCVBUF 4 KiB): the member of issue 13's pull flood, which never reads."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.setsockopt(zmq.RCVBUF, 4096)
    sock.connect(endpoint)
    return sock
