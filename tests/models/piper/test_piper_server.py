"""The bundled Piper voice served end to end over HTTP (real model, CPU)."""

import base64
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import jiwer
import numpy as np
import pytest
import uvicorn
from websockets.sync.client import connect

from omnistage.bench.asr import PocketSphinxASR
from omnistage.bench.wer import normalize_for_wer
from omnistage.serve.app import ServerSettings, create_app
from omnistage.serve.registry import ModelRegistry
from omnistage.testing.waits import free_port
from tests.serve.conftest import RunningServer

SENTENCES = [
    "Hello world, this is a test.",
    "The quick brown fox jumps over the lazy dog.",
    "Dr. Smith arrived at 10:30 and paid $5.50 for coffee.",
    "Is this the right way to the station?",
    "We have 3 apples, 12 oranges and 250 grapes.",
    "Please call me tomorrow morning.",
    "The meeting was moved to March 3rd, 2024.",
    "Wow! That was fast; really fast.",
    "Mr. and Mrs. Brown live on Main St. near the park.",
    (
        "Speech synthesis turns written text into spoken words. Modern systems split the text "
        "into sentences, convert each sentence into phonemes, and then generate audio one "
        "sentence at a time, so that playback can begin before the whole paragraph is ready."
    ),
]
# Corpus WER bar for pocketsphinx on these sentences: measured 0.21 with default noise.
WER_BAR = 0.35
DETERMINISTIC = {"noise_scale": 0, "noise_w": 0}


@pytest.fixture(scope="module")
def piper_server():
    config = ModelRegistry.discover().resolve(None)
    app = create_app(config, ServerSettings())
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base_url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{base_url}/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    yield RunningServer(base_url, app, server)
    server.should_exit = True
    thread.join(10)


def synthesize(server, text: str, **fields) -> tuple[np.ndarray, httpx.Response]:
    body = {"model": "en_US-joe-medium", "voice": "joe", "input": text, "response_format": "pcm", **fields}
    response = httpx.post(f"{server.base_url}/v1/audio/speech", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return np.frombuffer(response.content, dtype="<i2").astype(np.float32) / 32767, response


def test_varied_english_is_speech_like_and_intelligible(piper_server):
    """Audio is not silence, lasts a plausible time per character, and pocketsphinx
    understands it: corpus WER measured 0.21 on these sentences (bar 0.35)."""
    asr = PocketSphinxASR()
    references, hypotheses = [], []
    for text in SENTENCES:
        audio, response = synthesize(piper_server, text)
        rate = int(response.headers["x-sample-rate"])
        seconds_per_char = len(audio) / rate / len(text)
        assert 0.03 < seconds_per_char < 0.15, (text, seconds_per_char)
        assert np.sqrt(np.mean(audio**2)) > 0.02
        references.append(normalize_for_wer(text))
        hypotheses.append(normalize_for_wer(asr.transcribe(audio, rate)))
    wer = jiwer.wer(references, hypotheses)
    assert wer < WER_BAR, list(zip(references, hypotheses, strict=True))


def test_streamed_audio_equals_non_streamed_audio_with_noise_off(piper_server):
    text = SENTENCES[-1]
    whole, _ = synthesize(piper_server, text, **DETERMINISTIC)
    body = {"input": text, "response_format": "pcm", "stream": True, **DETERMINISTIC}
    with httpx.stream("POST", f"{piper_server.base_url}/v1/audio/speech", json=body, timeout=120) as response:
        chunks = list(response.iter_bytes())
    streamed = np.frombuffer(b"".join(chunks), dtype="<i2").astype(np.float32) / 32767
    assert len(chunks) >= 2
    np.testing.assert_array_equal(streamed, whole)


def test_sse_stream_sends_one_delta_per_sentence(piper_server):
    body = {"input": "One. Two. Three.", "stream_format": "sse", **DETERMINISTIC}
    response = httpx.post(f"{piper_server.base_url}/v1/audio/speech", json=body, timeout=60)
    events = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["speech.audio.delta"] * 3 + ["speech.audio.done"]
    assert sum(len(base64.b64decode(e["audio"])) for e in events[:-1]) > 0


def test_sixteen_concurrent_requests_all_succeed(piper_server):
    texts = [SENTENCES[i % len(SENTENCES)] for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda t: synthesize(piper_server, t)[0], texts))
    assert all(len(audio) > 0 for audio in results)


@pytest.mark.parametrize(
    ("field", "value"),
    [("voice", "alloy"), ("language", "en"), ("noise_scale", 5), ("temperature", 0.7),
     ("ref_audio", "AAAA")],
)
def test_fields_the_voice_does_not_support_are_400(piper_server, field, value):
    body = {"input": "Hello.", field: value}
    response = httpx.post(f"{piper_server.base_url}/v1/audio/speech", json=body, timeout=30)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == field


@pytest.mark.parametrize("speed", [0.25, 0.5, 2.0, 4.0])
def test_duration_scales_as_one_over_speed_within_five_percent(piper_server, speed):
    """OpenAI's speed: the audio lasts 1 / speed as long (Piper's length scale alone gave
    0.36-0.52 at speed 4; see omnistage/models/piper/modeling/speed.py)."""
    for text in ("Yes.", "The quick brown fox jumps over the lazy dog. Is this the right way?"):
        normal, _ = synthesize(piper_server, text, **DETERMINISTIC)
        scaled, _ = synthesize(piper_server, text, speed=speed, **DETERMINISTIC)
        assert len(scaled) * speed / len(normal) == pytest.approx(1.0, rel=0.05), text


def test_instructions_are_ignored_and_named(piper_server):
    plain, _ = synthesize(piper_server, "Hello.", **DETERMINISTIC)
    audio, response = synthesize(piper_server, "Hello.", instructions="cheerful", **DETERMINISTIC)
    assert response.headers["x-ignored-fields"] == "instructions"
    assert np.array_equal(audio, plain)


def stream_text(server, deltas: list[str]) -> tuple[bytes, list[dict]]:
    """One WebSocket session: config, the deltas, input.done -> (audio, JSON events)."""
    url = server.base_url.replace("http://", "ws://") + "/v1/audio/speech/stream"
    audio, events = [], []
    with connect(url) as ws:
        ws.send(json.dumps({"type": "session.config", "voice": "joe", "response_format": "pcm", **DETERMINISTIC}))
        for delta in deltas:
            ws.send(json.dumps({"type": "input.text", "text": delta}))
        ws.send(json.dumps({"type": "input.done"}))
        while not events or events[-1]["type"] not in ("session.done", "error"):
            message = ws.recv(timeout=60)
            audio.append(message) if isinstance(message, bytes) else events.append(json.loads(message))
    return b"".join(audio), events


def test_websocket_text_word_by_word_speaks_sentence_by_sentence_as_the_whole_text(piper_server):
    text = "The quick brown fox jumps over the lazy dog. Is this the right way to the station?"
    whole, whole_events = stream_text(piper_server, [text])
    by_word, events = stream_text(piper_server, [w + " " for w in text.split(" ")])
    assert by_word == whole and len(whole) > 0
    assert [e["text"] for e in events if e["type"] == "audio.start"] == [
        "The quick brown fox jumps over the lazy dog.", "Is this the right way to the station?"
    ]
    assert events[-1]["type"] == whole_events[-1]["type"] == "session.done"
    # each sentence is what a speech request of that sentence alone gives (24 kHz pcm)
    first, _ = synthesize(piper_server, "The quick brown fox jumps over the lazy dog.", **DETERMINISTIC)
    assert np.abs(np.frombuffer(whole, "<i2")[: len(first)] / 32767 - first).max() < 2e-3
