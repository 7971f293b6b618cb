"""A cluster that joins again inside the same process (removed for missed heartbeats while
SIGSTOPped, or forgotten by a restarted leader) writes a ``join`` record for it, as its first
join does, marked ``rejoin`` (review 33 of issue 15, run2's cluster b at 70 s: the re-join was
in no figure). Real leader and followers in this process, a real ClusterClient."""

from __future__ import annotations

import json
import time

import pytest

from dips.algo.consumed import tokens_consumed_of
from dips.node.cluster import record_joins
from dips.roles.client import ClusterClient
from dips.train.model import build_model
from dips.train.run import TrainLog
from dips.wire.pki import Identity
from dips.wire.security import Credentials
from tests.roles.test_protocol import CFG, Run, _wait_until

pytestmark = pytest.mark.timeout(120)


def test_a_rejoin_in_the_same_process_writes_its_join_record(tmp_path):
    run = Run(tmp_path / "run")
    c = ClusterClient(build_model(CFG, seed=1), run.addr, "a",
                      Credentials.insecure(Identity.cluster("a")), H=2, timeout_s=60,
                      admit_timeout_s=60, heartbeat_interval_s=0.1)
    path = tmp_path / "train.jsonl"
    out = TrainLog(path, stamp=time.time, delay=False)
    try:
        assert c.join() == 0
        record_joins(out, "a", c)
        out.write({"step": 1, "loss": 5.0, "tokens": 256})
        run.leader.leave("a")  # as a removal: its next heartbeat hears it is no member
        _wait_until(c._rejoin.is_set, "a heartbeat told it to re-join")
        assert c.maintain()  # the re-join, where the training loop makes it
        out.write({"step": 2, "loss": 5.0, "tokens": 512})
    finally:
        out.close()
        c.close()
        run.close()
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    joins = [r for r in recs if r.get("event") == "join"]
    assert [(r["cluster"], r["version"], r.get("rejoin")) for r in joins] == [
        ("a", 0, None), ("a", 0, True)]
    assert joins[1]["stages"] == joins[0]["stages"] and c.joins == 2
    assert tokens_consumed_of(recs) == 512  # the same process: its count goes on
