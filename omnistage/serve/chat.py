"""``POST /v1/chat/completions`` for a chat model (:class:`~omnistage.serve.model.ChatModelConfig`),
and ``GET /v1/audio/voices`` listing its speakers.

Request flow: capped body -> parse -> validate against the model's capabilities -> media
read and decoded in the decoder pool -> the model's request builder (all 4xx, before any
model work) -> admission -> response. A client disconnect aborts the request in the
pipeline.

Output: the model's text terminal stage streams :class:`~omnistage.core.payloads.TextDelta`
items and ends with a :class:`~omnistage.core.payloads.TextResult`; with audio its audio
terminal stage streams :class:`~omnistage.core.payloads.AudioChunk` items and ends with an
:class:`~omnistage.core.payloads.AudioResult`.

- Whole reply: ``choices[0].message.content`` is the text; with audio,
  ``message.audio = {id, data, expires_at, transcript}`` (``data``: the whole file of
  ``audio.format``, base64; ``transcript``: the text again).
- Streamed reply (``text/event-stream``, ``data: <chunk>`` lines, then ``data: [DONE]``):
  a first chunk with ``delta.role``; text in ``delta.content`` pieces; audio in
  ``delta.audio = {id, data}`` pieces (``pcm16``: 24 kHz s16le); a last audio delta with
  ``expires_at`` and the whole ``transcript``; a chunk with ``finish_reason``; with
  ``stream_options.include_usage`` a last chunk with no choices and the ``usage``. Headers go
  out once the first piece exists, so a failure before it is a JSON error with its status; a
  failure after it sends ``data: {"error": ...}`` and no ``[DONE]``.

``finish_reason``: ``"length"`` when the text (``max_tokens``) or the speech (the talker's
cap) was cut, else ``"stop"``.
"""

from __future__ import annotations

import base64
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import JsonValue
from starlette.concurrency import run_in_threadpool

from omnistage.core.errors import (
    OmnistageError,
    RequestAbortedError,
)
from omnistage.core.payloads import AudioResult, TextDelta, TextResult
from omnistage.core.request import PipelineRequest, new_request_id
from omnistage.pipeline.coordinator import PipelineResult, RequestHandle
from omnistage.serve.audio import StreamingAudioEncoder, audio_of_chunk, encode_audio, resample
from omnistage.serve.chat_media import load_chat_inputs
from omnistage.serve.chat_protocol import (
    ENCODER_FORMAT,
    PCM16_SAMPLE_RATE,
    SSE_DONE,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatUsage,
    Choice,
    ChunkChoice,
    CompletionTokensDetails,
    Delta,
    DeltaAudio,
    PromptTokensDetails,
    ReplyAudio,
    ReplyMessage,
    chat_voices_response,
    check_chat_capabilities,
    parse_chat_request,
    sse_data,
    validate_chat_request,
)
from omnistage.serve.decoding import request_id_var
from omnistage.serve.model import ChatModelConfig
from omnistage.serve.protocol import error_envelope
from omnistage.serve.server_core import (
    ModelServer,
    ServerSettings,
    admit,
    count_request_end,
    read_body,
    record_first_audio,
    require_json,
    watch_disconnect,
)

__all__ = ["ChatServer", "install_chat_routes"]

logger = logging.getLogger(__name__)

#: ``message.audio.expires_at`` is this many seconds after the reply (OpenAI keeps a reply's
#: audio for multi-turn reuse by id; this server keeps none, the id is informative).
AUDIO_EXPIRES_S = 3600


class ChatServer(ModelServer):
    """The server's state for a chat model: its capabilities and requests."""

    def __init__(
        self, model: ChatModelConfig, settings: ServerSettings, on_fatal: Callable[[str], None] | None = None
    ) -> None:
        self.model: ChatModelConfig = model
        self.capabilities = model.capabilities()
        self.request_type = model.chat_request
        check_chat_capabilities(self.capabilities, self.request_type)
        if settings.served_model_names:
            names = tuple(dict.fromkeys(settings.served_model_names))
            self.capabilities = self.capabilities.model_copy(update={"model_names": names})
        super().__init__(model, settings, on_fatal)

    @property
    def model_name(self) -> str:
        return self.capabilities.model_name

    def prepare(self, body: bytes | Mapping[str, JsonValue] | ChatCompletionRequest) -> tuple[ChatCompletionRequest, PipelineRequest]:
        """A chat body -> (validated request, the model's typed request): parse, validate,
        read and decode the media, build. Blocks (run it in a thread).

        Raises:
            OmnistageError: 4xx naming the field, before any model work.
        """
        req = body if isinstance(body, ChatCompletionRequest) else parse_chat_request(body, self.request_type)
        req = validate_chat_request(req, self.capabilities)
        turns = load_chat_inputs(req, self.capabilities, self.settings.media_policy)
        return req, self.model.build_request(req, turns)

    def warmup_request(self) -> PipelineRequest:
        return self.prepare(self.model.sample_requests()[0])[1]


