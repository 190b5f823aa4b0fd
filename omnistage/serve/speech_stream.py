"""``WebSocket /v1/audio/speech/stream``: text in as it is written, audio out as it is made.

Protocol (message names as vLLM-Omni's streaming-text handler; docs/speech_api.md):

Client -> server, JSON text messages::

    {"type": "session.config", <speech request fields but input/stream/stream_format>}
    {"type": "input.text", "text": "<delta>"}      # any number, any split
    {"type": "input.done"}                          # flush: no more text

Server -> client::

    {"type": "session.started", "session_id", "model", "response_format", "sample_rate", "ignored_fields"}
    {"type": "audio.start", "segment_index", "text"}    # before a segment's audio
    <binary frames: the response_format's bytes>         # all frames of the session form one stream
    {"type": "audio.done", "segment_index", "finish_reason", "usage"}
    {"type": "session.done", "segments", "usage"}       # after input.done, once all audio is out
    {"type": "error", "error": {message, type, param, code}, "segment_index"?}  # last: then the socket closes

Live text (a model whose capabilities declare ``live_text_input``): the
session is ONE request, admitted at the first text that is not blank, and every later
delta enters that running request as it arrives (:class:`~omnistage.core.payloads.InputText`
client input; ``input.done`` ends its input), so the model reads text that was not yet
written when its audio began; one ``audio.start``/``audio.done`` pair (segment 0, its
``text`` the text it started with). The session's text may have at most the model's
``max_input_chars``.

Segments (every other model): the text is cut into sentences as it arrives (after ``.!?;`` and their CJK forms
when whitespace follows, at a newline, or at the last space before
:data:`SEGMENT_MAX_CHARS`); each sentence becomes one speech request of the session's
fields, admitted as soon as it is complete, so audio starts before the text is finished.
The cut depends only on the text, never on how it was split into deltas: the same text
word by word or at once gives the same segments and, with a seed, the same audio.

Backpressure: at most :data:`MAX_PENDING_SEGMENTS` segments are admitted ahead of the one
being sent; the text past them waits, cut, for room (at most :data:`MAX_AHEAD_CHARS`,
each waiting segment counted as its characters plus :data:`SEGMENT_OVERHEAD_CHARS`), so
each message is read as it comes until ``input.done`` (none after it); a client that
stops reading blocks the server's sends, which holds back the next segments;
each request's stream buffer is capped by the coordinator. A disconnect, an error or the
end of the session aborts every request of the session it has not finished; an error
stops the session's audio before its ``error`` event is sent.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from pydantic import JsonValue
from starlette.concurrency import run_in_threadpool

from omnistage.core.errors import (
    OmnistageError,
    PayloadTooLargeError,
    RequestAbortedError,
    RequestValidationError,
)
from omnistage.core.payloads import InputText
from omnistage.pipeline.coordinator import RequestHandle
from omnistage.serve.audio import StreamingAudioEncoder, audio_of_chunk
from omnistage.serve.protocol import (
    ErrorBody,
    SpeechUsage,
    check_text,
    error_envelope,
    output_sample_rate,
    usage_of,
)
from omnistage.serve.voice_library import key_owner

if TYPE_CHECKING:
    from omnistage.serve.app import SpeechServer

__all__ = ["MAX_PENDING_SEGMENTS", "SEGMENT_MAX_CHARS", "SentenceSegmenter", "install_speech_stream_route"]

SEGMENT_MAX_CHARS = 400
"""Longest segment (characters): a sentence longer than this is cut at its last space
before it, so the first audio of a long sentence is not held back by its end."""
MAX_PENDING_SEGMENTS = 2
"""Segments admitted ahead of the one whose audio is being sent."""
MAX_MESSAGE_CHARS = 64 * 1024
MAX_AHEAD_CHARS = 1 << 20
"""What the cut segments a session holds waiting for admission may count (characters, each
segment's plus :data:`SEGMENT_OVERHEAD_CHARS`): a client further ahead of its audio than
this is refused (413 naming ``text``)."""
SEGMENT_OVERHEAD_CHARS = 64
"""What one waiting segment counts toward :data:`MAX_AHEAD_CHARS` beyond its characters:
about the bytes of a Python string's header and its queue slot, so that many tiny segments
("a. a. a. ...") cost what they hold, not only their letters."""
_BOUNDARY = re.compile(r"[.!?;。！？；](?=\s)|\n")
_SESSION_FIELDS_REFUSED = frozenset({"input", "text", "stream", "stream_format"})
_PROBE_TEXT = "probe"
"""The text ``session.config``'s fields are checked with: any valid word would do."""


class SentenceSegmenter:
    """Cuts text arriving in deltas into sentences, the same way however it is split.

    Args:
        max_chars: longest segment (>= 1).
    """

    def __init__(self, max_chars: int = SEGMENT_MAX_CHARS) -> None:
        self.max_chars = max_chars
        self._buffer = ""

    def push(self, delta: str) -> list[str]:
        """Add ``delta``; return the segments it completed (stripped, never blank)."""
        self._buffer += delta
        segments = []
        while (cut := self._cut()) is not None:
            segment, self._buffer = self._buffer[:cut], self._buffer[cut:]
            segments.append(segment)
        return [s.strip() for s in segments if s.strip()]

    def flush(self) -> list[str]:
        """The rest of the text as the last segment(s)."""
        segments = self.push("")
        rest, self._buffer = self._buffer.strip(), ""
        return [*segments, rest] if rest else segments

    def _cut(self) -> int | None:
        """End of the first complete segment in the buffer, or None (wait for more)."""
        match = _BOUNDARY.search(self._buffer, 0, self.max_chars + 1)
        if match is not None and match.end() <= self.max_chars:
            return match.end()
        if len(self._buffer) <= self.max_chars:
            return None
        space = self._buffer.rfind(" ", 1, self.max_chars)
        return space if space > 0 else self.max_chars


@dataclass
class _Segment:
    index: int
    text: str
    handle: RequestHandle
    received: float
    samples: int = 0
    chars: int = 0  # characters of its text (live: all of the session's)


@dataclass
class _Session:
    """One WebSocket session's state: its fields, segmenter, admitted segments, usage."""

    server: SpeechServer
    websocket: WebSocket
    owner: str
    fields: dict[str, JsonValue]
    encoder: StreamingAudioEncoder
    segmenter: SentenceSegmenter
    session_id: str = field(default_factory=lambda: f"sess_{secrets.token_hex(8)}")
    pending: asyncio.Queue[_Segment | None] = field(default_factory=asyncio.Queue)
    room: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(MAX_PENDING_SEGMENTS + 1))
    running: dict[str, _Segment] = field(default_factory=dict)
    usage: list[SpeechUsage] = field(default_factory=list)
    next_index: int = 0
    live_segment: _Segment | None = None  # live text: the session's one request
    opening: str = ""  # live text: what came before it was admitted
    ahead_chars: int = 0  # _ahead_cost of the segments cut, not admitted yet (the one waiting for room too)

    @property
    def live(self) -> bool:
        return self.server.capabilities.live_text_input

    async def admit(self, text: str) -> None:
        """Admit one segment (live text: the session's request, whose text continues),
        once fewer than MAX_PENDING_SEGMENTS wait behind the one being sent.

        Raises:
            _SegmentError: the segment is invalid or the server cannot take it.
        """
        await self.room.acquire()
        received = time.perf_counter()
        body = {**self.fields, "input": text, "stream": True}
        try:
            _, model_request = await run_in_threadpool(self.server.prepare, body, self.owner, live=self.live)
            handle = self.server.pipeline.submit(model_request)
        except OmnistageError as exc:
            self.room.release()
            self.server.metrics.request_rejected(exc.http_status)
            raise _SegmentError(self.next_index, exc) from exc
        self.server.metrics.request_started()
        segment = _Segment(self.next_index, text, handle, received, chars=len(text))
        self.running[handle.request_id] = segment
        if self.live:
            self.live_segment = segment
        self.next_index += 1
        await self.pending.put(segment)

    def finish(self, segment: _Segment, error: OmnistageError | None, finish_reason: str = "stop") -> None:
        """Count ``segment``'s end in the metrics and forget it (once)."""
        if self.running.pop(segment.handle.request_id, None) is None:
            return
        self.room.release()
        latency = time.perf_counter() - segment.received
        audio_s = segment.samples / self.server.capabilities.sample_rate
        if error is None:
            self.server.metrics.request_finished(200, finish_reason, latency, audio_s)
            return
        reason = "abort" if isinstance(error, RequestAbortedError) else "error"
        self.server.metrics.request_finished(error.http_status, reason, latency, audio_s)

    def abort_all(self) -> None:
        """Abort every segment not finished yet (the session ended early)."""
        for segment in list(self.running.values()):
            if not segment.handle.finished:
                self.server.pipeline.abort(segment.handle.request_id)
            segment.handle.close()
            self.finish(segment, RequestAbortedError("the session ended"))


