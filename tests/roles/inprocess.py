"""In-process followers and the leader's gRPC service, for tests that drive a real
:class:`dips.roles.leader.Leader` on loopback (tests/roles/test_protocol.py,
tests/sim/test_against_leader.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from dips.algo import partition_contiguous
from dips.roles.follower import FollowerShard
from dips.roles.leader import FollowerEntry, Leader
from dips.train.model import layer_table
from dips.wire.admission import admission_key
from dips.wire.control import make_server
from dips.wire.dataplane import DataServer
from dips.wire.keys import Keyring
from dips.wire.pb import control_pb2_grpc as pbg
from dips.wire.pki import Identity
from dips.wire.security import Credentials
from dips.wire.services import LeaderServicer


def add_followers(leader: Leader, model0: torch.nn.Module, log_root: Path, n: int,
                  shards: list, servers: list) -> list[FollowerEntry]:
    """Serve ``n`` follower shards of ``model0``'s layers (byte-balanced, contiguous) behind
    ZeroMQ data servers and register each with ``leader``, as a follower process does.

    ``shards`` and ``servers`` are appended to (the leader's ``connect`` may already read
    ``shards``). Returns the registered entries, in index order.
    """
    table = layer_table(model0)
    params = {name: p.detach().clone() for name, p in model0.named_parameters()}
    secret = leader.issued.data_secret
    entries = []
    for i, r in enumerate(partition_contiguous([b for _, _, b in table], n)):
        layers = {table[j][0]: table[j][1] for j in r}
        shard = FollowerShard(i, layers, params, log_dir=log_root / f"f{i}",
                              require_tickets=True)
        shard.set_admission_key(admission_key(secret))  # as a registration does
        server = DataServer(Keyring(secret), shard.handle, authorize=shard.authorize).start()
        shards.append(shard)
        servers.append(server)
        entries.append(FollowerEntry(i, server.endpoint, "", list(layers),
                                     [table[j][2] for j in r]))
        answer = leader.register_follower(entries[-1])
        assert answer.data_secret == secret
    return entries


def serve_leader(leader: Leader):
    """The leader's gRPC service on a free 127.0.0.1 port, started; returns (server, address)."""
    server = make_server(max_workers=16)
    pbg.add_LeaderServicer_to_server(LeaderServicer(leader, None), server)
    port = Credentials.insecure(Identity.leader()).add_port(server, "127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"
