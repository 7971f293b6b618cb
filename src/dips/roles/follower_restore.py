"""The reconciliation side of a follower shard (§12): what the leader asks of each follower
after a failure to bring them all to one version, a mixin of
:class:`dips.roles.follower.FollowerShard` (which owns the lock, θ, the momentum, the
prepared step and the checkpoint writer); split out to keep each module small.

``report`` says the committed version, the prepared one and the complete checkpoints on
disk; the leader picks the target (:func:`dips.algo.reconcile.reconcile_target`) and calls
``restore``: roll forward (commit the prepared step) or back (load a checkpoint).
"""

from __future__ import annotations

from dips.roles.shard_checksum import shard_checksum

__all__ = ["ShardRecovery"]


class ShardRecovery:
    """``report`` and ``restore`` of a follower shard (see the module docstring)."""

    def restore(self, version: int) -> tuple[int, str]:
        """Make ``version`` current: commit it if prepared, else load its checkpoint.

        Used by the leader to bring every follower to one common version after a failure
        (roll forward or back). Raises FileNotFoundError if no complete checkpoint of that
        version exists here.
        """
        from dips.roles.checkpoint import load_checkpoint

        with self._lock:
            if self._prepared is not None and self._prepared.version == version:
                return self.commit(version)
            if self._prepared is not None:
                self._drop_prepared()
            if version == self.version:
                return self.version, self.checksum
            if self._ckpt_dir is None:
                raise FileNotFoundError(f"follower {self.index}: no checkpoints to restore {version}")
            params, momenta, _ = load_checkpoint(self._ckpt_dir, version, self.names)
            self.params, self.momenta, self.version = params, momenta, version
            if getattr(self, "_pools", None) is not None:
                self._pools[1].forget_after(version - 1)  # its snapshot may be of other θ
            self._spare.refresh(version, self.params, self.momenta)
            self._drop(None)
            self.checksum = shard_checksum(self.params)
            self._record({"event": "restore", "version": version, "checksum": self.checksum})
            return version, self.checksum

    def checkpoint_versions(self) -> list[int]:
        """Complete checkpoint versions on disk (ascending); [] without a checkpoint dir."""
        from dips.roles.checkpoint import complete_versions

        return complete_versions(self._ckpt_dir) if self._ckpt_dir else []

    def report(self) -> tuple[int, int, list[int]]:
        """(committed version, prepared version or -1, complete checkpoint versions)."""
        return self.version, self.prepared_version, self.checkpoint_versions()
