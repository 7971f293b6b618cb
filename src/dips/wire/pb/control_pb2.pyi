from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Refusal(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REFUSAL_UNSPECIFIED: _ClassVar[Refusal]
    NOT_JOINED: _ClassVar[Refusal]
    PUSH_IN_FLIGHT: _ClassVar[Refusal]
    NOT_READY: _ClassVar[Refusal]
    UNKNOWN_PUSH: _ClassVar[Refusal]
    VERSION_GONE: _ClassVar[Refusal]
    NOT_ADMITTED: _ClassVar[Refusal]
    UNDECIDED: _ClassVar[Refusal]
    INVALID_ARGUMENT: _ClassVar[Refusal]
    NO_LEDGER: _ClassVar[Refusal]
    LEDGER_CONFLICT: _ClassVar[Refusal]
    NOTHING_TRAINED: _ClassVar[Refusal]
    FORBIDDEN: _ClassVar[Refusal]
    STALE_TERM: _ClassVar[Refusal]
    LEASE_HELD: _ClassVar[Refusal]
    MODEL_MISMATCH: _ClassVar[Refusal]
    RUN_FINISHED: _ClassVar[Refusal]
    STALE_GRANT: _ClassVar[Refusal]
    BUSY: _ClassVar[Refusal]
    NOT_LEADER: _ClassVar[Refusal]
REFUSAL_UNSPECIFIED: Refusal
NOT_JOINED: Refusal
PUSH_IN_FLIGHT: Refusal
NOT_READY: Refusal
UNKNOWN_PUSH: Refusal
VERSION_GONE: Refusal
NOT_ADMITTED: Refusal
UNDECIDED: Refusal
INVALID_ARGUMENT: Refusal
NO_LEDGER: Refusal
LEDGER_CONFLICT: Refusal
NOTHING_TRAINED: Refusal
FORBIDDEN: Refusal
STALE_TERM: Refusal
LEASE_HELD: Refusal
MODEL_MISMATCH: Refusal
RUN_FINISHED: Refusal
STALE_GRANT: Refusal
BUSY: Refusal
NOT_LEADER: Refusal

class Ack(_message.Message):
    __slots__ = ("ok", "error")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class FollowerInfo(_message.Message):
    __slots__ = ("index", "data_endpoint", "control_endpoint", "layers", "layer_bytes", "version", "prepared_version", "checkpoints", "incarnation", "leader_term", "data_plane_error")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    CONTROL_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    LAYER_BYTES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PREPARED_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LEADER_TERM_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_ERROR_FIELD_NUMBER: _ClassVar[int]
    index: int
    data_endpoint: str
    control_endpoint: str
    layers: _containers.RepeatedScalarFieldContainer[str]
    layer_bytes: _containers.RepeatedScalarFieldContainer[int]
    version: int
    prepared_version: int
    checkpoints: _containers.RepeatedScalarFieldContainer[int]
    incarnation: int
    leader_term: int
    data_plane_error: str
    def __init__(self, index: _Optional[int] = ..., data_endpoint: _Optional[str] = ..., control_endpoint: _Optional[str] = ..., layers: _Optional[_Iterable[str]] = ..., layer_bytes: _Optional[_Iterable[int]] = ..., version: _Optional[int] = ..., prepared_version: _Optional[int] = ..., checkpoints: _Optional[_Iterable[int]] = ..., incarnation: _Optional[int] = ..., leader_term: _Optional[int] = ..., data_plane_error: _Optional[str] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("term", "data_secret", "encrypt", "member_keys", "next_key_seq")
    TERM_FIELD_NUMBER: _ClassVar[int]
    DATA_SECRET_FIELD_NUMBER: _ClassVar[int]
    ENCRYPT_FIELD_NUMBER: _ClassVar[int]
    MEMBER_KEYS_FIELD_NUMBER: _ClassVar[int]
    NEXT_KEY_SEQ_FIELD_NUMBER: _ClassVar[int]
    term: int
    data_secret: bytes
    encrypt: bool
    member_keys: _containers.RepeatedScalarFieldContainer[str]
    next_key_seq: int
    def __init__(self, term: _Optional[int] = ..., data_secret: _Optional[bytes] = ..., encrypt: _Optional[bool] = ..., member_keys: _Optional[_Iterable[str]] = ..., next_key_seq: _Optional[int] = ...) -> None: ...

class StageLayers(_message.Message):
    __slots__ = ("layers",)
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, layers: _Optional[_Iterable[str]] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("cluster_id", "stages", "fingerprint")
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    cluster_id: str
    stages: _containers.RepeatedCompositeFieldContainer[StageLayers]
    fingerprint: str
    def __init__(self, cluster_id: _Optional[str] = ..., stages: _Optional[_Iterable[_Union[StageLayers, _Mapping]]] = ..., fingerprint: _Optional[str] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("version", "followers", "heartbeat_interval_s", "push_timeout_s", "key_id", "key", "encrypt", "followers_epoch")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FOLLOWERS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    PUSH_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    ENCRYPT_FIELD_NUMBER: _ClassVar[int]
    FOLLOWERS_EPOCH_FIELD_NUMBER: _ClassVar[int]
    version: int
    followers: _containers.RepeatedCompositeFieldContainer[FollowerInfo]
    heartbeat_interval_s: float
    push_timeout_s: float
    key_id: str
    key: bytes
    encrypt: bool
    followers_epoch: int
    def __init__(self, version: _Optional[int] = ..., followers: _Optional[_Iterable[_Union[FollowerInfo, _Mapping]]] = ..., heartbeat_interval_s: _Optional[float] = ..., push_timeout_s: _Optional[float] = ..., key_id: _Optional[str] = ..., key: _Optional[bytes] = ..., encrypt: _Optional[bool] = ..., followers_epoch: _Optional[int] = ...) -> None: ...

class PushRequest(_message.Message):
    __slots__ = ("cluster_id", "base_version", "tokens", "inner_steps", "progress", "expected_push_s")
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    INNER_STEPS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_PUSH_S_FIELD_NUMBER: _ClassVar[int]
    cluster_id: str
    base_version: int
    tokens: int
    inner_steps: int
    progress: _containers.RepeatedCompositeFieldContainer[ChunkPos]
    expected_push_s: float
    def __init__(self, cluster_id: _Optional[str] = ..., base_version: _Optional[int] = ..., tokens: _Optional[int] = ..., inner_steps: _Optional[int] = ..., progress: _Optional[_Iterable[_Union[ChunkPos, _Mapping]]] = ..., expected_push_s: _Optional[float] = ...) -> None: ...

class ChunkPos(_message.Message):
    __slots__ = ("chunk", "position")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    chunk: int
    position: int
    def __init__(self, chunk: _Optional[int] = ..., position: _Optional[int] = ...) -> None: ...

class LeaseRequest(_message.Message):
    __slots__ = ("cluster_id", "n")
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    cluster_id: str
    n: int
    def __init__(self, cluster_id: _Optional[str] = ..., n: _Optional[int] = ...) -> None: ...

class LeaseReply(_message.Message):
    __slots__ = ("holdings", "windows_per_chunk", "epoch")
    HOLDINGS_FIELD_NUMBER: _ClassVar[int]
    WINDOWS_PER_CHUNK_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    holdings: _containers.RepeatedCompositeFieldContainer[ChunkPos]
    windows_per_chunk: int
    epoch: int
    def __init__(self, holdings: _Optional[_Iterable[_Union[ChunkPos, _Mapping]]] = ..., windows_per_chunk: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class Transfer(_message.Message):
    __slots__ = ("stage", "layer", "follower")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    FOLLOWER_FIELD_NUMBER: _ClassVar[int]
    stage: int
    layer: str
    follower: int
    def __init__(self, stage: _Optional[int] = ..., layer: _Optional[str] = ..., follower: _Optional[int] = ...) -> None: ...

class Step(_message.Message):
    __slots__ = ("transfers",)
    TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    transfers: _containers.RepeatedCompositeFieldContainer[Transfer]
    def __init__(self, transfers: _Optional[_Iterable[_Union[Transfer, _Mapping]]] = ...) -> None: ...

class PushGrant(_message.Message):
    __slots__ = ("push_id", "round", "server_version", "schedule", "stage_first", "ticket", "ticket_mac")
    PUSH_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    SCHEDULE_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIRST_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    TICKET_MAC_FIELD_NUMBER: _ClassVar[int]
    push_id: str
    round: int
    server_version: int
    schedule: _containers.RepeatedCompositeFieldContainer[Step]
    stage_first: bool
    ticket: str
    ticket_mac: bytes
    def __init__(self, push_id: _Optional[str] = ..., round: _Optional[int] = ..., server_version: _Optional[int] = ..., schedule: _Optional[_Iterable[_Union[Step, _Mapping]]] = ..., stage_first: _Optional[bool] = ..., ticket: _Optional[str] = ..., ticket_mac: _Optional[bytes] = ...) -> None: ...

class PushDoneRequest(_message.Message):
    __slots__ = ("cluster_id", "push_id", "ok", "error")
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    PUSH_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    cluster_id: str
    push_id: str
    ok: bool
    error: str
    def __init__(self, cluster_id: _Optional[str] = ..., push_id: _Optional[str] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class PushVerdict(_message.Message):
    __slots__ = ("accepted", "has_score", "score", "threshold", "version", "round", "clip_factor", "reason", "holdings")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    HAS_SCORE_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CLIP_FACTOR_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    HOLDINGS_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    has_score: bool
    score: float
    threshold: float
    version: int
    round: int
    clip_factor: float
    reason: str
    holdings: _containers.RepeatedCompositeFieldContainer[ChunkPos]
    def __init__(self, accepted: _Optional[bool] = ..., has_score: _Optional[bool] = ..., score: _Optional[float] = ..., threshold: _Optional[float] = ..., version: _Optional[int] = ..., round: _Optional[int] = ..., clip_factor: _Optional[float] = ..., reason: _Optional[str] = ..., holdings: _Optional[_Iterable[_Union[ChunkPos, _Mapping]]] = ...) -> None: ...

class PullDoneRequest(_message.Message):
    __slots__ = ("cluster_id", "version")
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    cluster_id: str
    version: int
    def __init__(self, cluster_id: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("cluster_id", "inner_step", "tokens", "last_loss")
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    INNER_STEP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAST_LOSS_FIELD_NUMBER: _ClassVar[int]
    cluster_id: str
    inner_step: int
    tokens: int
    last_loss: float
    def __init__(self, cluster_id: _Optional[str] = ..., inner_step: _Optional[int] = ..., tokens: _Optional[int] = ..., last_loss: _Optional[float] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("version", "known", "followers_epoch", "finished")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    FOLLOWERS_EPOCH_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    version: int
    known: bool
    followers_epoch: int
    finished: str
    def __init__(self, version: _Optional[int] = ..., known: _Optional[bool] = ..., followers_epoch: _Optional[int] = ..., finished: _Optional[str] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("cluster_id",)
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    cluster_id: str
    def __init__(self, cluster_id: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FenceRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class FenceReply(_message.Message):
    __slots__ = ("term",)
    TERM_FIELD_NUMBER: _ClassVar[int]
    term: int
    def __init__(self, term: _Optional[int] = ...) -> None: ...

class SpecRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SpecReply(_message.Message):
    __slots__ = ("run_spec", "fingerprint", "term")
    RUN_SPEC_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    run_spec: str
    fingerprint: str
    term: int
    def __init__(self, run_spec: _Optional[str] = ..., fingerprint: _Optional[str] = ..., term: _Optional[int] = ...) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("cluster_id", "inner_step", "tokens", "last_loss", "last_push", "pulled_version", "heartbeat_age_s", "tokens_pushed", "tokens_accepted")
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    INNER_STEP_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAST_LOSS_FIELD_NUMBER: _ClassVar[int]
    LAST_PUSH_FIELD_NUMBER: _ClassVar[int]
    PULLED_VERSION_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PUSHED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    cluster_id: str
    inner_step: int
    tokens: int
    last_loss: float
    last_push: str
    pulled_version: int
    heartbeat_age_s: float
    tokens_pushed: int
    tokens_accepted: int
    def __init__(self, cluster_id: _Optional[str] = ..., inner_step: _Optional[int] = ..., tokens: _Optional[int] = ..., last_loss: _Optional[float] = ..., last_push: _Optional[str] = ..., pulled_version: _Optional[int] = ..., heartbeat_age_s: _Optional[float] = ..., tokens_pushed: _Optional[int] = ..., tokens_accepted: _Optional[int] = ...) -> None: ...

class FollowerHealth(_message.Message):
    __slots__ = ("index", "up", "heartbeat_age_s", "version")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    index: int
    up: bool
    heartbeat_age_s: float
    version: int
    def __init__(self, index: _Optional[int] = ..., up: _Optional[bool] = ..., heartbeat_age_s: _Optional[float] = ..., version: _Optional[int] = ...) -> None: ...

class Fault(_message.Message):
    __slots__ = ("time", "kind", "member", "reason", "detail")
    TIME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    time: float
    kind: str
    member: str
    reason: str
    detail: str
    def __init__(self, time: _Optional[float] = ..., kind: _Optional[str] = ..., member: _Optional[str] = ..., reason: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class FaultCount(_message.Message):
    __slots__ = ("kind", "reason", "count")
    KIND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    kind: str
    reason: str
    count: int
    def __init__(self, kind: _Optional[str] = ..., reason: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("version", "rounds", "updates_pushed", "updates_accepted", "updates_rejected", "tokens_pushed", "tokens_accepted", "phase", "clusters", "followers", "outer_steps", "followers_ready", "accepted_windows", "ledger_epoch", "outer_steps_lost", "finished", "last_eval", "faults", "fault_counts", "fault_window_s", "follower_health", "followers_configured")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    UPDATES_PUSHED_FIELD_NUMBER: _ClassVar[int]
    UPDATES_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    UPDATES_REJECTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PUSHED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    CLUSTERS_FIELD_NUMBER: _ClassVar[int]
    FOLLOWERS_FIELD_NUMBER: _ClassVar[int]
    OUTER_STEPS_FIELD_NUMBER: _ClassVar[int]
    FOLLOWERS_READY_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_WINDOWS_FIELD_NUMBER: _ClassVar[int]
    LEDGER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    OUTER_STEPS_LOST_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    LAST_EVAL_FIELD_NUMBER: _ClassVar[int]
    FAULTS_FIELD_NUMBER: _ClassVar[int]
    FAULT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    FAULT_WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    FOLLOWER_HEALTH_FIELD_NUMBER: _ClassVar[int]
    FOLLOWERS_CONFIGURED_FIELD_NUMBER: _ClassVar[int]
    version: int
    rounds: int
    updates_pushed: int
    updates_accepted: int
    updates_rejected: int
    tokens_pushed: int
    tokens_accepted: int
    phase: str
    clusters: _containers.RepeatedCompositeFieldContainer[ClusterStatus]
    followers: _containers.RepeatedCompositeFieldContainer[FollowerInfo]
    outer_steps: int
    followers_ready: int
    accepted_windows: int
    ledger_epoch: int
    outer_steps_lost: int
    finished: str
    last_eval: EvalRecord
    faults: _containers.RepeatedCompositeFieldContainer[Fault]
    fault_counts: _containers.RepeatedCompositeFieldContainer[FaultCount]
    fault_window_s: float
    follower_health: _containers.RepeatedCompositeFieldContainer[FollowerHealth]
    followers_configured: int
    def __init__(self, version: _Optional[int] = ..., rounds: _Optional[int] = ..., updates_pushed: _Optional[int] = ..., updates_accepted: _Optional[int] = ..., updates_rejected: _Optional[int] = ..., tokens_pushed: _Optional[int] = ..., tokens_accepted: _Optional[int] = ..., phase: _Optional[str] = ..., clusters: _Optional[_Iterable[_Union[ClusterStatus, _Mapping]]] = ..., followers: _Optional[_Iterable[_Union[FollowerInfo, _Mapping]]] = ..., outer_steps: _Optional[int] = ..., followers_ready: _Optional[int] = ..., accepted_windows: _Optional[int] = ..., ledger_epoch: _Optional[int] = ..., outer_steps_lost: _Optional[int] = ..., finished: _Optional[str] = ..., last_eval: _Optional[_Union[EvalRecord, _Mapping]] = ..., faults: _Optional[_Iterable[_Union[Fault, _Mapping]]] = ..., fault_counts: _Optional[_Iterable[_Union[FaultCount, _Mapping]]] = ..., fault_window_s: _Optional[float] = ..., follower_health: _Optional[_Iterable[_Union[FollowerHealth, _Mapping]]] = ..., followers_configured: _Optional[int] = ...) -> None: ...

class EvalReport(_message.Message):
    __slots__ = ("version", "eval_loss", "eval_tokens")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    EVAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    EVAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    version: int
    eval_loss: float
    eval_tokens: int
    def __init__(self, version: _Optional[int] = ..., eval_loss: _Optional[float] = ..., eval_tokens: _Optional[int] = ...) -> None: ...

class EvalRecord(_message.Message):
    __slots__ = ("time", "version", "tokens_accepted", "eval_loss", "perplexity", "eval_tokens")
    TIME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    EVAL_LOSS_FIELD_NUMBER: _ClassVar[int]
    PERPLEXITY_FIELD_NUMBER: _ClassVar[int]
    EVAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    time: float
    version: int
    tokens_accepted: int
    eval_loss: float
    perplexity: float
    eval_tokens: int
    def __init__(self, time: _Optional[float] = ..., version: _Optional[int] = ..., tokens_accepted: _Optional[int] = ..., eval_loss: _Optional[float] = ..., perplexity: _Optional[float] = ..., eval_tokens: _Optional[int] = ...) -> None: ...

class ScoreRequest(_message.Message):
    __slots__ = ("round", "cluster_ids", "push_ids", "retired_push_ids")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_IDS_FIELD_NUMBER: _ClassVar[int]
    PUSH_IDS_FIELD_NUMBER: _ClassVar[int]
    RETIRED_PUSH_IDS_FIELD_NUMBER: _ClassVar[int]
    round: int
    cluster_ids: _containers.RepeatedScalarFieldContainer[str]
    push_ids: _containers.RepeatedScalarFieldContainer[str]
    retired_push_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, round: _Optional[int] = ..., cluster_ids: _Optional[_Iterable[str]] = ..., push_ids: _Optional[_Iterable[str]] = ..., retired_push_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ClusterNorm(_message.Message):
    __slots__ = ("cluster_id", "valid", "sq_norm", "error")
    CLUSTER_ID_FIELD_NUMBER: _ClassVar[int]
    VALID_FIELD_NUMBER: _ClassVar[int]
    SQ_NORM_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    cluster_id: str
    valid: bool
    sq_norm: float
    error: str
    def __init__(self, cluster_id: _Optional[str] = ..., valid: _Optional[bool] = ..., sq_norm: _Optional[float] = ..., error: _Optional[str] = ...) -> None: ...

class ScoreReply(_message.Message):
    __slots__ = ("norms", "version")
    NORMS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    norms: _containers.RepeatedCompositeFieldContainer[ClusterNorm]
    version: int
    def __init__(self, norms: _Optional[_Iterable[_Union[ClusterNorm, _Mapping]]] = ..., version: _Optional[int] = ...) -> None: ...

class AggregateRequest(_message.Message):
    __slots__ = ("round", "cluster_ids", "weights")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_IDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    round: int
    cluster_ids: _containers.RepeatedScalarFieldContainer[str]
    weights: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, round: _Optional[int] = ..., cluster_ids: _Optional[_Iterable[str]] = ..., weights: _Optional[_Iterable[float]] = ...) -> None: ...

class AggregateReply(_message.Message):
    __slots__ = ("sq_norm",)
    SQ_NORM_FIELD_NUMBER: _ClassVar[int]
    sq_norm: float
    def __init__(self, sq_norm: _Optional[float] = ...) -> None: ...

class ApplyRequest(_message.Message):
    __slots__ = ("round", "clip_factor", "new_version", "accepted", "weights")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    CLIP_FACTOR_FIELD_NUMBER: _ClassVar[int]
    NEW_VERSION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    round: int
    clip_factor: float
    new_version: int
    accepted: _containers.RepeatedScalarFieldContainer[str]
    weights: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, round: _Optional[int] = ..., clip_factor: _Optional[float] = ..., new_version: _Optional[int] = ..., accepted: _Optional[_Iterable[str]] = ..., weights: _Optional[_Iterable[float]] = ...) -> None: ...

class ApplyReply(_message.Message):
    __slots__ = ("version", "checksum")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    version: int
    checksum: str
    def __init__(self, version: _Optional[int] = ..., checksum: _Optional[str] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("new_version",)
    NEW_VERSION_FIELD_NUMBER: _ClassVar[int]
    new_version: int
    def __init__(self, new_version: _Optional[int] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class DiscardRequest(_message.Message):
    __slots__ = ("round", "all_rounds")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ALL_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    round: int
    all_rounds: bool
    def __init__(self, round: _Optional[int] = ..., all_rounds: _Optional[bool] = ...) -> None: ...

class FollowerStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FollowerState(_message.Message):
    __slots__ = ("index", "version", "checksum", "prepared_version", "checkpoints")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    PREPARED_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    index: int
    version: int
    checksum: str
    prepared_version: int
    checkpoints: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, index: _Optional[int] = ..., version: _Optional[int] = ..., checksum: _Optional[str] = ..., prepared_version: _Optional[int] = ..., checkpoints: _Optional[_Iterable[int]] = ...) -> None: ...