def install_chat_routes(v1: APIRouter, server: ChatServer) -> None:
    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        call = await _open_call(server, request, time.monotonic())
        return await (call.respond_stream() if call.chat.stream else call.respond_whole())

    @v1.get("/audio/voices")
    async def voices() -> JSONResponse:
        return JSONResponse(chat_voices_response(server.capabilities, server.request_type).model_dump())


async def _open_call(server: ChatServer, request: Request, received: float) -> _ChatCall:
    """Prepare and admit one chat request (4xx and 503 here, counted in the metrics).

    Raises:
        OmnistageError: the request is invalid, or the server cannot take it now.
    """
    request_id = new_request_id()
    request_id_var.set(request_id)  # for the decoder pool's log lines (threads copy it)

    async def prepare_and_submit() -> _ChatCall:
        require_json(request)
        body = await read_body(request, server.settings.max_body_bytes)
        chat, model_request = await run_in_threadpool(server.prepare, body)
        handle = server.pipeline.submit(model_request, request_id, collect=False, received_at=received)
        return _ChatCall(server, request, chat, handle, received)

    return await admit(server, request_id, prepare_and_submit)


@dataclass
class _Piece:
    """One piece of a reply as it streams: text, or audio samples (model rate)."""

    text: str | None = None
    audio: np.ndarray | None = None


