"""Kernel-enforced link shaping: one network namespace per cluster, veth, ``tc tbf`` (§13).

The seed's network experiments (§13, §15) give each cluster its own cross-cluster link
(10/5/1 Gbit).  As root this module builds that topology for real, inside namespaces the run
itself creates and removes::

    ns <prefix>h (hub: leader, followers)     ns <prefix>c<i> (cluster i)
      bridge <prefix>br 198.18.0.1/24  ── veth <prefix>h<i> ══ <prefix>c<i> ── 198.18.0.(10+i)

Every veth end carries ``tc qdisc ... root tbf rate R burst B latency L`` on its egress: the
cluster end shapes the cluster's upload, the hub end its download.  Clusters reach each other
through the hub's bridge (for the all-reduce and peer-to-peer baselines), so a transfer between
two clusters runs at the slower of their two links.  Addresses come only from the RFC 2544
benchmarking range 198.18.0.0/15.  ``netem`` is not needed (not available here).

Measured on the project machine: a 100 Mbit tbf delivers 95 Mbit/s of TCP payload
(``make bench-shaping``; BENCHMARKS.md).  Source: ip-netns(8), tc-tbf(8), veth(4).
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "BENCH_NET",
    "Capability",
    "NetnsError",
    "ShapedNetwork",
    "cleanup_stale",
    "list_namespaces",
    "new_prefix",
    "probe",
    "tbf_params",
]

BENCH_NET = ipaddress.ip_network("198.18.0.0/15")
"""RFC 2544 benchmarking range; the only addresses this module ever assigns."""
_SUBNET = ipaddress.ip_network("198.18.0.0/24")
_HUB_HOST = 1
_FIRST_CLUSTER_HOST = 10
MAX_CLUSTERS = 200
_PREFIX_RE = re.compile(r"^dps[0-9a-z]{1,6}$")


class NetnsError(RuntimeError):
    """A namespace, link or qdisc command failed; the message holds the command and stderr."""


def _run(argv: Sequence[str], timeout_s: float, check: bool = True) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise NetnsError(f"{' '.join(argv)!r} timed out after {timeout_s} s") from None
    except OSError as exc:
        raise NetnsError(f"{' '.join(argv)!r} could not run: {exc}") from None
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(argv)!r} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def new_prefix() -> str:
    """A fresh run prefix ``dps`` + 6 random hex digits (names stay within IFNAMSIZ = 15)."""
    return "dps" + secrets.token_hex(3)


def _check_prefix(prefix: str) -> str:
    if not isinstance(prefix, str) or not _PREFIX_RE.match(prefix):
        raise ValueError(f"prefix must match {_PREFIX_RE.pattern} (e.g. new_prefix()), got {prefix!r}")
    return prefix


def tbf_params(rate_bps: float) -> tuple[int, float]:
    """``(burst bytes, latency seconds)`` for a tbf of ``rate_bps`` bits/s.

    The burst holds 5 ms of traffic (at least 32 KiB) so that a kernel timer tick of up to
    4 ms (HZ = 250) never starves the bucket; latency 50 ms bounds the queue.  Raises
    ValueError for a rate that is not a finite number >= 8000 bits/s.
    """
    if isinstance(rate_bps, bool) or not isinstance(rate_bps, (int, float)) or not 8000 <= rate_bps < 1e13:
        raise ValueError(f"rate_bps must be a number in [8000, 1e13) bits/s, got {rate_bps!r}")
    return tbf_burst(rate_bps), 0.05


def tbf_burst(rate_bps: float) -> int:
    """The tbf burst (bytes) for ``rate_bps`` bits/s: 5 ms of traffic, at least 32 KiB."""
    return max(32768, int(rate_bps / 8 * 0.005))


@dataclass(frozen=True)
class Capability:
    """What this machine allows; ``shaping`` is ``tc-tbf`` when everything works."""

    root: bool
    ip: bool
    tc: bool
    netns: bool
    tbf: bool
    reason: str

    @property
    def shaping(self) -> str:
        """``tc-tbf`` (kernel) if namespaces and tbf work, else ``token-bucket`` (fallback)."""
        return "tc-tbf" if self.root and self.ip and self.tc and self.netns and self.tbf else "token-bucket"


def probe(timeout_s: float = 10.0) -> Capability:
    """Check root, ``ip``, ``tc``, and that a namespace with a tbf'd veth can be made.

    Creates and removes one throw-away namespace ``<new_prefix()>p``.  Never raises for a
    missing capability; ``reason`` says what is missing.
    """
    root = os.geteuid() == 0
    has_ip, has_tc = shutil.which("ip") is not None, shutil.which("tc") is not None
    if not (root and has_ip and has_tc):
        missing = [n for n, ok in (("root", root), ("ip", has_ip), ("tc", has_tc)) if not ok]
        return Capability(root, has_ip, has_tc, False, False, f"missing: {', '.join(missing)}")
    ns = new_prefix() + "p"
    netns_ok = tbf_ok = False
    reason = "ok"
    try:
        _run(["ip", "netns", "add", ns], timeout_s)
        netns_ok = True
        _run(["ip", "-n", ns, "link", "add", "pa", "type", "veth", "peer", "name", "pb"], timeout_s)
        _run(["tc", "-n", ns, "qdisc", "add", "dev", "pa", "root", "tbf", "rate", "1mbit",
              "burst", "32kb", "latency", "50ms"], timeout_s)
        tbf_ok = True
    except NetnsError as exc:
        reason = str(exc)
    finally:
        _run(["ip", "netns", "del", ns], timeout_s, check=False)
    return Capability(root, has_ip, has_tc, netns_ok, tbf_ok, reason)


def list_namespaces(prefix: str, timeout_s: float = 10.0) -> list[str]:
    """Names of existing namespaces starting with ``prefix`` (validated as in :func:`new_prefix`)."""
    _check_prefix(prefix)
    out = _run(["ip", "netns", "list"], timeout_s).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix)]


def cleanup_stale(prefix: str, timeout_s: float = 10.0) -> list[str]:
    """Delete every namespace of run ``prefix`` (their veths and bridge go with them).

    Returns the names deleted.  Raises NetnsError if one cannot be deleted.
    """
    gone = []
    for name in list_namespaces(prefix, timeout_s):
        _run(["ip", "netns", "del", name], timeout_s)
        gone.append(name)
    return gone


class ShapedNetwork:
    """The hub + per-cluster namespaces of one run, shaped with tbf; a context manager.

    Args:
        clusters: cluster ids (1 … 200, unique), in order; cluster i gets 198.18.0.(10+i).
        rates_bps: cluster id -> link rate in bits/s (both directions), or None for an
            unshaped veth; clusters missing from the mapping are unshaped.
        prefix: run prefix (default :func:`new_prefix`); namespaces are ``<prefix>h`` and
            ``<prefix>c<i>``.
        timeout_s: timeout of every ``ip``/``tc`` command (seconds).

    ``with ShapedNetwork(...) as net:`` creates everything and always removes it on exit,
    also on exceptions and KeyboardInterrupt (including one during creation).

    Raises:
        ValueError: bad clusters, rates or prefix (named with the value).
        NetnsError: a command failed (nothing is left behind).
    """

    def __init__(self, clusters: Sequence[str], rates_bps: Mapping[str, float | None] | None = None,
                 prefix: str | None = None, timeout_s: float = 10.0) -> None:
        ids = list(clusters)
        if not ids or len(ids) > MAX_CLUSTERS or len(set(ids)) != len(ids) or not all(
                isinstance(c, str) and c for c in ids):
            raise ValueError(f"clusters must be 1..{MAX_CLUSTERS} unique non-empty str, got {clusters!r}")
        rates = dict(rates_bps or {})
        unknown = set(rates) - set(ids)
        if unknown:
            raise ValueError(f"rates_bps names unknown clusters {sorted(unknown)}")
        for cid, rate in rates.items():
            if rate is not None:
                tbf_params(rate)  # validates
        self.clusters = ids
        self.prefix = _check_prefix(prefix or new_prefix())
        self.timeout_s = float(timeout_s)
        self._rates: dict[str, float | None] = {c: rates.get(c) for c in ids}
        self._created = False

    # names and addresses -------------------------------------------------------------------
    @property
    def hub_ns(self) -> str:
        """Name of the hub (servers') namespace."""
        return f"{self.prefix}h"

    @property
    def hub_addr(self) -> str:
        """IPv4 address of the hub's bridge (198.18.0.1)."""
        return str(_SUBNET[_HUB_HOST])

    def _index(self, cluster: str) -> int:
        try:
            return self.clusters.index(cluster)
        except ValueError:
            raise ValueError(f"cluster {cluster!r} is not one of {self.clusters}") from None

    def ns(self, cluster: str) -> str:
        """Namespace of ``cluster``."""
        return f"{self.prefix}c{self._index(cluster)}"

    def addr(self, cluster: str) -> str:
        """IPv4 address of ``cluster`` (198.18.0.(10+i))."""
        return str(_SUBNET[_FIRST_CLUSTER_HOST + self._index(cluster)])

    def iface(self, cluster: str) -> str:
        """The cluster-side veth (e.g. for ``GLOO_SOCKET_IFNAME``)."""
        return f"{self.prefix}c{self._index(cluster)}"

    def _hub_iface(self, cluster: str) -> str:
        return f"{self.prefix}h{self._index(cluster)}"

    def exec_prefix(self, cluster: str | None = None) -> list[str]:
        """argv prefix running a command inside ``cluster``'s namespace (None: the hub's)."""
        return ["ip", "netns", "exec", self.hub_ns if cluster is None else self.ns(cluster)]

    def rate(self, cluster: str) -> float | None:
        """Current configured rate of ``cluster``'s link, bits/s (None: unshaped)."""
        return self._rates[self.clusters[self._index(cluster)]]

    # life cycle ----------------------------------------------------------------------------
    def __enter__(self) -> "ShapedNetwork":
        try:
            self.create()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def _ip(self, *args: str) -> None:
        _run(["ip", *args], self.timeout_s)

    def create(self) -> None:
        """Create namespaces, bridge, veths, addresses and qdiscs.  Raises NetnsError."""
        if self.list_namespaces():
            raise NetnsError(f"namespaces of prefix {self.prefix!r} already exist; cleanup_stale first")
        self._created = True
        hub, br = self.hub_ns, f"{self.prefix}br"
        self._ip("netns", "add", hub)
        self._ip("-n", hub, "link", "set", "lo", "up")
        self._ip("-n", hub, "link", "add", br, "type", "bridge")
        self._ip("-n", hub, "addr", "add", f"{self.hub_addr}/{_SUBNET.prefixlen}", "dev", br)
        self._ip("-n", hub, "link", "set", br, "up")
        for cid in self.clusters:
            ns, c_if, h_if = self.ns(cid), self.iface(cid), self._hub_iface(cid)
            self._ip("netns", "add", ns)
            self._ip("-n", ns, "link", "set", "lo", "up")
            # Both ends are born inside namespaces: nothing ever touches the root namespace.
            self._ip("-n", hub, "link", "add", h_if, "type", "veth", "peer", "name", c_if, "netns", ns)
            self._ip("-n", hub, "link", "set", h_if, "master", br)
            self._ip("-n", hub, "link", "set", h_if, "up")
            self._ip("-n", ns, "addr", "add", f"{self.addr(cid)}/{_SUBNET.prefixlen}", "dev", c_if)
            self._ip("-n", ns, "link", "set", c_if, "up")
            if self._rates[cid] is not None:
                self._apply(cid, self._rates[cid], "add")

    def _apply(self, cluster: str, rate_bps: float, verb: str) -> None:
        burst, latency = tbf_params(rate_bps)
        for ns, dev in ((self.ns(cluster), self.iface(cluster)), (self.hub_ns, self._hub_iface(cluster))):
            _run(["tc", "-n", ns, "qdisc", verb, "dev", dev, "root", "tbf", "rate", f"{int(rate_bps)}bit",
                  "burst", str(burst), "latency", f"{int(latency * 1000)}ms"], self.timeout_s)

    def set_rate(self, cluster: str, rate_bps: float | None) -> None:
        """Change ``cluster``'s link rate at run time (both directions); None removes shaping.

        Raises ValueError (bad rate/cluster), NetnsError (tc failed; rate left as before).
        """
        idx = self._index(cluster)
        cid = self.clusters[idx]
        if rate_bps is None:
            for ns, dev in ((self.ns(cid), self.iface(cid)), (self.hub_ns, self._hub_iface(cid))):
                _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], self.timeout_s, check=False)
        else:
            tbf_params(rate_bps)
            self._apply(cid, rate_bps, "replace")
        self._rates[cid] = rate_bps

    def set_link(self, cluster: str, up: bool) -> None:
        """Cut (``up=False``) or restore ``cluster``'s link: its veth end goes down or up, so all
        of its traffic stops in the kernel (fault injection, issue 4). Raises NetnsError."""
        cid = self.clusters[self._index(cluster)]
        self._ip("-n", self.ns(cid), "link", "set", self.iface(cid), "up" if up else "down")

    def qdiscs(self, cluster: str) -> str:
        """``tc qdisc show`` of the cluster end and the hub end (for reports and tests)."""
        return "\n".join(_run(["tc", "-n", ns, "qdisc", "show", "dev", dev], self.timeout_s).stdout
                         for ns, dev in ((self.ns(cluster), self.iface(cluster)),
                                         (self.hub_ns, self._hub_iface(cluster))))

    def list_namespaces(self) -> list[str]:
        """Existing namespaces of this run."""
        return list_namespaces(self.prefix, self.timeout_s)

    def destroy(self) -> None:
        """Delete this run's namespaces (veths and bridge go with them); idempotent.

        Retries each deletion once if interrupted, so a Ctrl-C during clean-up leaves nothing.
        Raises NetnsError if a namespace survives.
        """
        if not self._created:
            return
        interrupted: KeyboardInterrupt | None = None
        for _ in range(2):
            try:
                cleanup_stale(self.prefix, self.timeout_s)
                break
            except KeyboardInterrupt as exc:  # finish cleaning, then re-raise
                interrupted = exc
        left = self.list_namespaces()
        if left:
            raise NetnsError(f"namespaces {left} survived clean-up")
        self._created = False
        if interrupted is not None:
            raise interrupted
