"""Wire models, parsing, capability validation, error envelopes and SSE formatting.

Models add their own fields by subclassing :class:`SpeechRequest`: Qwen3-TTS's schema
(voice-clone fields) and ``NoiseRequest`` (float knobs, like Piper's) stand for that here."""

from __future__ import annotations

import base64
import json
import math
import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import Field, ValidationError

from omnistage.core.errors import (
    AuthenticationError,
    OmnistageError,
    PayloadTooLargeError,
    PipelineUnhealthyError,
    QueueFullError,
    RequestAbortedError,
    RequestTimeoutError,
    RequestValidationError,
    StageFailureError,
)
from omnistage.models.qwen3_tts.request_builders import Qwen3TTSSpeechRequest as CloneRequest
from omnistage.serve.protocol import (
    OPENAI_PCM_SAMPLE_RATE,
    ErrorEvent,
    SpeechAudioDelta,
    SpeechAudioDone,
    SpeechCapabilities,
    SpeechRequest,
    SpeechUsage,
    body_too_large,
    check_capabilities,
    error_envelope,
    model_list,
    not_found_envelope,
    output_sample_rate,
    parse_speech_request,
    request_error_from_validation,
    sse_event,
    validate_speech_request,
    voices_response,
    wire_fields,
)


class NoiseRequest(SpeechRequest):
    noise_scale: float | None = Field(default=None, ge=0.0)
    noise_w: float | None = Field(default=None, ge=0.0, le=1.0, description="duration noise")


QWEN = SpeechCapabilities(
    model_names=("qwen3-tts", "Qwen/Qwen3-TTS"),
    model_type="qwen3_tts",
    supported_fields=frozenset(
        {
            "speed", "language", "instructions", "task_type", "ref_audio", "ref_text",
            "references", "x_vector_only_mode", "initial_codec_chunk_frames",
            "max_new_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "seed",
        }
    ),
    voices=("joe", "amy"),
    default_voice="joe",
    languages=("auto", "English", "Chinese"),
    sample_rate=24000,
    max_input_chars=50,
    speed_range=(0.5, 2.0),
)  # fmt: skip

PIPER = SpeechCapabilities(
    model_names=("piper",),
    model_type="piper",
    default_voice="lessac",
    sample_rate=22050,
    supported_fields=frozenset({"noise_scale", "noise_w"}),
    response_formats=frozenset({"wav", "pcm"}),
)


def rejects(param: str | None, fn, *args) -> RequestValidationError:
    with pytest.raises(RequestValidationError) as info:
        fn(*args)
    assert info.value.param == param, str(info.value)
    assert info.value.http_status == 400
    return info.value


SCHEMAS = {"qwen3_tts": CloneRequest, "piper": NoiseRequest}


def parse(body, caps: SpeechCapabilities | None = None) -> SpeechRequest:
    return parse_speech_request(body, SCHEMAS.get(caps.model_type, SpeechRequest) if caps else SpeechRequest)


def valid(body: dict, caps: SpeechCapabilities = QWEN) -> SpeechRequest:
    return validate_speech_request(parse(body, caps), caps)


# --------------------------------------------------------------------------- parsing


def test_minimal_request_defaults():
    req = parse_speech_request(b'{"input": "hello"}')
    assert req.input == "hello"
    assert req.response_format == "wav"
    assert req.speed == 1.0
    assert req.stream is None and req.stream_format == "audio" and not req.streaming
    assert req.sample_rate is None and req.ignored_fields == ()
    assert req.voice is None and req.seed is None


@pytest.mark.parametrize(
    ("body", "field", "value"),
    [
        ({"text": "hi"}, "input", "hi"),
        ({"input": "hi", "speaker": "amy"}, "voice", "amy"),
        ({"text": "hi", "input": "hi"}, "input", "hi"),
        ({"input": "hi", "voice": "amy", "speaker": "amy"}, "voice", "amy"),
    ],
)
def test_aliases(body, field, value):
    req = parse_speech_request(body)
    assert getattr(req, field) == value
    assert field in req.model_fields_set


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "a", "text": "b"}, "input"),
        ({"input": "a", "voice": "joe", "speaker": "amy"}, "voice"),
    ],
)
def test_conflicting_aliases_rejected(body, param):
    err = rejects(param, parse_speech_request, body)
    assert "alias" in str(err)


