"""Every field of every control-plane message, checked in one place per message (issue 13).

A member holding valid credentials may still send anything protobuf can encode: negative
versions, 10 MB strings, a million repeated entries, NaN. Each servicer method of
:mod:`dips.wire.services` passes its request through the function named after the message
before it uses any field; the function returns plain Python values and raises
:class:`dips.algo.refusal.Refused` (``INVALID_ARGUMENT``) naming the message, the field and
its value (cut to :data:`SHOWN` characters). Integers arrive within int64/int32 (protobuf
guarantees it) and are checked against their meaning here (no negative version, round or
count); identifiers against their pattern; strings and repeated fields against a length;
doubles must be finite. Free text (an error description) is cut and made printable
(:func:`text`), not refused. What the run
itself bounds (chunks held, T_j, layer keys owned) the role checks against its state.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Iterable

from dips.algo.evaluation import EvalReport, check_report
from dips.algo.refusal import Refusal, Refused
from dips.wire.pb import control_pb2 as pb
from dips.wire.admission import PUSH_ID
from dips.wire.pki import CLUSTER_ID
from dips.wire.ratelog import printable

INT64_MAX = 2**63 - 1
#: Characters of a bad value quoted in a refusal.
SHOWN = 60
#: Free text kept (characters); longer text is cut.
MAX_TEXT = 1000
#: Layer keys in one message (a model has one per transformer block plus two).
MAX_LAYERS = 4096
#: Clusters named in one message of a round (Score, Aggregate, Apply).
MAX_CLUSTERS = 4096
#: Chunk positions reported in one push request (a member holds a few chunks).
MAX_PROGRESS = 4096
#: Checkpoint versions a follower reports.
MAX_CHECKPOINTS = 4096
#: A model fingerprint's JSON (characters; a real one is a few KB per hundred tensors).
MAX_FINGERPRINT = 1 << 20
#: An endpoint address (characters).
MAX_ENDPOINT = 512
#: A push's predicted transfer time (seconds); more is cut to this.
MAX_EXPECTED_S = 1e6

LAYER_KEY = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
_ENDPOINT = re.compile(r"[!-~]{0,%d}" % MAX_ENDPOINT)  # printable ASCII, no spaces


def _show(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= SHOWN else f"{r[:SHOWN]}... ({len(r)} characters)"


def _bad(msg: str, field: str, v: Any, want: str) -> Refused:
    return Refused(Refusal.INVALID_ARGUMENT, f"{msg} field {field!r} = {_show(v)}: {want}")


def integer(msg: str, field: str, v: Any, lo: int = 0, hi: int = INT64_MAX) -> int:
    """``v`` if it is an int (not a bool) in [lo, hi]; else Refused(INVALID_ARGUMENT)."""
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _bad(msg, field, v, f"must be an integer in [{lo}, {hi}]")
    return v


def real(msg: str, field: str, v: Any, lo: float, hi: float) -> float:
    """``v`` as a float if it is finite and in [lo, hi]; else Refused(INVALID_ARGUMENT)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or not lo <= v <= hi:
        raise _bad(msg, field, v, f"must be a finite number in [{lo}, {hi}]")
    return float(v)


def clamp_count(v: Any) -> int:
    """A count a member reports about itself (never trusted): an int cut to [0, 2**63 - 1]."""
    if isinstance(v, bool) or not isinstance(v, int):
        return 0
    return min(max(v, 0), INT64_MAX)


