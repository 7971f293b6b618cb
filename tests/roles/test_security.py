"""Secure by default: who may call what, decided from certificates (mutual TLS), never from
the request body; each refusal leaves every follower's θ bit-identical (issue 11).

A real leader (:class:`dips.roles.leader.Leader` behind its gRPC servicer) and a real
follower (shard, control servicer with its fence, ZeroMQ data server) in this process, on
127.0.0.1 with TLS certificates from ``dips.wire.pki.init_pki``.
"""

from __future__ import annotations

import time

import grpc
import pytest
import torch

from dips.algo.refusal import Refusal
from dips.node.common import RoleError, credentials
from dips.roles.fence import Fence
from dips.roles.follower import FollowerShard
from dips.roles.leader import FollowerEntry, Leader, LeaderConfig
from dips.roles.leader_types import Issued
from dips.spec import MembershipConfig, ModelConfig
from dips.train.model import build_model, fingerprint_of, layer_table
from dips.wire import keys
from dips.wire.control import Client, make_server, refusal_of
from dips.wire.dataplane import DataClient, DataPlaneError, DataServer, FrameError
from dips.wire.keys import Keyring
from dips.wire.pb import control_pb2 as pb
from dips.wire.pb import control_pb2_grpc as pbg
from dips.wire.pki import Identity, init_pki, read_revoked, revoke
from dips.wire.security import INSECURE_WARNING, Credentials
from dips.wire.services import FollowerControlClient, FollowerServicer, LeaderServicer

pytestmark = pytest.mark.timeout(120)

CFG = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                  num_kv_heads=2, vocab_size=512, max_seq_len=64)
VOCAB = {"a": 0, "b": 1}


class Site:
    """One leader and one follower (owning the whole model), both behind mutual TLS."""

    def __init__(self, tmp_path) -> None:
        self.pki = tmp_path / "pki"
        init_pki(self.pki, 1, ["a", "b"])
        init_pki(tmp_path / "other", 1, ["a"])
        self.other = tmp_path / "other"
        model = build_model(CFG, seed=0)
        self.fingerprint = fingerprint_of(model, VOCAB).to_json()
        table = layer_table(model)
        layers = {l: names for l, names, _ in table}
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        self.shard = FollowerShard(0, layers, params)
        self.theta0 = {n: t.clone() for n, t in self.shard.params.items()}
        leader_creds = self.creds("leader")
        self.leader = Leader(LeaderConfig(followers=1, membership=MembershipConfig(
            heartbeat_interval_s=1.0, missed_heartbeats=30)),
            lambda e: FollowerControlClient(e.control_endpoint, leader_creds, e.index, 1),
            issued=Issued(term=1, fingerprint=self.fingerprint))
        self.fence = Fence(None, lease_s=3.0)
        self.data = DataServer(Keyring(self.leader.issued.data_secret), self.shard.handle,
                               authorize=self.shard.authorize).start()
        self.fserver = make_server(max_workers=4)
        pbg.add_FollowerServicer_to_server(FollowerServicer(self.shard, self.fence), self.fserver)
        self.follower_addr = f"127.0.0.1:{self.creds('follower-0').add_port(self.fserver, '127.0.0.1:0')}"
        self.fserver.start()
        self.lserver = make_server(max_workers=8)
        pbg.add_LeaderServicer_to_server(LeaderServicer(
            self.leader, lambda i: FollowerEntry(i.index, i.data_endpoint, i.control_endpoint,
                                                 list(i.layers), list(i.layer_bytes),
                                                 i.incarnation, leader_term=i.leader_term),
            revoked=lambda: read_revoked(self.pki / "leader" / "revoked.txt")), self.lserver)
        self.leader_addr = f"127.0.0.1:{leader_creds.add_port(self.lserver, '127.0.0.1:0')}"
        self.lserver.start()
        self.leader.register_follower(FollowerEntry(0, self.data.endpoint, self.follower_addr,
                                                    list(layers), [b for _, _, b in table]))
        self.stages = [list(layers)]

    def creds(self, name: str, pki=None) -> Credentials:
        return Credentials.tls((pki or self.pki) / name)

    def leader_as(self, name: str, pki=None) -> Client:
        return Client(pbg.LeaderStub, self.leader_addr, self.creds(name, pki), Identity.leader(),
                      timeout_s=10)

    def theta_unchanged(self) -> bool:
        return all(torch.equal(self.shard.params[n], t) for n, t in self.theta0.items())

    def close(self) -> None:
        self.lserver.stop(0).wait(5)
        self.fserver.stop(0).wait(5)
        self.data.stop()
        self.shard.close()


