"""Property tests of the control plane (issue 13): any protobuf message, with any field values
(huge and negative integers, NaN and inf, very long strings, long repeated fields), and any
bytes posing as one, sent into every method of the leader's and the follower's servicers,
either succeeds or is refused with a typed status carrying a ``Refusal`` code: never an
unhandled exception, never INTERNAL or UNKNOWN; and the leader keeps serving afterwards.

Most examples call the servicer objects directly (a fake context names the caller); a sample
goes through real gRPC servers on 127.0.0.1, where random bytes reach the deserializer.
"""

from __future__ import annotations

import math
import time
from typing import Any

import grpc
import pytest
import torch
from google.protobuf.descriptor import FieldDescriptor as FD
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dips.algo.ledger import ChunkLedger
from dips.algo.refusal import Refusal
from dips.roles.fence import Fence
from dips.roles.follower import FollowerShard
from dips.roles.leader import FollowerEntry, Leader, LeaderConfig
from dips.spec import GraceConfig, MembershipConfig, Timeouts
from dips.wire import fields
from dips.wire.control import make_server, refusal_of
from dips.wire.pb import control_pb2 as pb
from dips.wire.pb import control_pb2_grpc as pbg
from dips.wire.pki import Identity
from dips.wire.security import IDENTITY_KEY, Credentials
from dips.wire.services import TERM_KEY, FollowerServicer, LeaderServicer
from tests.servicer_context import Aborted
from tests.servicer_context import FakeContext as Context

pytestmark = pytest.mark.timeout(300)

FUZZ = settings(max_examples=25, deadline=None, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.large_base_example,
                                       HealthCheck.function_scoped_fixture])
LEADER_METHODS = [m.name for m in pb.DESCRIPTOR.services_by_name["Leader"].methods]
FOLLOWER_METHODS = [m.name for m in pb.DESCRIPTOR.services_by_name["Follower"].methods]
#: Identities a caller may claim (insecure mode): members, strangers of each role.
CALLERS = ["cluster-a", "cluster-evil", "cluster-revoked", "follower-0", "follower-7", "admin",
           "leader"]
#: Strings that get past some checks (ids, push ids, layer keys) mixed with hostile ones.
WORDS = ["", "a", "evil", "revoked", "l0", "l1", "0123456789abcdef", "tcp://127.0.0.1:1",
         "x" * 100_000, "\x00", "ü" * 300, "../../etc/passwd", '{"architecture": [[[[]]]]}']
INT64 = (-(2**63), 2**63 - 1)
INT32 = (-(2**31), 2**31 - 1)
ODD_INTS = [0, 1, -1, 2, 16, 2**31 - 1, -(2**31), 2**62, 2**63 - 1, -(2**63)]


# ----- random messages from the protobuf descriptors ----------------------------------------
def _scalar(f: Any, small: bool) -> st.SearchStrategy:
    if f.type in (FD.TYPE_INT64, FD.TYPE_SINT64, FD.TYPE_SFIXED64):
        return st.one_of(st.sampled_from(ODD_INTS), st.integers(*INT64))
    if f.type in (FD.TYPE_INT32, FD.TYPE_SINT32, FD.TYPE_SFIXED32):
        return st.one_of(st.sampled_from([v for v in ODD_INTS if INT32[0] <= v <= INT32[1]]),
                         st.integers(*INT32))
    if f.type == FD.TYPE_DOUBLE:
        return st.one_of(st.sampled_from([0.0, 0.5, 1.0, -1.0, 1e308, math.nan, math.inf,
                                          -math.inf]), st.floats())
    if f.type == FD.TYPE_BOOL:
        return st.booleans()
    if f.type == FD.TYPE_STRING:
        words = [w for w in WORDS if len(w) < 1000] if small else WORDS
        return st.one_of(st.sampled_from(words), st.text(max_size=40))
    if f.type == FD.TYPE_BYTES:
        return st.binary(max_size=64)
    raise AssertionError(f"no strategy for field {f.full_name} (type {f.type})")


