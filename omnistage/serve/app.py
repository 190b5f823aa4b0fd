"""The OpenAI-compatible HTTP server (FastAPI).

Endpoints: ``POST /v1/audio/speech``, ``GET /v1/audio/voices``, ``GET /v1/models``,
``GET /v1/models/{id}``, ``GET /health`` (503 while starting, while a dead stage process
restarts, naming its stages in ``stages_down``, and ``failed`` past the restart limit),
``GET /metrics`` (Prometheus), and the web playground at ``GET /`` (:mod:`omnistage.serve.playground`).
Errors use the OpenAI envelope, mapped from the typed errors of :mod:`omnistage.core.errors`.
Request flow: capped body -> parse -> validate against the model's capabilities -> the
model's request builder (all 4xx, before any model work) -> admission -> response. A
client disconnect aborts the request in the pipeline.

Streaming: headers go out only once the first audio chunk exists, so a failure before it
is a JSON error with its status; a failure after it truncates the stream (raw audio: no
clean end of the chunked body; SSE: an ``error`` event and never ``speech.audio.done``).

Timeline: every speech response carries ``X-Timeline`` (the request's marks so far, ms
after receipt); at the first audio byte the phases of the time to first audio go to the
``omnistage_request_phase_seconds`` histograms and to a DEBUG log line
(:mod:`omnistage.pipeline.timeline`).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError as FastAPIValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import JsonValue
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from omnistage.core.errors import (
    AuthenticationError,
    OmnistageError,
    PipelineUnhealthyError,
    RequestAbortedError,
    RequestValidationError,
    StageFailureError,
    UnsupportedMediaTypeError,
)
from omnistage.core.messages import StreamChunk
from omnistage.core.request import PipelineRequest, new_request_id
from omnistage.pipeline.coordinator import PipelineResult, RequestHandle
from omnistage.serve.audio import (
    StreamingAudioEncoder,
    audio_of_chunk,
    content_type,
    encode_audio,
    resample,
)
from omnistage.serve.chat import ChatServer, install_chat_routes
from omnistage.serve.decoding import request_id_var
from omnistage.serve.model import ChatModelConfig, ModelConfig, SpeechModelConfig
from omnistage.serve.playground import mount_playground
from omnistage.serve.protocol import (
    BatchItem,
    BatchResponse,
    ErrorBody,
    ErrorEvent,
    SpeechAudioDelta,
    SpeechAudioDone,
    SpeechRequest,
    SpeechUsage,
    check_capabilities,
    error_envelope,
    model_card,
    model_list,
    not_found_envelope,
    output_sample_rate,
    parse_batch,
    parse_speech_request,
    sse_event,
    usage_of,
    validate_speech_request,
)
from omnistage.serve.server_core import (
    ModelServer,
    ServerSettings,
    StreamCut,
    admit,
    count_request_end,
    quiet_stream_cuts,
    read_body,
    record_first_audio,
    require_json,
    watch_disconnect,
)
from omnistage.serve.speech_stream import install_speech_stream_route
from omnistage.serve.voice_library import VoiceLibrary, data_uri, key_owner
from omnistage.serve.voices_api import install_voice_routes

logger = logging.getLogger(__name__)
T = TypeVar("T")

#: Response header with the request's timeline so far (``name=ms;...`` after receipt; see
#: :mod:`omnistage.pipeline.timeline`): a client can decompose its TTFA.
TIMELINE_HEADER = "X-Timeline"


class SpeechServer(ModelServer):
    """The server's state for a speech model: its capabilities, voice library and requests."""

    def __init__(
        self, model: SpeechModelConfig, settings: ServerSettings, on_fatal: Callable[[str], None] | None = None
    ) -> None:
        self.model: SpeechModelConfig = model
        self.capabilities = model.capabilities()
        self.request_type = model.speech_request
        check_capabilities(self.capabilities, self.request_type)
        if settings.served_model_names:
            names = tuple(dict.fromkeys(settings.served_model_names))
            self.capabilities = self.capabilities.model_copy(update={"model_names": names})
        super().__init__(model, settings, on_fatal)
        self.library = (
            VoiceLibrary(settings.data_dir)
            if settings.data_dir is not None and self.capabilities.saved_voices
            else None
        )

    @property
    def model_name(self) -> str:
        return self.capabilities.model_name

    def prepare(
        self, body: bytes | Mapping[str, JsonValue], owner: str, *, live: bool = False
    ) -> tuple[SpeechRequest, PipelineRequest]:
        """A speech request body -> (validated request, the model's typed request): parse,
        resolve a saved voice of ``owner``, validate, build (``live``: as a request whose
        text continues while it runs, ``build_live_request``). CPU only (run it in a thread).

        Raises:
            OmnistageError: 4xx naming the field, before any model work.
        """
        speech_request = parse_speech_request(body, self.request_type)
        speech_request = self.with_saved_voice(speech_request, owner)
        speech_request = validate_speech_request(speech_request, self.capabilities)
        build = self.model.build_live_request if live else self.model.build_request
        return speech_request, build(speech_request, self.settings.media_policy)

    def with_saved_voice(self, request: SpeechRequest, owner: str) -> SpeechRequest:
        """``request`` with its ``voice``, when it names one of ``owner``'s saved voices
        (and no built-in voice), turned into the model's own clone fields."""
        if self.library is None or request.voice is None or request.voice in self.capabilities.voices:
            return request
        voice = self.library.find(owner, request.voice)
        if voice is None:
            return request
        return self.model.with_saved_voice(request, data_uri(voice.mime_type, self.library.audio(voice)), voice.ref_text)

    def warmup_request(self) -> PipelineRequest:
        warmup = validate_speech_request(self.model.sample_requests()[0], self.capabilities)
        return self.model.build_request(warmup, self.settings.media_policy)

    async def stop(self) -> None:
        await super().stop()
        if self.library is not None:
            self.library.close()