def test_unknown_field_rejected_with_its_name():
    err = rejects("foo", parse_speech_request, {"input": "hi", "foo": 1})
    assert "unknown field 'foo'" in str(err)


def test_a_field_of_another_model_is_unknown():
    rejects("noise_scale", parse, {"input": "hi", "noise_scale": 0.5}, QWEN)
    rejects("noise_scale", parse_speech_request, {"input": "hi", "noise_scale": 0.5})


def test_unknown_field_hint_lists_the_model_own_fields():
    err = rejects("noise", parse, {"input": "hi", "noise": 0.5}, PIPER)
    assert "this model's own fields: noise_scale, noise_w" in str(err)
    err = rejects("noise", parse_speech_request, {"input": "hi", "noise": 0.5})
    assert "own fields" not in str(err)


def test_own_fields_are_typed():
    req = valid({"input": "hi", "noise_scale": 1, "noise_w": 0.25}, PIPER)
    assert isinstance(req, NoiseRequest) and (req.noise_scale, req.noise_w) == (1.0, 0.25)
    assert isinstance(req.noise_scale, float)


@pytest.mark.parametrize("value", ["0.5", True, [0.5]])
def test_own_field_bad_type_named_as_sent(value):
    err = rejects("noise_w", parse, {"input": "hi", "noise_w": value}, PIPER)
    assert str(err).startswith("noise_w: ")


@pytest.mark.parametrize("top_k", [-1, 0])
def test_top_k_disabled_is_stored_as_zero(top_k):
    req = parse_speech_request({"input": "hi", "top_k": top_k})
    assert req.top_k == 0


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("speed", 4.5, "less than or equal to 4"),
        ("speed", 0.1, "greater than or equal to 0.25"),
        ("speed", "fast", "valid number"),
        ("temperature", -0.1, "greater than or equal to 0"),
        ("top_p", 0, "greater than 0"),
        ("top_p", 1.5, "less than or equal to 1"),
        ("top_k", -2, "greater than or equal to -1"),
        ("repetition_penalty", 0, "greater than 0"),
        ("max_new_tokens", 0, "greater than or equal to 1"),
        ("max_new_tokens", 1.5, "valid integer"),
        ("seed", -1, "greater than or equal to 0"),
        ("seed", 2**64, "less than or equal to"),
        ("initial_codec_chunk_frames", -1, "greater than or equal to 0"),
        ("stream", "yes", "valid boolean"),
        ("stream_format", "ws", "'audio' or 'sse'"),
        ("response_format", "ogg", "'wav', 'pcm', 'flac', 'mp3', 'opus' or 'aac'"),
        ("input", 5, "valid string"),
        ("ref_audio", "", "at least 1 character"),
        ("speed", math.inf, "finite number"),
    ],
)
def test_field_errors_name_the_field(field, value, fragment):
    body = {"input": "hi", field: value}
    err = rejects(field, parse, body, QWEN)
    assert str(err).startswith(f"{field}: ")
    assert fragment in str(err)


def test_nested_error_location_is_dotted():
    body = {"input": "hi", "references": [{"audio": "a"}, {"audio": "b", "txt": "x"}]}
    err = rejects("references.1.txt", parse, body, QWEN)
    assert str(err) == "references.1.txt: unknown field"


def test_missing_input():
    err = rejects("input", parse_speech_request, {"voice": "joe"})
    assert "Field required" in str(err)


@pytest.mark.parametrize(
    "raw", [b"", b"{", b"[1, 2]", b'"hi"', b"null", b"\xff\xfe\x00", b"[" * 100_000, "{'a': 1}"]
)
def test_malformed_bodies_are_400_without_param(raw):
    err = rejects(None, parse_speech_request, raw)
    assert "JSON" in str(err)


def test_multiple_errors_are_counted():
    err = rejects("speed", parse_speech_request, {"input": "hi", "speed": 9, "top_p": 9})
    assert str(err).endswith("(and 1 more error)")


