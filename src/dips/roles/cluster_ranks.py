"""A multi-rank cluster's stage workers are its ranks (issue 14; §5, §10 of the seed).

A cluster launched by torchrun as ``world`` DDP replicas splits its layers among its ranks as
it splits them among stage workers in one process: contiguous blocks balanced by bytes
(:func:`rank_blocks`; at most one block per layer, so ranks ``>= len(blocks)`` own none).
As pipeline stages (``parallel: pipeline``) rank r owns the layers of its stage instead
(:func:`dips.train.pipeline.stage_blocks`: the first stage has the embedding, the last the
final norm and head); everything below is the same.
Rank 0 runs the cluster's :class:`dips.roles.client.ClusterClient` logic
(:class:`RankLeadClient`: join, heartbeats, leases, push requests, verdicts); wherever that
logic would move tensors it broadcasts a command on the control group and every rank executes
it with its own :class:`RankWorker`:

* ``connect``: each rank opens its own stage worker (one ZeroMQ connection per follower) with
  the member key rank 0 got at its join (it travels on the in-cluster network, in clear);
* ``push``: each rank sends its block in the order of the leader's §10 schedule straight to the
  owning followers (the followers see one connection per stage worker, not per replica), and
  the outcomes are all-gathered (a refusal on any rank fails the whole push);
* ``pull``: each rank fetches its block at the verdict's version; only if every rank got all
  of its tensors (all-gather) does each widen its block into its replica and broadcast it to
  the others, so every replica holds the same complete model of one version; then the ranks
  compare per-shard checksums (:func:`dips.roles.shard_checksum.shard_checksum`) and fail if any
  replica differs;
* ``end``: the command sequence of one inner step (or join) is over; it carries rank 0's data
  position (:class:`dips.train.ddp.RankSampler` state) and whether to stop.

The other ranks wait in :meth:`RankWorker.serve` meanwhile, each wait bounded by the control
group's timeout.

Under FSDP2 (``fully_shard``; the parameters are DTensors sharded over the ranks) a layer is
whole only inside a collective, and the owner of a block stages it one layer at a time in a
bounded set of host buffers (:mod:`dips.roles.cluster_shards`): before a push every rank
gathers the planned layers in one agreed order (``full_tensor()``) and each owner streams its
own as they come; after a pull each owner fetches its layers one stream each and every rank
takes its shard of each as it is broadcast from its owner. An owner's extra host memory is
at most ``StageWorker.depth + 1`` of its largest layers in the wire dtype, not its block.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import torch

from dips.algo import partition_contiguous
from dips.algo.refusal import Refusal
from dips.roles.client import ClusterClient
from dips.roles.client_sync import AHEAD_CAP_S, PullFailed, StageFailures, _in_threads
from dips.roles.cluster import StageWorker
from dips.roles.cluster_shards import LayerSlots, ShardedPull, ShardedPush
from dips.roles.shard_checksum import ShardHasher
from dips.roles.rank_comm import Ranks, broadcast_params
from dips.roles.transfer_threads import Beside, Stragglers
from dips.wire.dataclient import DataPlaneError
from dips.wire.frames import DTYPES
from dips.wire.keys import MemberKey
from dips.wire.pb import control_pb2 as pb

log = logging.getLogger(__name__)

__all__ = ["RankLeadClient", "RankWorker", "rank_blocks"]

#: Seconds a rank's transfer stops short of the control group's timeout.
MARGIN_S = 60.0
#: Seconds :meth:`RankWorker.close` waits for the transfer threads it gave up on.
CLOSE_WAIT_S = 60.0

Layers = list[tuple[str, list[tuple[str, torch.nn.Parameter]]]]


def rank_blocks(sizes: list[int], world: int) -> list[range]:
    """Layer indices of each rank's block: ``min(world, len(sizes))`` contiguous ranges
    (rank r owns block r; later ranks none), minimising the largest block's bytes.

    Args: sizes: bytes of each layer in model order (ints >= 0); world: ranks (>= 1).
    Raises ValueError for no layers, ``world < 1`` or a bad size. Source: §10 (stage workers).
    """
    if world < 1 or not sizes:
        raise ValueError(f"rank_blocks: world = {world} must be >= 1 and sizes non-empty")
    return partition_contiguous(list(sizes), min(world, len(sizes)))


class RankWorker:
    """One rank's stage worker and its part in the cluster's commands (module docstring).

    Args:
        ranks: this rank's :class:`~dips.roles.rank_comm.Ranks`.
        layers: the replica's layers in model order (:func:`dips.roles.layers.group_layers`).
        blocks: :func:`rank_blocks` of those layers, or the pipeline's stages
            (:func:`dips.train.pipeline.stage_blocks`); the same on every rank.
        limiter: called with each data-plane message's bytes (link shaping) or None.
        wire_dtype: "bf16" or "fp32". stop: this process's stop request (gives a transfer up).
        verify: compare the replicas' checksums after every pull.
    """

    def __init__(self, ranks: Ranks, layers: Layers, blocks: list[range],
                 limiter: Callable[[int], Any] | None = None, wire_dtype: str = "bf16",
                 stop: threading.Event | None = None, verify: bool = True) -> None:
        self.ranks = ranks
        self.ranges = list(blocks)
        self.blocks = [[layers[i] for i in r] for r in blocks]
        own = dict(self.blocks[ranks.rank]) if ranks.rank < len(blocks) else {}
        #: FSDP2: the parameters are DTensors sharded over the ranks; the owner of a block
        #: stages one layer at a time in ``slots`` (:mod:`dips.roles.cluster_shards`).
        self.sharded = any(_is_dtensor(p) for _, ps in layers for _, p in ps)
        self.mine = own  # layer -> [(name, parameter)] this rank pushes and pulls
        self.limiter = limiter
        self.wire_dtype = wire_dtype
        self.slots: LayerSlots | None = self._slots() if self.sharded and own else None
        self.stop = stop or threading.Event()
        self.verify = verify
        self.stage: StageWorker | None = None
        #: transfer threads still running past their deadline (joined by :meth:`close`)
        self.stragglers = Stragglers()
        self.owner: dict[str, int] = {}
        self._connect_cmd: dict | None = None
        self._pulled: dict[str, torch.Tensor] = {}
        self.checksums: dict[str, str] = {}  # follower index -> checksum after the last pull

    def _slots(self) -> LayerSlots:
        """FSDP2: ``StageWorker.depth + 1`` host buffers as large as this rank's largest
        layer in the wire dtype (one converted while ``depth`` are on the wire)."""
        largest = max(sum(p.numel() for _, p in ps) for ps in self.mine.values())
        return LayerSlots(StageWorker.depth + 1, largest, DTYPES[self.wire_dtype])

    # ----- commands --------------------------------------------------------------------
    def run(self, cmd: dict, abandon: Callable[[], str | None] | None = None) -> list[dict]:
        """Execute ``cmd`` (the same on every rank); returns every rank's outcome (rank
        order). Raises RuntimeError if a collective fails."""
        op = cmd["op"]
        if op == "connect":
            self.connect(cmd)
            return []
        if op == "push" and self.sharded:
            return self.ranks.gather(self._sharded_push(cmd, abandon))
        if op == "push":
            return self.ranks.gather(self._transfer(cmd, abandon, self._push))
        if op == "pull" and self.sharded:
            return self._sharded_pull(cmd, abandon)
        if op == "pull":
            got: list = []  # this pull's tensors, never an abandoned pull's (its own list)
            results = self.ranks.gather(self._transfer(
                cmd, abandon, lambda c, stage: got.append(self._fetch(c, stage))))
            if got and all(r["error"] is None for r in results):
                self._pulled = got[0]
                self._load_and_share()
            self._pulled = {}
            return results
        raise ValueError(f"unknown in-cluster command {op!r}")

    def serve(self) -> dict:
        """Follow rank 0's commands until its ``end``; returns that message."""
        while True:
            cmd = self.ranks.broadcast(None)
            if cmd["op"] == "end":
                return cmd
            self.run(cmd, lambda: "stopping" if self.stop.is_set() else None)

    def connect(self, cmd: dict) -> None:
        """(Re)open this rank's stage worker to the followers of ``cmd``."""
        self._close_stage()
        self._connect_cmd = cmd
        self.owner = {k: int(v) for k, v in cmd["owner"].items()}
        if self.mine:
            key = MemberKey(cmd["key_id"], bytes.fromhex(cmd["key"]), bool(cmd["encrypt"]))
            self.stage = StageWorker(self.ranks.rank, self.mine, key,
                                     {int(f): ep for f, ep in cmd["endpoints"].items()},
                                     float(cmd["timeout_s"]), limiter=self.limiter,
                                     dtype=self.wire_dtype)

    def _transfer(self, cmd: dict, abandon: Callable[[], str | None] | None,
                  job: Callable[[dict, StageWorker], None]) -> dict:
        """Run ``job(cmd, stage)`` on this rank's stage worker in a thread, within
        ``cmd["limit"]`` seconds.

        Ownership: the job's thread uses only the stage worker it was given. If it is still
        running at the deadline or the abort, that stage worker is its thread's from then
        on (closed by it when the job returns, :func:`_in_threads`): this rank drops it
        without closing it and opens a fresh one (review 31 of issue 14: closing the sockets
        of a push still blocked in them aborted rank 0 in libzmq, or crashed it)."""
        out = self._outcome()
        stage = self.stage
        if stage is None:
            return out
        stage.set_timeout(float(cmd["limit"]))
        failures = _in_threads([lambda: job(cmd, stage)], float(cmd["limit"]), abandon, [stage])
        out["acked"] = stage.acked_bytes
        if failures is not None:
            failures.silent = {self.ranks.rank: f for f in failures.silent.values()}  # its block
            out.update(error=str(failures), overran=failures.overran, aborted=failures.aborted,
                       refusals=[int(c) for c in failures.refusals()])
            if failures.overran:
                self.stragglers.add(failures.running)
                self.stage = None  # the stuck thread's now: never closed from here
                if self._connect_cmd is not None:
                    self.connect(self._connect_cmd)
        return out

    def _outcome(self) -> dict[str, Any]:
        """This rank's outcome of a transfer that went well."""
        return {"rank": self.ranks.rank, "error": None, "refusals": [], "overran": False,
                "aborted": None, "acked": 0, "layers": sorted(self.mine)}

    def _push(self, cmd: dict, stage: StageWorker) -> None:
        ticket = (cmd["ticket"], bytes.fromhex(cmd["ticket_mac"])) if cmd.get("ticket") else None
        plan = [(layer, int(f)) for layer, f in cmd["plans"][self.ranks.rank]] \
            if self.ranks.rank < len(cmd["plans"]) else []
        stage.push(cmd["cluster"], int(cmd["round"]), cmd["push_id"], plan, int(cmd["tokens"]),
                   stage=bool(cmd["stage_first"]), ticket=ticket)

    def _fetch(self, cmd: dict, stage: StageWorker) -> Any:
        return stage.pull(int(cmd["version"]), self.owner)

    def _joined(self, side: Beside, limit: float) -> dict:
        """A sharded transfer's outcome, waiting ``limit`` seconds (a thread still running
        then hung: kept in ``stragglers``); after an overrun the stuck stage worker keeps its
        slots, so this rank takes fresh ones."""
        out = side.wait(limit)
        if out is None:
            self.stragglers.add([side.thread])
            out = dict(self._outcome(), error="transfer thread hung", overran=True)
        if out["overran"] and self.slots is not None:
            self.slots = self._slots()
        return out

    def _after_failure(self, side: Beside, limit: float) -> None:
        """A collective failed beside a transfer: wait up to ``limit`` seconds for its thread
        before the error goes up; one still running then keeps this rank's stage worker
        (never closed from here, as after an overrun) and goes to ``stragglers``."""
        side.wait(limit)
        if side.thread.is_alive():
            self.stragglers.add([side.thread])
            self.stage = None

    def _sharded_push(self, cmd: dict, abandon: Callable[[], str | None] | None) -> dict:
        """FSDP2 push: the planned layers gathered one at a time on every rank, each owner's
        streamed from a slot by its stage worker (:class:`ShardedPush`)."""
        limit = float(cmd["limit"])
        plans = [[layer for layer, _ in plan] for plan in cmd["plans"]]
        push = ShardedPush(self.blocks, self.ranks.rank, plans, self.slots,
                           time.monotonic() + limit)
        if self.stage is not None:
            self.stage.staging = push
        side = Beside(lambda: self._transfer(cmd, abandon, self._push), push.done.set)
        try:
            push.feed()
        except BaseException:  # a collective failed: its stage worker stops at the deadline
            self._after_failure(side, limit + MARGIN_S)
            raise
        out = self._joined(side, limit + MARGIN_S)
        if not out["overran"]:
            push.finish()
        return out

    def _sharded_pull(self, cmd: dict, abandon: Callable[[], str | None] | None) -> list[dict]:
        """FSDP2 pull: each owner's layers fetched one stream each into slots and scattered
        as they land (:class:`ShardedPull`), then (``verify``) checked; returns every rank's
        outcome, with ``loaded`` (layers loaded: the model is partly the new version when
        the pull failed after some)."""
        limit, version = float(cmd["limit"]), int(cmd["version"])
        pull = ShardedPull(self.blocks, self.ranks, self.slots, self.wire_dtype,
                           time.monotonic() + limit)

        def fetch(_: dict, stage: StageWorker) -> None:
            pull.fetch(lambda layer, out: stage.pull_layer(version, layer, self.owner[layer],
                                                           out))

        side = Beside(lambda: self._transfer(cmd, abandon, fetch), pull.fetched)
        try:
            ok = pull.load()
        except BaseException:  # a collective failed: its stage worker fetches no more
            pull.gave_up.set()
            self._after_failure(side, limit + MARGIN_S)
            raise
        out = dict(self._joined(side, limit + MARGIN_S), loaded=pull.loaded)
        if not out["overran"]:
            pull.finish()
        if pull.missing is not None and out["error"] is None:
            out["error"] = f"layer {pull.missing!r} was not fetched within {limit:.0f} s"
        results = self.ranks.gather(out)
        if ok and all(r["error"] is None for r in results) and self.verify:
            self.checksums = pull.verify(self._hash_shards)
        return results

    def _load_and_share(self) -> None:
        """Widen this rank's pulled block into the replica, broadcast every block from its
        rank, then (``verify``) check that every replica holds the same model."""
        with torch.no_grad():
            for params in self.mine.values():
                for n, p in params:
                    p.copy_(self._pulled[n])
        for src, block in enumerate(self.blocks):
            broadcast_params([p for _, ps in block for _, p in ps], src)
        if not self.verify:
            return
        self.checksums = {f: h.hexdigest() for f, h in self._hash_shards(
            lambda n, p: p.detach().float().cpu()).items()}
        seen = self.ranks.gather({"checksums": self.checksums})
        if any(s["checksums"] != self.checksums for s in seen):
            raise RuntimeError(f"replicas differ after a pull: {[s['checksums'] for s in seen]}")

    def _hash_shards(self, host: Callable[[str, torch.Tensor], torch.Tensor | None]
                     ) -> dict[str, ShardHasher]:
        """Per follower shard (its index as a string), the :class:`ShardHasher` of this
        replica's parameters, each brought to the host by ``host(name, param)`` in turn (None:
        not hashed on this rank) in the same order on every rank (shards by index, names
        sorted), so a collective inside ``host`` matches up and one parameter at a time
        is on the host."""
        shards: dict[int, list[tuple[str, torch.Tensor]]] = {}
        for block in self.blocks:
            for layer, params in block:
                shards.setdefault(self.owner.get(layer, -1), []).extend(params)
        out: dict[str, ShardHasher] = {}
        for f, params in sorted(shards.items()):
            h = out.setdefault(str(f), ShardHasher())
            for n, p in sorted(params, key=lambda item: item[0]):
                whole = host(n, p)
                if whole is not None:
                    h.add(n, whole)
        return out

    def close(self, timeout_s: float = CLOSE_WAIT_S) -> None:
        """Close this rank's stage worker (if any), then wait up to ``timeout_s`` seconds for
        every transfer thread it gave up on (``stragglers``; each closes its own stage
        worker). Raises RuntimeError naming those still running then: the process must not
        exit over them (:mod:`dips.roles.transfer_threads`)."""
        self._close_stage()
        self.stragglers.join(timeout_s)

    def _close_stage(self) -> None:
        if self.stage is not None:
            self.stage.close()
            self.stage = None