def create_app(
    model: ModelConfig,
    settings: ServerSettings | None = None,
    *,
    on_fatal: Callable[[str], None] | None = None,
) -> FastAPI:
    """Build the FastAPI app for ``model`` (a speech or a chat model: the routes of its
    kind); the pipeline starts with the app's lifespan.

    ``on_fatal(reason)`` is called once the pipeline gives up (a stage process died more
    often than its restart limit): the caller should stop the server, non-zero. Until
    then ``/health`` answers 503 ``failed``.

    Raises:
        TypeError: ``model`` is of neither kind.
    """
    settings = settings or ServerSettings()
    server: ModelServer
    if isinstance(model, ChatModelConfig):
        server = ChatServer(model, settings, on_fatal)
    elif isinstance(model, SpeechModelConfig):
        server = SpeechServer(model, settings, on_fatal)
    else:
        raise TypeError(f"{type(model).__name__} is neither a SpeechModelConfig nor a ChatModelConfig")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Start in the background so the port opens at once and /health says "starting"
        # (503) while weights load and the warm-up runs, instead of refusing connections.
        starting = asyncio.create_task(_start(server))
        try:
            yield
        finally:
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            await server.stop()

    quiet_stream_cuts()
    app = FastAPI(title="omnistage", lifespan=lifespan)
    app.state.server = server
    _install_error_handlers(app)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(_require_api_key(server))])
    if isinstance(server, ChatServer):
        _install_common_routes(app, v1, server, server.capabilities.model_names)
        install_chat_routes(v1, server)
    else:
        _install_common_routes(app, v1, server, server.capabilities.model_names)
        _install_speech_routes(app, v1, server)
    app.include_router(v1)
    if server.settings.playground:
        mount_playground(app)
    return app


async def _start(server: ModelServer) -> None:
    try:
        await server.start()
    except Exception as exc:  # the server boundary: reported by /health, never swallowed
        logger.exception("the model failed to start")
        server.start_error = f"{type(exc).__name__}: {exc}"


