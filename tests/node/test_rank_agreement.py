"""Review 14 F2: the ranks of one torchrun cluster must run the same command. A rank started
with another ``--cluster-id`` than rank 0 took that cluster's settings (another parallel mode)
and the job hung at start-up; now it refuses at once, naming both ids."""

from __future__ import annotations

import threading

import pytest

from dips.node.cluster_ddp import _spec
from dips.node.common import RoleError

pytestmark = pytest.mark.timeout(30)


class _Follower:
    """Rank 1's view of the boot group: rank 0's broadcast is ``msg``."""

    rank, lead = 1, False

    def __init__(self, msg: dict) -> None:
        self.msg = msg

    def broadcast(self, obj):
        assert obj is None
        return self.msg


def test_a_rank_started_as_another_cluster_refuses_naming_both_ids():
    with pytest.raises(RoleError, match=r"rank 1 was started with --cluster-id 'p', rank 0 with "
                                        r"'d': every rank of a torchrun cluster runs the same"):
        _spec(_Follower({"spec": "{}", "cluster_id": "d"}), "127.0.0.1:1", "p", None, None,
              threading.Event())
    with pytest.raises(RoleError, match="rank 0 could not start: no spec"):
        _spec(_Follower({"error": "no spec"}), "127.0.0.1:1", "p", None, None, threading.Event())
