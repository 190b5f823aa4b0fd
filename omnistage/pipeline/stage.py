"""StageRuntime: the I/O shell around a stage's scheduler.

Inbound (from the host, any thread): fan-in collection and ``merge_fn``; stream chunks
and stream-done (counted over the stage's stream sources, forwarded once); the client's
input into a running request (at the stage that declares ``accepts_client_input``: its
chunks checked against those classes, its stream-done forwarded as it is, with
``source`` :data:`~omnistage.core.messages.CLIENT_SOURCE`); aborts
(idempotent, forwarded to the scheduler on every race path); tombstones that drop late
messages. Outbound (the scheduler's :class:`~omnistage.scheduling.base.StageOutbox`, any
thread): stream-done to the active stream targets before the payload goes on, routing
via ``route_fn``, completions and stream output of terminal stages to the coordinator,
failures to the coordinator as typed errors; timeline marks (a request's first stream
item and its result at this stage, and the scheduler's own, :meth:`StageRuntime.mark`) to
the coordinator (:mod:`omnistage.pipeline.timeline`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from omnistage.config.hooks import factory_args, import_callable
from omnistage.config.pipeline import PipelineConfig, StageConfig
from omnistage.core.errors import OmnistageError, StageFailureError
from omnistage.core.messages import (
    CLIENT_SOURCE,
    Abort,
    CoordinatorEvent,
    StageDead,
    StageFailed,
    StageInput,
    StageMark,
    StagePayload,
    StageResult,
    StreamBatch,
    StreamChunk,
    StreamDone,
)
from omnistage.core.request import FinishReason, PipelineRequest, most_severe
from omnistage.core.tombstones import Tombstones
from omnistage.pipeline.edges import check_message
from omnistage.pipeline.relay import RelayError
from omnistage.pipeline.timeline import FIRST_OUTPUT, RESULT
from omnistage.pipeline.topology import Topology
from omnistage.scheduling.base import Scheduler


class StageLinks(Protocol):
    """What a stage runtime needs from its host process."""

    def send(self, target: str, message: StageInput, source: str) -> None: ...

    def to_coordinator(self, events: Sequence[CoordinatorEvent]) -> None:
        """Hand ``events`` (in order) to the coordinator as one delivery."""


@dataclass(frozen=True)
class StageBuildContext:
    """What a stage factory is given: ``factory(ctx, **factory.args) -> Scheduler``."""

    pipeline: PipelineConfig
    stage: StageConfig


def build_scheduler(pipeline: PipelineConfig, stage: StageConfig) -> Scheduler:
    """Call the stage's factory.

    Raises:
        PipelineConfigError: the factory path does not resolve, or its args do not fit
            its signature (:func:`~omnistage.config.hooks.factory_args`).
        TypeError: the factory did not return a :class:`Scheduler`.
    """
    factory = import_callable(stage.factory.path, stage=stage.name, what="factory")
    scheduler = factory(StageBuildContext(pipeline, stage), **factory_args(stage))
    if not isinstance(scheduler, Scheduler):
        raise TypeError(f"stage {stage.name!r}: factory returned {type(scheduler).__name__}, not a Scheduler")
    return scheduler


@dataclass
class _Active:
    """A request known at this stage: from its payload, or from a first stream chunk."""

    request: PipelineRequest
    stream_targets: list[str]
    payload: StagePayload | None = None
    announced: set[str] = field(default_factory=set)  # stream targets that got `request`
    streamed: bool = False  # its first stream item went out (timeline mark sent)


def describe_failure(stage: str, error: BaseException) -> OmnistageError:
    """A typed error for ``error`` raised in ``stage`` (typed errors pass through)."""
    if isinstance(error, OmnistageError):
        return error
    return StageFailureError(stage, f"{type(error).__name__}: {error}")


Outgoing = list[tuple[str, StageInput]]


class StageRuntime:
    """One stage in one process: a scheduler plus its inbound and outbound plumbing.

    Messages are prepared under the stage's lock and sent after it is released, so two
    stages never hold each other's locks and serialization for other processes happens
    outside it.
    """

    def __init__(self, topology: Topology, name: str, scheduler: Scheduler, links: StageLinks) -> None:
        self.topology, self.name, self.scheduler, self.links = topology, name, scheduler, links
        self.config = topology.stages[name]
        self.types = topology.types[name]
        self.stream_sources = frozenset(topology.stream_sources.get(name, ()))
        self._lock = threading.Lock()
        self._fan_in: dict[str, dict[str, StagePayload]] = {}
        self._dones: dict[str, set[str]] = {}
        self._active: dict[str, _Active] = {}
        self._ended = Tombstones()
        scheduler.bind(name, self, expects_stream=bool(self.stream_sources or self.types.client_input))

    # ------------------------------------------------------------------- inbound
    def deliver(self, message: StageInput, source: str) -> None:
        """Thread-safe entry for every message addressed to this stage (a
        :class:`StreamBatch` is taken chunk by chunk, in order, under one lock).

        The scheduler gets the message under the stage's lock, so an abort can never
        overtake the payload it aborts on the way into the scheduler's inbox.
        """
        messages = message.chunks if isinstance(message, StreamBatch) else (message,)
        failed: list[StageFailed] = []
        with self._lock:
            for item in messages:
                failure = self._deliver_locked(item, source)
                if failure is not None:
                    failed.append(failure)
        for failure in failed:
            self._emit(failure.request_id, [], [failure])

    def _deliver_locked(self, message: StageInput, source: str) -> StageFailed | None:
        request_id = message.request_id
        if isinstance(message, Abort):
            self._release(request_id)
            self.scheduler.put(message)
            return None
        if request_id in self._ended:
            return None
        try:
            if isinstance(message, StagePayload):
                forward = self._on_payload(message, source)
            else:
                forward = self._on_stream(message, source)
        except StageFailureError as exc:  # a dynamic hook failed or broke its contract
            return self._fail_locked(request_id, exc)
        if forward is not None:
            self.scheduler.put(forward)
        return None

    def _on_payload(self, payload: StagePayload, source: str) -> StagePayload | None:
        request_id = payload.request_id
        if self.config.wait_for:
            waits = self.topology.waits(self.name, payload)
            if source not in waits:
                raise StageFailureError(self.name, f"got a payload from {source!r}, but waits for {sorted(waits)}")
            arrived = self._fan_in.setdefault(request_id, {})
            arrived[source] = payload
            if set(arrived) != waits:
                return None
            del self._fan_in[request_id]
            merged = self.topology.merge(self.name, arrived)
            check_message(self.name, "merged payload", merged, self.types.payload)
            finish = most_severe(p.finish_reason for p in arrived.values())
            payload = StagePayload(request_id, payload.request, merged, finish)
        active = self._known(request_id, payload.request)
        active.payload = payload
        return payload

    def _on_stream(self, message: StreamChunk | StreamDone, source: str) -> StageInput | None:
        request_id = message.request_id
        active = self._active.get(request_id)
        if active is None or active.payload is None:
            if not self.config.can_accept_stream_before_payload:
                raise StageFailureError(
                    self.name,
                    f"{type(message).__name__} from {source!r} arrived before the payload, and "
                    "the stage does not declare can_accept_stream_before_payload",
                )
            if active is None and isinstance(message, StreamChunk) and message.request is not None:
                self._known(request_id, message.request)
        if source == CLIENT_SOURCE:
            return self._client_input(message)
        if isinstance(message, StreamChunk):
            return message
        done = self._dones.setdefault(request_id, set())
        done.add(source)
        if done != self.stream_sources:
            return None
        del self._dones[request_id]
        return StreamDone(request_id, self.name)

    def _client_input(self, message: StreamChunk | StreamDone) -> StreamChunk | StreamDone:
        """The client's input, checked: only a stage that takes it, only its classes."""
        if not self.types.client_input:
            raise StageFailureError(self.name, "got client input, but declares no accepts_client_input")
        if isinstance(message, StreamChunk):
            check_message(self.name, "client input", message.data, self.types.client_input)
        return message

    def _known(self, request_id: str, request: PipelineRequest) -> _Active:
        active = self._active.get(request_id)
        if active is None:
            targets = self.topology.stream_targets(self.name, StagePayload(request_id, request, None))
            active = self._active[request_id] = _Active(request, targets)
        return active

    def _release(self, request_id: str) -> _Active | None:
        self._ended.add(request_id)
        self._fan_in.pop(request_id, None)
        self._dones.pop(request_id, None)
        return self._active.pop(request_id, None)

    # ----------------------------------------------------- outbound (StageOutbox)
    def result(self, request_id: str, data: object, finish_reason: FinishReason = "stop") -> None:
        outgoing: Outgoing = []
        events: list[CoordinatorEvent] = []
        with self._lock:
            if request_id in self._ended:
                return
            active = self._release(request_id)
            if active is None or active.payload is None:
                error = StageFailureError(self.name, "produced a result for a request without payload")
                events.append(StageFailed(request_id, self.name, error))
            else:
                events.append(StageMark(request_id, self.name, RESULT, time.monotonic()))
                finish_reason = most_severe((finish_reason, active.payload.finish_reason))
                try:
                    check_message(self.name, "result", data, self.types.result)
                    outgoing = [(t, StreamDone(request_id, self.name)) for t in active.stream_targets]
                    payload = StagePayload(request_id, active.request, data, finish_reason)
                    if self.config.terminal:
                        events.append(StageResult(request_id, self.name, data, finish_reason))
                    else:
                        outgoing += [(t, payload) for t in self.topology.routes(self.name, payload)]
                except StageFailureError as exc:  # a mistyped result, or route_fn broke its contract
                    outgoing = []  # the stage's mark stays; no StageResult was added before the failure
                    events.append(StageFailed(request_id, self.name, exc))
        self._emit(request_id, outgoing, events)

    def stream(self, request_id: str, data: object) -> None:
        outgoing: Outgoing = []
        events: list[CoordinatorEvent] = []
        with self._lock:
            self._stream_locked(request_id, data, outgoing, events)
        self._emit(request_id, outgoing, events)

    def stream_many(self, items: Sequence[tuple[str, object]]) -> None:
        """:meth:`stream` of many requests' chunks under one lock, as ONE
        :class:`StreamBatch` per stream target."""
        outgoing: Outgoing = []
        events: list[CoordinatorEvent] = []
        with self._lock:
            for request_id, data in items:
                self._stream_locked(request_id, data, outgoing, events)
        by_target: dict[str, list[StreamChunk]] = {}
        for target, chunk in outgoing:
            assert isinstance(chunk, StreamChunk)
            by_target.setdefault(target, []).append(chunk)
        batches: Outgoing = [(t, StreamBatch(self.name, tuple(chunks))) for t, chunks in by_target.items()]
        try:
            for target, message in batches:
                self.links.send(target, message, self.name)
            if events:  # a terminal stage's chunks of the whole step: one delivery
                self.links.to_coordinator(events)
        except RelayError as exc:  # every request of the batch fails (none is half-sent)
            failed = []
            for request_id in dict.fromkeys(request_id for request_id, _ in items):
                self._release_now(request_id)
                failed.append(StageFailed(request_id, self.name, exc))
            self.links.to_coordinator(failed)

    def _stream_locked(
        self, request_id: str, data: object, outgoing: Outgoing, events: list[CoordinatorEvent]
    ) -> None:
        active = self._active.get(request_id)
        if active is None:
            return  # ended (or failed) meanwhile
        try:
            check_message(self.name, "stream item", data, self.types.streams)
        except StageFailureError as exc:
            events.append(self._fail_locked(request_id, exc))
            return
        if not active.streamed:
            active.streamed = True
            events.append(StageMark(request_id, self.name, FIRST_OUTPUT, time.monotonic()))
        if self.config.terminal:
            events.append(StreamChunk(request_id, self.name, data))
        for target in active.stream_targets:
            first = target not in active.announced
            active.announced.add(target)
            request = active.request if first else None
            outgoing.append((target, StreamChunk(request_id, self.name, data, request)))

    def mark(self, request_id: str, name: str) -> None:
        """A point of the request's timeline at this stage (``<stage>.<name>``), now."""
        at = time.monotonic()
        with self._lock:
            if request_id not in self._active:
                return
        self._emit(request_id, [], [StageMark(request_id, self.name, name, at)])

    def fail(self, request_id: str, error: BaseException) -> None:
        with self._lock:
            if request_id in self._ended:
                return
            event = self._fail_locked(request_id, describe_failure(self.name, error))
        self._emit(request_id, [], [event])

    def dead(self, error: BaseException) -> None:
        self.links.to_coordinator([StageDead(self.name, f"{type(error).__name__}: {error}")])

    def _fail_locked(self, request_id: str, error: OmnistageError) -> StageFailed:
        self._release(request_id)
        return StageFailed(request_id, self.name, error)

    def _emit(self, request_id: str, outgoing: Outgoing, events: list[CoordinatorEvent]) -> None:
        """Send, outside the lock; a message that cannot be serialized for another process
        fails its request (the request is already forgotten here, so nothing else would)."""
        try:
            for target, message in outgoing:
                self.links.send(target, message, self.name)
            if events:
                self.links.to_coordinator(events)
        except RelayError as exc:
            self._release_now(request_id)
            self.links.to_coordinator([StageFailed(request_id, self.name, exc)])

    def _release_now(self, request_id: str) -> None:
        with self._lock:
            self._release(request_id)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()

    def live_state(self) -> dict[str, list[str]]:
        """Per-request state still held, by structure (empty dict when clean)."""
        with self._lock:
            state = {
                "fan_in": sorted(self._fan_in),
                "stream_done": sorted(self._dones),
                "active": sorted(self._active),
            }
        state["scheduler"] = sorted(self.scheduler.live_requests())
        return {key: ids for key, ids in state.items() if ids}