def finite_or_none(v: Any) -> float | None:
    """A reported float, or None when it is not a finite number (NaN and inf are ignored)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def text(v: Any, limit: int = MAX_TEXT) -> str:
    """Free text from a peer, cut to ``limit`` characters and made printable
    (:func:`dips.wire.ratelog.printable`; review
    21, F4: a member's ``PushDone.error`` reached the operator's terminal as escapes and
    markup)."""
    s = v if isinstance(v, str) else str(v)
    cut = printable(s[:limit])
    return cut if len(s) <= limit else cut + "..."


def cluster_id(msg: str, v: Any, empty: bool = True, field: str = "cluster_id") -> str:
    """A cluster id (``dips.wire.pki.CLUSTER_ID``); "" only when ``empty`` (the caller's)."""
    if isinstance(v, str) and (CLUSTER_ID.fullmatch(v) or (empty and v == "")):
        return v
    raise _bad(msg, field, v, f"must match {CLUSTER_ID.pattern}")


def push_id(msg: str, v: Any, field: str = "push_id") -> str:
    """A push id: 16 lower-case hex digits (the grant's nonce)."""
    if isinstance(v, str) and PUSH_ID.fullmatch(v):
        return v
    raise _bad(msg, field, v, "must be 16 lower-case hex digits")


def _bounded(msg: str, field: str, values: Any, limit: int) -> list:
    if len(values) > limit:
        raise _bad(msg, field, f"<{len(values)} entries>", f"at most {limit} entries")
    return list(values)


def _ids(msg: str, field: str, values: Iterable) -> list[str]:
    out = [cluster_id(msg, c, empty=False, field=field) for c in _bounded(msg, field, values,
                                                                          MAX_CLUSTERS)]
    if len(set(out)) != len(out):
        raise _bad(msg, field, out, "names a cluster twice")
    return out


def _layers(msg: str, field: str, values: Iterable) -> list[str]:
    out = _bounded(msg, field, values, MAX_LAYERS)
    for l in out:
        if not isinstance(l, str) or not LAYER_KEY.fullmatch(l):
            raise _bad(msg, field, l, f"a layer key must match {LAYER_KEY.pattern}")
    return out


def _weights(msg: str, field: str, values: Iterable, n: int) -> list[float]:
    out = [real(msg, field, w, 0.0, 1.0) for w in _bounded(msg, field, values, MAX_CLUSTERS)]
    if len(out) != n:
        raise _bad(msg, field, f"<{len(out)} weights>", f"must give one weight per cluster ({n})")
    return out


def endpoint(msg: str, field: str, v: Any) -> str:
    if isinstance(v, str) and _ENDPOINT.fullmatch(v):
        return v
    raise _bad(msg, field, v, f"must be printable ASCII without spaces, at most {MAX_ENDPOINT}")


# ----- the Leader service's requests --------------------------------------------------------
def follower_info(r: pb.FollowerInfo, followers: int) -> pb.FollowerInfo:
    """A registration of one of ``followers`` followers; returns a copy with its free text
    cut."""
    m = "FollowerInfo"
    integer(m, "index", r.index, 0, followers - 1)
    endpoint(m, "data_endpoint", r.data_endpoint)
    endpoint(m, "control_endpoint", r.control_endpoint)
    layers = _layers(m, "layers", r.layers)
    if len(set(layers)) != len(layers):
        raise _bad(m, "layers", layers, "names a layer twice")
    sizes = _bounded(m, "layer_bytes", r.layer_bytes, MAX_LAYERS)
    if len(sizes) != len(layers):
        raise _bad(m, "layer_bytes", f"<{len(sizes)} sizes>", f"must give one size per layer "
                                                               f"({len(layers)})")
    for b in sizes:
        integer(m, "layer_bytes", b)
    integer(m, "version", r.version)
    integer(m, "prepared_version", r.prepared_version, -1)
    for v in _bounded(m, "checkpoints", r.checkpoints, MAX_CHECKPOINTS):
        integer(m, "checkpoints", v)
    integer(m, "leader_term", r.leader_term)
    out = pb.FollowerInfo()
    out.CopyFrom(r)
    out.data_plane_error = text(r.data_plane_error)
    return out


def join_request(r: pb.JoinRequest) -> tuple[str, list[list[str]], str]:
    """(cluster id or "", the stages' layer keys, fingerprint JSON)."""
    m = "JoinRequest"
    cid = cluster_id(m, r.cluster_id)
    stages = [_layers(m, "stages", s.layers) for s in _bounded(m, "stages", r.stages, MAX_LAYERS)]
    if sum(len(s) for s in stages) > MAX_LAYERS:
        raise _bad(m, "stages", f"<{sum(len(s) for s in stages)} layers>",
                   f"at most {MAX_LAYERS} layers")
    if len(r.fingerprint) > MAX_FINGERPRINT:
        raise _bad(m, "fingerprint", f"<{len(r.fingerprint)} characters>",
                   f"at most {MAX_FINGERPRINT} characters")
    return cid, stages, r.fingerprint


@dataclass(frozen=True)
class PushFields:
    """A checked :class:`pb.PushRequest` (see :func:`push_request`)."""

    cluster_id: str
    base_version: int
    tokens: int
    inner_steps: int
    progress: dict[int, int]
    expected_s: float | None


def push_request(r: pb.PushRequest) -> PushFields:
    """Versions, counts and positions >= 0, T_j >= 1, each chunk once, the predicted push time
    finite (0: none; more than :data:`MAX_EXPECTED_S` is cut to it)."""
    m = "PushRequest"
    progress: dict[int, int] = {}
    for c in _bounded(m, "progress", r.progress, MAX_PROGRESS):
        chunk = integer(m, "progress.chunk", c.chunk)
        if chunk in progress:
            raise _bad(m, "progress", chunk, "lists a chunk twice")
        progress[chunk] = integer(m, "progress.position", c.position)
    expected = real(m, "expected_push_s", r.expected_push_s, 0.0, math.inf)
    return PushFields(cluster_id(m, r.cluster_id), integer(m, "base_version", r.base_version),
                      integer(m, "tokens", r.tokens, 1), integer(m, "inner_steps", r.inner_steps),
                      progress, min(expected, MAX_EXPECTED_S) if expected > 0 else None)


def push_done_request(r: pb.PushDoneRequest) -> tuple[str, str, bool, str]:
    """(cluster id or "", push id, ok, error cut to :data:`MAX_TEXT`)."""
    m = "PushDoneRequest"
    return cluster_id(m, r.cluster_id), push_id(m, r.push_id), bool(r.ok), text(r.error)


def pull_done_request(r: pb.PullDoneRequest) -> tuple[str, int]:
    """(cluster id or "", version pulled; -1: gave up)."""
    m = "PullDoneRequest"
    return cluster_id(m, r.cluster_id), integer(m, "version", r.version, -1)


def heartbeat_request(r: pb.HeartbeatRequest) -> tuple[str, int, int, float | None]:
    """(cluster id or "", inner step, tokens, loss): what a member says of itself is shown in
    the status only, so it is clamped rather than refused (counts to [0, 2**63 - 1], a loss
    that is not finite is None)."""
    return (cluster_id("HeartbeatRequest", r.cluster_id), clamp_count(r.inner_step),
            clamp_count(r.tokens), finite_or_none(r.last_loss))


def leave_request(r: pb.LeaveRequest) -> str:
    return cluster_id("LeaveRequest", r.cluster_id)


def lease_request(r: pb.LeaseRequest) -> tuple[str, int]:
    """(cluster id or "", chunks wanted >= 0)."""
    m = "LeaseRequest"
    return cluster_id(m, r.cluster_id), integer(m, "n", r.n)


def eval_report(r: pb.EvalReport) -> EvalReport:
    """The evaluator's report (issue 15), its fields checked on their own by
    :func:`dips.algo.evaluation.check_report` (the leader checks the version against its
    own). Raises Refused(INVALID_ARGUMENT) naming the field and value."""
    return check_report(EvalReport(r.version, r.eval_loss, r.eval_tokens))


# ----- the Follower service's requests (from the leader only) --------------------------------
def score_request(r: pb.ScoreRequest) -> tuple[int, list[str], list[str] | None, list[str]]:
    """(round, clusters, push ids in the same order or None, push ids decided as not
    delivered: ``retired_push_ids``, at most :data:`MAX_CLUSTERS`)."""
    m = "ScoreRequest"
    clusters = _ids(m, "cluster_ids", r.cluster_ids)
    pids = [push_id(m, p, "push_ids") for p in _bounded(m, "push_ids", r.push_ids, MAX_CLUSTERS)]
    if pids and len(pids) != len(clusters):
        raise _bad(m, "push_ids", f"<{len(pids)} ids>", f"must give one per cluster "
                                                        f"({len(clusters)}) or none")
    retired = [push_id(m, p, "retired_push_ids")
               for p in _bounded(m, "retired_push_ids", r.retired_push_ids, MAX_CLUSTERS)]
    return integer(m, "round", r.round), clusters, pids or None, retired


def aggregate_request(r: pb.AggregateRequest) -> tuple[int, list[str], list[float]]:
    """(round, clusters, their weights in [0, 1])."""
    m = "AggregateRequest"
    clusters = _ids(m, "cluster_ids", r.cluster_ids)
    return integer(m, "round", r.round), clusters, _weights(m, "weights", r.weights, len(clusters))


def apply_request(r: pb.ApplyRequest) -> tuple[int, float, int, list[str], list[float]]:
    """(round, clip factor in [0, 1], new version >= 1, accepted clusters, their weights)."""
    m = "ApplyRequest"
    accepted = _ids(m, "accepted", r.accepted)
    return (integer(m, "round", r.round), real(m, "clip_factor", r.clip_factor, 0.0, 1.0),
            integer(m, "new_version", r.new_version, 1), accepted,
            _weights(m, "weights", r.weights, len(accepted)))


def commit_request(r: pb.CommitRequest) -> int:
    return integer("CommitRequest", "new_version", r.new_version, 1)


def discard_request(r: pb.DiscardRequest) -> tuple[int, bool]:
    """(round >= 0, every round)."""
    return integer("DiscardRequest", "round", r.round), bool(r.all_rounds)


def restore_request(r: pb.RestoreRequest) -> int:
    return integer("RestoreRequest", "version", r.version)


def fence_request(r: pb.FenceRequest) -> int:
    return integer("FenceRequest", "version", r.version)


def term_metadata(raw: Any, key: str) -> int:
    """The leader term sent in call metadata ``key``: a decimal int in [0, 2**63 - 1]."""
    if not isinstance(raw, str) or not raw.isascii() or not raw.isdigit() or len(raw) > 19:
        raise _bad("metadata", key, raw, "must be a decimal integer in [0, 2**63 - 1]")
    return integer("metadata", key, int(raw))