def _is_dtensor(p: torch.Tensor) -> bool:
    return type(p).__name__ == "DTensor" or hasattr(p, "device_mesh")


def _failures(results: list[dict], limit: float) -> StageFailures | None:
    """Rank 0's view of the ranks' outcomes: each failed rank as a stage error."""
    failed = [r for r in results if r["error"] is not None]
    if not failed:
        return None
    out = StageFailures(timeout_s=limit, overran=any(r["overran"] for r in failed),
                        aborted=next((r["aborted"] for r in failed if r["aborted"]), None))
    for r in failed:
        codes = r["refusals"] or [int(Refusal.UNSPECIFIED)]
        out.errors.append((r["rank"], DataPlaneError(f"rank {r['rank']}: {r['error']}",
                                                     Refusal(codes[0]))))
    return out


class RankLeadClient(ClusterClient):
    """Rank 0's :class:`~dips.roles.client.ClusterClient` of a multi-rank cluster: the same
    control logic, with every transfer run by all ranks (module docstring).

    Args: as ClusterClient (``stages`` is the number of rank blocks), plus ``worker`` (rank
    0's :class:`RankWorker`). Attributes after each push / pull: ``last_ranks`` (every rank's
    outcome of the last push: layers, acked bytes, error) and ``worker.checksums``.
    """

    def __init__(self, model: torch.nn.Module, leader: str, cluster_id: str, creds: Any, *,
                 worker: RankWorker, **kwargs: Any) -> None:
        self.worker = worker
        self.last_ranks: list[dict] = []
        super().__init__(model, leader, cluster_id, creds, **kwargs)
        self._stage_ranges = list(worker.ranges)  # the ranks' blocks (pipeline: its stages)

    def _limit(self, kind: str, cap_s: float) -> float:
        """A transfer's deadline (seconds): the measured one, never within MARGIN_S of the
        control group's timeout (the other ranks wait that long at most)."""
        return min(self._xfer.limit(kind, cap_s), max(1.0, self.worker.ranks.timeout_s - MARGIN_S))

    def sync(self) -> Any:
        self.last_ranks = []  # filled by this sync's push, if it gets that far
        return super().sync()

    def _connect(self, followers: list[pb.FollowerInfo], keep_owner: bool = False) -> None:
        self._endpoints = {f.index: f.data_endpoint for f in followers}
        if not keep_owner:
            self._owner = {l: f.index for f in followers for l in f.layers}
        assert self._key is not None
        cmd = {"op": "connect", "key_id": self._key.key_id, "key": self._key.key.hex(),
               "encrypt": self._key.encrypt, "timeout_s": self.timeout_s,
               "endpoints": {str(f): ep for f, ep in self._endpoints.items()},
               "owner": self._owner}
        self.worker.ranks.broadcast(cmd)
        self.worker.run(cmd)
        # The worker owns its stage worker (it replaces one whose transfer overran, and
        # RankWorker.close closes it): ClusterClient.close must not close a stale one.
        self._stages = []

    def _guard(self, failures: StageFailures | None) -> StageFailures | None:
        return failures  # each rank replaces its own overrun stage worker (RankWorker)

    def _run_stages(self, grant: pb.PushGrant, tokens: int) -> str | None:
        plans: list[list[tuple[str, int]]] = [[] for _ in self.worker.blocks]
        for step in grant.schedule:
            for t in step.transfers:
                plans[t.stage].append((t.layer, t.follower))
        limit = self._limit("push_s", AHEAD_CAP_S if grant.stage_first else self.timeout_s)
        cmd = {"op": "push", "cluster": self.cluster_id, "round": grant.round,
               "push_id": grant.push_id, "plans": plans, "tokens": tokens,
               "stage_first": grant.stage_first, "limit": limit,
               "ticket": grant.ticket or None, "ticket_mac": bytes(grant.ticket_mac).hex()}
        t0 = time.monotonic()
        self.worker.ranks.broadcast(cmd)
        self.last_ranks = self.worker.run(cmd, self._abandoned())
        failures = _failures(self.last_ranks, limit)
        if failures is not None and Refusal.NOT_JOINED in failures.refusals():
            self._rejoin.set()
        if failures is not None and not failures.aborted:
            took = time.monotonic() - t0
            acked = sum(r["acked"] for r in self.last_ranks)
            self._xfer.observe("push_s", took * self._push_bytes / acked if acked
                               else 2 * max(took, limit))
        return None if failures is None else str(failures)

    def _pull(self, version: int) -> None:
        t0 = time.monotonic()
        limit = self._limit("pull_s", self.timeout_s)
        cmd = {"op": "pull", "version": version, "limit": limit}
        self.worker.ranks.broadcast(cmd)
        results = self.worker.run(cmd, self._abandoned())
        failures = _failures(results, limit)
        if failures is not None:  # FSDP2 loads as it pulls: maybe partly loaded
            raise PullFailed(version, failures, loading=any(r.get("loaded") for r in results))
        self._xfer.observe("pull_s", time.monotonic() - t0)
        self.version = version
        self.tokens_since_pull = 0

    def end(self, state: dict) -> None:
        """Close the command sequence of this step: the other ranks adopt ``state``."""
        self.worker.ranks.broadcast({"op": "end", **state})