@pytest.fixture
def site(tmp_path):
    s = Site(tmp_path)
    yield s
    s.close()


def _refused(call, code: Refusal, status=grpc.StatusCode.PERMISSION_DENIED) -> str:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == status and refusal_of(info.value) is code, info.value
    return info.value.details()


def test_no_client_certificate_or_another_ca_is_refused(site):
    ca = (site.pki / "ca.crt").read_bytes()
    bare = grpc.secure_channel(site.leader_addr, grpc.ssl_channel_credentials(ca),
                               options=[("grpc.ssl_target_name_override", "leader")])
    try:
        with pytest.raises(grpc.RpcError) as info:
            pbg.LeaderStub(bare).GetStatus(pb.StatusRequest(), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        bare.close()
    stranger = site.leader_as("cluster-a", pki=site.other)
    with pytest.raises(grpc.RpcError) as info:
        stranger.GetStatus(pb.StatusRequest(), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    stranger.close()
    assert site.leader_as("admin").GetStatus(pb.StatusRequest()).followers_ready >= 0


def test_a_cluster_acts_only_as_itself(site):
    a = site.leader_as("cluster-a")
    reply = a.JoinCluster(pb.JoinRequest(stages=[pb.StageLayers(layers=s) for s in site.stages],
                                         fingerprint=site.fingerprint))
    assert reply.key_id.startswith("cluster-a/") and len(reply.key) == 32
    calls = [lambda: a.Heartbeat(pb.HeartbeatRequest(cluster_id="b")),
             lambda: a.Lease(pb.LeaseRequest(cluster_id="b", n=0)),
             lambda: a.RequestPush(pb.PushRequest(cluster_id="b", base_version=0, tokens=1)),
             lambda: a.PushDone(pb.PushDoneRequest(cluster_id="b", push_id="x", ok=True)),
             lambda: a.PullDone(pb.PullDoneRequest(cluster_id="b", version=0)),
             lambda: a.LeaveCluster(pb.LeaveRequest(cluster_id="b"))]
    for call in calls:
        assert "cluster_id" in _refused(call, Refusal.FORBIDDEN)
    assert "a" in site.leader.clusters  # cluster a is still a member, nobody left as it
    f = site.leader_as("follower-0")
    assert "only a cluster" in _refused(
        lambda: f.JoinCluster(pb.JoinRequest(cluster_id="a")), Refusal.FORBIDDEN)
    b = site.leader_as("follower-0")
    _refused(lambda: b.RegisterFollower(pb.FollowerInfo(index=1)), Refusal.FORBIDDEN)
    assert site.theta_unchanged()


def test_only_the_leader_calls_a_follower_and_only_with_a_live_term(site):
    as_cluster = Client(pbg.FollowerStub, site.follower_addr, site.creds("cluster-a"),
                        Identity.follower(0), timeout_s=10)
    # The attack of issue 11: a cluster committing its own outer step on a follower.
    _refused(lambda: as_cluster.Apply(pb.ApplyRequest(round=1, clip_factor=1.0, new_version=1,
                                                      accepted=["a"], weights=[1.0])),
             Refusal.FORBIDDEN)
    assert site.shard.version == 0 and site.theta_unchanged()
    fenced = []
    lead = site.creds("leader")
    one = FollowerControlClient(site.follower_addr, lead, 0, 1, on_fenced=fenced.append)
    assert one.fence() == 1 and site.fence.term == 1
    two = FollowerControlClient(site.follower_addr, lead, 0, 2)  # a second leader, term 2
    _refused(two.report, Refusal.LEASE_HELD, grpc.StatusCode.UNAVAILABLE)
    assert site.fence.term == 1
    site.fence._clock = lambda: 1e12  # the first leader fell silent for longer than the lease
    assert two.fence() == 2
    _refused(lambda: one.abort(None), Refusal.STALE_TERM, grpc.StatusCode.FAILED_PRECONDITION)
    assert fenced and "term 1 is stale" in fenced[0]
    assert site.theta_unchanged()


def test_a_revoked_cluster_is_refused_at_its_next_join_and_every_read(site):
    b = site.leader_as("cluster-b")
    join = pb.JoinRequest(stages=[pb.StageLayers(layers=s) for s in site.stages],
                          fingerprint=site.fingerprint)
    b.JoinCluster(join)
    revoke(site.pki, "b")
    assert "revoked" in _refused(lambda: b.JoinCluster(join), Refusal.FORBIDDEN)
    _refused(lambda: b.Heartbeat(pb.HeartbeatRequest()), Refusal.FORBIDDEN)
    # Found by a review: the reads stayed open to a revoked cluster (config, members' losses).
    _refused(lambda: b.GetStatus(pb.StatusRequest()), Refusal.FORBIDDEN)
    _refused(lambda: b.GetSpec(pb.SpecRequest()), Refusal.FORBIDDEN)
    site.leader_as("cluster-a").GetStatus(pb.StatusRequest())  # others still may


def test_a_model_that_differs_is_refused_at_join_naming_the_fields(site):
    other = build_model(CFG.model_copy(update={"num_heads": 8, "num_kv_heads": 4,
                                               "head_dim": 4, "rope_theta": 5e5}), seed=0)
    assert [p.shape for p in other.parameters()] == [p.shape for p in build_model(CFG, 0).parameters()]
    a = site.leader_as("cluster-a")
    why = _refused(lambda: a.JoinCluster(pb.JoinRequest(
        stages=[pb.StageLayers(layers=s) for s in site.stages],
        fingerprint=fingerprint_of(other, VOCAB).to_json())), Refusal.MODEL_MISMATCH,
        grpc.StatusCode.FAILED_PRECONDITION)
    assert "num_attention_heads: run 4, cluster 8" in why and "rope_parameters" in why
    assert "a" not in site.leader.clusters


def test_the_data_plane_believes_a_member_only_as_itself(site):
    secret = site.leader.issued.data_secret
    key_a = keys.issue(secret, Identity.cluster("a"), False)
    t = torch.zeros(4, dtype=torch.bfloat16)
    layer = site.stages[0][0]
    with DataClient(key_a, site.data.endpoint, timeout_s=10) as c:
        with pytest.raises(DataPlaneError) as info:  # a push naming cluster b under a's key
            c.request({"op": "push", "cluster": "b", "round": 1, "push_id": "p", "layer": layer,
                       "base_version": 0, "tokens": 1}, [("x", t)])
        assert info.value.code is Refusal.FORBIDDEN
    forged = keys.MemberKey(key_a.key_id, keys.derive(b"x" * 32, key_a.key_id))
    with DataClient(forged, site.data.endpoint, timeout_s=10) as c:
        # Refused under the real key of that id, which the forger cannot verify either.
        with pytest.raises(FrameError, match="mac does not match"):
            c.request({"op": "pull", "version": 0, "layers": [layer], "dtype": "bf16"})
    follower_key = keys.issue(secret, Identity.follower(0), False)
    with DataClient(follower_key, site.data.endpoint, timeout_s=10) as c:
        with pytest.raises(DataPlaneError) as info:
            c.request({"op": "pull", "version": 0, "layers": [layer], "dtype": "bf16"})
        assert info.value.code is Refusal.FORBIDDEN
    assert site.theta_unchanged() and not site.shard._staged


def test_insecure_needs_the_flag_and_warns(capsys, tmp_path):
    creds = credentials(None, True, Identity.cluster("a"))
    assert not creds.secure and INSECURE_WARNING in capsys.readouterr().err
    with pytest.raises(RoleError, match="exactly one"):
        credentials(None, False, Identity.cluster("a"))
    init_pki(tmp_path, 1, ["a"])
    with pytest.raises(RoleError, match="cluster-a"):
        credentials(tmp_path / "cluster-a", False, Identity.cluster("b"))


def test_a_second_process_as_follower_0_supersedes_the_first_which_is_refused(site):
    f0 = site.leader_as("follower-0")
    info = pb.FollowerInfo(index=0, data_endpoint=site.data.endpoint,
                           control_endpoint=site.follower_addr, layers=site.stages[0],
                           layer_bytes=[4] * len(site.stages[0]), incarnation=111)
    f0.RegisterFollower(info)  # replaces the in-process registration (a restart)
    second = pb.FollowerInfo()
    second.CopyFrom(info)
    second.incarnation = 222
    f0.RegisterFollower(second)  # another process with the same certificate
    assert site.leader.followers[0].incarnation == 222
    assert "superseded" in _refused(lambda: f0.RegisterFollower(info), Refusal.FORBIDDEN)
    assert site.leader.followers[0].incarnation == 222 and site.theta_unchanged()


def test_a_departed_members_key_stops_working_and_a_revoked_cluster_stops(site):
    from dips.roles.client import ClusterClient
    from dips.algo.refusal import Refused
    from dips.wire.keys import MemberKey

    b = ClusterClient(build_model(CFG, seed=0), site.leader_addr, "b", site.creds("cluster-b"),
                      fingerprint=site.fingerprint, timeout_s=10)
    try:
        b.join()
        old = b._key
        ring = site.data._keys

        def refresh():  # what a follower's next registration brings
            ans = site.leader.register_follower(site.leader.followers[0])
            ring.set_members(list(ans.member_keys), ans.next_key_seq)

        refresh()
        layer = site.stages[0][0]
        pull = {"op": "pull", "version": 0, "layers": [layer], "dtype": "bf16"}
        with DataClient(old, site.data.endpoint, timeout_s=10) as c:
            assert c.request(pull).header["op"] == "model"
        site.leader.leave("b")  # departed (or removed): its key is no member's any more
        refresh()
        with DataClient(old, site.data.endpoint, timeout_s=10) as c:
            with pytest.raises(DataPlaneError) as info:
                c.request(pull)
            assert info.value.code is Refusal.NOT_JOINED
        b.join()  # a new key, and it works
        assert b._key.key_id != old.key_id
        with DataClient(MemberKey(b._key.key_id, b._key.key, b._key.encrypt), site.data.endpoint,
                        timeout_s=10) as c:
            assert c.request(pull).header["op"] == "model"
        revoke(site.pki, "b")
        deadline = time.monotonic() + 30  # its next heartbeat is refused: it must re-join...
        while not b._rejoin.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(Refused) as info:  # ...which is refused for good: the process stops
            b.maintain()
        assert info.value.code is Refusal.FORBIDDEN and "revoked" in info.value.message
    finally:
        b.close()


def test_a_leader_whose_state_is_behind_a_follower_cannot_take_its_lease(site):
    """A stale copy of a leader's state directory, started when the live leader died, must not
    take the followers (its term may be higher): the follower refuses by version first."""
    site.shard.version = 5  # the run went on past the copy's version
    stale = FollowerControlClient(site.follower_addr, site.creds("leader"), 0, 9)
    why = _refused(lambda: stale.fence(version=3), Refusal.STALE_TERM,
                   grpc.StatusCode.FAILED_PRECONDITION)
    assert "stale copy" in why and site.fence.term == 0  # no term was taken
    assert stale.fence(version=5) == 9  # a leader as recent as the follower takes it
