"""A cluster hears that its accepted push was undone by a rollback (review 32 of issue 14, m2).

A follower killed right after an outer step came back at the version before it (its checkpoint
is written asynchronously); the leader reconciled to that version (``rollback lost=1``), its
ledger handed the step's windows out again and its counts dropped the step's tokens. The
clusters had logged that push as "accepted: version N" and nothing told them otherwise. Now
the cluster, re-joining at the older version, logs that its push accepted into version N was
undone. The followers here are restored to version 0 by hand, as the reconciliation after such
a restart does; every wait is for an event."""

from __future__ import annotations

import logging

import pytest

from dips.roles.checkpoint import save_checkpoint

from tests.roles.test_protocol import Run, _perturb, _wait_until

pytestmark = pytest.mark.timeout(120)


def test_a_rolled_back_accepted_push_is_logged_by_its_cluster_and_its_tokens_uncounted(
        tmp_path, caplog):
    run = Run(tmp_path)
    try:
        for i, shard in enumerate(run.shards):  # version 0 on disk, as a follower keeps it
            shard._ckpt_dir = tmp_path / f"ckpt{i}"
            save_checkpoint(shard._ckpt_dir, 0, i, shard.params, shard.momenta, shard.checksum, 3)
        c = run.client("a")
        c.join()
        _perturb(c.model, seed=3)
        c.step_done(100)
        res = c.step_done(100)  # H = 2: push, verdict, pull
        assert res is not None and res.accepted and c.accepted_version == 1, res
        assert run.leader.counts["tokens_accepted"] > 0
        for shard in run.shards:  # each follower back at version 0, as after its restart
            shard.restore(0)
        with run.leader._cond:
            run.leader.needs_reconcile = True
        _wait_until(lambda: run.leader.version == 0 and not run.leader.needs_reconcile,
                    "the leader reconciled to version 0")
        assert run.leader.counts["tokens_accepted"] == 0  # the lost step's tokens uncounted
        caplog.set_level(logging.WARNING, logger="dips.roles.client")
        for _ in range(40):  # its next sync is refused (base version 1 is ahead): re-join
            c._retry_at = 0.0
            c.step_done(100, wait=False)
            if c.version == 0:
                break
        assert c.version == 0 and c.accepted_version is None
        assert "its push accepted into version 1 was undone: the run rolled back to " \
               "version 0" in caplog.text
        c.close()
    finally:
        run.close()