# --------------------------------------------------------------------------- validation


def test_full_request_accepted():
    req = valid(
        {
            "model": "Qwen/Qwen3-TTS", "input": "hello", "voice": "amy", "language": "English",
            "task_type": "Base", "speed": 1.5, "instructions": "calm", "ref_audio": "a.wav",
            "ref_text": "hi", "x_vector_only_mode": True, "initial_codec_chunk_frames": 0,
            "max_new_tokens": 100, "temperature": 0.0, "top_p": 1, "top_k": 50,
            "repetition_penalty": 1.1, "seed": 3, "stream": True, "response_format": "pcm",
        }
    )  # fmt: skip
    assert req.streaming and req.voice == "amy"


def test_unknown_model():
    err = rejects("model", validate_speech_request, SpeechRequest(input="hi", model="x"), QWEN)
    assert "available models: qwen3-tts, Qwen/Qwen3-TTS" in str(err)


@pytest.mark.parametrize("text", ["", "   ", "\n\t"])
def test_empty_input(text):
    rejects("input", valid, {"input": text})


@pytest.mark.parametrize("text", ["\u200b", "\ufeff", " \u200b\n\u2060\ufeff "])
def test_input_of_only_format_characters_is_blank(text):
    """Zero-width space, BOM, word joiner (Unicode category Cf) are nothing to speak."""
    err = rejects("input", valid, {"input": text})
    assert str(err) == "input must not be empty"


def test_format_characters_around_text_are_kept():
    assert valid({"input": "\ufeffhi\u200b"}).input == "\ufeffhi\u200b"


def test_input_length_cap():
    valid({"input": "x" * 50})
    err = rejects("input", valid, {"input": "x" * 51})
    assert "51 characters; the maximum is 50" in str(err)


def test_unsupported_field_lists_supported_fields():
    err = rejects("language", valid, {"input": "hi", "language": "English"}, PIPER)
    assert "field 'language' is not supported by model 'piper'" in str(err)
    assert "supported fields: input, model, noise_scale, noise_w, response_format" in str(err)


@pytest.mark.parametrize(("field", "value"), [("seed", 0), ("references", [{"audio": "a"}])])
def test_each_unsupported_field_is_named(field, value):
    rejects(field, valid, {"input": "hi", field: value}, PIPER)


@pytest.mark.parametrize(("field", "value"), [("speed", 1.5), ("instructions", "calm")])
def test_an_openai_field_the_model_does_not_use_is_ignored_and_named(field, value):
    req = valid({"input": "hi", field: value}, PIPER)
    assert req.ignored_fields == (field,)
    assert getattr(req, field) == SpeechRequest.model_fields[field].get_default()


def test_ignored_fields_are_sorted_and_default_values_are_not_named():
    caps = SpeechCapabilities(model_names=("m",), model_type="t", sample_rate=16000)
    body = {"input": "hi", "voice": "alloy", "speed": 2.0, "instructions": "x"}
    assert valid(body, caps).ignored_fields == ("instructions", "speed", "voice")
    assert valid({"input": "hi", "speed": 1.0}, caps).ignored_fields == ()


def test_default_valued_fields_are_no_ops_on_any_model():
    valid({"input": "hi", "speed": 1.0, "language": None, "seed": None}, PIPER)
    plain = QWEN.model_copy(update={"supported_fields": frozenset()})
    valid({"input": "hi", "x_vector_only_mode": False, "references": []}, plain)


def test_voice_not_available_lists_voices():
    err = rejects("voice", valid, {"input": "hi", "voice": "bob"})
    assert str(err) == "voice 'bob' is not available; available voices: joe, amy"


def test_voice_and_language_match_case_insensitively_in_the_declared_spelling():
    req = valid({"input": "hi", "voice": "AMY", "language": "english"})
    assert (req.voice, req.language) == ("amy", "English")
    assert valid({"input": "hi", "voice": "Lessac"}, PIPER).voice == "lessac"