def _one(f: Any, depth: int, small: bool) -> st.SearchStrategy:
    if f.type == FD.TYPE_MESSAGE:
        return messages(f.message_type._concrete_class, depth + 1, small)
    return _scalar(f, small)


def _field(f: Any, depth: int, small: bool) -> st.SearchStrategy:
    one = _one(f, depth, small)
    if not f.is_repeated:
        return one
    if depth > 0 or small:
        return st.lists(one, max_size=3)
    # Long repeated fields repeat one small value (a few MB at most, never GBs).
    long = st.builds(lambda v, n: [v] * n, _one(f, depth, True), st.sampled_from([1000, 5000]))
    return st.one_of(st.lists(one, max_size=6), long)


def messages(cls: type, depth: int = 0, small: bool = False) -> st.SearchStrategy:
    """Messages of type ``cls`` with each field absent or set to a random value (``small``:
    no string longer than 1000 characters)."""
    parts = {f.name: _field(f, depth, small) for f in cls.DESCRIPTOR.fields}
    return st.fixed_dictionaries({}, optional=parts).map(lambda kw: cls(**kw))


def _request_type(service: str, method: str) -> type:
    m = pb.DESCRIPTOR.services_by_name[service].methods_by_name[method]
    return m.input_type._concrete_class


# ----- outcomes -------------------------------------------------------------------------------
def FakeContext(identity: str, term: str | None = None) -> Context:  # noqa: N802
    """A direct call's context whose waits end within 0.3 s (fuzzing makes thousands)."""
    return Context(identity, term, time_left_s=0.3)


def assert_typed(call, reply_type: type | None = None) -> None:
    """``call()`` returns a reply, or ends with a typed refusal (a status other than
    INTERNAL/UNKNOWN carrying a Refusal code). Any other exception propagates (a failure)."""
    try:
        reply = call()
    except Aborted as e:
        assert e.code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), e
        assert e.refusal is not None and Refusal(e.refusal), e
        return
    if reply_type is not None:
        assert isinstance(reply, reply_type), reply


# ----- the leader -----------------------------------------------------------------------------
class FakeFollower:
    def report(self):
        return 0, -1, [0]

    def restore(self, version):
        return version, "x"

    def abort(self, rnd):
        pass

    def discard(self, rnd):
        pass

    def score(self, rnd, clusters, push_ids=None, retired=None):
        return [(c, True, 1.0, "") for c in clusters]

    def aggregate(self, rnd, clusters, weights):
        return 0.25

    def apply(self, rnd, clip, new_version, accepted, weights):
        return new_version, "x"

    def commit(self, new_version):
        return new_version, "x"


def _entry(info: pb.FollowerInfo) -> FollowerEntry:
    return FollowerEntry(info.index, info.data_endpoint, info.control_endpoint,
                         list(info.layers), list(info.layer_bytes), info.incarnation,
                         leader_term=info.leader_term, version=info.version)


@pytest.fixture(scope="module")
def leader(tmp_path_factory):
    cfg = LeaderConfig(followers=1, grace=GraceConfig(window_s=0.0),
                       membership=MembershipConfig(heartbeat_interval_s=5.0, missed_heartbeats=60),
                       timeouts=Timeouts(push_s=1.0, pull_s=1.0), lease_ahead=2,
                       max_push_tokens=10_000)
    fake = FakeFollower()
    ld = Leader(cfg, connect=lambda e: fake, run_dir=tmp_path_factory.mktemp("leader"),
                ledger=ChunkLedger(16, 10), tokens_per_window=64)
    ld.register_follower(FollowerEntry(0, "tcp://127.0.0.1:1", "", ["l0", "l1"], [4, 4]))
    ld.start()
    deadline = time.monotonic() + 30
    while not ld.ready:
        assert time.monotonic() < deadline, "follower not reconciled"
        time.sleep(0.02)
    for cid in ("a", "evil"):
        ld.join_cluster(cid, [["l0", "l1"]])
        ld.lease(cid, 2)
    yield ld
    ld.stop()


