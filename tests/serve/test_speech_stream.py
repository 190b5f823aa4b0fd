"""WebSocket /v1/audio/speech/stream against the tone model: text in as deltas, audio out
per sentence, the same audio however the text is split, backpressure and abort."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from starlette.websockets import WebSocket
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from omnistage.serve import speech_stream
from omnistage.serve.app import ServerSettings, create_app
from omnistage.serve.audio import float_to_s16, resample
from omnistage.serve.speech_stream import MAX_PENDING_SEGMENTS, SentenceSegmenter
from omnistage.testing.tone import SAMPLE_RATE, ToneConfig
from omnistage.testing.waits import wait_until_async
from tests.serve.conftest import run_uvicorn, wait_health
from tests.serve.test_server import expected_samples, wait_idle

TEXT = "Hello there. How are you? Fine; thanks!"
SEGMENTS = ["Hello there.", "How are you?", "Fine;", "thanks!"]


def ws_url(server) -> str:
    return server.base_url.replace("http://", "ws://") + "/v1/audio/speech/stream"


@contextmanager
def session(server, **fields) -> Iterator[ClientConnection]:
    """A connected session, its config sent and ``session.started`` received."""
    with connect(ws_url(server)) as ws:
        ws.send(json.dumps({"type": "session.config", "voice": "sine", "response_format": "pcm", **fields}))
        started = json.loads(ws.recv(timeout=10))
        assert started["type"] == "session.started", started
        assert started["response_format"] == fields.get("response_format", "pcm")
        yield ws


def send_text(ws: ClientConnection, *deltas: str) -> None:
    for delta in deltas:
        ws.send(json.dumps({"type": "input.text", "text": delta}))


def read_all(ws: ClientConnection) -> tuple[bytes, list[dict]]:
    """Every message until the session ends -> (binary frames joined, JSON events)."""
    audio, events = [], []
    while True:
        message = ws.recv(timeout=30)
        if isinstance(message, bytes):
            audio.append(message)
            continue
        events.append(json.loads(message))
        if events[-1]["type"] in ("session.done", "error"):
            return b"".join(audio), events


def speak(server, deltas: list[str], **fields) -> tuple[bytes, list[dict]]:
    with session(server, **fields) as ws:
        send_text(ws, *deltas)
        ws.send(json.dumps({"type": "input.done"}))
        return read_all(ws)


def expected_stream(segments: list[str]) -> bytes:
    """The tone model's audio of each segment, one 24 kHz pcm stream across them."""
    samples = np.concatenate([expected_samples(s) for s in segments])
    return float_to_s16(resample(samples, SAMPLE_RATE, 24_000)).tobytes()


@pytest.mark.parametrize(
    ("deltas", "segments"),
    [(["Hi. Bye"], ["Hi.", "Bye"]), (list("Hi. Bye"), ["Hi.", "Bye"]), (["Hi.", " ", "", "Bye."], ["Hi.", "Bye."]),
     (["one\ntwo"], ["one", "two"]), (["a" * 10 + " " + "b" * 5], ["a" * 10, "b" * 5]), (["   "], [])],
)
def test_segmenter_cuts_the_same_however_the_text_is_split(deltas, segments):
    segmenter = SentenceSegmenter(max_chars=12)
    out = [s for d in deltas for s in segmenter.push(d)] + segmenter.flush()
    assert out == segments


def test_word_by_word_gives_the_same_audio_as_the_whole_text(tone_server):
    whole_audio, whole_events = speak(tone_server, [TEXT])
    words = [w + " " for w in TEXT.split(" ")]
    word_audio, word_events = speak(tone_server, words)
    assert word_audio == whole_audio == expected_stream(SEGMENTS)
    starts = [e["text"] for e in word_events if e["type"] == "audio.start"]
    assert starts == [e["text"] for e in whole_events if e["type"] == "audio.start"] == SEGMENTS
    done = word_events[-1]
    assert done["type"] == "session.done" and done["segments"] == 4
    assert done["usage"]["input_characters"] == sum(len(s) for s in SEGMENTS)
    assert done["usage"]["total_tokens"] == 2 * sum(len(s) for s in SEGMENTS)
    segment_done = [e for e in word_events if e["type"] == "audio.done"]
    assert [e["segment_index"] for e in segment_done] == [0, 1, 2, 3]
    assert all(e["finish_reason"] == "stop" for e in segment_done)
    wait_idle(tone_server)