def test_validation_returns_a_normalized_copy_and_leaves_the_request_alone():
    req = parse({"input": "hi", "voice": "Joe"}, QWEN)
    assert validate_speech_request(req, QWEN).voice == "joe" and req.voice == "Joe"
    exact = parse({"input": "hi", "voice": "joe", "stream": True}, QWEN)
    assert validate_speech_request(exact, QWEN) is exact


def test_voice_equal_to_two_declared_names_after_case_folding_is_ambiguous():
    caps = SpeechCapabilities(model_names=("m",), model_type="t", voices=("Ann", "ANN"), sample_rate=1)
    assert valid({"input": "hi", "voice": "ANN"}, caps).voice == "ANN"
    rejects("voice", valid, {"input": "hi", "voice": "ann"}, caps)


def test_default_only_voice():
    assert valid({"input": "hi", "voice": "lessac"}, PIPER).voice == "lessac"
    err = rejects("voice", valid, {"input": "hi", "voice": "bob"}, PIPER)
    assert "available voices: lessac" in str(err)


def test_voiceless_model_ignores_any_voice():
    caps = SpeechCapabilities(model_names=("m",), model_type="t", sample_rate=16000)
    req = valid({"input": "hi", "voice": "joe"}, caps)
    assert req.voice is None and req.ignored_fields == ("voice",)


@pytest.mark.parametrize("voice", ["amy", {"id": "amy"}])
def test_voice_is_a_name_or_the_sdk_object_form(voice):
    assert valid({"input": "hi", "voice": voice}).voice == "amy"
    assert valid({"input": "hi", "speaker": voice}).voice == "amy"


@pytest.mark.parametrize("voice", [{"name": "amy"}, {"id": 3}, {"id": "amy", "x": 1}, 5])
def test_other_voice_shapes_are_400(voice):
    rejects("voice", valid, {"input": "hi", "voice": voice})


def test_stream_unset_streams_what_the_model_can_stream():
    assert valid({"input": "hi", "response_format": "pcm"}, PIPER).stream is True
    assert valid({"input": "hi", "response_format": "pcm", "stream": False}, PIPER).stream is False
    assert valid({"input": "hi", "response_format": "flac"}, QWEN).stream is False  # not streamable there
    rejects("response_format", valid, {"input": "hi", "response_format": "flac", "stream": True})


def test_references_audio_path_is_an_alias_of_audio():
    req = valid({"input": "hi", "references": [{"audio_path": "clip.wav", "text": "t"}]})
    assert req.references[0].audio == "clip.wav"
    rejects("references", valid, {"input": "hi", "references": [{"audio_path": "a", "audio": "b"}]})


def test_sse_cannot_be_combined_with_stream_false():
    assert valid({"input": "hi", "stream_format": "sse"}).stream is True
    rejects("stream", valid, {"input": "hi", "stream_format": "sse", "stream": False})


@pytest.mark.parametrize(("fmt", "rate"), [("pcm", None), ("pcm", 16000), ("wav", None), ("wav", 48000)])
def test_output_sample_rate_defaults_to_openai_pcm_and_model_wav(fmt, rate):
    req = valid({"input": "hi", "response_format": fmt, "sample_rate": rate})
    default = OPENAI_PCM_SAMPLE_RATE if fmt == "pcm" else QWEN.sample_rate
    assert output_sample_rate(req, QWEN) == (rate or default)


def test_sample_rate_is_for_pcm_and_wav_only_and_within_range():
    rejects("sample_rate", valid, {"input": "hi", "response_format": "mp3", "sample_rate": 16000})
    rejects("sample_rate", valid, {"input": "hi", "response_format": "pcm", "sample_rate": 4000})


def test_voice_required_without_default():
    caps = SpeechCapabilities(model_names=("m",), model_type="t", voices=("a",), sample_rate=1)
    err = rejects("voice", valid, {"input": "hi"}, caps)
    assert "voice is required; available voices: a" in str(err)


def test_language_choices():
    err = rejects("language", valid, {"input": "hi", "language": "French"})
    assert "available languages: auto, English, Chinese" in str(err)


def test_speed_range_of_model():
    valid({"input": "hi", "speed": 2.0})
    err = rejects("speed", valid, {"input": "hi", "speed": 2.5})
    assert "range 0.5..2.0" in str(err)


