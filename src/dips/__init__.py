"""dips: Di-PS, asynchronous two-level training across heterogeneous clusters.

The public cluster-side API is :class:`dips.ClusterClient` (imported lazily, so that
``import dips.algo`` stays light).
"""

from typing import Any

__all__ = ["ClusterClient", "SyncResult"]


def __getattr__(name: str) -> Any:
    if name == "ClusterClient":
        from dips.roles.client import ClusterClient

        return ClusterClient
    if name == "SyncResult":
        from dips.roles.cluster import SyncResult

        return SyncResult
    raise AttributeError(f"module 'dips' has no attribute {name!r}")
