"""A cluster's log line per sync (review 24, F6): a push the leader judged names its round and
verdict; a sync that got no round (the run finished, the leader unreachable) says no push was
made, not "push of round -1 not accepted" (review 31 of issue 14, minor 3)."""

from __future__ import annotations

import logging

from dips.roles.cluster import SyncResult
from dips.train.dips_sync import push_record


def test_a_sync_without_a_round_says_no_push_was_made(caplog):
    caplog.set_level(logging.INFO, logger="dips")
    rec = push_record(SyncResult(False, 7, -1, 2048, reason="the run finished", ok=False))
    assert rec["round"] == -1 and rec["accepted"] is False
    assert "no push made (the run finished): version 7" in caplog.text
    assert "round -1" not in caplog.text


def test_a_judged_push_names_its_round_and_verdict(caplog):
    caplog.set_level(logging.INFO, logger="dips")
    push_record(SyncResult(False, 7, 12, 2048, reason="stale"))
    push_record(SyncResult(True, 8, 13, 2048))
    assert "push of round 12 not accepted (stale): version 7" in caplog.text
    assert "push of round 13 accepted: version 8" in caplog.text