@pytest.fixture(scope="module")
def leader_servicer(leader):
    return LeaderServicer(leader, _entry, revoked=lambda: frozenset({"revoked"}))


def _still_serving(servicer: LeaderServicer) -> None:
    status = servicer.GetStatus(pb.StatusRequest(), FakeContext("admin"))
    assert isinstance(status, pb.StatusReply) and status.phase in (
        "idle", "window", "push", "update", "pull")


@pytest.mark.parametrize("method", LEADER_METHODS)
@FUZZ
@given(data=st.data())
def test_any_message_into_the_leader_is_served_or_refused_with_a_code(leader_servicer, method,
                                                                      data):
    request = data.draw(messages(_request_type("Leader", method)), label="request")
    who = data.draw(st.sampled_from(CALLERS), label="caller")
    assert_typed(lambda: getattr(leader_servicer, method)(request, FakeContext(who)))
    _still_serving(leader_servicer)


def test_the_leader_threads_survive_the_fuzzing(leader, leader_servicer):
    # The one way they may end: a follower's valid claim of a higher leader term (fencing,
    # which the fuzz may draw for caller follower-0) makes the leader step down; they then
    # exit cleanly instead of dying.
    stepped_down = leader.fenced.is_set()
    for t in leader._threads:
        t.join(timeout=10.0 if stepped_down else 0.0)
        assert t.is_alive() != stepped_down, (t.name, leader.fenced_reason)
    assert leader_servicer.gate.in_progress() == 0  # every place given back
    _still_serving(leader_servicer)


# ----- the follower's control service ---------------------------------------------------------
class CheckingShard:
    """Accepts everything, and checks that only checked values reach a shard."""

    version = 3
    prepared_version = -1

    def _ids(self, clusters):
        assert all(isinstance(c, str) and fields.CLUSTER_ID.fullmatch(c) for c in clusters)
        assert len(set(clusters)) == len(clusters)

    def _weights(self, weights, n):
        assert len(weights) == n and all(0.0 <= w <= 1.0 and math.isfinite(w) for w in weights)

    def score(self, rnd, clusters, push_ids=None, retired=None):
        assert isinstance(rnd, int) and 0 <= rnd <= fields.INT64_MAX
        self._ids(clusters)
        assert push_ids is None or (len(push_ids) == len(clusters) and all(
            fields.PUSH_ID.fullmatch(p) for p in push_ids))
        return [(c, True, 1.0, "") for c in clusters]

    def aggregate(self, rnd, clusters, weights):
        assert rnd >= 0
        self._ids(clusters)
        self._weights(weights, len(clusters))
        return 0.5

    def apply(self, rnd, clip, new_version, accepted, weights):
        assert rnd >= 0 and 0.0 <= clip <= 1.0 and new_version >= 1
        self._ids(accepted)
        self._weights(weights, len(accepted))
        return new_version, "x"

    def commit(self, new_version):
        assert new_version >= 1
        return new_version, "x"

    def abort(self, rnd):
        assert rnd is None or rnd >= 0

    def restore(self, version):
        assert version >= 0
        return version, "x"

    def discard(self, rnd):
        assert rnd >= 0

    def state(self):
        return 0, self.version, "x"

    def checkpoint_versions(self):
        return [self.version]


TERMS = st.one_of(st.none(), st.sampled_from(["1", "0", "-1", "99999999999999999999", "1e3",
                                              "x" * 5000, "٣", " 1"]), st.text(max_size=8))


