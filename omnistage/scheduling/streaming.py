"""StreamingScheduler: the base of stages that consume a stream (e.g. a vocoder).

Per request it keeps a :class:`StreamState` that may be created by the first chunk, the
stream-done or the payload, in any order (chunks and done may arrive before the payload).
Each tick takes every message already in the inbox, ingests them, and runs :meth:`step`
once on all touched requests, inside the batch boundary, so a subclass can process
several requests' due work as one batch. The stream items a tick emits leave as one
message per stream target (:meth:`StageOutbox.stream_many`), not one per request: sent at
the end of the tick, or before a result that follows them. A request finishes (:meth:`complete`) once it has
its payload and, when the stage has stream sources, its stream-done. Finished and aborted
requests leave a tombstone: late chunks never recreate state.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from omnistage.core.messages import Abort, StageInput, StagePayload, StreamChunk, StreamDone
from omnistage.core.request import FinishReason
from omnistage.core.tombstones import Tombstones
from omnistage.scheduling.base import Scheduler

StateT = TypeVar("StateT")
"""A streaming scheduler's own per-request state (``StreamState.model_state``)."""


@dataclass
class StreamState(Generic[StateT]):
    """A request's state at a streaming stage.

    Attributes:
        request_id: the request.
        payload: the stage payload once it arrived, else None.
        chunks: chunks ingested but not yet consumed by :meth:`StreamingScheduler.step`.
        done: all stream sources finished.
        model_state: the subclass's own per-request state (None until it sets one).
    """

    request_id: str
    payload: StagePayload | None = None
    chunks: list[StreamChunk] = field(default_factory=list)
    done: bool = False
    model_state: StateT | None = None


class StreamingScheduler(Scheduler, Generic[StateT]):
    """Subclasses implement :meth:`step` and call :meth:`emit` / :meth:`complete`;
    ``StreamingScheduler[S]`` keeps an ``S`` per request in ``StreamState.model_state``."""

    max_messages_per_tick = 256

    def __init__(self, release_callback: Callable[[str], None] | None = None) -> None:
        super().__init__(release_callback)
        self.states: dict[str, StreamState[StateT]] = {}
        self._ended = Tombstones()
        self._emitted: list[tuple[str, object]] = []  # this tick's stream items, not sent yet

    def live_requests(self) -> set[str]:
        return set(self.states)

    @abstractmethod
    def step(self, states: list[StreamState[StateT]]) -> None:
        """Process the due work of ``states`` (new chunks in ``state.chunks``; finishing
        requests have :meth:`ready_to_finish`); runs inside the batch boundary."""

    def ready_to_finish(self, state: StreamState[StateT]) -> bool:
        return state.payload is not None and (state.done or not self.expects_stream)

    def emit(self, state: StreamState[StateT], data: object) -> None:
        """A stream item of ``state``'s request, sent with the tick's others."""
        self._emitted.append((state.request_id, data))

    def complete(self, state: StreamState[StateT], data: object, finish_reason: FinishReason = "stop") -> None:
        """Finish ``state``'s request with ``data`` (after the items emitted before it);
        its state is dropped."""
        self._flush()
        self._release_state(state.request_id)
        self.outbox.result(state.request_id, data, finish_reason)

    def _flush(self) -> None:
        if self._emitted:
            items, self._emitted = self._emitted, []
            self.outbox.stream_many(items)

    def _release_state(self, request_id: str) -> None:
        self.states.pop(request_id, None)
        self._ended.add(request_id)

    def _run(self) -> None:
        while True:
            messages = self.take(block=not self.carried_over(), limit=self.max_messages_per_tick)
            touched: dict[str, StreamState[StateT]] = dict(self.carried_over())
            for message in messages:
                if message is None:
                    return
                state = self._ingest(message)
                if state is not None:
                    touched[state.request_id] = state
            live = [s for s in touched.values() if s.request_id in self.states]
            if live:
                self._tick(live)

    def carried_over(self) -> dict[str, StreamState[StateT]]:
        """States with due work left from the last tick (e.g. waiting for a free decoder
        slot that is free now): they join the next tick, and the loop does not block on
        the inbox while there are any. None by default."""
        return {}

    def _tick(self, states: list[StreamState[StateT]]) -> None:
        ids = [s.request_id for s in states]
        ok = self.run_batch(ids, lambda: self.step(states))
        # a failed batch's requests have ended: what they emitted is dropped by the runtime
        self._flush()
        if not ok:
            for request_id in ids:
                self._release_state(request_id)

    def _ingest(self, message: StageInput) -> StreamState[StateT] | None:
        request_id = message.request_id
        if isinstance(message, Abort):
            self._release_state(request_id)
            self.release(request_id)
            return None
        if request_id in self._ended:
            return None
        state = self.states.get(request_id)
        if state is None:
            state = self.states[request_id] = StreamState(request_id)
        if isinstance(message, StagePayload):
            state.payload = message
        elif isinstance(message, StreamChunk):
            state.chunks.append(message)
        elif isinstance(message, StreamDone):
            state.done = True
        return state
