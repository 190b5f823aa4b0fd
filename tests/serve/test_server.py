"""The HTTP server end to end, with the deterministic tone model behind a real uvicorn."""

import base64
import gzip
import io
import json
import logging
import re
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import av
import httpx
import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omnistage.serve.app import ServerSettings, StreamCut, create_app
from omnistage.serve.audio import float_to_s16, resample
from omnistage.serve.decoding import shared_pool
from omnistage.serve.protocol import OPENAI_PCM_SAMPLE_RATE
from omnistage.testing.tone import SAMPLE_RATE, ToneConfig, ToneRequest, tone_samples
from tests.serve.conftest import run_uvicorn, serve, wait_health

JSON = {"Content-Type": "application/json"}


def expected_samples(text: str, voice: str = "sine", speed: float = 1.0) -> np.ndarray:
    """The tone model's float32 output at its own rate (16 kHz)."""
    return np.concatenate(tone_samples(ToneRequest(text, voice, speed, 10_000, 0.0)))


def expected_pcm(text: str, voice: str = "sine", speed: float = 1.0, rate: int = OPENAI_PCM_SAMPLE_RATE) -> bytes:
    """What a pcm request returns: s16le at ``rate`` (24 kHz unless ``sample_rate`` is set)."""
    return float_to_s16(resample(expected_samples(text, voice, speed), SAMPLE_RATE, rate)).tobytes()


def speech(server, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/audio/speech", json=body, timeout=30, **kwargs)


def decoded(data: bytes) -> tuple[int, int]:
    """(sample rate in Hz, sample count) of the audio file ``data``, as FFmpeg decodes it."""
    with av.open(io.BytesIO(data)) as container:
        rate = container.streams.audio[0].rate
        return rate, sum(frame.samples for frame in container.decode(audio=0))


def wait_idle(server, timeout=5.0) -> None:
    deadline = time.monotonic() + timeout
    while server.speech.pipeline.coordinator.in_flight and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.speech.pipeline.coordinator.in_flight == 0


# ----------------------------------------------------------------- OpenAI SDK
def test_openai_sdk_non_streaming_returns_exact_audio(tone_server):
    client = openai.OpenAI(base_url=f"{tone_server.base_url}/v1", api_key="unused")
    audio = client.audio.speech.create(model="tone-test", voice="square", input="hello", response_format="pcm")
    assert audio.content == expected_pcm("hello", "square")


def test_voice_in_another_case_reaches_the_model_as_declared(tone_server):
    client = openai.OpenAI(base_url=f"{tone_server.base_url}/v1", api_key="unused")
    audio = client.audio.speech.create(model="tone-test", voice="Square", input="hello", response_format="pcm")
    assert audio.content == expected_pcm("hello", "square")


def test_openai_sdk_streaming_equals_non_streaming(tone_server):
    client = openai.OpenAI(base_url=f"{tone_server.base_url}/v1", api_key="unused")
    whole = client.audio.speech.create(
        model="tone-test", voice="sine", input="stream me", response_format="pcm", extra_body={"stream": False}
    )
    assert "x-finish-reason" in whole.response.headers  # a whole file: its headers come last
    with client.audio.speech.with_streaming_response.create(
        model="tone-test", voice="sine", input="stream me", response_format="pcm"
    ) as response:  # OpenAI's default: streamed
        assert response.headers["x-sample-rate"] == str(OPENAI_PCM_SAMPLE_RATE)
        assert "x-finish-reason" not in response.headers
        streamed = b"".join(response.iter_bytes(chunk_size=333))
    assert streamed == whole.content == expected_pcm("stream me")


def sse_events(text: str) -> list[tuple[str, dict]]:
    """(event line's name, data) of each SSE event in ``text``."""
    events = []
    for block in text.split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if line)
        if lines:
            events.append((lines.get("event"), json.loads(lines["data"])))
    return events


def test_sse_stream_sends_named_deltas_then_done_with_integer_usage(tone_server):
    response = speech(tone_server, {"input": "sse", "stream_format": "sse", "response_format": "pcm"})
    events = sse_events(response.text)
    assert [name for name, _ in events] == [data["type"] for _, data in events]
    deltas = len(events) - 1  # one per character, plus the resampler's tail (16 -> 24 kHz)
    assert [name for name, _ in events] == ["speech.audio.delta"] * deltas + ["speech.audio.done"]
    assert deltas >= 3
    pcm = b"".join(base64.b64decode(data["audio"]) for _, data in events[:-1])
    assert pcm == expected_pcm("sse")
    done = events[-1][1]
    assert done["finish_reason"] == "stop"
    assert done["usage"]["output_audio_seconds"] == pytest.approx(0.15)
    assert done["usage"]["input_tokens"] == 3 and done["usage"]["output_tokens"] == 3
    assert done["usage"]["total_tokens"] == 6


