"""A cluster whose chunk was reassigned re-syncs its holdings at the refusal (review 14, F3):
the leader refuses its push LEDGER_CONFLICT; the client asks for its holdings at once instead of
pushing the lost chunk again at every retry until it has used up its other chunks."""

from __future__ import annotations

import grpc
import pytest
import torch

from dips.algo.refusal import Refusal
from dips.roles.client import ClusterClient
from dips.wire.control import REFUSAL_KEY
from dips.wire.pb import control_pb2 as pb
from dips.wire.pki import Identity
from dips.wire.security import Credentials

pytestmark = pytest.mark.timeout(60)


class Conflict(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.FAILED_PRECONDITION

    def details(self):
        return "report: chunk 3 is held by 'b', not 'a'"

    def trailing_metadata(self):
        return ((REFUSAL_KEY, str(int(Refusal.LEDGER_CONFLICT))),)


class Leader:
    """The leader's side: refuses the push, answers the lease with the ledger's holdings."""

    def __init__(self) -> None:
        self.leases: list[int] = []

    def RequestPush(self, request, timeout=None, cancel=None):
        raise Conflict()

    def Lease(self, request, timeout=None):
        self.leases.append(request.n)
        return pb.LeaseReply(holdings=[pb.ChunkPos(chunk=1, position=4)])


class Data:
    """A ledger-aware data source holding chunks 1 (trained to 6) and 3 (reassigned)."""

    def __init__(self) -> None:
        self.held = {1: 6, 3: 2}

    def positions(self) -> dict[int, int]:
        return dict(self.held)

    def wanted(self) -> int:
        return 0

    def merge_holdings(self, holdings) -> None:
        self.held = {c: max(p, self.held.get(c, p)) for c, p in holdings}

    def set_holdings(self, holdings) -> None:
        self.held = dict(holdings)


def test_a_ledger_conflict_makes_the_client_adopt_the_leaders_holdings():
    data, leader = Data(), Leader()
    client = ClusterClient(torch.nn.Linear(2, 2), "127.0.0.1:1", "a",
                           Credentials.insecure(Identity.parse("cluster-a")), H=1, data=data,
                           layer_of=lambda name: "head")
    client._leader = leader
    result = client.sync()
    assert not result.ok and "held by" in result.reason
    assert leader.leases == [0]                  # asked at the refusal, for nothing new
    assert data.positions() == {1: 6}            # the lost chunk dropped, local progress kept