def test_session_started_names_the_ignored_fields(tone_server):
    with connect(ws_url(tone_server)) as ws:
        ws.send(json.dumps({"type": "session.config", "instructions": "calm", "sample_rate": 16000, "response_format": "wav"}))
        started = json.loads(ws.recv(timeout=10))
    assert started["ignored_fields"] == ["instructions"]
    assert (started["sample_rate"], started["response_format"], started["model"]) == (16000, "wav", "tone-test")


def test_first_audio_arrives_before_the_last_word_is_sent(tone_server):
    with session(tone_server) as ws:
        send_text(ws, "First", " sentence.", " ")
        kinds = []
        while not kinds or kinds[-1] != "binary":
            message = ws.recv(timeout=10)
            kinds.append("binary" if isinstance(message, bytes) else json.loads(message)["type"])
        assert kinds[0] == "audio.start"
        send_text(ws, "Last.")
        ws.send(json.dumps({"type": "input.done"}))
        _, events = read_all(ws)
    assert events[-1]["type"] == "session.done" and events[-1]["segments"] == 2


def test_disconnect_aborts_the_session_and_leaves_no_state(tone_server):
    with session(tone_server, delay_s=0.05) as ws:
        send_text(ws, "x" * 60 + ". ", "y" * 60 + ". ")
        while not isinstance(ws.recv(timeout=10), bytes):
            pass
    wait_idle(tone_server, timeout=5)
    tone_server.assert_no_request_state()


def test_disconnect_after_input_done_aborts_what_is_still_sending(tone_server):
    with session(tone_server, delay_s=0.05) as ws:
        send_text(ws, "x" * 40 + ". ", "y" * 40 + ".")
        ws.send(json.dumps({"type": "input.done"}))
        while not isinstance(ws.recv(timeout=10), bytes):
            pass
    wait_idle(tone_server, timeout=5)
    tone_server.assert_no_request_state()


def test_disconnect_while_segments_wait_for_room_admits_none_of_them(tone_server):
    """The client leaves while cut segments wait for admission: the one being admitted is
    cancelled with the session, not submitted after its abort (it was left in flight)."""
    for _ in range(3):
        with session(tone_server, delay_s=0.05) as ws:
            send_text(ws, *[f"Sentence {i}. " for i in range(12)])
            while not isinstance(ws.recv(timeout=10), bytes):
                pass
        wait_idle(tone_server, timeout=5)
        tone_server.assert_no_request_state()


def test_a_client_that_does_not_read_holds_back_the_next_segments(tone_server):
    """Sending many sentences without reading: at most MAX_PENDING_SEGMENTS segments wait
    behind the one being sent, so the server never runs ahead unbounded."""
    with session(tone_server, delay_s=0.01) as ws:
        send_text(ws, *[f"Sentence {i}. " for i in range(12)])
        coordinator = tone_server.speech.pipeline.coordinator
        peak, deadline = 0, time.monotonic() + 1.5
        while time.monotonic() < deadline:
            peak = max(peak, coordinator.in_flight)
            time.sleep(0.01)
        assert 1 <= peak <= MAX_PENDING_SEGMENTS + 1
        ws.send(json.dumps({"type": "input.done"}))
        _, events = read_all(ws)
    assert events[-1]["type"] == "session.done" and events[-1]["segments"] == 12


def test_a_client_far_ahead_of_the_audio_keeps_its_session():
    """Text sent faster than it is spoken, in more messages than uvicorn queues (32): the
    socket is still read, so the keepalive's pongs arrive (the session was cut with 1011
    "keepalive ping timeout" once a ping went unanswered)."""
    app = create_app(ToneConfig.for_model_path("tone-test"), ServerSettings())
    for server in run_uvicorn(app, ws_ping_interval=0.2, ws_ping_timeout=1.0):
        assert wait_health(server.base_url).status_code == 200
        with session(server, delay_s=0.01) as ws:
            send_text(ws, *[f"Sentence {i}. " for i in range(60)])
            ws.send(json.dumps({"type": "input.done"}))
            _, events = read_all(ws)
        assert events[-1]["type"] == "session.done" and events[-1]["segments"] == 60, events[-1]


def test_text_further_ahead_than_the_cap_is_413_naming_text(tone_server, monkeypatch):
    monkeypatch.setattr(speech_stream, "MAX_AHEAD_CHARS", 100)
    with session(tone_server, delay_s=0.05) as ws:
        # one message: the server closes the socket after its error, so a client still
        # sending separate deltas then could meet the close in its send instead of its read
        send_text(ws, "".join(f"Sentence {i}. " for i in range(20)))
        _, events = read_all(ws)
    assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == 413, events[-1]
    assert events[-1]["error"]["param"] == "text"
    wait_idle(tone_server, timeout=5)
    tone_server.assert_no_request_state()