class _SegmentError(Exception):
    def __init__(self, index: int, error: OmnistageError) -> None:
        super().__init__(str(error))
        self.index, self.error = index, error


def install_speech_stream_route(app: FastAPI, server: SpeechServer) -> None:
    """Add ``/v1/audio/speech/stream`` (authenticated like ``/v1``: ``Authorization:
    Bearer <key>`` on the upgrade request)."""

    @app.websocket("/v1/audio/speech/stream")
    async def speech_stream(websocket: WebSocket) -> None:
        try:
            owner = key_owner(server.settings.api_keys, websocket.headers.get("authorization", ""))
        except OmnistageError:
            await websocket.close(code=1008, reason="invalid or missing API key")
            return
        await websocket.accept()
        await _run_session(server, websocket, owner)


async def _run_session(server: SpeechServer, websocket: WebSocket, owner: str) -> None:
    """Run one session to its end; on an error, its audio sender is stopped and its
    requests aborted first, so the ``error`` event is the last message before the close."""
    session: _Session | None = None
    sender: asyncio.Task | None = None
    error: OmnistageError | None = None
    error_index: int | None = None
    try:
        session = await _open_session(server, websocket, owner)
        sender = asyncio.create_task(_send_audio(session))
        await _read_text(session, sender)
        await sender
        await _send_json(websocket, {"type": "session.done", "segments": session.next_index, "usage": _total(session.usage)})
        await websocket.close()
    except (WebSocketDisconnect, OSError):
        pass  # the client left (uvicorn's ClientDisconnected is an OSError): aborted below
    except _SegmentError as exc:
        error, error_index = exc.error, exc.index
    except OmnistageError as exc:
        error = exc
    finally:
        if sender is not None and not sender.done():
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
        if session is not None:
            session.abort_all()
    if error is not None:
        await _send_error(websocket, error, error_index)


