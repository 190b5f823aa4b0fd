"""Messages that travel between stages and back to the coordinator.

Between stages: a :class:`StagePayload` (the request's input to a stage), a
:class:`StreamChunk` (an item on a streaming edge) or a :class:`StreamBatch` of them (one
producer step's chunks for many requests), :class:`StreamDone` (the end of one producer's
stream), and :class:`Abort`. Back to the coordinator: :class:`StageResult`
(a terminal stage's completion), a :class:`StreamChunk` from a terminal stage (output for
the client), :class:`StageFailed` and :class:`StageMark` (a point of a request's timeline).

Stream chunks and stream-done may arrive at a stage BEFORE its payload (they travel on a
different edge); see ``StageConfig.can_accept_stream_before_payload``.

Client input: a request submitted with its input still open gets the rest from its
client while it runs, as stream chunks and a stream-done whose ``source`` is
:data:`CLIENT_SOURCE`, sent by the coordinator to the one stage that declares
``StageConfig.accepts_client_input``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from omnistage.core.request import FinishReason, PipelineRequest

DataT = TypeVar("DataT", covariant=True)
"""A stage payload's data class (the stage's ``payload_type``; None for the entry stage)."""

ItemT = TypeVar("ItemT", covariant=True)
"""A stream chunk's item class (one of its source's ``stream_types``)."""

CLIENT_SOURCE = "client"
"""The ``source`` of the stream chunks and stream-done a client sends into its running
request (no stage may have this name)."""


@dataclass(frozen=True, slots=True)
class StagePayload(Generic[DataT]):
    """A request's input to one stage; a stage annotates what it takes as
    ``StagePayload[ItsPayloadType]`` (the class its ``payload_type`` declares, checked when
    the topology is built and on every message at run time, :mod:`omnistage.pipeline.edges`).

    Attributes:
        request_id: the request's id.
        request: the typed request as submitted; the same object for every stage, which
            is what dynamic hooks decide from.
        data: this stage's input (a model's typed payload; for fan-in, ``merge_fn``'s
            result); the entry stage gets None (it reads ``request``).
        finish_reason: how the stages before this one ended the request (the most severe
            of them for fan-in, e.g. the engine's ``"length"``); a terminal stage's result
            carries the more severe of this and its own, so it reaches the client without
            any model payload carrying it.
    """

    request_id: str
    request: PipelineRequest
    data: DataT
    finish_reason: FinishReason = "stop"


@dataclass(frozen=True, slots=True)
class StreamChunk(Generic[ItemT]):
    """One item on a streaming edge (or, from a terminal stage, output for the client);
    ``StreamChunk[Item]`` names the item's class.

    Attributes:
        request_id: the request's id.
        source: the producing stage.
        data: the item, one typed message per purpose (e.g.
            :class:`omnistage.engine.sequence.CodeFrames`,
            :class:`omnistage.core.payloads.AudioChunk`): consumers dispatch on its type,
            and the stage's ``stream_types`` declare which it may be. Tensors stay on the
            device they were made on.
        request: the typed request, on the first chunk a producer sends to each target
            (so a consumer that starts before its payload can evaluate its own hooks);
            None on later chunks.
    """

    request_id: str
    source: str
    data: ItemT
    request: PipelineRequest | None = None

    def __reduce__(self) -> tuple:
        # by constructor arguments: a step's batch holds one chunk per stream, and the
        # default of a slots dataclass (a setstate walking its fields) was most of the
        # unpickle time
        return StreamChunk, (self.request_id, self.source, self.data, self.request)


@dataclass(frozen=True, slots=True)
class StreamBatch:
    """The stream chunks one producer step sends to one target, as ONE message (an AR
    engine's frames of every running request): the target's runtime takes them in order,
    as if they had come one by one, and the per-step cost of a stream edge (a lock, a
    message; across processes a serialization and a send) does not grow per request.

    Attributes:
        source: the producing stage.
        chunks: the chunks (each with its own request id), in the order they were made.
    """

    source: str
    chunks: tuple[StreamChunk, ...]
    request_id: str = ""  # a batch belongs to no single request


@dataclass(frozen=True, slots=True)
class StreamDone:
    """The producer ``source`` will send no more chunks for ``request_id``."""

    request_id: str
    source: str


@dataclass(frozen=True, slots=True)
class Abort:
    """Drop every trace of ``request_id``; idempotent."""

    request_id: str


@dataclass(frozen=True, slots=True)
class StageResult:
    """A terminal stage's completion of a request, sent to the coordinator; ``data`` is of
    the stage's declared ``result_type`` (checked at run time; e.g.
    :class:`omnistage.core.payloads.AudioResult`), which the server narrows by class."""

    request_id: str
    stage: str
    data: object
    finish_reason: FinishReason = "stop"


@dataclass(frozen=True, slots=True)
class StageFailed:
    """A stage failed a request; ``error`` is a typed :class:`omnistage.core.errors.OmnistageError`."""

    request_id: str
    stage: str
    error: Exception


@dataclass(frozen=True, slots=True)
class StageDead:
    """A stage's compute loop died (``reason``); the pipeline is unhealthy."""

    stage: str
    reason: str
    request_id: str = ""  # no request: the whole pipeline is affected


@dataclass(frozen=True, slots=True)
class StageMark:
    """A point of a request's timeline, reached at ``stage``: ``mark`` (e.g.
    ``"first_output"``, ``"prefill"``) at ``at``, ``time.monotonic()`` seconds (one clock for
    every process of the host: Linux ``CLOCK_MONOTONIC``)."""

    request_id: str
    stage: str
    mark: str
    at: float


StageInput = StagePayload | StreamChunk | StreamBatch | StreamDone | Abort
CoordinatorEvent = StageResult | StreamChunk | StageFailed | StageDead | StageMark