@pytest.mark.parametrize("fmt", ["wav", "pcm", "flac", "mp3", "opus", "aac"])
@pytest.mark.parametrize("stream", [False, True])
def test_every_format_decodes_to_the_expected_sample_count(tone_server, fmt, stream):
    response = speech(tone_server, {"input": "formats!", "response_format": fmt, "stream": stream})
    assert response.status_code == 200, response.text
    expected = len(expected_samples("formats!"))
    if fmt == "pcm":
        assert response.content == expected_pcm("formats!")
        return
    rate, count = decoded(response.content)
    assert response.headers["x-sample-rate"] == str(rate)  # the rate sent: opus's is 48 kHz
    if not stream and fmt != "aac":  # counted at that rate (ADTS keeps the codec's padding)
        assert int(response.headers["x-audio-samples"]) == count
    if fmt in ("wav", "flac"):
        assert count == expected
    elif fmt == "opus":  # encoded at 48 kHz
        assert count == expected * 48000 // SAMPLE_RATE
    else:  # encoder priming + padding of one frame at most (mp3: 1105+576, aac: 1024+1024)
        assert expected <= count <= expected + 2048


def test_non_streaming_headers_report_finish_reason_and_counts(tone_server):
    body = {"input": "abcdef", "max_new_tokens": 3, "response_format": "pcm", "stream": False}
    response = speech(tone_server, body)
    assert response.status_code == 200
    assert response.headers["x-finish-reason"] == "length"
    assert response.headers["x-audio-frames"] == "3"
    assert response.headers["x-input-tokens"] == "6"
    assert response.headers["x-sample-rate"] == str(OPENAI_PCM_SAMPLE_RATE)
    assert int(response.headers["x-audio-samples"]) == len(response.content) // 2
    assert response.headers["x-request-id"]


# ---------------------------------------------------------------- status codes
@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "voice": "bob"}, "voice"),
        ({"input": "   "}, "input"),
        ({"input": "\u200b\ufeff"}, "input"),
        ({"input": "hi", "speed": 9}, "speed"),
        ({"input": "hi", "temperature": 0.5}, "temperature"),
        ({"input": "hi", "bogus": 1}, "bogus"),
        ({"input": "hi", "response_format": "ogg"}, "response_format"),
        ({"input": "x" * 4097}, "input"),
        ({"text": "hi", "input": "ho"}, "input"),
    ],
)
def test_bad_fields_are_400_naming_the_field(tone_server, body, param):
    response = speech(tone_server, body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_malformed_json_is_400(tone_server):
    response = httpx.post(f"{tone_server.base_url}/v1/audio/speech", content=b"{not json", headers=JSON, timeout=10)
    assert response.status_code == 400 and "error" in response.json()


def test_a_body_not_declared_as_json_is_415(tone_server):
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"Content-Type": content_type} if content_type else {}
        response = httpx.post(f"{tone_server.base_url}/v1/audio/speech", content=b'{"input": "hi"}', headers=headers)
        assert response.status_code == 415 and response.json()["error"]["code"] == 415


def test_a_compressed_body_is_415_naming_its_encoding(tone_server):
    """The body is never decompressed: gzip JSON was a 400 "not valid JSON: 'utf-8' codec
    can't decode byte 0x8b", and a plain body declared gzip was read as plain."""
    for body in (gzip.compress(b'{"input": "hi"}'), b'{"input": "hi"}'):
        headers = {**JSON, "Content-Encoding": "gzip"}
        response = httpx.post(f"{tone_server.base_url}/v1/audio/speech", content=body, headers=headers)
        assert response.status_code == 415 and "gzip" in response.json()["error"]["message"], response.text
        assert response.headers["accept-encoding"] == "identity"  # RFC 7694, section 3
    identity = {**JSON, "Content-Encoding": "identity"}
    body = b'{"input": "hi", "stream": false}'
    assert httpx.post(f"{tone_server.base_url}/v1/audio/speech", content=body, headers=identity).status_code == 200