async def _open_session(server: SpeechServer, websocket: WebSocket, owner: str) -> _Session:
    """Read ``session.config``, check its fields as a speech request's (the model's own
    checks included: the request is built, as :meth:`SpeechServer.prepare` builds it, for
    a one-word text, and dropped), announce the session. ``ignored_fields`` are then those
    of that request: a saved voice, which the request uses, is not among them.

    Raises:
        OmnistageError: not a config message, or fields every request of the session
            would fail on (4xx naming the field).
    """
    message = await _receive(websocket)
    if message.get("type") != "session.config":
        raise RequestValidationError('the first message must be {"type": "session.config", ...}', param="type")
    fields = {k: v for k, v in message.items() if k != "type"}
    refused = sorted(_SESSION_FIELDS_REFUSED & set(fields))
    if refused:
        raise RequestValidationError(
            f"{refused[0]!r} is not a session field: text comes in input.text messages, and a session always streams",
            param=refused[0],
        )
    caps = server.capabilities
    probe_body = {**fields, "input": _PROBE_TEXT, "stream": True}
    probe, _ = await run_in_threadpool(server.prepare, probe_body, owner, live=caps.live_text_input)
    rate = output_sample_rate(probe, caps)
    session = _Session(
        server=server,
        websocket=websocket,
        owner=owner,
        fields=fields,
        encoder=StreamingAudioEncoder(probe.response_format, caps.sample_rate, rate),
        segmenter=SentenceSegmenter(min(SEGMENT_MAX_CHARS, caps.max_input_chars)),
    )
    await _send_json(websocket, {
        "type": "session.started", "session_id": session.session_id, "model": caps.model_name,
        "response_format": probe.response_format, "sample_rate": rate,
        "ignored_fields": list(probe.ignored_fields),
    })  # fmt: skip
    return session