def _error_response(exc: BaseException) -> JSONResponse:
    status, body = error_envelope(exc)
    headers = {"WWW-Authenticate": "Bearer"} if isinstance(exc, AuthenticationError) else None
    if isinstance(exc, PipelineUnhealthyError) and exc.retry_after_s is not None:
        headers = {"Retry-After": str(math.ceil(exc.retry_after_s))}
    if isinstance(exc, UnsupportedMediaTypeError) and exc.coding is not None:
        headers = {"Accept-Encoding": "identity"}
    return JSONResponse(body, status_code=status, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OmnistageError)
    async def omnistage_error(request: Request, exc: OmnistageError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            status, body = not_found_envelope(f"no route {request.method} {request.url.path}")
        else:
            status = exc.status_code
            body = {"error": {"message": str(exc.detail), "type": "invalid_request_error", "param": None, "code": status}}
        return JSONResponse(body, status_code=status, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        return _error_response(exc)  # 500 server_error, no details leaked

    @app.exception_handler(FastAPIValidationError)
    async def validation_error(request: Request, exc: FastAPIValidationError) -> JSONResponse:
        """A route's declared parameter (a form field, a path part) is missing or bad: 400
        naming it, in the envelope."""
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(part) for part in first.get("loc", ()) if part not in ("body", "query", "path")]
        param = ".".join(loc) or None
        message = f"{param}: {first.get('msg', 'invalid')}" if param else "invalid request"
        return _error_response(RequestValidationError(message, param=param))


def _require_api_key(server: ModelServer) -> Callable[[Request], None]:
    """A dependency of every ``/v1`` route: checks ``Authorization: Bearer <key>``.

    (A dependency, not an HTTP middleware: Starlette's middleware wrapper hides client
    disconnects from the route, and a disconnect must abort the request.)
    """

    def check(request: Request) -> None:
        request.state.owner = key_owner(server.settings.api_keys, request.headers.get("authorization", ""))

    return check


def _install_common_routes(app: FastAPI, v1: APIRouter, server: ModelServer, model_names: tuple[str, ...]) -> None:
    """``/health``, ``/metrics``, ``/v1/models`` and ``/v1/models/{id}`` (``model_names``:
    the served names, the first is the id)."""

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> JSONResponse:
        pipeline = server.pipeline
        failed = server.start_error or pipeline.fatal_error
        if failed is not None:
            return JSONResponse({"status": "failed", "reason": failed}, status_code=503)
        if not server.ready:
            return JSONResponse({"status": "starting"}, status_code=503)
        if not pipeline.healthy:
            coordinator = pipeline.coordinator
            body = {
                "status": "unhealthy",
                "reason": coordinator.unhealthy_reason if coordinator else None,
                "stages_down": sorted(s for stages in pipeline.down.values() for s in stages),
            }
            retry = coordinator.retry_after_s if coordinator else None
            headers = {"Retry-After": str(math.ceil(retry))} if retry is not None else None
            return JSONResponse(body, status_code=503, headers=headers)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        server.update_stage_metrics()
        data, media_type = server.metrics.render()
        return Response(data, media_type=media_type)

    @v1.get("/models")
    async def models() -> JSONResponse:
        return JSONResponse(model_list(model_names, server.created).model_dump())

    @v1.get("/models/{model_id:path}")
    async def model(model_id: str) -> JSONResponse:
        if model_id not in model_names:
            status, body = not_found_envelope(
                f"model {model_id!r} is not served here; available models: {', '.join(model_names)}"
            )
            return JSONResponse(body, status_code=status)
        return JSONResponse(model_card(model_id, server.created).model_dump())


def _install_speech_routes(app: FastAPI, v1: APIRouter, server: SpeechServer) -> None:
    install_voice_routes(v1, server)
    install_speech_stream_route(app, server)

    @v1.post("/audio/speech")
    async def speech(request: Request) -> Response:
        call = await _open_call(server, request, time.monotonic())
        if not call.speech.streaming:
            return await call.respond_whole()
        return await call.respond_stream()

    @v1.post("/audio/speech/batch")
    async def speech_batch(request: Request) -> JSONResponse:
        """Every request of the batch at once (the engine batches them), answered in order,
        each with its own status; a client that leaves aborts them all."""
        received = time.monotonic()
        require_json(request)
        bodies = parse_batch(await read_body(request, server.settings.max_body_bytes))
        items = await asyncio.gather(*(_batch_item(server, request, body, received) for body in bodies))
        data = [item.model_copy(update={"index": i}) for i, item in enumerate(items)]
        return JSONResponse(BatchResponse(data=data).model_dump(mode="json", exclude_none=True))


async def _open_call(
    server: SpeechServer, request: Request, received: float, body: Mapping[str, JsonValue] | None = None
) -> _SpeechCall:
    """Prepare and admit one speech request: ``body``, else the request's own JSON body
    (4xx and 503 here, counted in the metrics).

    Raises:
        OmnistageError: the request is invalid, or the server cannot take it now.
    """
    request_id = new_request_id()
    request_id_var.set(request_id)  # for the decoder pool's log lines (threads copy it)

    async def prepare_and_submit() -> _SpeechCall:
        nonlocal body
        if body is None:
            require_json(request)
            body = await read_body(request, server.settings.max_body_bytes)
        speech_request, model_request = await run_in_threadpool(server.prepare, body, request.state.owner)
        handle = server.pipeline.submit(
            model_request, request_id, collect=not speech_request.streaming, received_at=received
        )
        return _SpeechCall(server, request, speech_request, handle, received)

    return await admit(server, request_id, prepare_and_submit)


async def _batch_item(server: SpeechServer, request: Request, body: dict[str, JsonValue], received: float) -> BatchItem:
    """One request of a batch, always a whole file: its result or its error, never raised."""
    try:
        if body.get("stream") or body.get("stream_format") == "sse":
            raise RequestValidationError("a batch answers whole files: stream and stream_format sse are not allowed in it", param="stream")
        call = await _open_call(server, request, received, {**body, "stream": False})
        whole = await call.whole()
    except OmnistageError as exc:
        status, envelope = error_envelope(exc)
        return BatchItem(index=0, status=status, error=ErrorBody(**envelope["error"]))
    return BatchItem(
        index=0,
        status=200,
        response_format=call.speech.response_format,
        sample_rate=call.output_rate,
        audio=base64.b64encode(whole.data).decode("ascii"),
        finish_reason=whole.finish_reason,
        usage=whole.usage,
        ignored_fields=list(call.speech.ignored_fields),
    )


def _audio_of(chunks: list[StreamChunk]) -> list[np.ndarray]:
    """The samples of the audio chunks among ``chunks``, in order."""
    return [audio for chunk in chunks if (audio := audio_of_chunk(chunk)) is not None]


def _push_all(encoder: StreamingAudioEncoder, audio: list[np.ndarray]) -> list[bytes]:
    """``encoder.push`` of each array in turn: the bytes of each."""
    return [encoder.push(samples) for samples in audio]


@dataclass(frozen=True)
class WholeAudio:
    """A finished request's audio as one file of its ``response_format``."""

    data: bytes
    finish_reason: str
    usage: SpeechUsage
    headers: dict[str, str]


class _SpeechCall:
    """One speech request's response, with metrics and abort-on-disconnect."""

    def __init__(
        self, server: SpeechServer, request: Request, speech: SpeechRequest, handle: RequestHandle, received: float
    ) -> None:
        self.server, self.request, self.speech, self.handle = server, request, speech, handle
        self.received = received
        self.sample_rate = server.capabilities.sample_rate
        self.output_rate = output_sample_rate(speech, server.capabilities)
        self.samples_sent = 0
        self.first_audio_at: float | None = None
        self.result: PipelineResult | None = None
        self._reported = False

    # -------------------------------------------------------------- whole file
    async def whole(self) -> WholeAudio:
        """Wait for the request's end and encode its audio as one file.

        Raises:
            OmnistageError: the request failed, or produced no audio (500).
        """
        try:
            result = await self._watch(self.handle.result())
        except OmnistageError as exc:
            self._finished(exc)
            raise
        audio = [a for c in result.chunks if (a := audio_of_chunk(c)) is not None]
        if not audio:
            error = StageFailureError("server", "the model produced no audio", self.handle.request_id)
            self._finished(error)
            raise error
        samples = np.concatenate(audio)
        fmt = self.speech.response_format
        try:
            out = await run_in_threadpool(resample, samples, self.sample_rate, self.output_rate)
            data = await run_in_threadpool(encode_audio, out, self.output_rate, fmt)
        except Exception as exc:
            self._finished(exc)
            raise
        self.samples_sent = len(samples)
        self._first_byte()
        self._finished(None, result.finish_reason)
        headers = self._headers(result.outputs, result.finish_reason, len(out))
        return WholeAudio(data, result.finish_reason, self.usage(result.outputs), headers)

    async def respond_whole(self) -> Response:
        whole = await self.whole()
        return Response(whole.data, media_type=content_type(self.speech.response_format), headers=whole.headers)

    # -------------------------------------------------------------- streaming
    async def respond_stream(self) -> Response:
        ready = self.handle.stream_ready().__aiter__()
        try:
            first = await self._watch(self._first_audio(ready))
        except OmnistageError as exc:
            self._finished(exc)
            raise
        if self.speech.stream_format == "sse":
            body, media_type = self._sse(first, ready), "text/event-stream"
        else:
            body, media_type = self._raw(first, ready), content_type(self.speech.response_format)
        headers = {
            "X-Request-Id": self.handle.request_id,
            "X-Sample-Rate": str(self.output_rate),
            TIMELINE_HEADER: self.handle.timeline.header(),
        }
        headers.update(self._ignored_header())
        self._end_watch = asyncio.ensure_future(self._count_failure_when_it_ends())
        return StreamingResponse(body, media_type=media_type, headers=headers)

    async def _count_failure_when_it_ends(self) -> None:
        """Count a stream the pipeline fails (or aborts: a client past its stream cap) when
        it fails: the response itself may be stuck sending to a client that stopped
        reading, and would count it only once that client goes."""
        await self.handle.wait_finished()
        if self.handle.error is not None:
            self._finished(self.handle.error)

    async def _first_audio(self, ready: AsyncIterator[list[StreamChunk]]) -> list[np.ndarray]:
        """The audio of the first chunks that hold any (one or more arrays)."""
        async for chunks in ready:
            if audio := _audio_of(chunks):
                return audio
        await self.handle.result()  # raises the request's error, if any
        raise StageFailureError("server", "the model produced no audio", self.handle.request_id)

    async def _audio_ready(
        self, first: list[np.ndarray], ready: AsyncIterator[list[StreamChunk]]
    ) -> AsyncIterator[list[np.ndarray]]:
        yield first
        async for chunks in ready:
            if audio := _audio_of(chunks):
                yield audio

    async def _encoded(
        self, first: list[np.ndarray], ready: AsyncIterator[list[StreamChunk]]
    ) -> AsyncIterator[list[bytes]]:
        """The response format's bytes of each audio chunk, in lists of the chunks that
        were ready together (one write each; a part may be b""), then the encoder's tail
        (only after the request succeeded: a failed stream never looks complete)."""
        encoder = StreamingAudioEncoder(self.speech.response_format, self.sample_rate, self.output_rate)
        # pcm is a float -> int16 conversion (and a soxr resample when asked): tens of us
        # per chunk, less than a hop to the thread pool and back, which was almost half
        # of the event loop's busy time at 16 streams (py-spy of a CPU server);
        # a codec's encoder (PyAV) keeps the pool (one hop per list) so it never blocks the loop
        inline = self.speech.response_format == "pcm"
        async for audio in self._audio_ready(first, ready):
            self.samples_sent += sum(len(samples) for samples in audio)
            parts = _push_all(encoder, audio) if inline else await run_in_threadpool(_push_all, encoder, audio)
            if any(parts):
                self._first_byte()
                yield parts
        self.result = await self.handle.result()
        tail = encoder.finish()
        if tail:
            self._first_byte()
            yield [tail]

    async def _raw(self, first: list[np.ndarray], ready: AsyncIterator[list[StreamChunk]]) -> AsyncIterator[bytes]:
        error: BaseException | None = None
        try:
            async for parts in self._encoded(first, ready):
                yield b"".join(parts)
            assert self.result is not None
            self._finished(None, self.result.finish_reason)
        except OmnistageError as exc:
            error = exc
            logger.warning(
                "request %s: stream cut after %d samples: %s", self.handle.request_id, self.samples_sent, exc
            )
            raise StreamCut(self.handle.request_id) from None  # no clean end of the chunked body
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._close(error)

    async def _sse(self, first: list[np.ndarray], ready: AsyncIterator[list[StreamChunk]]) -> AsyncIterator[bytes]:
        error: BaseException | None = None
        try:
            async for parts in self._encoded(first, ready):
                yield b"".join(sse_event(SpeechAudioDelta.from_bytes(data)) for data in parts if data)
            assert self.result is not None
            yield sse_event(SpeechAudioDone(usage=self.usage(self.result.outputs), finish_reason=self.result.finish_reason))
            self._finished(None, self.result.finish_reason)
        except OmnistageError as exc:
            error = exc
            yield sse_event(ErrorEvent.from_exception(exc))
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._close(error)

    def usage(self, outputs: dict[str, object]) -> SpeechUsage:
        return usage_of(outputs, len(self.speech.input), self.samples_sent / self.sample_rate)

    def _close(self, error: BaseException | None) -> None:
        if not self.handle.finished:  # the client went away mid-stream
            self.server.pipeline.abort(self.handle.request_id)
            error = RequestAbortedError("client disconnected")
        elif self.handle.error is not None and not isinstance(error, OmnistageError):
            error = self.handle.error  # it ended while the response was stuck sending
        self._end_watch.cancel()
        self.handle.close()
        if error is not None:
            self._finished(error)

    # ------------------------------------------------------------------ helpers
    async def _watch(self, awaitable: Awaitable[T]) -> T:
        """Await ``awaitable``; if the client disconnects meanwhile, abort the request."""
        return await watch_disconnect(awaitable, self.request, lambda: self.server.pipeline.abort(self.handle.request_id))

    def _first_byte(self) -> None:
        if self.first_audio_at is None:
            self.first_audio_at = record_first_audio(self.server.metrics, self.handle, self.received)

    def _finished(self, error: BaseException | None, finish_reason: str = "stop") -> None:
        if self._reported:
            return
        self._reported = True
        latency = time.monotonic() - self.received
        count_request_end(self.server.metrics, error, finish_reason, latency, self.samples_sent / self.sample_rate)

    def _ignored_header(self) -> dict[str, str]:
        ignored = self.speech.ignored_fields
        return {"X-Ignored-Fields": ", ".join(ignored)} if ignored else {}

    def _headers(self, outputs: dict[str, object], finish_reason: str, samples_out: int) -> dict[str, str]:
        usage = self.usage(outputs)
        headers = {
            "X-Request-Id": self.handle.request_id,
            "X-Finish-Reason": finish_reason,
            "X-Sample-Rate": str(self.output_rate),
            "X-Audio-Samples": str(samples_out),
            "X-Audio-Frames": str(usage.output_tokens),
            "X-Input-Tokens": str(usage.input_tokens),
            TIMELINE_HEADER: self.handle.timeline.header(),
        }
        headers.update(self._ignored_header())
        return headers