@pytest.mark.parametrize(
    "lines",
    [[("Content-Encoding", "identity"), ("Content-Encoding", "gzip")], [("Content-Encoding", "identity, GZip")]],
    ids=["second_line", "comma_list"],
)
def test_every_content_coding_of_every_header_line_is_checked(tone_server, lines):
    """``Content-Encoding: identity`` then a second ``Content-Encoding: gzip`` line passed:
    only the first line was read, and a gzip body was read as plain."""
    headers = [("Content-Type", "application/json"), *lines]
    response = httpx.post(f"{tone_server.base_url}/v1/audio/speech", content=b'{"input": "hi"}', headers=headers)
    assert response.status_code == 415 and "'gzip'" in response.json()["error"]["message"], response.text
    fine = [("Content-Type", "application/json"), ("Content-Encoding", "Identity, ,identity"), ("Content-Encoding", "identity")]
    body = b'{"input": "hi", "stream": false}'
    assert httpx.post(f"{tone_server.base_url}/v1/audio/speech", content=body, headers=fine).status_code == 200


def test_a_compressed_voice_upload_is_415_before_its_form_is_read(tone_server):
    """The multipart upload never checked Content-Encoding: a plain form declared gzip was
    read as plain (here: the tone model's 400 'does not clone voices', from the route)."""
    files = {"audio_sample": ("clip.wav", b"RIFF", "audio/wav")}
    url = f"{tone_server.base_url}/v1/audio/voices"
    response = httpx.post(url, files=files, data={"name": "n", "consent": "c"}, headers={"Content-Encoding": "gzip"})
    assert response.status_code == 415 and "'gzip'" in response.json()["error"]["message"], response.text
    assert response.headers["accept-encoding"] == "identity"
    plain = httpx.post(url, files=files, data={"name": "n", "consent": "c"})
    assert plain.status_code == 400 and "does not clone voices" in plain.json()["error"]["message"]


@pytest.mark.parametrize("escaped", [r"hello\u0000world", r"hello \ud800 there"])
def test_nul_and_unpaired_surrogates_in_text_are_400(tone_server, escaped):
    body = ('{"input": "' + escaped + '"}').encode()
    response = httpx.post(f"{tone_server.base_url}/v1/audio/speech", content=body, headers=JSON)
    assert response.status_code == 400 and response.json()["error"]["param"] == "input"


def test_errors_echoing_odd_or_huge_client_values_still_encode(tone_server):
    body = ('{"input": "hi", ' + r'"\ud800": 1, "' + "k" * 50_000 + '": 2}').encode()
    response = httpx.post(f"{tone_server.base_url}/v1/audio/speech", content=body, headers=JSON)
    assert response.status_code == 400
    error = response.json()["error"]
    assert len(error["message"]) <= 2003 and (error["param"] is None or len(error["param"]) <= 203)


def test_a_started_server_has_its_decoder_workers_running(tone_server):
    policy = tone_server.speech.settings.media_policy
    assert len(shared_pool().pids) >= policy.decode_workers  # started with the server, not at a first job


def test_head_health(tone_server):
    assert httpx.head(f"{tone_server.base_url}/health").status_code == 200


def test_unknown_route_is_404_in_the_envelope(tone_server):
    response = httpx.get(f"{tone_server.base_url}/v1/nothing")
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"


@pytest.mark.parametrize(
    ("method", "path"), [("GET", "/v1/audio/speech"), ("POST", "/v1/models"), ("POST", "/health")]
)
def test_wrong_method_is_405_in_the_envelope(tone_server, method, path):
    r = httpx.request(method, f"{tone_server.base_url}{path}")
    assert r.status_code == 405
    error = r.json()["error"]
    assert error["code"] == 405 and error["type"] == "invalid_request_error"


def test_oversized_body_is_413(tone_server):
    response = speech(tone_server, {"input": "hi", "ref_audio": "A" * 100_000})
    assert response.status_code == 413


def test_stage_failure_is_500_and_serving_goes_on(tone_server, caplog):
    response = speech(tone_server, {"input": "FAIL"})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "stage_failure"
    # the body names the stage and the request; the exception text goes to the log only
    request_id = re.fullmatch(r"stage 'tone' failed for request (\S+); the server log .*", error["message"])[1]
    assert "failing as asked" not in response.text and "RuntimeError" not in response.text
    logged = [r.getMessage() for r in caplog.records if request_id in r.getMessage()]
    assert any("tone: failing as asked" in line for line in logged), logged
    assert speech(tone_server, {"input": "ok", "response_format": "pcm"}).content == expected_pcm("ok")