def test_response_formats_of_model():
    err = rejects("response_format", valid, {"input": "hi", "response_format": "mp3"}, PIPER)
    assert "available response formats: pcm, wav" in str(err)


@pytest.mark.parametrize("body", [{"stream": True}, {"stream_format": "sse"}])
def test_streaming_formats(body):
    assert valid({"input": "hi", "response_format": "pcm", **body}).streaming
    err = rejects("response_format", valid, {"input": "hi", "response_format": "mp3", **body})
    assert "streaming response formats: pcm, wav" in str(err)


def test_instructions_length_cap():
    rejects("instructions", valid, {"input": "hi", "instructions": "x" * 51})


@pytest.mark.parametrize(
    ("name", "value"), [("noise_w", 1.01), ("noise_w", -0.1), ("noise_scale", -1)]
)
def test_own_field_range(name, value):
    err = rejects(name, valid, {"input": "hi", name: value}, PIPER)
    assert "greater than or equal" in str(err) or "less than or equal" in str(err)


def test_own_field_unbounded_side():
    assert valid({"input": "hi", "noise_scale": 1e9}, PIPER).noise_scale == 1e9


# --------------------------------------------------------------------------- capabilities


@pytest.mark.parametrize(
    "kwargs",
    [
        {"voices": ("a",), "default_voice": "b"},
        {"supported_fields": frozenset({"language"})},
        {"speed_range": (1.5, 2.0)},
        {"speed_range": (0.1, 2.0)},
        {"response_formats": frozenset({"mp3"})},
        {"model_names": ()},
        {"sample_rate": 0},
    ],
)
def test_inconsistent_capabilities_rejected_at_build(kwargs):
    base = {"model_names": ("m",), "model_type": "t", "sample_rate": 16000}
    with pytest.raises(ValidationError):
        SpeechCapabilities(**{**base, **kwargs})


@pytest.mark.parametrize("field", ["speeed", "input", "noise_scale"])
def test_supported_fields_must_be_optional_fields_of_the_schema(field):
    caps = SpeechCapabilities(
        model_names=("m",), model_type="t", sample_rate=16000, supported_fields=frozenset({field})
    )
    with pytest.raises(ValueError, match=repr(field)):
        check_capabilities(caps, CloneRequest)
    check_capabilities(QWEN, CloneRequest)


def test_capabilities_are_frozen():
    with pytest.raises(ValidationError):
        QWEN.sample_rate = 1


# --------------------------------------------------------------------------- responses


def test_voices_response():
    body = voices_response(PIPER, NoiseRequest).model_dump(mode="json")
    assert body == {
        "model": "piper",
        "model_type": "piper",
        "voices": [],
        "default_voice": "lessac",
        "languages": [],
        "supported_fields": [
            "input", "model", "noise_scale", "noise_w", "response_format", "sample_rate",
            "stream", "stream_format", "voice",
        ],
        "fields": {
            "voice": {
                "anyOf": [{"type": "string"}, {"type": "null"}], "default": None,
                "description": 'voice name, or {"id": name} (alias: speaker)', "title": "Voice",
            },
            "noise_scale": {
                "anyOf": [{"type": "number", "minimum": 0.0}, {"type": "null"}], "default": None,
                "title": "Noise Scale",
            },
            "noise_w": {
                "anyOf": [{"type": "number", "minimum": 0.0, "maximum": 1.0}, {"type": "null"}],
                "default": None, "description": "duration noise", "title": "Noise W",
            },
        },
        "definitions": {},
        "response_formats": ["pcm", "wav"],
        "sample_rate": 22050,
        "max_input_chars": 4096,
        "saved_voices": False,
    }  # fmt: skip
    qwen = voices_response(QWEN, CloneRequest)
    assert qwen.voices == ["joe", "amy"]
    assert qwen.fields["references"]["anyOf"][0]["items"] == {"$ref": "#/definitions/Qwen3TTSReference"}
    assert set(qwen.definitions["Qwen3TTSReference"]["properties"]) == {"audio", "text"}


