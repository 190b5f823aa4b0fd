"""Qwen3-TTS over WebSocket: the session's text enters its running generation as it
arrives (one request, fed one token per frame), on tiny random checkpoints on CPU.

Exactness: the engine's codes of a session fed word by word equal those of the whole text
sent to ``/v1/audio/speech`` in streaming text mode with the same seed, and the audio is
within 1 LSB (the vocoder decodes the same codes in chunks of other sizes when frames come
at other times). Equal codes also prove that a request whose text had not arrived was never
fed a pad row in its place: the random talker's codes depend on every row it reads.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
from test_pipeline_http import ENGINE_FRAMES, record_engine_codes, tone_clip, wav_data_uri
from websockets.sync.client import ClientConnection, connect

from omnistage.models.qwen3_tts.config import Qwen3TTSPipelineConfig
from omnistage.models.qwen3_tts.live_text import FinalTokens
from omnistage.models.qwen3_tts.modeling.prompt import PromptTokens
from omnistage.models.qwen3_tts.modeling.weights import load_checkpoint
from omnistage.serve.app import ServerSettings, create_app
from omnistage.testing.leaks import assert_no_request_state
from tests.serve.conftest import RunningServer, run_uvicorn, wait_health

WORDS = ["Hi ", "you ", "all, ", "good ", "day."]
# ICL: 0.8 s of reference (11 codec rows with bos) and a 3-token transcript, so the
# prefill holds the first 8 tokens of the text (a WebSocket message holds at most 64 KiB)
CLIP = wav_data_uri(tone_clip(0.8, rate=8_000, channels=1), rate=8_000)
VOICES = {"custom_voice": {"voice": "aiden"}, "base": {"ref_audio": CLIP, "ref_text": "Hi."}}
FIELDS = {"seed": 11, "max_new_tokens": 24, "min_new_tokens": 24, "response_format": "pcm"}


@pytest.fixture(scope="module")
def servers(tiny_servable_checkpoints: dict[str, Path]) -> Iterator[dict[str, RunningServer]]:
    running, generators = {}, []
    try:
        for model_type in VOICES:
            config = Qwen3TTSPipelineConfig.for_model_path(str(tiny_servable_checkpoints[model_type]))
            generator = run_uvicorn(create_app(config, ServerSettings(playground=False, warmup=False)))
            generators.append(generator)
            server = next(generator)
            assert wait_health(server.base_url).status_code == 200
            record_engine_codes(server)
            running[model_type] = server
        yield running
    finally:
        for generator in generators:
            generator.close()


@contextmanager
def open_session(server: RunningServer, model_type: str, **fields) -> Iterator[ClientConnection]:
    with connect(server.base_url.replace("http://", "ws://") + "/v1/audio/speech/stream") as ws:
        ws.send(json.dumps({"type": "session.config", **VOICES[model_type], **FIELDS, **fields}))
        started = json.loads(ws.recv(timeout=30))
        assert started["type"] == "session.started", started
        yield ws


def send(ws: ClientConnection, *deltas: str | None) -> None:
    """Text deltas; None is ``input.done``."""
    for delta in deltas:
        ws.send(json.dumps({"type": "input.done"} if delta is None else {"type": "input.text", "text": delta}))


def first_audio(ws: ClientConnection, events: list[dict]) -> bytes:
    """Wait for the session's first binary frame (its JSON events before it go to ``events``)."""
    while not isinstance(message := ws.recv(timeout=60), bytes):
        events.append(json.loads(message))
        assert events[-1]["type"] != "error", events[-1]
    return message


def rest(ws: ClientConnection, events: list[dict]) -> bytes:
    """Everything until the session ends: the binary frames joined (events to ``events``)."""
    audio = []
    while not events or events[-1]["type"] not in ("session.done", "error"):
        message = ws.recv(timeout=60)
        audio.append(message) if isinstance(message, bytes) else events.append(json.loads(message))
    return b"".join(audio)


