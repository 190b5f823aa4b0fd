"""The coordinator: request lifecycle in the server process, on its asyncio loop.

It admits requests (bounded: over the bound raises :class:`QueueFullError`), decides each
request's terminal set, hands the request to the entry stage, passes a client's further
input into its running request to the stage that takes it (:meth:`Coordinator.send_input`,
:meth:`Coordinator.end_input`), collects terminal stream
output into a per-request queue (with a per-request and a global byte cap), merges the results of several
terminal stages, enforces deadlines, and ends every request exactly once: success, error
or abort. Any stage failure fails the request and aborts it at every stage (fail fast).

Thread model: every public method runs on the loop; stage threads hand events over with
:meth:`Coordinator.post`, which is thread-safe.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from omnistage.core.errors import (
    OmnistageError,
    PipelineUnhealthyError,
    QueueFullError,
    RequestAbortedError,
    RequestTimeoutError,
    RequestValidationError,
    StageFailureError,
    StreamBufferFullError,
)
from omnistage.core.messages import (
    CLIENT_SOURCE,
    CoordinatorEvent,
    StageDead,
    StageFailed,
    StageMark,
    StagePayload,
    StageResult,
    StreamChunk,
    StreamDone,
)
from omnistage.core.payloads import AudioChunk
from omnistage.core.request import FinishReason, PipelineRequest, most_severe, new_request_id
from omnistage.core.tombstones import Tombstones
from omnistage.pipeline.relay import RelayError
from omnistage.pipeline.timeline import ADMITTED, RECEIVED, Timeline
from omnistage.pipeline.topology import Topology

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PipelineResult:
    """A finished request: each terminal stage's result, the request's finish_reason
    (the most severe of the terminals': error > abort > length > stop), and the stream
    chunks the client had not consumed through :meth:`RequestHandle.stream`."""

    request_id: str
    outputs: dict[str, object]
    finish_reason: FinishReason
    chunks: list[StreamChunk] = field(default_factory=list)


def chunk_nbytes(data: object) -> int:
    """Bytes a stream chunk holds (tensor, array, bytes, or an :class:`AudioChunk`'s
    samples; other objects count 0)."""
    if isinstance(data, AudioChunk):
        data = data.samples
    if isinstance(data, torch.Tensor):
        return data.nbytes
    if isinstance(data, np.ndarray | bytes | bytearray):
        return data.nbytes if isinstance(data, np.ndarray) else len(data)
    return 0


@dataclass(eq=False)
class RequestHandle:
    """The client's view of one request: its stream chunks, then its result or error.

    Queued chunks (``queued_bytes`` of them) count against the coordinator's per-request
    and global stream byte caps until the client takes them (:meth:`stream`,
    :meth:`result`) or drops them (:meth:`close`; also done when the request is aborted),
    or until the request fails: then they stop counting but stay queued, so :meth:`stream`
    yields every chunk that arrived before the failure and then raises, however late the
    client reads. A handle made with ``collect=True`` (a client that wants the whole output
    at the end) is not subject to the caps. ``timeline`` collects the request's marks
    (:mod:`omnistage.pipeline.timeline`) as the stages report them.
    """

    request_id: str
    terminals: frozenset[str]
    _release_bytes: Callable[[RequestHandle, int], None]
    collect: bool = False
    timeline: Timeline = field(default_factory=Timeline)
    _queue: asyncio.Queue[tuple[StreamChunk, int] | None] = field(default_factory=asyncio.Queue)
    _done: asyncio.Event = field(default_factory=asyncio.Event)
    _outputs: dict[str, object] = field(default_factory=dict)
    _finish_reason: FinishReason = "stop"
    _error: OmnistageError | None = None
    _timer: asyncio.TimerHandle | None = None
    queued_bytes: int = 0

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    @property
    def error(self) -> OmnistageError | None:
        """Why the request failed, once it has (None while running or after success)."""
        return self._error

    async def wait_finished(self) -> None:
        """Return once the request has ended (success, error or abort)."""
        await self._done.wait()

    async def stream(self) -> AsyncIterator[StreamChunk]:
        """Terminal stages' stream chunks in arrival order, until the request ends.

        Raises:
            OmnistageError: the request failed (typed, see :mod:`omnistage.core.errors`).
        """
        async for chunks in self.stream_ready():
            for chunk in chunks:
                yield chunk

    async def stream_ready(self) -> AsyncIterator[list[StreamChunk]]:
        """:meth:`stream` in lists: each holds every chunk that had arrived when the client
        came for more (at least one), in arrival order, so a client that fell behind (a
        busy event loop) catches up with one write instead of one per chunk.

        Raises:
            OmnistageError: the request failed (typed, see :mod:`omnistage.core.errors`).
        """
        while not (self._done.is_set() and self._queue.empty()):
            item = await self._queue.get()
            chunks = []
            while item is not None:
                chunk, size = item
                self._release(size)
                chunks.append(chunk)
                item = None if self._queue.empty() else self._queue.get_nowait()
            if chunks:
                yield chunks
        if self._error is not None:
            raise self._error

    async def result(self) -> PipelineResult:
        """Wait for the end of the request; stream chunks not consumed yet come with it.

        Raises:
            OmnistageError: the request failed, timed out or was aborted.
        """
        await self._done.wait()
        chunks = self._drain()
        if self._error is not None:
            raise self._error
        return PipelineResult(self.request_id, dict(self._outputs), self._finish_reason, chunks)

    def close(self) -> None:
        """Drop the chunks still queued (a client that stops reading); idempotent."""
        self._drain()

    def _uncount(self) -> None:
        """Keep the queued chunks readable but release their bytes from the global cap."""
        for chunk in self._drain():
            self._queue.put_nowait((chunk, 0))

    def _drain(self) -> list[StreamChunk]:
        chunks = []
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if item is not None:
                self._release(item[1])
                chunks.append(item[0])
        return chunks

    def _release(self, size: int) -> None:
        self.queued_bytes -= size
        self._release_bytes(self, size)


class Coordinator:
    """Admission, terminal sets, stream queues, deadlines and the single end of a request.

    Args:
        topology: the validated pipeline graph.
        dispatch: hands a payload to the entry stage (thread-safe, non-blocking).
        broadcast_abort: tells every stage (every process) to drop a request.
        deliver_input: hands a client's input (a chunk or stream-done from
            :data:`CLIENT_SOURCE`) to the topology's ``client_input_stage``.
        max_concurrent_requests: admission bound.
        stream_queue_max_bytes: global cap on queued stream bytes.
        stream_request_max_bytes: cap on one request's queued stream bytes (at most the
            global cap); a chunk always fits a request with nothing queued.
        request_timeout_s: default deadline per request (None: no deadline).
    """

    def __init__(
        self,
        topology: Topology,
        dispatch: Callable[[StagePayload], None],
        broadcast_abort: Callable[[str], None],
        deliver_input: Callable[[StreamChunk | StreamDone], None],
        *,
        max_concurrent_requests: int,
        stream_queue_max_bytes: int,
        stream_request_max_bytes: int,
        request_timeout_s: float | None,
    ) -> None:
        self.topology = topology
        self._dispatch = dispatch
        self._broadcast_abort = broadcast_abort
        self._deliver_input = deliver_input
        self.max_concurrent_requests = max_concurrent_requests
        self.stream_queue_max_bytes = stream_queue_max_bytes
        self.stream_request_max_bytes = min(stream_request_max_bytes, stream_queue_max_bytes)
        self.request_timeout_s = request_timeout_s
        self.loop = asyncio.get_running_loop()
        self.requests: dict[str, RequestHandle] = {}
        self.queued_bytes = 0
        self._holders: set[RequestHandle] = set()  # handles with unread stream bytes
        self.unhealthy_reason: str | None = None
        self.retry_after_s: float | None = None  # set while a stage process restarts
        self._ended = Tombstones()

    @property
    def in_flight(self) -> int:
        return len(self.requests)

    def submit(
        self,
        request: PipelineRequest,
        request_id: str | None = None,
        timeout_s: float | None = None,
        *,
        collect: bool = False,
        received_at: float | None = None,
    ) -> RequestHandle:
        """Admit ``request`` and start it at the entry stage. ``collect``: the client takes
        the output at the end (:meth:`RequestHandle.result`), not as a stream.
        ``received_at``: ``time.monotonic()`` when the request was received (the origin of
        its timeline; None: now).

        Raises:
            PipelineUnhealthyError: a stage process died.
            QueueFullError: ``max_concurrent_requests`` are in flight.
            RequestValidationError: ``request_id`` is in flight or ended recently (stages
                still hold its tombstone).
            StageFailureError: ``terminal_stages_fn`` failed or broke its contract, or the
                request cannot be sent to the entry stage's process.
            TypeError: ``request`` is not a :class:`PipelineRequest` (a model bug: its
                ``build_request`` returned something else).
        """
        if not isinstance(request, PipelineRequest):
            raise TypeError(f"a pipeline request must be a PipelineRequest, got {type(request).__name__}")
        if self.unhealthy_reason is not None:
            raise PipelineUnhealthyError(self.unhealthy_reason, self.retry_after_s)
        if len(self.requests) >= self.max_concurrent_requests:
            raise QueueFullError(self.max_concurrent_requests)
        request_id = request_id or new_request_id()
        if request_id in self.requests or request_id in self._ended:
            raise RequestValidationError(f"request id {request_id!r} is in use", "request_id")
        terminals = self.topology.terminal_set(request)
        handle = RequestHandle(request_id, terminals, self._release_bytes, collect)
        now = time.monotonic()
        handle.timeline.add(RECEIVED, now if received_at is None else received_at)
        handle.timeline.add(ADMITTED, now)
        self.requests[request_id] = handle
        timeout_s = timeout_s if timeout_s is not None else self.request_timeout_s
        if timeout_s is not None:
            handle._timer = self.loop.call_later(timeout_s, self._expire, request_id, timeout_s)
        try:
            self._dispatch(StagePayload(request_id, request, None))
        except RelayError as exc:
            self._finish(request_id, error=exc, finish_reason="error")
            raise
        return handle

    def send_input(self, request_id: str, data: object) -> bool:
        """More input of a running request from its client (e.g. an
        :class:`~omnistage.core.payloads.InputText`), to the stage that takes client input.
        Input comes to that stage in the order it is sent, after the request's own.

        Returns:
            False if the request has ended (the input is dropped).

        Raises:
            RequestValidationError: no stage of this pipeline takes client input.
            StageFailureError: the input cannot be sent to that stage's process (the
                request fails).
        """
        return self._input(request_id, StreamChunk(request_id, CLIENT_SOURCE, data))

    def end_input(self, request_id: str) -> bool:
        """The client will send no more input for ``request_id`` (see :meth:`send_input`)."""
        return self._input(request_id, StreamDone(request_id, CLIENT_SOURCE))

    def _input(self, request_id: str, message: StreamChunk | StreamDone) -> bool:
        if self.topology.client_input_stage is None:
            raise RequestValidationError("this pipeline takes no input while a request runs", "input")
        if request_id not in self.requests:
            return False
        try:
            self._deliver_input(message)
        except RelayError as exc:
            self._finish(request_id, error=exc, finish_reason="error")
            raise
        return True

    def abort(self, request_id: str, reason: str = "aborted by the client") -> None:
        """End ``request_id`` as aborted and drop it at every stage; idempotent."""
        if request_id in self.requests:
            self._finish(request_id, error=RequestAbortedError(reason), finish_reason="abort")

    def post(self, events: Sequence[CoordinatorEvent]) -> None:
        """Thread-safe: deliver stage events (in order) to the loop, as ONE wake-up of
        the loop however many there are (a terminal stage's chunks of a whole step)."""
        self.loop.call_soon_threadsafe(self._on_events, tuple(events))

    def _on_events(self, events: tuple[CoordinatorEvent, ...]) -> None:
        for event in events:
            self.on_event(event)

    def on_event(self, event: CoordinatorEvent) -> None:
        if isinstance(event, StageDead):
            self.fail_all(f"stage {event.stage!r} stopped computing: {event.reason}")
            return
        handle = self.requests.get(event.request_id)
        if handle is None:
            return  # the request already ended: a late event
        if isinstance(event, StageMark):
            handle.timeline.add(f"{event.stage}.{event.mark}", event.at)
        elif isinstance(event, StreamChunk):
            self._enqueue(handle, event)
        elif isinstance(event, StageResult):
            if event.stage not in handle.terminals:
                error = StageFailureError(
                    event.stage,
                    f"finished the request but is not in its terminal set {sorted(handle.terminals)}: "
                    "the routes and terminal_stages_fn disagree on this request",
                )
                self._finish(event.request_id, error=error, finish_reason="error")
                return
            handle._outputs[event.stage] = event.data
            handle._finish_reason = most_severe((handle._finish_reason, event.finish_reason))
            if handle.terminals <= handle._outputs.keys():
                self._finish(event.request_id)
        elif isinstance(event, StageFailed):
            self._finish(event.request_id, error=event.error, finish_reason="error")

    def fail_all(self, reason: str, retry_after_s: float | None = None) -> None:
        """Mark the pipeline unhealthy and fail every in-flight request (a process died);
        ``retry_after_s``: when it may serve again (a restart is under way)."""
        self.unhealthy_reason, self.retry_after_s = reason, retry_after_s
        for request_id in list(self.requests):
            error = PipelineUnhealthyError(reason, retry_after_s)
            self._finish(request_id, error=error, finish_reason="error")

    def recovered(self) -> None:
        """The pipeline serves again (a dead stage process was restarted)."""
        self.unhealthy_reason, self.retry_after_s = None, None

    def _enqueue(self, handle: RequestHandle, chunk: StreamChunk) -> None:
        """Queue a chunk for its client. A client past its own cap is aborted; when the
        global cap is reached, the requests holding the most unread bytes are aborted
        (possibly this one) until the chunk fits, so a client that reads is never the one
        that pays for clients that do not."""
        size = 0 if handle.collect else chunk_nbytes(chunk.data)
        if size and handle.queued_bytes and handle.queued_bytes + size > self.stream_request_max_bytes:
            error = StreamBufferFullError(
                f"the client stopped reading its stream: {handle.queued_bytes} bytes unread, "
                f"the per-request cap is {self.stream_request_max_bytes} bytes"
            )
            self._finish(handle.request_id, error=error, finish_reason="abort")
            return
        while size and self._holders and self.queued_bytes + size > self.stream_queue_max_bytes:
            slowest = max(self._holders, key=lambda h: h.queued_bytes)
            error = StreamBufferFullError(
                f"the client stopped reading its stream: {slowest.queued_bytes} bytes unread, "
                f"the most of any request when the global cap of {self.stream_queue_max_bytes} "
                "bytes was reached"
            )
            self._drop_unread(slowest, error)
            if slowest is handle:
                return
        handle.queued_bytes += size
        self.queued_bytes += size
        if size:
            self._holders.add(handle)
        handle._queue.put_nowait((chunk, size))

    def _drop_unread(self, handle: RequestHandle, error: StreamBufferFullError) -> None:
        """Abort ``handle`` for not reading: in flight, it ends here; already ended (its
        client still has chunks to take), its chunks are dropped and it fails instead, so
        the client never sees a shortened stream end as if complete."""
        if handle.request_id in self.requests:
            self._finish(handle.request_id, error=error, finish_reason="abort")
        else:
            handle._error, handle._finish_reason = error, "abort"
            handle.close()

    def _release_bytes(self, handle: RequestHandle, size: int) -> None:
        self.queued_bytes -= size
        if not handle.queued_bytes:
            self._holders.discard(handle)

    def _expire(self, request_id: str, timeout_s: float) -> None:
        if request_id in self.requests:
            error = RequestTimeoutError(f"request did not finish within {timeout_s:g} s")
            self._finish(request_id, error=error, finish_reason="error")

    def _finish(
        self, request_id: str, *, error: OmnistageError | None = None, finish_reason: FinishReason | None = None
    ) -> None:
        handle = self.requests.pop(request_id)
        self._ended.add(request_id)
        if isinstance(error, StageFailureError):
            # the cause (internal exception text) goes to the log only, under the request id
            error = error.for_request(request_id)
            logger.error("request %s: %s", request_id, error)
        if handle._timer is not None:
            handle._timer.cancel()
        if finish_reason is not None:
            handle._finish_reason = finish_reason
        handle._error = error
        if finish_reason == "abort":
            handle.close()  # its client is gone
        elif error is not None:
            handle._uncount()  # no more chunks come; those that came are still the client's
        # Also on success: a stage that still holds the request (its hooks disagreed with
        # the terminal set on a request the sample requests did not cover) lets it go.
        self._broadcast_abort(request_id)
        handle._queue.put_nowait(None)
        handle._done.set()