class _ChatCall:
    """One chat request's response, with metrics and abort-on-disconnect."""

    def __init__(
        self, server: ChatServer, request: Request, chat: ChatCompletionRequest, handle: RequestHandle, received: float
    ) -> None:
        self.server, self.request, self.chat, self.handle = server, request, chat, handle
        self.received = received
        self.id = f"chatcmpl-{handle.request_id}"
        self.audio_id = f"audio-{handle.request_id}"
        self.created = int(time.time())
        self.model_name = chat.model or server.capabilities.model_name
        self.sample_rate = server.capabilities.sample_rate
        self.samples = 0
        self.text: list[str] = []
        self.result: PipelineResult | None = None
        self.first_audio_at: float | None = None
        self._reported = False

    # -------------------------------------------------------------- pieces
    async def _pieces(self) -> AsyncIterator[_Piece]:
        """The reply's pieces in arrival order; sets ``self.result`` at the end.

        Raises:
            OmnistageError: the request failed or was aborted.
        """
        async for chunk in self.handle.stream():
            if isinstance(chunk.data, TextDelta):
                self.text.append(chunk.data.text)
                yield _Piece(text=chunk.data.text)
            elif (audio := audio_of_chunk(chunk)) is not None:
                self.samples += len(audio)
                yield _Piece(audio=audio)
        self.result = await self.handle.result()

    async def _abort_on_disconnect(self, pieces: AsyncIterator[_Piece]) -> _Piece | None:
        """The next piece (None at the end), aborting the request if the client leaves."""
        return await watch_disconnect(anext(pieces, None), self.request, self._abort)

    def _abort(self) -> None:
        self.server.pipeline.abort(self.handle.request_id)

    # -------------------------------------------------------------- whole reply
    async def respond_whole(self) -> JSONResponse:
        pieces, audio = self._pieces(), []
        try:
            while (piece := await self._abort_on_disconnect(pieces)) is not None:
                if piece.audio is not None:
                    audio.append(piece.audio)
            assert self.result is not None
            message = ReplyMessage(content="".join(self.text), audio=await self._whole_audio(audio))
            if message.audio is not None:
                self._first_audio()
        except BaseException as exc:
            self._finished(exc)
            self.handle.close()
            raise
        finish = self._finish_reason()
        self._finished(None, finish)
        body = ChatCompletion(
            id=self.id, created=self.created, model=self.model_name,
            choices=[Choice(message=message, finish_reason=finish)], usage=self._usage(),
        )  # fmt: skip
        return JSONResponse(body.model_dump(mode="json"), headers={"X-Request-Id": self.handle.request_id})

    async def _whole_audio(self, audio: list[np.ndarray]) -> ReplyAudio | None:
        if self.chat.audio is None:
            return None
        fmt = self.chat.audio.format
        samples = np.concatenate(audio) if audio else np.zeros(0, np.float32)
        rate = PCM16_SAMPLE_RATE if fmt == "pcm16" else self.sample_rate
        samples = await run_in_threadpool(resample, samples, self.sample_rate, rate)
        data = await run_in_threadpool(encode_audio, samples, rate, ENCODER_FORMAT[fmt])
        return ReplyAudio(
            id=self.audio_id, data=base64.b64encode(data).decode("ascii"),
            expires_at=self.created + AUDIO_EXPIRES_S, transcript="".join(self.text),
        )  # fmt: skip

    # -------------------------------------------------------------- streamed reply
    async def respond_stream(self) -> Response:
        pieces = self._pieces()
        try:
            first = await self._abort_on_disconnect(pieces)
        except BaseException as exc:
            self._finished(exc)
            self.handle.close()
            raise
        headers = {"X-Request-Id": self.handle.request_id, "Cache-Control": "no-cache"}
        return StreamingResponse(self._events(first, pieces), media_type="text/event-stream", headers=headers)

    def _chunk(self, delta: Delta, finish: str | None = None) -> bytes:
        choice = ChunkChoice(delta=delta, finish_reason=finish)
        return sse_data(ChatCompletionChunk(id=self.id, created=self.created, model=self.model_name, choices=[choice]))

    async def _events(self, first: _Piece | None, pieces: AsyncIterator[_Piece]) -> AsyncIterator[bytes]:
        error: BaseException | None = None
        encoder = None
        if self.chat.audio is not None:
            fmt = self.chat.audio.format
            rate = PCM16_SAMPLE_RATE if fmt == "pcm16" else self.sample_rate
            encoder = StreamingAudioEncoder(ENCODER_FORMAT[fmt], self.sample_rate, rate)
        try:
            yield self._chunk(Delta(role="assistant", content=""))
            piece = first
            while piece is not None:
                if piece.text:
                    yield self._chunk(Delta(content=piece.text))
                elif piece.audio is not None and encoder is not None:
                    if data := await run_in_threadpool(encoder.push, piece.audio):
                        yield self._audio_chunk(data)
                piece = await anext(pieces, None)
            if encoder is not None:
                if tail := encoder.finish():
                    yield self._audio_chunk(tail)
                last = DeltaAudio(id=self.audio_id, transcript="".join(self.text), expires_at=self.created + AUDIO_EXPIRES_S)
                yield self._chunk(Delta(audio=last))
            finish = self._finish_reason()
            yield self._chunk(Delta(), finish)
            if self.chat.stream_options is not None and self.chat.stream_options.include_usage:
                usage = ChatCompletionChunk(id=self.id, created=self.created, model=self.model_name, choices=[], usage=self._usage())
                yield sse_data(usage)
            yield SSE_DONE
            self._finished(None, finish)
        except OmnistageError as exc:
            error = exc
            logger.warning("request %s: chat stream cut: %s", self.handle.request_id, exc)
            yield sse_data(error_envelope(exc)[1])  # no [DONE]: the reply is not complete
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._close(error)

    def _audio_chunk(self, data: bytes) -> bytes:
        self._first_audio()
        return self._chunk(Delta(audio=DeltaAudio(id=self.audio_id, data=base64.b64encode(data).decode("ascii"))))

    # -------------------------------------------------------------- helpers
    def _first_audio(self) -> None:
        if self.first_audio_at is None:
            self.first_audio_at = record_first_audio(self.server.metrics, self.handle, self.received)

    def _finish_reason(self) -> str:
        assert self.result is not None
        return "length" if self.result.finish_reason == "length" else "stop"

    def _usage(self) -> ChatUsage:
        """Token counts from the terminal stages' results."""
        assert self.result is not None
        outputs = self.result.outputs.values()
        text = next(r for r in outputs if isinstance(r, TextResult))
        audio_tokens = sum(r.num_frames for r in outputs if isinstance(r, AudioResult))
        prompt = PromptTokensDetails(
            text_tokens=text.prompt_tokens - text.prompt_audio_tokens - text.prompt_image_tokens,
            audio_tokens=text.prompt_audio_tokens, image_tokens=text.prompt_image_tokens,
        )  # fmt: skip
        completion = CompletionTokensDetails(text_tokens=text.completion_tokens, audio_tokens=audio_tokens)
        completion_tokens = text.completion_tokens + audio_tokens
        return ChatUsage(
            prompt_tokens=text.prompt_tokens, completion_tokens=completion_tokens,
            total_tokens=text.prompt_tokens + completion_tokens,
            prompt_tokens_details=prompt, completion_tokens_details=completion,
        )  # fmt: skip

    def _close(self, error: BaseException | None) -> None:
        if not self.handle.finished:  # the client went away mid-stream
            self._abort()
            error = RequestAbortedError("client disconnected")
        elif self.handle.error is not None and not isinstance(error, OmnistageError):
            error = self.handle.error
        self.handle.close()
        if error is not None:
            self._finished(error)

    def _finished(self, error: BaseException | None, finish_reason: str = "stop") -> None:
        if self._reported:
            return
        self._reported = True
        latency = time.monotonic() - self.received
        count_request_end(self.server.metrics, error, finish_reason, latency, self.samples / self.sample_rate)

