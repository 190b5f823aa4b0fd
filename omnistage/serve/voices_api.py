"""``/v1/audio/voices``: what the served model takes, and its library of saved voices.

- ``GET /v1/audio/voices``: the model's voices, fields and limits, plus this key's saved
  voices as OpenAI voice objects (``uploaded_voices``).
- ``POST /v1/audio/voices`` (multipart, the field names of vLLM-Omni and of OpenAI's
  ``client.audio.voices.create``): ``audio_sample`` (file), ``name``, ``consent``, and
  omnistage's optional ``ref_text`` (the clip's transcript: in-context cloning; without it
  the model clones from the speaker embedding alone). Answers the OpenAI voice object.
  The form is sent as is: a ``Content-Encoding`` other than identity is a 415, before
  the body is read.
- ``DELETE /v1/audio/voices/{id}`` (the id or the name): OpenAI's ``audio.voice.deleted``.

An upload is checked the way a speech request naming it would be (the model's request
builder decodes the clip and applies its duration limits) before it is stored, so a saved
voice never fails later for its audio.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Literal

from fastapi import APIRouter, Form, Request, UploadFile
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData

from omnistage.core.errors import (
    ConflictError,
    OmnistageError,
    PayloadTooLargeError,
    RequestValidationError,
)
from omnistage.serve.protocol import validate_speech_request, voices_response
from omnistage.serve.server_core import IdentityBodyRoute
from omnistage.serve.voice_library import MAX_NAME_CHARS, SavedVoice, data_uri

if TYPE_CHECKING:
    from omnistage.serve.app import SpeechServer

__all__ = ["VoiceObject", "install_voice_routes"]

_UPLOAD_READ_BYTES = 1 << 20
_UPLOAD_FIELDS = ("audio_sample", "name", "consent", "ref_text")


class VoiceObject(BaseModel):
    """A saved voice as OpenAI's API shows one (``openai.types.audio.Voice``), plus its
    consent reference and whether it has a transcript."""

    id: str
    object: Literal["audio.voice"] = "audio.voice"
    name: str
    created_at: int
    type: Literal["audio_sample"] = "audio_sample"
    consent: str
    has_ref_text: bool

    @classmethod
    def of(cls, voice: SavedVoice) -> VoiceObject:
        return cls(
            id=voice.id,
            name=voice.name,
            created_at=voice.created_at,
            consent=voice.consent,
            has_ref_text=voice.ref_text is not None,
        )


class VoiceDeleted(BaseModel):
    """OpenAI's ``audio.voice.deleted`` answer."""

    id: str
    object: Literal["audio.voice.deleted"] = "audio.voice.deleted"
    deleted: bool = True


def install_voice_routes(v1: APIRouter, server: SpeechServer) -> None:
    """Add the ``/audio/voices`` routes to the ``/v1`` router."""
    caps = server.capabilities

    @v1.get("/audio/voices")
    async def voices(request: Request) -> JSONResponse:
        body = voices_response(caps, server.request_type).model_dump(mode="json")
        saved = server.library.list(request.state.owner) if server.library is not None else []
        body["uploaded_voices"] = [VoiceObject.of(v).model_dump() for v in saved]
        return JSONResponse(body)

    async def upload(
        request: Request,
        audio_sample: UploadFile,
        name: str = Form(),
        consent: str = Form(),
        ref_text: str | None = Form(default=None),
    ) -> JSONResponse:
        library = _library(server)
        _check_form_fields(await request.form())
        name, consent = _check_name(name, caps.voices), _check_consent(consent)
        mime_type = _mime_type(audio_sample.content_type)
        data = await _read_upload(audio_sample, server.settings.media_policy.max_bytes)
        await run_in_threadpool(_check_clip, server, data_uri(mime_type, data), ref_text or None)
        voice = await run_in_threadpool(
            library.add, request.state.owner, name, consent, ref_text or None, mime_type, data
        )
        return JSONResponse(VoiceObject.of(voice).model_dump())

    v1.add_api_route("/audio/voices", upload, methods=["POST"], route_class_override=IdentityBodyRoute)

    @v1.delete("/audio/voices/{voice_id}")
    async def delete(request: Request, voice_id: str) -> JSONResponse:
        voice = await run_in_threadpool(_library(server).delete, request.state.owner, voice_id)
        return JSONResponse(VoiceDeleted(id=voice.id).model_dump())


def _library(server: SpeechServer):
    if server.library is None:
        reason = (
            f"model {server.capabilities.model_name!r} does not clone voices"
            if not server.capabilities.saved_voices
            else "the server has no data directory (--data-dir)"
        )
        raise RequestValidationError(f"no voice library: {reason}")
    return server.library


def _check_form_fields(form: FormData) -> None:
    """Each part of the upload is one of :data:`_UPLOAD_FIELDS`, once.

    Raises:
        RequestValidationError: an unknown or repeated part (``param`` its name).
    """
    counts = Counter(key for key, _ in form.multi_items())
    for key, count in counts.items():
        if key not in _UPLOAD_FIELDS:
            raise RequestValidationError(
                f"unknown field {key!r} (an upload takes {', '.join(_UPLOAD_FIELDS)})", param=key
            )
        if count > 1:
            raise RequestValidationError(f"{key} is sent {count} times; send it once", param=key)


def _check_name(name: str, builtin: tuple[str, ...]) -> str:
    name = name.strip()
    if not name or len(name) > MAX_NAME_CHARS or not name.isprintable():
        raise RequestValidationError(
            f"name must be 1 to {MAX_NAME_CHARS} printable characters", param="name"
        )
    if name.casefold() in {v.casefold() for v in builtin}:
        raise ConflictError(f"{name!r} is a built-in voice of this model", param="name")
    return name


def _check_consent(consent: str) -> str:
    consent = consent.strip()
    if not consent or len(consent) > 256:
        raise RequestValidationError(
            "consent must name the speaker's consent (1 to 256 characters)", param="consent"
        )
    return consent


def _mime_type(content_type: str | None) -> str:
    """The clip's type for its data URI: an ``audio/*`` type as sent, else octet-stream
    (the decoder reads the container from the bytes either way)."""
    base = (content_type or "").split(";")[0].strip().lower()
    return base if base.startswith("audio/") and base.isprintable() else "application/octet-stream"


async def _read_upload(upload: UploadFile, limit: int) -> bytes:
    """The uploaded file, at most ``limit`` bytes (413 above it)."""
    chunks, size = [], 0
    while chunk := await upload.read(_UPLOAD_READ_BYTES):
        size += len(chunk)
        if size > limit:
            raise PayloadTooLargeError(
                f"audio_sample exceeds the limit of {limit} bytes", param="audio_sample"
            )
        chunks.append(chunk)
    if not size:
        raise RequestValidationError("audio_sample is empty", param="audio_sample")
    return b"".join(chunks)


def _check_clip(server: SpeechServer, audio: str, ref_text: str | None) -> None:
    """Build a request naming the clip as its voice, as a speech request would (decoding,
    duration and silence checks of the model); an error names ``audio_sample``."""
    probe = server.model.with_saved_voice(server.request_type(input="Hello."), audio, ref_text)
    try:
        probe = validate_speech_request(probe, server.capabilities)
        server.model.build_request(probe, server.settings.media_policy)
    except OmnistageError as exc:
        param = getattr(exc, "param", None)
        if param == "ref_text" or not isinstance(exc, RequestValidationError):
            raise
        raise type(exc)(f"audio_sample: {exc}", param="audio_sample") from None