@pytest.mark.parametrize("method", FOLLOWER_METHODS)
@FUZZ
@given(data=st.data())
def test_any_message_into_a_follower_reaches_its_shard_only_checked(method, data):
    request = data.draw(messages(_request_type("Follower", method)), label="request")
    who = data.draw(st.sampled_from(["leader"] * 4 + CALLERS), label="caller")
    term = data.draw(TERMS, label="term")
    servicer = FollowerServicer(CheckingShard(), Fence(None, lease_s=3.0))
    assert_typed(lambda: getattr(servicer, method)(request, FakeContext(who, term)))


@pytest.fixture(scope="module")
def real_shard():
    params = {"w0": torch.zeros(4), "w1": torch.ones(3)}
    s = FollowerShard(0, {"l0": ["w0"], "l1": ["w1"]}, params)
    yield s
    s.close()


@pytest.mark.parametrize("method", FOLLOWER_METHODS)
@settings(parent=FUZZ, max_examples=15)
@given(data=st.data())
def test_any_message_into_a_real_follower_shard_is_served_or_refused(real_shard, method, data):
    request = data.draw(messages(_request_type("Follower", method)), label="request")
    servicer = FollowerServicer(real_shard, Fence(None, lease_s=3.0))
    assert_typed(lambda: getattr(servicer, method)(request, FakeContext("leader", "1")))


# ----- a sample through real gRPC servers -----------------------------------------------------
@pytest.fixture(scope="module")
def servers(leader_servicer):
    """The leader's and a follower's servicer behind real gRPC servers on 127.0.0.1."""
    lserver, fserver = make_server(max_workers=8), make_server(max_workers=4)
    pbg.add_LeaderServicer_to_server(leader_servicer, lserver)
    pbg.add_FollowerServicer_to_server(FollowerServicer(CheckingShard(), Fence(None, 3.0)),
                                       fserver)
    creds = Credentials.insecure(Identity.leader())
    ports = {"Leader": creds.add_port(lserver, "127.0.0.1:0"),
             "Follower": creds.add_port(fserver, "127.0.0.1:0")}
    assert all(ports.values())
    lserver.start()
    fserver.start()
    channels = {s: grpc.insecure_channel(f"127.0.0.1:{p}") for s, p in ports.items()}
    yield channels
    for ch in channels.values():
        ch.close()
    lserver.stop(0).wait(5)
    fserver.stop(0).wait(5)


def _over_grpc(channel: grpc.Channel, service: str, method: str, body: bytes,
               who: str) -> None:
    """Send raw ``body`` as ``service.method``'s request; assert a reply or a typed status."""
    call = channel.unary_unary(f"/dips.v1.{service}/{method}")  # bytes in, bytes out
    meta = ((IDENTITY_KEY, who),) + (((TERM_KEY, "1"),) if service == "Follower" else ())
    try:
        call(body, timeout=10, metadata=meta)
    except grpc.RpcError as exc:
        assert exc.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), exc
        assert refusal_of(exc) is not None, (exc.code(), exc.details())


SERVICE_METHODS = [("Leader", m) for m in LEADER_METHODS] + \
                  [("Follower", m) for m in FOLLOWER_METHODS]


@settings(parent=FUZZ, max_examples=60)
@given(target=st.sampled_from(SERVICE_METHODS), body=st.binary(max_size=300),
       who=st.sampled_from(CALLERS))
def test_random_bytes_over_grpc_are_refused_with_a_code(servers, target, body, who):
    service, method = target
    _over_grpc(servers[service], service, method, body, who)


@settings(parent=FUZZ, max_examples=40)
@given(data=st.data())
def test_random_messages_over_grpc_are_served_or_refused_with_a_code(servers, leader_servicer,
                                                                     data):
    service, method = data.draw(st.sampled_from(SERVICE_METHODS), label="method")
    request = data.draw(messages(_request_type(service, method)), label="request")
    body = request.SerializeToString()
    if len(body) > 3 << 20:  # beyond gRPC's message limit: refused by gRPC itself
        return
    _over_grpc(servers[service], service, method, body, data.draw(st.sampled_from(CALLERS)))
    _still_serving(leader_servicer)