def test_model_list_openai_shape():
    body = model_list(QWEN.model_names, created=1700000000).model_dump(mode="json")
    assert body == {
        "object": "list",
        "data": [
            {"id": "qwen3-tts", "object": "model", "created": 1700000000, "owned_by": "omnistage"},
            {
                "id": "Qwen/Qwen3-TTS",
                "object": "model",
                "created": 1700000000,
                "owned_by": "omnistage",
            },
        ],
    }


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("exc", "status", "etype", "param"),
    [
        (RequestValidationError("bad voice", param="voice"), 400, "invalid_request_error", "voice"),
        (PayloadTooLargeError("too big"), 413, "invalid_request_error", None),
        (QueueFullError(8), 503, "queue_full", None),
        (PipelineUnhealthyError("stage died"), 503, "service_unavailable", None),
        (RequestTimeoutError("late"), 504, "timeout", None),
        (StageFailureError("talker", "RuntimeError: x"), 500, "stage_failure", None),
        (RequestAbortedError("gone"), 499, "aborted", None),
        (OmnistageError("base"), 500, "server_error", None),
    ],
)
def test_error_envelope_by_type(exc, status, etype, param):
    got_status, body = error_envelope(exc)
    assert got_status == status
    assert body == {"error": {"message": exc.public_message, "type": etype, "param": param, "code": status}}


def test_a_stage_failure_body_names_the_stage_and_request_never_the_cause():
    error = StageFailureError("talker", "RuntimeError: CUDA error at 0x7f00").for_request("req-1")
    _, body = error_envelope(error)
    assert body["error"]["message"] == (
        "stage 'talker' failed for request req-1; the server log has the cause under that request id"
    )
    assert "CUDA" not in json.dumps(body) and "CUDA" in str(error)  # the log keeps it


def test_error_envelope_hides_unexpected_exceptions():
    status, body = error_envelope(KeyError("secret internals"))
    assert status == 500
    assert "secret" not in json.dumps(body)
    assert body["error"]["type"] == "server_error"


def test_error_envelope_converts_pydantic_errors():
    with pytest.raises(ValidationError) as info:
        SpeechRequest.model_validate({"input": "hi", "speed": 5})
    status, body = error_envelope(info.value)
    assert status == 400
    assert body["error"]["param"] == "speed"
    assert body["error"]["message"] == "speed: Input should be less than or equal to 4"
    assert request_error_from_validation(info.value).param == "speed"


def test_auth_not_found_and_too_large_helpers():
    assert error_envelope(AuthenticationError("invalid or missing API key")) == (
        401,
        {"error": {"message": "invalid or missing API key", "type": "authentication_error",
                   "param": None, "code": 401}},
    )  # fmt: skip
    status, body = not_found_envelope("no route /v1/x")
    assert (status, body["error"]["type"], body["error"]["message"]) == (
        404, "not_found_error", "no route /v1/x",
    )  # fmt: skip
    status, body = error_envelope(body_too_large(1024, size_bytes=2048))
    assert status == 413
    assert body["error"]["message"] == "request body (2048 bytes) exceeds the limit of 1024 bytes"


# --------------------------------------------------------------------------- SSE


def parse_sse(frame: bytes) -> dict:
    assert frame.startswith(b"event: ") and frame.endswith(b"\n\n")
    assert frame.count(b"\n") == 3
    event_line, data_line = frame[:-2].split(b"\n")
    assert data_line.startswith(b"data: ")
    data = json.loads(data_line[len(b"data: ") :])
    assert event_line == b"event: " + data["type"].encode()
    return data


def test_sse_delta_round_trips_audio():
    chunk = bytes(range(256)) + b"\n\n"
    event = parse_sse(sse_event(SpeechAudioDelta.from_bytes(chunk)))
    assert event["type"] == "speech.audio.delta"
    assert base64.b64decode(event["audio"]) == chunk