def test_many_tiny_segments_count_toward_the_cap_as_what_they_hold(tone_server):
    """One message of 21,000 two-letter sentences: 42,000 letters, far under the cap, but
    21,000 queued strings; each waiting segment counts SEGMENT_OVERHEAD_CHARS more, so
    it is a 413 naming text before any of them is admitted (it was taken, a whole
    string per segment)."""
    count = 21_000
    assert 2 * count < speech_stream.MAX_AHEAD_CHARS < count * (2 + speech_stream.SEGMENT_OVERHEAD_CHARS)
    with session(tone_server) as ws:
        send_text(ws, "a. " * count)
        event = json.loads(ws.recv(timeout=10))
        assert event["type"] == "error" and event["error"]["code"] == 413, event
        assert event["error"]["param"] == "text"
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)
    wait_idle(tone_server, timeout=5)
    tone_server.assert_no_request_state()


@pytest.mark.parametrize(
    ("config", "param"),
    [({"voice": "nobody"}, "voice"), ({"input": "hi"}, "input"), ({"stream_format": "sse"}, "stream_format"),
     ({"bogus": 1}, "bogus")],
)
def test_a_bad_session_config_is_an_error_event_then_close(tone_server, config, param):
    with connect(ws_url(tone_server)) as ws:
        ws.send(json.dumps({"type": "session.config", **config}))
        event = json.loads(ws.recv(timeout=10))
        assert event["type"] == "error" and event["error"]["param"] == param and event["error"]["code"] == 400
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
        assert closed.value.rcvd.code == 1008


def test_a_failing_segment_ends_the_session_with_its_index(tone_server):
    _, events = speak(tone_server, ["Fine. ", "FAIL. ", "Never."])
    assert events[-1]["type"] == "error" and events[-1]["segment_index"] == 1
    assert events[-1]["error"]["type"] == "stage_failure"
    assert not any(e["type"] == "session.done" for e in events)
    wait_idle(tone_server)


def test_the_stream_needs_the_api_key(auth_server):
    with pytest.raises(InvalidStatus):
        connect(ws_url(auth_server))
    with connect(ws_url(auth_server), additional_headers={"Authorization": "Bearer sekret"}) as ws:
        ws.send(json.dumps({"type": "session.config", "response_format": "pcm"}))
        assert json.loads(ws.recv(timeout=10))["type"] == "session.started"


def read_until_close(ws: ClientConnection) -> list[str | dict]:
    """Every message until the server closes the socket: "binary" for a frame, else the
    JSON event."""
    messages: list[str | dict] = []
    while True:
        try:
            message = ws.recv(timeout=30)
        except ConnectionClosed:
            return messages
        messages.append("binary" if isinstance(message, bytes) else json.loads(message))


def test_nothing_follows_the_error_event_of_a_session_sending_audio(tone_server, monkeypatch):
    """A 413 while segments' audio is being sent: the error event is the last message
    before the close. The server's sends are written one at a time, in order, and the
    error's write ends only once the audio sender's next send waits behind it (or the
    sender has ended): the sender, still running until the close, had its frames written
    between the error and the close."""
    monkeypatch.setattr(speech_stream, "MAX_AHEAD_CHARS", 1000)
    original_send = WebSocket.send
    writes: dict[str, object] = {}

    async def send(self, message):
        if message["type"] == "websocket.send" and message.get("bytes") is not None:
            writes["audio_sender"] = asyncio.current_task()
        writes["queued"] += 1
        async with writes["lock"]:
            writes["queued"] -= 1
            await original_send(self, message)
            if message.get("text") and json.loads(message["text"])["type"] == "error":
                await wait_until_async(
                    lambda: writes["queued"] or writes["audio_sender"].done(), what="the audio sender's next send"
                )

    monkeypatch.setattr(WebSocket, "send", send)
    for _ in range(3):
        writes.update(queued=0, lock=asyncio.Lock(), audio_sender=None)
        with session(tone_server) as ws:
            send_text(ws, *[f"{'x' * 150}. " for _ in range(MAX_PENDING_SEGMENTS + 1)])
            while not isinstance(ws.recv(timeout=10), bytes):
                pass  # the first segment's audio is being sent, the next ones are admitted
            send_text(ws, "y " * 2000)
            messages = read_until_close(ws)
        errors = [i for i, m in enumerate(messages) if isinstance(m, dict) and m["type"] == "error"]
        assert errors == [len(messages) - 1], messages[errors[0] if errors else -3 :][:5]
        assert messages[-1]["error"]["code"] == 413 and messages[-1]["error"]["param"] == "text"
        wait_idle(tone_server, timeout=5)
        tone_server.assert_no_request_state()