def whole_text(server: RunningServer, model_type: str, **fields) -> tuple[np.ndarray, list]:
    """The whole text at once over HTTP, in streaming text mode: (samples, engine codes)."""
    body = {"input": "".join(WORDS), **VOICES[model_type], **FIELDS, "non_streaming_mode": False, **fields}
    response = httpx.post(f"{server.base_url}/v1/audio/speech", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return np.frombuffer(response.content, "<i2"), codes(response.headers["x-request-id"])


def codes(request_id: str) -> list:
    return [row for frame in ENGINE_FRAMES.get(request_id, []) for row in frame.tolist()]


def request_id_of(server: RunningServer) -> str:
    """The id of the one request in flight."""
    (request_id,) = server.speech.pipeline.coordinator.requests
    return request_id


def assert_same_audio(live: bytes, whole: np.ndarray) -> None:
    samples = np.frombuffer(live, "<i2").astype(np.int32)
    assert len(samples) == len(whole) > 0
    assert np.abs(samples - whole).max() <= 1


def leak_check(server: RunningServer) -> None:
    pipeline = server.speech.pipeline
    asyncio.run_coroutine_threadsafe(assert_no_request_state(pipeline), pipeline.coordinator.loop).result(timeout=15)


@pytest.mark.parametrize("model_type", list(VOICES))
def test_text_fed_word_by_word_is_the_whole_text_and_audio_starts_before_it_ends(servers, model_type):
    server = servers[model_type]
    whole, whole_codes = whole_text(server, model_type)
    events: list[dict] = []
    with open_session(server, model_type) as ws:
        send(ws, *WORDS[:-1])  # final so far: "Hi you all, good" (ICL's prefill takes 8)
        head = first_audio(ws, events)
        request_id = request_id_of(server)
        send(ws, WORDS[-1], None)  # the last word goes after audio came
        audio = head + rest(ws, events)
    assert events[-1]["type"] == "session.done" and events[-1]["segments"] == 1, events[-1]
    assert codes(request_id) == whole_codes
    assert_same_audio(audio, whole)
    leak_check(server)


def test_the_frame_cap_follows_the_whole_text(servers):
    """Without max_new_tokens the cap is the whole text's, known at input.done."""
    server = servers["custom_voice"]
    whole, whole_codes = whole_text(server, "custom_voice", max_new_tokens=None, min_new_tokens=None)
    events: list[dict] = []
    with open_session(server, "custom_voice", max_new_tokens=None, min_new_tokens=None) as ws:
        send(ws, *WORDS[:2])
        head = first_audio(ws, events)
        request_id = request_id_of(server)
        send(ws, *WORDS[2:], None)
        audio = head + rest(ws, events)
    assert codes(request_id) == whole_codes
    assert_same_audio(audio, whole)


def test_a_request_waiting_for_text_holds_back_no_other(servers):
    """Session A starts, then waits for its text; B runs from start to end meanwhile (its
    frames are batched with A's wait, A leaves the batch); A then finishes as if whole."""
    server = servers["custom_voice"]
    whole, whole_codes = whole_text(server, "custom_voice")
    events_a: list[dict] = []
    with open_session(server, "custom_voice") as a:
        send(a, *WORDS[:2])
        head = first_audio(a, events_a)
        waiting = request_id_of(server)
        events_b: list[dict] = []
        with open_session(server, "custom_voice") as b:
            send(b, *WORDS, None)
            audio_b = rest(b, events_b)
        assert events_b[-1]["type"] == "session.done", events_b[-1]
        assert waiting in server.speech.pipeline.coordinator.requests  # A still waits for text
        send(a, *WORDS[2:], None)
        audio_a = head + rest(a, events_a)
    assert codes(waiting) == whole_codes
    assert_same_audio(audio_a, whole)
    assert_same_audio(audio_b, whole)
    leak_check(server)


def test_a_client_that_leaves_while_its_request_waits_for_text_aborts_it(servers):
    server = servers["custom_voice"]
    with open_session(server, "custom_voice") as ws:
        send(ws, *WORDS[:2])
        first_audio(ws, [])
        request_id = request_id_of(server)
    leak_check(server)  # aborted everywhere: the engine's sequence and the vocoder's slot too
    assert request_id not in server.speech.pipeline.coordinator.requests


def test_non_streaming_mode_is_refused_for_live_text(servers):
    server = servers["custom_voice"]
    with open_session(server, "custom_voice", non_streaming_mode=True) as ws:
        send(ws, "Hello.")
        events: list[dict] = []
        rest(ws, events)
    assert events[-1]["type"] == "error" and events[-1]["error"]["param"] == "non_streaming_mode"


@pytest.mark.parametrize("text", ["Hello world, it's 2024.", "a  b\n\nc", "\nx.y z", "Hi you all, good day."])
def test_final_tokens_grow_to_the_whole_texts_however_it_is_split(tiny_servable_checkpoints, text):
    checkpoint = load_checkpoint(str(tiny_servable_checkpoints["custom_voice"]), "cpu")
    prompt_tokens = PromptTokens(checkpoint.config, checkpoint.tokenizer)
    whole = prompt_tokens.target(text)
    for deltas in (list(text), text.split(" "), [text]):
        tokens = FinalTokens(prompt_tokens)
        for i, delta in enumerate(deltas):
            tokens.push(delta if i == len(deltas) - 1 or len(deltas) == len(text) else delta + " ")
            assert tokens.ids == whole[1][: len(tokens.ids)]
            assert tokens.role in (None, whole[0])
        assert tokens.finish() == whole
    tokens = FinalTokens(prompt_tokens)
    tokens.push("Hello wor")
    assert checkpoint.tokenizer.decode(tokens.ids) == "Hello"  # the last piece waits for more
