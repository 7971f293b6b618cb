"""What a follower checks before it stages a byte of a push or serves a pull (issue 13).

A data-plane header comes from a member that holds a valid key but may be buggy or hostile,
so every field is type-checked and bounded before it is used: integers are ints (not
booleans) within int64 and their range, strings match their pattern and length, a layer is
one the follower owns, a pull's layer list is bounded by the shard. A failure is a
:class:`~dips.algo.refusal.Refused` with INVALID_ARGUMENT naming the field and its value (cut
to 80 characters).

:class:`Admission` then decides whether the push may be staged at all. With an admission key
(a follower process always has one, :mod:`dips.node.follower`), the header must carry the
leader's ticket (:mod:`dips.wire.admission`) for exactly this cluster, round and push id,
and T_j is the ticket's, never the header's. Replay is refused with STALE_GRANT: a round at
or below the highest round the follower closed (discarded, aborted or applied: the
*watermark*), a push id already taken into a round or replaced by a newer push of its
cluster, a push id admitted by an earlier process of this follower, and a base version ahead
of the follower's. Without a key (trusted in-process callers: the virtual-time engine and
unit tests) the ticket is not required and T_j comes from the header; every other check
still applies.

Replay refusal survives a restart for every kind of ticket (issue 13; review 14, finding F4:
a push sent ahead of its round, round 0, is not covered by the watermark, and a round open at
the crash is above it). The first time a ticket's push id is admitted, before the push is
staged or acknowledged, it is appended to ``push_ids`` in the follower's state directory and
fsynced (one line of 17 bytes per push and follower, not per layer: :class:`PushIds`). A
restarted follower loads the file and refuses every push id in it: whatever it had staged
for that push died with the process, so no layer of it can complete here (the leader fails
the pushes of a round when a follower restarts, and a push sent ahead of its round is scored
"layers missing"). The file keeps the newest :data:`RETIRED_IDS` ids, compacted with
:func:`dips.roles.durable.write_atomic`; an id older than that is forgotten, in a running
follower as after a restart.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from dips.algo.refusal import Refusal, Refused
from dips.roles.durable import append_durable, write_atomic
from dips.wire import admission
from dips.wire.admission import PUSH_ID
from dips.wire.pki import CLUSTER_ID

INT64_MAX = 2**63 - 1
#: Longest layer key accepted (characters).
MAX_LAYER_CHARS = 200
#: Pushes sent ahead of their round held at once, all clusters together (one per cluster).
MAX_EARLY_PUSHES = 64
#: Push ids remembered (admitted, taken into a round, or replaced), oldest forgotten first;
#: as many are kept on disk across restarts (:class:`PushIds`).
RETIRED_IDS = 4096
#: The file in a follower's state directory that keeps the push ids it admitted.
PUSH_IDS_FILE = "push_ids"
# A leader's push id is 16 hex digits; the virtual-time engine's are "<cluster>-<step>".
_DTYPES = ("bf16", "fp32")


def show(value: Any) -> str:
    """``repr(value)`` cut to 80 characters (a hostile value may be megabytes long)."""
    r = repr(value)
    return r if len(r) <= 80 else r[:77] + "..."


def bad(name: str, value: Any, why: str) -> Refused:
    """The INVALID_ARGUMENT refusal of header field ``name``."""
    return Refused(Refusal.INVALID_ARGUMENT, f"field {name!r} = {show(value)} {why}")


def int_field(h: Mapping[str, Any], name: str, lo: int = 0, hi: int = INT64_MAX) -> int:
    """Header field ``name`` as an int in [lo, hi]. Raises Refused(INVALID_ARGUMENT)."""
    v = h.get(name)
    if type(v) is not int or not lo <= v <= hi:  # type(): a bool is no count
        raise bad(name, v, f"is not an int in [{lo}, {hi}]")
    return v


def owned_layer(v: Any, layers: Mapping[str, Any], index: int, name: str = "layer") -> str:
    """``v`` if it is a layer key this follower owns. Raises Refused(INVALID_ARGUMENT)."""
    if not isinstance(v, str) or len(v) > MAX_LAYER_CHARS:
        raise bad(name, v, f"is not a layer key (a string of at most {MAX_LAYER_CHARS})")
    if v not in layers:
        raise bad(name, v, f"is not a layer owned by follower {index}")
    return v


@dataclass(frozen=True)
class PushFields:
    """The checked fields of a push header.

    Attributes:
        cluster: the cluster id. round: the round (0 for a push sent ahead of its round).
        layer: the layer key (owned by this follower). push_id: the grant's id (None only
            from trusted callers' round pushes). stage: sent ahead of its round.
        tokens: T_j (the ticket's under admission; else the header's, None if absent).
        base_version: the version the push started from (the ticket's; None without one).
    """

    cluster: str
    round: int
    layer: str
    push_id: str | None
    stage: bool
    tokens: int | None
    base_version: int | None = None


def push_fields(h: Mapping[str, Any], layers: Mapping[str, Any], index: int) -> PushFields:
    """The fields of push header ``h`` for a follower owning ``layers`` (follower ``index``).

    Raises Refused(INVALID_ARGUMENT) naming the first field that is missing, of the wrong
    type, or out of range.
    """
    cluster = h.get("cluster")
    if not isinstance(cluster, str) or not CLUSTER_ID.fullmatch(cluster):
        raise bad("cluster", cluster, f"is not a cluster id ({CLUSTER_ID.pattern})")
    rnd = int_field(h, "round")
    layer = owned_layer(h.get("layer"), layers, index)
    stage = h.get("stage", False)
    if type(stage) is not bool:
        raise bad("stage", stage, "is not a boolean")
    pid = h.get("push_id")
    if pid is not None and (not isinstance(pid, str) or not PUSH_ID.fullmatch(pid)):
        raise bad("push_id", pid, f"is not a push id ({PUSH_ID.pattern})")
    if stage and pid is None:
        raise bad("push_id", pid, "is missing from a push sent ahead of its round")
    tokens = h.get("tokens")
    if tokens is not None:
        tokens = int_field(h, "tokens", 1)
    return PushFields(cluster, rnd, layer, pid, stage, tokens)


def pull_fields(h: Mapping[str, Any], layers: Mapping[str, Any],
                index: int) -> tuple[int, list[str], str]:
    """``(version, layer keys, wire dtype)`` of pull header ``h``. Raises
    Refused(INVALID_ARGUMENT): a version that is not an int in int64, a layer list longer
    than the shard's, a layer not owned or listed twice, a dtype not "bf16"/"fp32"."""
    version = int_field(h, "version")
    want, dname = h.get("layers"), h.get("dtype", "bf16")
    if not isinstance(want, list) or len(want) > len(layers):
        raise bad("layers", want, f"is not a list of at most {len(layers)} layers")
    for layer in want:
        owned_layer(layer, layers, index, "layers")
    if len(set(want)) != len(want):
        raise bad("layers", want, "lists a layer twice")
    if not isinstance(dname, str) or dname not in _DTYPES:
        raise bad("dtype", dname, f"is not one of {list(_DTYPES)}")
    return version, want, dname


class PushIds:
    """The push ids a follower admitted under a ticket, kept across restarts (issue 13;
    review 14, finding F4).

    ``path`` is append-only, one id a line (16 hex digits and a newline); :meth:`add` fsyncs
    its line before it returns, so an id is on disk before any byte of its push is staged or
    acknowledged. The ids found in the file at start are *earlier*: admitted by a previous
    process of this follower. At most ``keep`` ids are held, the oldest forgotten first; the
    file is rewritten with them (:func:`~dips.roles.durable.write_atomic`) at start if it
    differs (a line cut by a crash, too many ids), when it has grown to ``2 * keep`` lines,
    and after a failed write. Not thread-safe (see :class:`Admission`).

    Args:
        path: the file (None: in memory only, nothing survives the process).
        keep: ids held (>= 1).

    Raises:
        OSError: the file cannot be read or rewritten.
    """

    def __init__(self, path: Path | None, keep: int = RETIRED_IDS) -> None:
        self.path, self.keep = path, keep
        self._ids: OrderedDict[str, bool] = OrderedDict()  # id -> admitted by an earlier process
        self._lines, self._suspect = 0, False
        if path is not None and path.exists():
            raw = path.read_bytes()
            for line in raw.decode("ascii", errors="replace").splitlines():
                if PUSH_ID.fullmatch(line):  # a line cut by a crash was never acknowledged
                    self._ids[line] = True
                    self._ids.move_to_end(line)
            self._trim()
            if raw != self._body():
                write_atomic(path, self._body())
            self._lines = len(self._ids)

    def earlier(self, push_id: str) -> bool:
        """Whether ``push_id`` was admitted by a previous process of this follower."""
        return self._ids.get(push_id, False)

    def add(self, push_id: str) -> None:
        """Keep ``push_id`` (a no-op if held): on disk, fsynced, when this returns. Raises
        OSError (then it is not held either)."""
        if push_id in self._ids:
            return
        self._ids[push_id] = False
        try:
            if self.path is not None and (self._suspect or self._lines + 1 >= 2 * self.keep):
                self._trim()
                write_atomic(self.path, self._body())
                self._lines, self._suspect = len(self._ids), False
            elif self.path is not None:
                append_durable(self.path, f"{push_id}\n".encode())
                self._lines += 1
        except OSError:
            # The file may now end in a cut line, or hold bytes the disk never took: the
            # next id rewrites it whole rather than appending to it.
            del self._ids[push_id]
            self._suspect = True
            raise
        self._trim()

    def _trim(self) -> None:
        while len(self._ids) > self.keep:
            self._ids.popitem(last=False)

    def _body(self) -> bytes:
        return "".join(f"{i}\n" for i in self._ids).encode()


class Admission:
    """Admission tickets and replay state of one follower (see the module docstring).

    Not thread-safe: the follower calls it under its lock.

    Args:
        required: refuse every push until :meth:`set_key` (a follower process, before its
            first registration); False: without a key, no ticket is required.
        key: the admission key (:func:`dips.wire.admission.admission_key`), or None.
        closed: the watermark to start from (see :func:`last_round`).
        state_dir: the follower's state directory, where :data:`PUSH_IDS_FILE` keeps the push
            ids it admitted across restarts (:class:`PushIds`); None: in memory only.

    Raises:
        OSError: the push ids file cannot be read or rewritten.
    """

    def __init__(self, required: bool = False, key: bytes | None = None, closed: int = 0,
                 state_dir: Path | None = None) -> None:
        self.required, self.key, self.closed = required, key, closed
        self._retired: OrderedDict[str, None] = OrderedDict()
        self._admitted = PushIds(None if state_dir is None else state_dir / PUSH_IDS_FILE)

    def set_key(self, key: bytes) -> None:
        """Check tickets under ``key`` from now on."""
        self.key = key

    def close(self, rnd: int) -> None:
        """Round ``rnd`` and every earlier one are closed: their pushes are replays now."""
        self.closed = max(self.closed, rnd)

    def retire(self, push_id: str) -> None:
        """``push_id`` was used up (taken into a round, or replaced)."""
        self._retired[push_id] = None
        self._retired.move_to_end(push_id)
        while len(self._retired) > RETIRED_IDS:
            self._retired.popitem(last=False)

    def admit(self, f: PushFields, header: Mapping[str, Any], version: int) -> PushFields:
        """``f`` with T_j and base version from the ticket, if the push may be staged.

        A ticket's push id admitted for the first time is recorded durably before this
        returns (:class:`PushIds`). Raises Refused: NOT_READY (a key is required and not yet
        known), FORBIDDEN (no ticket, a forged one, or one for another cluster, round or push
        id), INVALID_ARGUMENT (a malformed ticket), STALE_GRANT (a closed round, a used push
        id, a push id admitted before this follower restarted, a base version ahead of
        ``version``, the follower's). Raises OSError if the push id cannot be recorded (the
        push is then not staged).
        """
        if self.key is None:
            if self.required:
                raise Refused(Refusal.NOT_READY, "this follower has no admission key yet "
                                                 "(not registered with the leader)")
        else:
            t = admission.verify(self.key, header.get("ticket"), header.get("ticket_mac"))
            if (t.cluster, t.push_id) != (f.cluster, f.push_id) or t.round != f.round \
                    or f.stage != (t.round == 0):
                raise Refused(Refusal.FORBIDDEN, f"ticket of {t.cluster!r} for round {t.round}, "
                                                 f"push {t.push_id}, does not admit a push of "
                                                 f"{f.cluster!r} for round {f.round}, push "
                                                 f"{f.push_id} (stage: {f.stage})")
            if t.base_version > version:
                raise Refused(Refusal.STALE_GRANT, f"push {t.push_id} starts from version "
                                                   f"{t.base_version}, this follower holds "
                                                   f"{version}")
            f = replace(f, tokens=t.tokens, base_version=t.base_version)
        if not f.stage and f.round <= self.closed:
            raise Refused(Refusal.STALE_GRANT, f"round {f.round} is closed on this follower "
                                               f"(closed up to round {self.closed}): a replay")
        if f.push_id is not None and f.push_id in self._retired:
            raise Refused(Refusal.STALE_GRANT, f"push id {f.push_id} was already used")
        if self.key is not None:
            if self._admitted.earlier(f.push_id):
                raise Refused(Refusal.STALE_GRANT, f"push id {f.push_id} was admitted before "
                                                   f"this follower restarted (what it staged "
                                                   f"is gone): a replay")
            self._admitted.add(f.push_id)
        return f


def last_round(log: Path | None) -> int:
    """The highest round in the tail (64 KiB) of a follower's ``applied.jsonl``, 0 if none:
    a restarted follower's watermark, so pushes of rounds it applied stay replays."""
    if log is None or not log.exists():
        return 0
    with open(log, "rb") as f:
        f.seek(max(0, f.seek(0, 2) - 65536))
        lines = f.read().decode("utf-8", errors="replace").splitlines()
    best = 0
    for line in lines:  # the first may be cut in the middle: it does not parse
        try:
            r = json.loads(line).get("round")
        except (ValueError, AttributeError):
            continue
        if type(r) is int:
            best = max(best, r)
    return best