async def _read_text(session: _Session, sender: asyncio.Task) -> None:
    """Read the client's messages until ``input.done``, then no more: live text goes
    into the session's request; other text is cut into segments that a second task admits
    as room frees, so each message is read as it comes, never waiting for room (a
    client's pongs too: while the reading waited for room, the server's keepalive ping
    went unanswered and cut the session after 40 s). A sender or admitter that fails
    first ends the reading (its error is raised).

    Raises:
        PayloadTooLargeError: the segments waiting for admission count more than
            :data:`MAX_AHEAD_CHARS` (see :func:`_ahead_cost`).
    """
    if session.live:
        await _read_live_text(session, sender)
        return
    ready: asyncio.Queue[str | None] = asyncio.Queue()
    admitter = asyncio.create_task(_admit_ready(session, ready, sender))
    try:
        while True:
            message = await _first(_receive(session.websocket), admitter)
            kind = message.get("type")
            if kind == "input.text":
                segments = session.segmenter.push(_text_of(message))
            elif kind == "input.done":
                segments = session.segmenter.flush()
            else:
                raise _unknown_type(kind)
            for text in segments:
                session.ahead_chars += _ahead_cost(text)
                ready.put_nowait(text)
            if session.ahead_chars > MAX_AHEAD_CHARS:
                raise PayloadTooLargeError(
                    f"the session's text waiting for its audio counts more than {MAX_AHEAD_CHARS} characters"
                    f" (each segment's plus {SEGMENT_OVERHEAD_CHARS})",
                    param="text",
                )
            if kind == "input.done":
                ready.put_nowait(None)
                await admitter
                return
    finally:
        if not admitter.done():
            admitter.cancel()
            await asyncio.gather(admitter, return_exceptions=True)


async def _admit_ready(session: _Session, ready: asyncio.Queue[str | None], sender: asyncio.Task) -> None:
    """Admit the segments of ``ready`` in order as room frees, until its None (then the
    end of the session's audio is queued). A segment counts in ``ahead_chars`` until it
    is admitted."""
    while (text := await _first(ready.get(), sender)) is not None:
        await _first(session.admit(text), sender)
        session.ahead_chars -= _ahead_cost(text)
    await session.pending.put(None)


def _ahead_cost(text: str) -> int:
    """What a segment waiting for admission counts toward :data:`MAX_AHEAD_CHARS`."""
    return len(text) + SEGMENT_OVERHEAD_CHARS


async def _read_live_text(session: _Session, sender: asyncio.Task) -> None:
    """Live text: each delta into the session's request until ``input.done``."""
    while True:
        message = await _first(_receive(session.websocket), sender)
        kind = message.get("type")
        if kind == "input.text":
            await _feed_live(session, sender, _text_of(message))
        elif kind == "input.done":
            if session.live_segment is not None:
                session.server.pipeline.end_input(session.live_segment.handle.request_id)
            await session.pending.put(None)
            return
        else:
            raise _unknown_type(kind)


def _text_of(message: dict[str, JsonValue]) -> str:
    text = message.get("text")
    if not isinstance(text, str):
        raise RequestValidationError("input.text needs a string text", param="text")
    return text


def _unknown_type(kind: JsonValue) -> RequestValidationError:
    return RequestValidationError(f"unknown message type {kind!r}; expected input.text or input.done", param="type")