def test_a_bug_before_admission_is_a_500_envelope_counted_in_metrics(tone_server, monkeypatch):
    def broken(self, request, media):
        raise ValueError("a bug in a request builder")

    monkeypatch.setattr(ToneConfig, "build_request", broken)
    counter = 'omnistage_requests_total{finish_reason="rejected",status="500"} '
    before = httpx.get(f"{tone_server.base_url}/metrics").text.count(counter + "1.0")
    response = speech(tone_server, {"input": "hi"})
    assert response.status_code == 500 and response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["type"] == "server_error" and "bug" not in error["message"]  # nothing leaked
    assert before == 0 and counter + "1.0" in httpx.get(f"{tone_server.base_url}/metrics").text
    monkeypatch.undo()
    assert speech(tone_server, {"input": "ok", "response_format": "pcm"}).content == expected_pcm("ok")


def test_streaming_failure_before_first_audio_is_a_json_error(tone_server):
    response = speech(tone_server, {"input": "FAIL", "stream": True})
    assert response.status_code == 500 and response.json()["error"]["type"] == "stage_failure"


def test_streaming_failure_after_first_audio_truncates_the_stream(tone_server):
    with pytest.raises(httpx.RemoteProtocolError):
        speech(tone_server, {"input": "LATEFAIL", "stream": True, "response_format": "pcm"})


def test_sse_failure_after_first_audio_sends_error_and_no_done(tone_server):
    response = speech(tone_server, {"input": "LATEFAIL", "stream_format": "sse"})
    types = [json.loads(line[6:])["type"] for line in response.text.splitlines() if line.startswith("data: ")]
    assert types == ["speech.audio.delta", "error"]


def test_queue_full_is_503(tone_server):
    body = {"input": "slow", "delay_s": 0.1, "response_format": "pcm"}
    with ThreadPoolExecutor(4) as pool:
        busy = [pool.submit(speech, tone_server, body) for _ in range(4)]
        deadline = time.monotonic() + 5
        while tone_server.speech.pipeline.coordinator.in_flight < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        rejected = speech(tone_server, {"input": "one more"})
        assert rejected.status_code == 503 and rejected.json()["error"]["type"] == "queue_full"
        assert all(f.result().status_code == 200 for f in busy)
    wait_idle(tone_server)


def test_client_disconnect_aborts_the_request(tone_server):
    body = {"input": "x" * 40, "delay_s": 0.05, "stream": True, "response_format": "pcm"}
    with httpx.stream("POST", f"{tone_server.base_url}/v1/audio/speech", json=body, timeout=30) as response:
        next(response.iter_bytes())
    wait_idle(tone_server)
    metrics = httpx.get(f"{tone_server.base_url}/metrics").text
    assert 'omnistage_requests_total{finish_reason="abort",status="499"}' in metrics


def test_a_client_that_stops_reading_is_aborted_counted_and_others_are_served():
    """Issue 12: the stream buffer cap was global only, so a few stalled clients got a
    prompt one refused. A stalled client is now aborted at its own cap (499, counted),
    its bytes released, while another client streams in full."""
    overrides = {"stream_request_max_bytes": 64 * 1024, "stream_queue_max_bytes": 256 * 1024}
    gen = serve(ServerSettings(warmup=False), **overrides)
    server = next(gen)
    aborted = 'omnistage_requests_total{finish_reason="abort",status="499"} 1.0'
    try:
        body = json.dumps({"input": "z" * 4000, "stream": True, "response_format": "pcm"}).encode()
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect
        stalled.connect(("127.0.0.1", int(server.base_url.rsplit(":", 1)[1])))
        stalled.sendall(
            b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )  # and never reads
        deadline = time.monotonic() + 30
        while aborted not in httpx.get(f"{server.base_url}/metrics").text:
            assert time.monotonic() < deadline, "the stalled client was never aborted"
            time.sleep(0.05)
        coordinator = server.speech.pipeline.coordinator
        assert coordinator.queued_bytes == 0 and coordinator.in_flight == 0
        prompt = speech(server, {"input": "prompt", "stream": True, "response_format": "pcm"})
        assert prompt.content == expected_pcm("prompt")
        stalled.close()
    finally:
        gen.close()