def test_sse_done():
    usage = SpeechUsage(
        input_tokens=7, output_tokens=3, total_tokens=10, input_characters=5, output_audio_seconds=1.25
    )
    event = parse_sse(sse_event(SpeechAudioDone(usage=usage, finish_reason="stop")))
    assert event["type"] == "speech.audio.done"
    assert event["finish_reason"] == "stop"
    assert event["usage"] == {
        "input_tokens": 7, "output_tokens": 3, "total_tokens": 10,
        "input_characters": 5, "output_audio_seconds": 1.25,
    }  # fmt: skip


def test_sse_error_event():
    event = parse_sse(sse_event(ErrorEvent.from_exception(RequestTimeoutError("late"))))
    assert event == {
        "type": "error",
        "error": {"message": "late", "type": "timeout", "param": None, "code": 504},
    }


def test_sse_event_of_mapping_keeps_text_on_one_line():
    event = parse_sse(sse_event({"type": "x", "text": "line1\nline2 ü"}))
    assert event["text"] == "line1\nline2 ü"


# --------------------------------------------------------------------------- fuzzing

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=60)
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
known_keys = st.sampled_from(sorted(wire_fields(CloneRequest) | wire_fields(NoiseRequest)))
keys = st.one_of([known_keys] * 4 + [st.text(max_size=12)])  # mostly known field names
names = st.sampled_from(["joe", "amy", "lessac", "bob", "auto", "English", "Base", ""])
reference = st.fixed_dictionaries({"audio": st.text(max_size=3)}, optional={"text": st.text()})
# Well-typed values per field, so the fuzzer also reaches the model-level checks.
plausible = {
    "input": st.text(max_size=80),
    "model": st.sampled_from(["piper", "qwen3-tts", "gpt-4o-mini-tts"]),
    "voice": names,
    "language": names,
    "task_type": names,
    "speed": st.floats(0, 5),
    "stream": st.booleans(),
    "stream_format": st.sampled_from(["audio", "sse"]),
    "response_format": st.sampled_from(["wav", "pcm", "mp3"]),
    "ref_audio": st.text(max_size=3),
    "ref_text": st.text(max_size=3),
    "references": st.lists(reference, max_size=2),
    "x_vector_only_mode": st.booleans(),
    "temperature": st.floats(-1, 3),
    "top_k": st.integers(-3, 100),
    "seed": st.integers(-5, 2**64),
    "noise_scale": st.floats(-1, 3),
    "noise_w": st.floats(-1, 3),
}


@st.composite
def bodies(draw) -> dict:
    body = {"input": "hello"} if draw(st.booleans()) else {}
    for key in draw(st.lists(keys, max_size=6)):
        typed = plausible.get(key)
        body[key] = draw(typed if typed is not None and draw(st.booleans()) else json_values)
    return body


caps_choice = st.sampled_from([QWEN, PIPER])


def parse_and_validate(body, caps) -> None:
    try:
        validate_speech_request(parse(body, caps), caps)
    except RequestValidationError as exc:
        assert exc.http_status == 400
        assert exc.param is None or isinstance(exc.param, str)
        assert str(exc)


@settings(max_examples=400, deadline=None)
@given(body=bodies(), caps=caps_choice)
def test_fuzz_dicts_only_raise_request_validation_error(body, caps):
    parse_and_validate(body, caps)


@settings(max_examples=200, deadline=None)
@given(body=bodies(), caps=caps_choice)
def test_fuzz_json_bytes_only_raise_request_validation_error(body, caps):
    try:
        raw = json.dumps(body).encode()
    except ValueError:
        return
    parse_and_validate(raw, caps)
    parse_and_validate(raw[: len(raw) // 2], caps)


@settings(max_examples=200, deadline=None)
@given(raw=st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()))
def test_fuzz_arbitrary_bodies(raw):
    parse_and_validate(raw, PIPER)


speakable = st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00")


@settings(max_examples=200, deadline=None)
@given(
    input_=st.text(speakable, min_size=1, max_size=50).filter(
        lambda text: any(not c.isspace() and unicodedata.category(c) != "Cf" for c in text)
    ),
    seed=st.integers(0, 2**63 - 1),
)
def test_fuzz_valid_requests_accepted(input_, seed):
    req = valid({"text": input_, "seed": seed, "voice": "amy"})
    assert (req.input, req.seed) == (input_, seed)