async def _feed_live(session: _Session, sender: asyncio.Task, text: str) -> None:
    """Live text: admit the session's request at its first non-blank text, then send it
    each delta.

    Raises:
        RequestValidationError: the session's text is longer than ``max_input_chars``, or
            a delta holds a NUL or an unpaired surrogate (the checks ``input`` gets).
    """
    segment = session.live_segment
    limit = session.server.capabilities.max_input_chars
    check_text("text", text, limit)
    total = (segment.chars if segment is not None else len(session.opening)) + len(text)
    if total > limit:
        raise RequestValidationError(f"a session's text may have at most {limit} characters", param="text")
    if segment is not None:
        segment.chars = total
        session.server.pipeline.send_input(segment.handle.request_id, InputText(text))
        return
    session.opening += text
    if session.opening.strip():
        await _first(session.admit(session.opening), sender)


async def _first(awaitable, sender: asyncio.Task):
    """Await ``awaitable`` unless the sender task ends first (then re-raise its error); a
    cancelled wait cancels ``awaitable`` too (an admission must not finish after the
    session's abort)."""
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task, sender}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    sender.result()  # raises the sender's error
    raise RuntimeError("the audio sender ended before the input")


async def _send_audio(session: _Session) -> None:
    """Send each segment's audio in order, then the encoder's tail."""
    websocket = session.websocket
    while (segment := await session.pending.get()) is not None:
        await _send_json(websocket, {"type": "audio.start", "segment_index": segment.index, "text": segment.text})
        try:
            async for data in _encoded(session, segment):
                if data:
                    await websocket.send_bytes(data)
            result = await segment.handle.result()
        except OmnistageError as exc:
            session.finish(segment, exc)
            raise _SegmentError(segment.index, exc) from exc
        seconds = segment.samples / session.server.capabilities.sample_rate
        usage = usage_of(result.outputs, segment.chars, seconds)
        session.usage.append(usage)
        session.finish(segment, None, result.finish_reason)
        await _send_json(websocket, {
            "type": "audio.done", "segment_index": segment.index, "finish_reason": result.finish_reason,
            "usage": usage.model_dump(),
        })  # fmt: skip
    tail = session.encoder.finish()
    if tail:
        await websocket.send_bytes(tail)


async def _encoded(session: _Session, segment: _Segment) -> AsyncIterator[bytes]:
    """The encoder's bytes per audio chunk of ``segment`` (maybe b"")."""
    async for chunk in segment.handle.stream():
        if (samples := audio_of_chunk(chunk)) is not None:
            segment.samples += len(samples)
            yield await run_in_threadpool(session.encoder.push, samples)


def _total(usages: list[SpeechUsage]) -> dict[str, int | float]:
    keys = ("input_tokens", "output_tokens", "total_tokens", "input_characters", "output_audio_seconds")
    return {key: sum(getattr(u, key) for u in usages) for key in keys}


async def _receive(websocket: WebSocket) -> dict[str, JsonValue]:
    """The next client message as a JSON object.

    Raises:
        WebSocketDisconnect: the client left.
        RequestValidationError: a binary frame, oversized or not a JSON object.
    """
    message = await websocket.receive()
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", 1000))
    text = message.get("text")
    if text is None:
        raise RequestValidationError("messages are JSON text frames", param="type")
    if len(text) > MAX_MESSAGE_CHARS:
        raise RequestValidationError(f"a message may have at most {MAX_MESSAGE_CHARS} characters", param="text")
    try:
        data = json.loads(text)
    except ValueError:
        raise RequestValidationError("a message is not valid JSON", param="type") from None
    if not isinstance(data, dict):
        raise RequestValidationError("a message must be a JSON object", param="type")
    return data


async def _send_json(websocket: WebSocket, data: Mapping[str, JsonValue]) -> None:
    await websocket.send_text(json.dumps(data, separators=(",", ":"), ensure_ascii=False))


async def _send_error(websocket: WebSocket, error: OmnistageError, index: int | None) -> None:
    """Tell the client why the session ends, then close it (quietly if it is gone)."""
    _, envelope = error_envelope(error)
    event: dict[str, JsonValue] = {"type": "error", "error": ErrorBody(**envelope["error"]).model_dump()}
    if index is not None:
        event["segment_index"] = index
    try:
        await _send_json(websocket, event)
        await websocket.close(code=1008 if error.http_status < 500 else 1011)
    except (WebSocketDisconnect, OSError, RuntimeError):
        pass  # the client is gone already
