"""OpenAI clients unchanged: the SDK in every format and both stream formats, served names,
the voice object form, output sample rates and the ignored-fields policy (tone model)."""

import base64
import io
import json
import wave
from collections.abc import Iterator

import av
import httpx
import numpy as np
import openai
import pytest
import soundfile

from omnistage.serve.app import ServerSettings
from omnistage.serve.audio import float_to_s16, resample
from omnistage.testing.tone import SAMPLE_RATE
from tests.serve.conftest import RunningServer, serve
from tests.serve.test_server import expected_pcm, expected_samples, speech

FORMATS = ["wav", "pcm", "flac", "mp3", "opus", "aac"]


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused")


def decode(data: bytes, fmt: str) -> tuple[np.ndarray, int]:
    """Decode ``data`` as ``fmt`` -> (mono float32 samples, sample rate)."""
    if fmt == "pcm":
        return np.frombuffer(data, "<i2").astype(np.float32) / 32767.0, 24_000
    with av.open(io.BytesIO(data), format={"aac": "aac", "opus": "ogg"}.get(fmt, fmt)) as container:
        stream = container.streams.audio[0]
        frames = [frame.to_ndarray().reshape(-1) for frame in container.decode(stream)]
        samples = np.concatenate(frames)
        scale = 32767.0 if samples.dtype == np.int16 else 1.0  # float_to_s16 inverts it exactly
        return (samples / scale).astype(np.float32), stream.rate


def assert_decodes_to_the_text(data: bytes, fmt: str, text: str) -> None:
    """``data`` is a valid ``fmt`` stream holding the tone model's audio for ``text``."""
    if fmt == "pcm":
        assert data == expected_pcm(text)
        return
    samples, rate = decode(data, fmt)
    expected = len(expected_samples(text)) * rate // SAMPLE_RATE
    if fmt in ("wav", "flac"):
        assert rate == SAMPLE_RATE and len(samples) == expected
        assert np.array_equal(float_to_s16(samples), float_to_s16(expected_samples(text)))
    elif fmt == "opus":  # Ogg Opus trims its pre-skip and padding exactly
        assert rate == 48_000 and len(samples) == expected
    else:  # mp3 / ADTS aac streams carry encoder priming and padding: a frame or two more
        assert expected <= len(samples) <= expected + 2 * 1152


def sse_deltas(lines: Iterator[str]) -> tuple[bytes, dict]:
    """Read an SSE stream by its ``event:`` lines -> (decoded deltas, done event)."""
    audio, done, event = [], None, None
    for line in lines:
        if line.startswith("event: "):
            event = line[len("event: ") :]
        elif line.startswith("data: "):
            data = json.loads(line[len("data: ") :])
            assert data["type"] == event
            if event == "speech.audio.delta":
                audio.append(base64.b64decode(data["audio"]))
            elif event == "speech.audio.done":
                done = data
    assert done is not None, "no speech.audio.done"
    return b"".join(audio), done


@pytest.mark.parametrize("fmt", ["pcm", "mp3", "opus", "aac"])
def test_sdk_streams_a_format_without_a_length_header_by_default(tone_server, fmt):
    text = "formats!"
    with client(tone_server).audio.speech.with_streaming_response.create(
        model="tone-test", voice="sine", input=text, response_format=fmt
    ) as response:
        assert "x-finish-reason" not in response.headers  # streamed: no trailing facts
        data = b"".join(response.iter_bytes(chunk_size=100))
    assert_decodes_to_the_text(data, fmt, text)


@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_a_format_whose_header_states_the_length_is_a_whole_file_by_default(tone_server, fmt):
    """A default request's wav/flac reads back with its true duration in ``wave`` and
    soundfile (a streamed header can only say "unknown length", which they misread)."""
    text = "a whole file, please"
    response = speech(tone_server, {"input": text, "response_format": fmt})
    assert response.headers["x-finish-reason"] == "stop"  # the whole-file response
    n = len(expected_samples(text))
    info = soundfile.info(io.BytesIO(response.content))
    assert (info.frames, info.samplerate) == (n, SAMPLE_RATE)
    if fmt == "wav":
        with wave.open(io.BytesIO(response.content)) as w:
            assert (w.getnframes(), w.getframerate()) == (n, SAMPLE_RATE)
    assert_decodes_to_the_text(response.content, fmt, text)


@pytest.mark.parametrize("fmt", ["wav", "flac"])
def test_a_length_header_format_streams_when_asked(tone_server, fmt):
    text = "streamed anyway"
    with client(tone_server).audio.speech.with_streaming_response.create(
        model="tone-test", voice="sine", input=text, response_format=fmt, extra_body={"stream": True}
    ) as response:
        assert "x-finish-reason" not in response.headers
        data = b"".join(response.iter_bytes(chunk_size=100))
    assert_decodes_to_the_text(data, fmt, text)