def test_a_stream_cut_by_a_late_failure_logs_one_line_and_no_traceback(tone_server, caplog):
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    uvicorn_errors = logging.getLogger("uvicorn.error")
    uvicorn_errors.addHandler(handler)
    try:
        with caplog.at_level(logging.WARNING, logger="omnistage.serve.app"):
            with pytest.raises(httpx.RemoteProtocolError):
                speech(tone_server, {"input": "LATEFAIL", "stream": True, "response_format": "pcm"})
            wait_idle(tone_server)
    finally:
        uvicorn_errors.removeHandler(handler)
    assert not [r for r in records if r.exc_info and isinstance(r.exc_info[1], StreamCut)]
    assert "stream cut after 800 samples" in caplog.text


def test_auth_is_required_on_v1_only(auth_server):
    missing = speech(auth_server, {"input": "hi"})
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert speech(auth_server, {"input": "hi"}, headers={"Authorization": "Bearer wrong"}).status_code == 401
    non_ascii = httpx.post(f"{auth_server.base_url}/v1/audio/speech", json={"input": "hi"},
                           headers=[(b"Authorization", "Bearer é".encode())])
    assert non_ascii.status_code == 401
    ok = speech(auth_server, {"input": "hi"}, headers={"Authorization": "Bearer sekret"})
    assert ok.status_code == 200
    assert httpx.get(f"{auth_server.base_url}/health").status_code == 200
    client = openai.OpenAI(base_url=f"{auth_server.base_url}/v1", api_key="sekret")
    assert client.models.list().data[0].id == "tone-test"


# --------------------------------------------------------------- other routes
def test_models_voices_and_metrics(tone_server):
    models = httpx.get(f"{tone_server.base_url}/v1/models").json()
    assert models["data"][0]["id"] == "tone-test"
    voices = httpx.get(f"{tone_server.base_url}/v1/audio/voices").json()
    assert voices["voices"] == ["sine", "square"] and voices["sample_rate"] == SAMPLE_RATE
    speech(tone_server, {"input": "metrics"})
    metrics = httpx.get(f"{tone_server.base_url}/metrics").text
    for name in ["omnistage_time_to_first_audio_seconds", "omnistage_request_latency_seconds",
                 "omnistage_requests_in_flight", 'omnistage_stage_batch_size_bucket{kind="batch",le="1.0",stage="tone"}',
                 'omnistage_stage_batch_seconds_count{kind="batch",stage="tone"}',
                 'omnistage_stage_queue_depth{stage="tone"}']:
        assert name in metrics


@pytest.mark.anyio
async def test_health_is_503_until_started():
    app = create_app(ToneConfig.for_model_path("tone-test"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://test") as client:
        response = await client.get("/health")
    assert response.status_code == 503 and response.json()["status"] == "starting"


def test_health_is_503_while_starting_and_when_start_fails():
    config = ToneConfig.for_model_path("tone-test")
    config.stages[0].factory.path = "omnistage.testing.tone:no_such_factory"
    for running in run_uvicorn(create_app(config)):
        assert httpx.get(f"{running.base_url}/health").status_code == 503
        health = wait_health(running.base_url)
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert "no_such_factory" in health.json()["reason"]
        response = speech(running, {"input": "hi"})
        assert response.status_code == 503 and "no_such_factory" in response.json()["error"]["message"]


# ---------------------------------------------------------------------- fuzz
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=10), children, max_size=3),
    max_leaves=8,
)
speech_fields = st.sampled_from(
    ["input", "text", "voice", "speaker", "response_format", "speed", "stream", "stream_format", "model",
     "max_new_tokens", "seed", "references", "ref_audio", "delay_s", "language", "top_k", "junk"]
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.dictionaries(speech_fields, json_values, max_size=6) | json_values)
def test_fuzzed_bodies_never_cause_a_500(tone_server, body):
    response = httpx.post(f"{tone_server.base_url}/v1/audio/speech", content=json.dumps(body), headers=JSON, timeout=30)
    assert response.status_code != 500, response.text
    assert response.status_code in (200, 400, 413, 503)


def test_server_still_serves_after_fuzzing(tone_server):
    assert speech(tone_server, {"input": "alive", "response_format": "pcm"}).content == expected_pcm("alive")


def test_client_disconnect_aborts_a_whole_file_request_behind_auth(auth_server):
    """Auth must not hide disconnects from the route (it is a dependency, not an HTTP
    middleware): a non-streaming request whose client leaves is aborted."""
    body = {"input": "y" * 60, "delay_s": 0.05, "response_format": "pcm", "stream": False}
    headers = {"Authorization": "Bearer sekret"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{auth_server.base_url}/v1/audio/speech", json=body, headers=headers, timeout=0.5)
    wait_idle(auth_server, timeout=2.0)
