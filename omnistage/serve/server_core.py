"""What the speech and the chat servers share: the server's settings and state (the model's
running pipeline, metrics, readiness), the request body rules, the disconnect watch, and the
deliberate cut of a failed stream."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from fastapi import Request, Response
from fastapi.routing import APIRoute
from starlette.requests import ClientDisconnect

from omnistage.core.errors import (
    OmnistageError,
    PipelineUnhealthyError,
    RequestAbortedError,
    UnsupportedMediaTypeError,
)
from omnistage.core.request import PipelineRequest
from omnistage.pipeline.coordinator import RequestHandle
from omnistage.pipeline.pipeline import Pipeline
from omnistage.pipeline.timeline import FIRST_BYTE
from omnistage.serve.decoding import shared_pool
from omnistage.serve.media import MediaPolicy
from omnistage.serve.metrics import ServerMetrics
from omnistage.serve.model import ModelConfig
from omnistage.serve.protocol import body_too_large

logger = logging.getLogger(__name__)
T = TypeVar("T")

DISCONNECT_POLL_S = 0.25


@dataclass(frozen=True)
class ServerSettings:
    """Server policy.

    Attributes:
        api_keys: when any, ``/v1/*`` requires ``Authorization: Bearer <one of them>``;
            each key owns the voices it saves.
        media_policy: where reference audio and chat media may come from, and their caps.
        max_body_bytes: request body cap (413 above it); the default, 15 MiB, fits the
            largest legitimate request: 10 MiB of reference audio (the media cap) is 13.3
            MiB as base64, plus at most 4,096 characters of text (issue 12: the cap was 32
            MiB, and 8 parallel 30 MB bodies kept 324 MiB of RSS).
        warmup: run the model's warm-up request before reporting ready.
        playground: serve the web playground at ``/`` (its assets under ``/playground``;
            both public, the page sends its key to ``/v1`` itself).
        served_model_names: the names requests may give as ``model`` (the first is the id
            in ``/v1/models``), replacing the model's own; empty: the model's own names.
        data_dir: where saved voices live (:mod:`omnistage.serve.voice_library`); None:
            no voice library.
    """

    api_keys: tuple[str, ...] = ()
    media_policy: MediaPolicy = field(default_factory=MediaPolicy)
    max_body_bytes: int = 15 * 1024 * 1024
    warmup: bool = True
    playground: bool = True
    served_model_names: tuple[str, ...] = ()
    data_dir: Path | None = None


class ModelServer:
    """The server's state for one model: its running pipeline, metrics, readiness. A kind's
    server (speech, chat) adds its request handling and gives the warm-up request."""

    def __init__(self, model: ModelConfig, settings: ServerSettings, on_fatal: Callable[[str], None] | None = None) -> None:
        self.model, self.settings = model, settings
        self.pipeline = Pipeline(model, on_fatal=on_fatal)
        self.metrics = ServerMetrics()
        self.ready = False
        self.start_error: str | None = None
        self.created = int(time.time())

    def warmup_request(self) -> PipelineRequest:
        """The model's typed request run once before reporting ready."""
        raise NotImplementedError

    @property
    def model_name(self) -> str:
        raise NotImplementedError

    async def start(self) -> None:
        """Start the decoder workers (so a first burst of media requests does not wait for
        them to boot: ~1.5 s each on the 2-core host) and the pipeline, then warm up."""
        shared_pool(self.settings.media_policy.decode_workers).start()
        await self.pipeline.start()
        assert self.pipeline.host is not None
        for name, stage in self.pipeline.host.stages.items():
            stage.scheduler.batch_observer = functools.partial(self.metrics.observe_batch, name)
        if self.settings.warmup:
            handle = self.pipeline.submit(self.warmup_request())
            await handle.result()
        self.ready = True
        logger.info("ready: serving %s", self.model_name)

    async def stop(self) -> None:
        self.ready = False
        await self.pipeline.stop()

    def update_stage_metrics(self) -> None:
        """Sample queue depths of the stages in this process (for a /metrics scrape);
        ``queued`` is the total of messages waiting in those stages' inboxes."""
        assert self.pipeline.host is not None
        depths = {name: stage.scheduler.queue_depth() for name, stage in self.pipeline.host.stages.items()}
        for name, depth in depths.items():
            self.metrics.set_stage_queue_depth(name, depth)
        self.metrics.set_queued(sum(depths.values()))


async def admit(server: ModelServer, request_id: str, prepare_and_submit: Callable[[], Awaitable[T]]) -> T:
    """Prepare and admit one request: 503 while the server is not ready, then
    ``prepare_and_submit()``. A refusal is counted in the metrics and raised (a bug's is
    logged and becomes a 500 envelope); an admission counts as started.

    Raises:
        OmnistageError: the request is invalid, or the server cannot take it now.
    """
    try:
        if not server.ready:
            raise PipelineUnhealthyError(server.start_error or "the server is starting; see GET /health")
        admitted = await prepare_and_submit()
    except OmnistageError as exc:
        server.metrics.request_rejected(exc.http_status)
        raise
    except Exception:  # a bug before admission: logged, counted, a 500 envelope
        logger.exception("request %s failed before admission", request_id)
        server.metrics.request_rejected(500)
        raise
    server.metrics.request_started()
    return admitted


def record_first_audio(metrics: ServerMetrics, handle: RequestHandle, received: float) -> float:
    """Record that a request's first audio byte is being handed to its response now: its
    time to first audio (``omnistage_time_to_first_audio_seconds``, from ``received``,
    ``time.monotonic()`` seconds), the ``first_byte`` mark of its timeline, and the phases of
    that TTFA (``omnistage_request_phase_seconds``; with DEBUG logging also one line per
    request). Returns the time of first audio (``time.monotonic()`` seconds)."""
    at = time.monotonic()
    metrics.first_audio(at - received)
    handle.timeline.add(FIRST_BYTE, at)
    phases = handle.timeline.phases(FIRST_BYTE)
    metrics.first_audio_phases(phases)
    if logger.isEnabledFor(logging.DEBUG):
        steps = " ".join(f"{name}=+{seconds * 1e3:.1f}" for name, seconds in phases)
        logger.debug("request %s: TTFA %.1f ms = %s (ms)", handle.request_id, (at - received) * 1e3, steps)
    return at


def count_request_end(
    metrics: ServerMetrics, error: BaseException | None, finish_reason: str, latency_s: float, audio_s: float
) -> None:
    """Count an admitted request's end: 200 with ``finish_reason`` on success, else the
    error's status with ``"abort"`` (client gone, explicit abort) or ``"error"``."""
    if error is None:
        metrics.request_finished(200, finish_reason, latency_s, audio_s)
        return
    status = error.http_status if isinstance(error, OmnistageError) else 500
    reason = "abort" if isinstance(error, RequestAbortedError) else "error"
    metrics.request_finished(status, reason, latency_s, audio_s)


async def watch_disconnect(awaitable: Awaitable[T], request: Request, abort: Callable[[], None]) -> T:
    """Await ``awaitable``; if the client disconnects meanwhile, call ``abort`` (and keep
    awaiting: the aborted request ends with its error)."""
    task = asyncio.ensure_future(awaitable)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
        if done:
            return task.result()
        if await request.is_disconnected():
            abort()
            return await task


def require_json(request: Request) -> None:
    """JSON bodies only, sent as is: besides being the API's format, this keeps a web page
    from making a browser post a "simple" (text/plain or form) request to a local server.

    Raises:
        UnsupportedMediaTypeError: another media type, or a content coding (see
            :func:`require_identity_encoding`).
    """
    media_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        raise UnsupportedMediaTypeError(
            f"the body must be JSON with Content-Type: application/json, got {media_type or 'none'!r}"
        )
    require_identity_encoding(request)


def require_identity_encoding(request: Request) -> None:
    """The body is sent as is: every ``Content-Encoding`` header line, each a comma-separated
    list, names only ``identity`` (any case) or nothing. The body is never decompressed.

    Raises:
        UnsupportedMediaTypeError: another coding (gzip, ...), named, with ``coding`` set
            (the answer then carries ``Accept-Encoding: identity``, RFC 7694).
    """
    for line in request.headers.getlist("content-encoding"):
        for coding in line.split(","):
            coding = coding.strip().lower()
            if coding not in ("", "identity"):
                raise UnsupportedMediaTypeError(
                    f"Content-Encoding {coding!r} is not supported; send the body uncompressed", coding=coding
                )


class IdentityBodyRoute(APIRoute):
    """A route whose body FastAPI parses itself (a multipart form): the body's encoding is
    checked (:func:`require_identity_encoding`) before it is read."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            require_identity_encoding(request)
            return await handler(request)

        return checked


async def read_body(request: Request, limit: int) -> bytes:
    """The body, at most ``limit`` bytes (413 above it; a client gone mid-upload ends the
    request quietly)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise body_too_large(limit, int(declared))
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise body_too_large(limit, size)
            chunks.append(chunk)
    except ClientDisconnect as exc:
        raise RequestAbortedError("client disconnected while sending the body") from exc
    return b"".join(chunks)


class StreamCut(Exception):
    """Raised into the ASGI server to end a streamed body on purpose without its final
    chunk (the request failed after its headers went out). It is logged as one warning
    line by the route; :class:`_QuietStreamCuts` keeps uvicorn from adding a traceback."""


class _QuietStreamCuts(logging.Filter):
    """Drops uvicorn's "Exception in ASGI application" record when the exception is a
    deliberate :class:`StreamCut` (issue 12: every failed stream logged a traceback)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], StreamCut))


def quiet_stream_cuts() -> None:
    uvicorn_errors = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _QuietStreamCuts) for f in uvicorn_errors.filters):
        uvicorn_errors.addFilter(_QuietStreamCuts())
