from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ServiceClass(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INTERACTIVE: _ClassVar[ServiceClass]
    BATCH: _ClassVar[ServiceClass]

class ReplicaKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GENERATIVE: _ClassVar[ReplicaKind]
    SINGLE_PASS: _ClassVar[ReplicaKind]

class RunPhase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    IDLE: _ClassVar[RunPhase]
    GENERATING: _ClassVar[RunPhase]
    PAUSED: _ClassVar[RunPhase]
INTERACTIVE: ServiceClass
BATCH: ServiceClass
GENERATIVE: ReplicaKind
SINGLE_PASS: ReplicaKind
IDLE: RunPhase
GENERATING: RunPhase
PAUSED: RunPhase

class AdmitRequest(_message.Message):
    __slots__ = ("turn_id", "run_id", "service_class", "caller", "model", "kind", "traceparent", "echoed_tool_call_ids", "request_bytes", "max_tokens")
    TURN_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SERVICE_CLASS_FIELD_NUMBER: _ClassVar[int]
    CALLER_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    ECHOED_TOOL_CALL_IDS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    turn_id: str
    run_id: str
    service_class: ServiceClass
    caller: str
    model: str
    kind: ReplicaKind
    traceparent: str
    echoed_tool_call_ids: _containers.RepeatedScalarFieldContainer[str]
    request_bytes: int
    max_tokens: int
    def __init__(self, turn_id: _Optional[str] = ..., run_id: _Optional[str] = ..., service_class: _Optional[_Union[ServiceClass, str]] = ..., caller: _Optional[str] = ..., model: _Optional[str] = ..., kind: _Optional[_Union[ReplicaKind, str]] = ..., traceparent: _Optional[str] = ..., echoed_tool_call_ids: _Optional[_Iterable[str]] = ..., request_bytes: _Optional[int] = ..., max_tokens: _Optional[int] = ...) -> None: ...

class AdmitReply(_message.Message):
    __slots__ = ("outcome", "replica", "url", "message", "held_ms", "run_id", "reservation_id", "slot")
    class Outcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        PLACED: _ClassVar[AdmitReply.Outcome]
        UNKNOWN_MODEL: _ClassVar[AdmitReply.Outcome]
    PLACED: AdmitReply.Outcome
    UNKNOWN_MODEL: AdmitReply.Outcome
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    HELD_MS_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    outcome: AdmitReply.Outcome
    replica: str
    url: str
    message: str
    held_ms: float
    run_id: str
    reservation_id: str
    slot: int
    def __init__(self, outcome: _Optional[_Union[AdmitReply.Outcome, str]] = ..., replica: _Optional[str] = ..., url: _Optional[str] = ..., message: _Optional[str] = ..., held_ms: _Optional[float] = ..., run_id: _Optional[str] = ..., reservation_id: _Optional[str] = ..., slot: _Optional[int] = ...) -> None: ...

class TurnStarted(_message.Message):
    __slots__ = ("streamed",)
    STREAMED_FIELD_NUMBER: _ClassVar[int]
    streamed: bool
    def __init__(self, streamed: _Optional[bool] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TurnCompleted(_message.Message):
    __slots__ = ("finish_reason", "prompt_tokens", "completion_tokens", "tool_call_ids", "tool_names")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_IDS_FIELD_NUMBER: _ClassVar[int]
    TOOL_NAMES_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    tool_call_ids: _containers.RepeatedScalarFieldContainer[str]
    tool_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, finish_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., tool_call_ids: _Optional[_Iterable[str]] = ..., tool_names: _Optional[_Iterable[str]] = ...) -> None: ...

class TurnFailed(_message.Message):
    __slots__ = ("error", "replica_fault")
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FAULT_FIELD_NUMBER: _ClassVar[int]
    error: str
    replica_fault: bool
    def __init__(self, error: _Optional[str] = ..., replica_fault: _Optional[bool] = ...) -> None: ...

class TurnAbandoned(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RunEnded(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TurnEvent(_message.Message):
    __slots__ = ("turn_id", "run_id", "started", "first_token", "completed", "failed", "abandoned", "run_ended")
    TURN_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    ABANDONED_FIELD_NUMBER: _ClassVar[int]
    RUN_ENDED_FIELD_NUMBER: _ClassVar[int]
    turn_id: str
    run_id: str
    started: TurnStarted
    first_token: FirstToken
    completed: TurnCompleted
    failed: TurnFailed
    abandoned: TurnAbandoned
    run_ended: RunEnded
    def __init__(self, turn_id: _Optional[str] = ..., run_id: _Optional[str] = ..., started: _Optional[_Union[TurnStarted, _Mapping]] = ..., first_token: _Optional[_Union[FirstToken, _Mapping]] = ..., completed: _Optional[_Union[TurnCompleted, _Mapping]] = ..., failed: _Optional[_Union[TurnFailed, _Mapping]] = ..., abandoned: _Optional[_Union[TurnAbandoned, _Mapping]] = ..., run_ended: _Optional[_Union[RunEnded, _Mapping]] = ...) -> None: ...

class WantReservations(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReservationUsed(_message.Message):
    __slots__ = ("reservation_id", "replica", "admit")
    RESERVATION_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    ADMIT_FIELD_NUMBER: _ClassVar[int]
    reservation_id: str
    replica: str
    admit: AdmitRequest
    def __init__(self, reservation_id: _Optional[str] = ..., replica: _Optional[str] = ..., admit: _Optional[_Union[AdmitRequest, _Mapping]] = ...) -> None: ...

class DataplaneItem(_message.Message):
    __slots__ = ("admit", "event", "want_reservations", "reservation_used", "reservation_returned")
    ADMIT_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    WANT_RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_USED_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_RETURNED_FIELD_NUMBER: _ClassVar[int]
    admit: AdmitRequest
    event: TurnEvent
    want_reservations: WantReservations
    reservation_used: ReservationUsed
    reservation_returned: str
    def __init__(self, admit: _Optional[_Union[AdmitRequest, _Mapping]] = ..., event: _Optional[_Union[TurnEvent, _Mapping]] = ..., want_reservations: _Optional[_Union[WantReservations, _Mapping]] = ..., reservation_used: _Optional[_Union[ReservationUsed, _Mapping]] = ..., reservation_returned: _Optional[str] = ...) -> None: ...

class DataplaneBatch(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[DataplaneItem]
    def __init__(self, items: _Optional[_Iterable[_Union[DataplaneItem, _Mapping]]] = ...) -> None: ...

class Placement(_message.Message):
    __slots__ = ("turn_id", "reply")
    TURN_ID_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    turn_id: str
    reply: AdmitReply
    def __init__(self, turn_id: _Optional[str] = ..., reply: _Optional[_Union[AdmitReply, _Mapping]] = ...) -> None: ...

class Reservation(_message.Message):
    __slots__ = ("id", "replica", "url", "models")
    ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    id: str
    replica: str
    url: str
    models: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, id: _Optional[str] = ..., replica: _Optional[str] = ..., url: _Optional[str] = ..., models: _Optional[_Iterable[str]] = ...) -> None: ...

class SchedulerBatch(_message.Message):
    __slots__ = ("placements", "nothing_held", "reservations", "revoked", "ended_runs")
    PLACEMENTS_FIELD_NUMBER: _ClassVar[int]
    NOTHING_HELD_FIELD_NUMBER: _ClassVar[int]
    RESERVATIONS_FIELD_NUMBER: _ClassVar[int]
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    ENDED_RUNS_FIELD_NUMBER: _ClassVar[int]
    placements: _containers.RepeatedCompositeFieldContainer[Placement]
    nothing_held: bool
    reservations: _containers.RepeatedCompositeFieldContainer[Reservation]
    revoked: _containers.RepeatedScalarFieldContainer[str]
    ended_runs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, placements: _Optional[_Iterable[_Union[Placement, _Mapping]]] = ..., nothing_held: _Optional[bool] = ..., reservations: _Optional[_Iterable[_Union[Reservation, _Mapping]]] = ..., revoked: _Optional[_Iterable[str]] = ..., ended_runs: _Optional[_Iterable[str]] = ...) -> None: ...

class RunState(_message.Message):
    __slots__ = ("run_id", "replica", "phase", "service_class", "caller", "idle_s", "tool_call_ids", "prompt_tokens", "completion_tokens", "max_tokens", "tool_names")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    SERVICE_CLASS_FIELD_NUMBER: _ClassVar[int]
    CALLER_FIELD_NUMBER: _ClassVar[int]
    IDLE_S_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOOL_NAMES_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    replica: str
    phase: RunPhase
    service_class: ServiceClass
    caller: str
    idle_s: float
    tool_call_ids: _containers.RepeatedScalarFieldContainer[str]
    prompt_tokens: int
    completion_tokens: int
    max_tokens: int
    tool_names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, run_id: _Optional[str] = ..., replica: _Optional[str] = ..., phase: _Optional[_Union[RunPhase, str]] = ..., service_class: _Optional[_Union[ServiceClass, str]] = ..., caller: _Optional[str] = ..., idle_s: _Optional[float] = ..., tool_call_ids: _Optional[_Iterable[str]] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., max_tokens: _Optional[int] = ..., tool_names: _Optional[_Iterable[str]] = ...) -> None: ...

class InFlightTurn(_message.Message):
    __slots__ = ("turn_id", "run_id", "replica", "service_class", "caller", "model", "kind")
    TURN_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_FIELD_NUMBER: _ClassVar[int]
    SERVICE_CLASS_FIELD_NUMBER: _ClassVar[int]
    CALLER_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    turn_id: str
    run_id: str
    replica: str
    service_class: ServiceClass
    caller: str
    model: str
    kind: ReplicaKind
    def __init__(self, turn_id: _Optional[str] = ..., run_id: _Optional[str] = ..., replica: _Optional[str] = ..., service_class: _Optional[_Union[ServiceClass, str]] = ..., caller: _Optional[str] = ..., model: _Optional[str] = ..., kind: _Optional[_Union[ReplicaKind, str]] = ...) -> None: ...

class ResyncRequest(_message.Message):
    __slots__ = ("runs", "turns", "ended_runs")
    RUNS_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    ENDED_RUNS_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[RunState]
    turns: _containers.RepeatedCompositeFieldContainer[InFlightTurn]
    ended_runs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, runs: _Optional[_Iterable[_Union[RunState, _Mapping]]] = ..., turns: _Optional[_Iterable[_Union[InFlightTurn, _Mapping]]] = ..., ended_runs: _Optional[_Iterable[str]] = ...) -> None: ...

class ResyncReply(_message.Message):
    __slots__ = ("runs", "turns")
    RUNS_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    runs: int
    turns: int
    def __init__(self, runs: _Optional[int] = ..., turns: _Optional[int] = ...) -> None: ...