@pytest.mark.parametrize("fmt", FORMATS)
def test_sdk_sse_deltas_decode_as_the_requested_format(tone_server, fmt):
    text = "formats!"
    with client(tone_server).audio.speech.with_streaming_response.create(
        model="tone-test", voice="sine", input=text, response_format=fmt, stream_format="sse"
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        data, done = sse_deltas(response.iter_lines())
    assert_decodes_to_the_text(data, fmt, text)
    usage = done["usage"]
    assert all(isinstance(usage[k], int) for k in ("input_tokens", "output_tokens", "total_tokens"))
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"] == 2 * len(text)


@pytest.mark.parametrize("fmt", FORMATS)
def test_whole_file_on_request_equals_the_stream(tone_server, fmt):
    """``stream: false`` gives one complete file (sizes, gapless and MD5 headers filled)."""
    text = "whole"
    whole = client(tone_server).audio.speech.create(
        model="tone-test", voice="sine", input=text, response_format=fmt, extra_body={"stream": False}
    )
    assert whole.response.headers["x-finish-reason"] == "stop"
    samples, _ = decode(whole.content, fmt)
    if fmt in ("pcm", "wav", "flac"):
        streamed, _ = decode(speech(tone_server, {"input": text, "response_format": fmt, "stream": True}).content, fmt)
        assert np.array_equal(samples, streamed)


def test_voice_object_form_of_the_sdk(tone_server):
    audio = client(tone_server).audio.speech.create(
        model="tone-test", voice={"id": "square"}, input="hi", response_format="pcm"
    )
    assert audio.content == expected_pcm("hi", "square")


@pytest.mark.parametrize("rate", [8_000, 16_000, 44_100, 48_000])
def test_pcm_sample_rate_is_resampled_exactly_like_the_whole_clip(tone_server, rate):
    response = speech(tone_server, {"input": "rate", "response_format": "pcm", "sample_rate": rate})
    assert response.headers["x-sample-rate"] == str(rate)
    assert response.content == expected_pcm("rate", rate=rate)


def test_pcm_at_the_models_own_rate_is_the_models_samples(tone_server):
    response = speech(tone_server, {"input": "native", "response_format": "pcm", "sample_rate": SAMPLE_RATE})
    assert response.content == float_to_s16(expected_samples("native")).tobytes()


@pytest.mark.parametrize("stream", [False, True])
def test_wav_sample_rate_is_in_its_header(tone_server, stream):
    body = {"input": "wav", "response_format": "wav", "sample_rate": 48_000, "stream": stream}
    samples, rate = decode(speech(tone_server, body).content, "wav")
    assert rate == 48_000
    expected = float_to_s16(resample(expected_samples("wav"), SAMPLE_RATE, 48_000))
    assert np.array_equal(float_to_s16(samples), expected)


def test_an_openai_field_the_model_does_not_use_is_named_in_x_ignored_fields(tone_server):
    body = {"input": "hi", "instructions": "whisper", "response_format": "pcm"}
    for stream in (False, True):
        response = speech(tone_server, {**body, "stream": stream})
        assert response.status_code == 200
        assert response.headers["x-ignored-fields"] == "instructions"
        assert response.content == expected_pcm("hi")
    assert "x-ignored-fields" not in speech(tone_server, {"input": "hi", "speed": 2.0}).headers


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "ref_audio": "x"}, "ref_audio"),  # nobody here defines it
        ({"input": "hi", "voice": "alloy"}, "voice"),  # a model with voices: it would change the voice
        ({"input": "hi", "sample_rate": 16000, "response_format": "mp3"}, "sample_rate"),
        ({"input": "hi", "stream": False, "stream_format": "sse"}, "stream"),
    ],
)
def test_values_that_would_change_what_the_user_gets_are_400(tone_server, body, param):
    response = speech(tone_server, body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param


# ----------------------------------------------------------------- served names
@pytest.fixture(scope="module")
def named_server() -> Iterator[RunningServer]:
    names = ("Qwen/Qwen3-TTS-12Hz-0.6B-Base", "tts-1", "gpt-4o-mini-tts")
    yield from serve(ServerSettings(served_model_names=names))


def test_served_model_names_replace_the_models_own(named_server):
    models = httpx.get(f"{named_server.base_url}/v1/models").json()
    assert [card["id"] for card in models["data"]] == ["Qwen/Qwen3-TTS-12Hz-0.6B-Base", "tts-1", "gpt-4o-mini-tts"]
    for name in ("tts-1", "gpt-4o-mini-tts", "Qwen/Qwen3-TTS-12Hz-0.6B-Base"):
        audio = client(named_server).audio.speech.create(model=name, voice="sine", input="hi", response_format="pcm")
        assert audio.content == expected_pcm("hi")
    response = speech(named_server, {"model": "tone-test", "input": "hi"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "model"


def test_get_model_by_id_including_a_hugging_face_id(named_server):
    sdk = client(named_server)
    card = sdk.models.retrieve("Qwen/Qwen3-TTS-12Hz-0.6B-Base")
    assert (card.id, card.object) == ("Qwen/Qwen3-TTS-12Hz-0.6B-Base", "model")
    assert sdk.models.retrieve("tts-1").id == "tts-1"
    response = httpx.get(f"{named_server.base_url}/v1/models/tts-2")
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error" and "tts-1" in response.json()["error"]["message"]


# ----------------------------------------------------------------- batch
def batch(server: RunningServer, requests, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/audio/speech/batch", json={"requests": requests}, timeout=30, **kwargs)


def test_batch_results_come_in_order_each_with_its_own_status(tone_server):
    requests = [
        {"input": "first", "response_format": "pcm"},
        {"input": "hi", "voice": "nobody"},
        {"input": "second", "voice": "square", "response_format": "pcm", "instructions": "x"},
        {"input": "FAIL"},
        {"input": "third", "response_format": "wav", "max_new_tokens": 2},
    ]
    response = batch(tone_server, requests)
    assert response.status_code == 200
    items = response.json()["data"]
    assert [item["index"] for item in items] == [0, 1, 2, 3, 4]
    assert [item["status"] for item in items] == [200, 400, 200, 500, 200]
    assert base64.b64decode(items[0]["audio"]) == expected_pcm("first")
    assert items[1]["error"]["param"] == "voice" and "audio" not in items[1]
    assert base64.b64decode(items[2]["audio"]) == expected_pcm("second", "square")
    assert items[2]["ignored_fields"] == ["instructions"]
    assert items[3]["error"]["type"] == "stage_failure"
    assert items[4]["finish_reason"] == "length" and items[4]["sample_rate"] == SAMPLE_RATE
    assert items[4]["usage"]["output_tokens"] == 2
    assert_decodes_to_the_text(base64.b64decode(items[4]["audio"]), "wav", "th")


@pytest.mark.parametrize(
    ("body", "param"),
    [({"requests": []}, "requests"), ({"requests": "x"}, "requests"), ({"requests": [1]}, "requests.0"),
     ({"requests": [{"input": "a"}], "extra": 1}, "extra"), ({"requests": [{"input": "a"}] * 65}, "requests")],
)
def test_a_malformed_batch_is_400(tone_server, body, param):
    response = httpx.post(f"{tone_server.base_url}/v1/audio/speech/batch", json=body, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_batch_items_cannot_stream(tone_server):
    items = batch(tone_server, [{"input": "a", "stream": True}, {"input": "b", "stream_format": "sse"}]).json()["data"]
    assert [(item["status"], item["error"]["param"]) for item in items] == [(400, "stream"), (400, "stream")]


# ----------------------------------------------------------------- every status in the envelope
@pytest.mark.parametrize(
    ("method", "path", "kwargs", "status", "error_type"),
    [
        ("POST", "/v1/audio/speech", {"json": {"input": "hi", "bogus": 1}}, 400, "invalid_request_error"),
        ("POST", "/v1/audio/voices", {"data": {"name": "n"}}, 400, "invalid_request_error"),
        ("GET", "/v1/models/nope", {}, 404, "not_found_error"),
        ("GET", "/v1/nothing", {}, 404, "not_found_error"),
        ("GET", "/v1/audio/speech", {}, 405, "invalid_request_error"),
        ("POST", "/v1/audio/speech", {"json": {"input": "hi", "ref_audio": "A" * 100_000}}, 413, "invalid_request_error"),
        ("POST", "/v1/audio/speech", {"content": b"{}", "headers": {"Content-Type": "text/plain"}}, 415, "invalid_request_error"),
        ("POST", "/v1/audio/speech", {"json": {"input": "FAIL"}}, 500, "stage_failure"),
    ],
)
def test_each_status_comes_in_the_openai_error_envelope(tone_server, method, path, kwargs, status, error_type):
    response = httpx.request(method, f"{tone_server.base_url}{path}", timeout=30, **kwargs)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["code"], error["type"]) == (status, error_type) and error["message"]


def test_401_comes_in_the_envelope(auth_server):
    response = httpx.get(f"{auth_server.base_url}/v1/models")
    assert response.status_code == 401
    assert response.json()["error"] == {
        "message": "invalid or missing API key", "type": "authentication_error", "param": None, "code": 401,
    }  # fmt: skip
