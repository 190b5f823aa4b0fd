"""The web playground end to end: the bundled Piper voice served for real, the page driven in
headless Chromium through Playwright (Debian's /usr/bin/chromium, not a downloaded browser).

Without the ``playwright`` package or ``/usr/bin/chromium`` the browser tests skip, saying
which is missing; the tests that need no browser still run.
"""

from __future__ import annotations

import base64
import os
import re
import signal
import subprocess
import sys
import time
import wave
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from omnistage.serve.app import ServerSettings, create_app
from omnistage.serve.playground import STATIC_DIR
from omnistage.serve.registry import ModelRegistry
from omnistage.testing.waits import free_port, wait_until
from tests.serve.conftest import RunningServer, run_uvicorn, wait_health

API_KEY = "playground-key"
SHORT_TEXT = "Hello from the playground. A second sentence follows the first."
# About 3,700 characters: tens of seconds of synthesis on 2 cores, so Stop lands mid-request.
LONG_TEXT = " ".join(["This long sentence keeps the voice busy for quite a while."] * 62)
DETERMINISTIC = {"noise_scale": 0, "noise_w": 0}
FINAL_STATES = ["done", "stopped", "error"]


# ----------------------------------------------------------------------------- fixtures


def _serve_piper(settings: ServerSettings) -> Iterator[RunningServer]:
    config = ModelRegistry.discover().resolve(None)
    for running in run_uvicorn(create_app(config, settings)):
        assert wait_health(running.base_url).status_code == 200
        yield running


@pytest.fixture(scope="module")
def piper_server() -> Iterator[RunningServer]:
    yield from _serve_piper(ServerSettings())


@pytest.fixture(scope="module")
def key_server() -> Iterator[RunningServer]:
    yield from _serve_piper(ServerSettings(api_keys=(API_KEY,), warmup=False))


# ----------------------------------------------------------------------------- helpers


def open_playground(page, server: RunningServer) -> dict:
    page.goto(f"{server.base_url}/")
    page.wait_for_function("() => window.playground && window.playground.state !== 'loading'")
    return status(page)


def status(page) -> dict:
    return page.evaluate("() => ({...window.playground})")


def wait_final(page, timeout_ms: int = 30_000) -> dict:
    page.wait_for_function(
        "(states) => states.includes(window.playground.state)", arg=FINAL_STATES, timeout=timeout_ms
    )
    return status(page)


def speak(page, text: str, *, stream: bool = True) -> dict:
    page.fill("#text", text)
    page.set_checked("#stream", stream)
    page.click("#play")
    return wait_final(page)


def set_deterministic(page) -> None:
    for name, value in DETERMINISTIC.items():
        page.fill(f"#param-{name}", str(value))


def server_pcm(server: RunningServer, text: str, **fields) -> bytes:
    body = {"input": text, "voice": "joe", "response_format": "pcm", **fields}
    response = httpx.post(f"{server.base_url}/v1/audio/speech", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.content


def aborted_requests(server: RunningServer) -> float:
    metrics = httpx.get(f"{server.base_url}/metrics").text
    pattern = r'^omnistage_requests_total\{[^}]*finish_reason="abort"[^}]*\} (\S+)$'
    return sum(float(value) for value in re.findall(pattern, metrics, re.MULTILINE))


# ----------------------------------------------------------------------------- the page


def test_page_lists_the_models_voice_and_its_own_fields_only(page, piper_server):
    requests: list[str] = []
    page.on("request", lambda request: requests.append(request.url))
    state = open_playground(page, piper_server)
    assert state["state"] == "idle" and state["voices"] == ["joe"], state
    options = page.eval_on_selector_all("#voice option", "options => options.map(o => o.value)")
    assert options == ["joe"] and page.input_value("#voice") == "joe"
    assert page.is_visible("#speed") and page.is_visible("#stream")
    for hidden in ("#language-field", "#instructions-field", "#reference-field"):
        assert page.is_hidden(hidden), hidden
    for name in DETERMINISTIC:
        bounds = page.eval_on_selector(
            f"#param-{name}", "input => [input.type, input.min, input.max]"
        )
        assert bounds == ["number", "0", "2"], (name, bounds)
    assert requests and all(url.startswith(piper_server.base_url) for url in requests), requests


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_played_audio_is_exactly_what_the_server_sends(page, piper_server, tmp_path, stream):
    """The page receives, schedules and plays every sample (as many as a direct non-streamed
    request returns), reports TTFA, duration and RTF, and its WAV download holds the same
    bytes."""
    # the page asks for pcm at the voice's own rate (its AudioContext runs at it)
    expected = server_pcm(piper_server, SHORT_TEXT, sample_rate=22050, **DETERMINISTIC)
    open_playground(page, piper_server)
    set_deterministic(page)
    clicked = time.monotonic()
    state = speak(page, SHORT_TEXT, stream=stream)
    elapsed = time.monotonic() - clicked
    assert state["state"] == "done", state
    samples = len(expected) // 2
    assert state["samplesReceived"] == state["samplesScheduled"] == samples
    assert state["sampleRate"] == 22050
    assert elapsed >= 0.9 * samples / 22050, "playback ended before the audio could have played"
    assert 0 < state["ttfaMs"] < elapsed * 1000 and re.fullmatch(
        r"\d+ ms", page.inner_text("#ttfa")
    )
    assert page.inner_text("#duration") == f"{samples / 22050:.2f} s"
    assert 0 < state["rtf"] < 5 and page.inner_text("#rtf") == f"{state['rtf']:.3f}"
    with page.expect_download() as download:
        page.click("#download")
    saved = tmp_path / "speech.wav"
    download.value.save_as(saved)
    with wave.open(str(saved)) as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, 22050)
        assert wav.readframes(wav.getnframes()) == expected


def test_empty_text_shows_the_servers_400_message(page, piper_server):
    open_playground(page, piper_server)
    state = speak(page, "")
    assert state["state"] == "error", state
    assert page.is_visible("#error")
    assert page.inner_text("#error") == "input must not be empty (HTTP 400)"
    assert page.is_enabled("#play") and page.is_disabled("#stop")


def test_stop_aborts_the_request_on_the_server(page, piper_server):
    coordinator = piper_server.speech.pipeline.coordinator
    aborted_before = aborted_requests(piper_server)
    open_playground(page, piper_server)
    page.fill("#text", LONG_TEXT)
    page.click("#play")
    page.wait_for_function("() => window.playground.samplesReceived > 0", timeout=30_000)
    assert coordinator.in_flight == 1
    page.click("#stop")
    stopped = status(page)
    assert stopped["state"] == "stopped" and page.is_disabled("#stop")
    wait_until(lambda: coordinator.in_flight == 0, 5, "the server's release of the request")
    assert aborted_requests(piper_server) == aborted_before + 1
    page.wait_for_timeout(300)
    assert status(page)["samplesReceived"] == stopped["samplesReceived"]


def test_api_key_is_sent_from_the_key_field(page, key_server):
    state = open_playground(page, key_server)
    assert state["state"] == "error" and page.is_disabled("#play")
    assert page.inner_text("#error") == "invalid or missing API key (HTTP 401)"
    page.fill("#api-key", API_KEY)
    page.click("#connect")
    page.wait_for_function("() => window.playground.state === 'idle'")
    assert status(page)["voices"] == ["joe"] and page.is_hidden("#error")
    state = speak(page, "The key works.")
    assert state["state"] == "done" and state["samplesReceived"] > 0, state
    page.fill("#api-key", "")
    state = speak(page, "No key now.")
    assert state["state"] == "error"
    assert page.inner_text("#error") == "invalid or missing API key (HTTP 401)"


CLONING_MODEL = {
    "model": "cloner",
    "model_type": "fake",
    "voices": [],
    "default_voice": None,
    "languages": ["auto", "en", "de"],
    "supported_fields": sorted(
        {"input", "model", "response_format", "stream", "language", "instructions"}
        | {"ref_audio", "ref_text", "temperature"}
    ),
    "fields": {"guidance": {"anyOf": [{"type": "number", "maximum": 3.0}, {"type": "null"}]}},
    "definitions": {},
    "response_formats": ["pcm", "wav"],
    "sample_rate": 16000,
    "max_input_chars": 4096,
}


def test_form_follows_the_model_and_sends_reference_audio_as_a_data_uri(page, piper_server):
    """Against a (routed) model that takes language, instructions and a reference clip:
    those inputs appear, voice and speed do not, and the body carries what was entered."""
    sent: list[dict] = []
    pcm = bytes(range(256)) * 8  # 1024 samples

    def speech(route):
        sent.append(route.request.post_data_json)
        route.fulfill(status=200, body=pcm, headers={"X-Sample-Rate": "16000"})

    page.route("**/v1/audio/voices", lambda route: route.fulfill(json=CLONING_MODEL))
    page.route("**/v1/audio/speech", speech)
    open_playground(page, piper_server)
    for shown in ("#language", "#instructions", "#ref-audio", "#ref-text", "#param-guidance"):
        assert page.is_visible(shown), shown
    assert page.is_hidden("#voice-field") and page.is_hidden("#speed-field")
    assert page.eval_on_selector("#param-guidance", "i => [i.min, i.max]") == ["", "3"]
    clip = b"RIFF\x24\x00\x00\x00WAVEfmt reference clip"
    page.set_input_files(
        "#ref-audio", files=[{"name": "me.wav", "mimeType": "audio/wav", "buffer": clip}]
    )
    page.fill("#ref-text", "what I said")
    page.fill("#instructions", "whisper")
    page.select_option("#language", "de")
    state = speak(page, "Hallo.", stream=False)
    assert state["state"] == "done" and state["samplesReceived"] == len(pcm) // 2, state
    assert sent == [
        {
            "model": "cloner",
            "input": "Hallo.",
            "language": "de",
            "instructions": "whisper",
            "ref_audio": "data:audio/wav;base64," + base64.b64encode(clip).decode(),
            "ref_text": "what I said",
            "response_format": "pcm",
            "sample_rate": 16000,
            "stream": False,
        }
    ]


PLAYER_CHECK = """async () => {
  const base = document.baseURI;
  const { S16Decoder } = await import(new URL("playground/pcm.js", base));
  const { StreamPlayer, LEAD_S } = await import(new URL("playground/player.js", base));
  const rate = 22050, n = rate;
  const bytes = new Uint8Array(2 * n), view = new DataView(bytes.buffer);
  for (let i = 0; i < n; i++) view.setInt16(2 * i, Math.round(20000 * Math.sin(i / 7)), true);
  const context = new OfflineAudioContext(1, n + rate, rate);
  const player = new StreamPlayer(context, rate), decoder = new S16Decoder();
  const sizes = [1, 3, 1000, 4097, 2, 777, 1, 6001];
  for (let offset = 0, k = 0; offset < bytes.length; offset += sizes[k++ % sizes.length]) {
    player.schedule(decoder.decode(bytes.subarray(offset, offset + sizes[k % sizes.length])));
  }
  const out = (await context.startRendering()).getChannelData(0);
  const start = Math.ceil(LEAD_S * rate);
  let diff = 0, outside = 0;
  for (let i = 0; i < out.length; i++) {
    const j = i - start;
    if (j >= 0 && j < n) diff = Math.max(diff, Math.abs(out[i] - view.getInt16(2 * j, true) / 32768));
    else outside = Math.max(outside, Math.abs(out[i]));
  }
  return { diff, outside, scheduled: player.samplesScheduled, underruns: player.underruns,
           pending: decoder.pendingBytes };
}"""


def test_pieces_split_mid_sample_play_back_to_back_without_gaps(page, piper_server):
    """The page's decoder and player, rendered offline: bytes cut at odd offsets, scheduled
    piece by piece, come out as exactly the original signal, contiguous, nothing around it."""
    open_playground(page, piper_server)
    result = page.evaluate(PLAYER_CHECK)
    assert result == {"diff": 0, "outside": 0, "scheduled": 22050, "underruns": 0, "pending": 0}


# ----------------------------------------------------------------------------- turned off


def test_playground_false_serves_no_page():
    config = ModelRegistry.discover().resolve(None)
    client = TestClient(create_app(config, ServerSettings(playground=False)))  # no lifespan
    for path in ("/", "/playground/main.js"):
        response = client.get(path)
        assert response.status_code == 404, path
        assert response.json()["error"]["type"] == "not_found_error"


def test_playground_assets_are_served_with_their_types():
    config = ModelRegistry.discover().resolve(None)
    client = TestClient(create_app(config, ServerSettings(api_keys=("secret",))))  # no lifespan
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    types = {".js": "javascript", ".css": "text/css"}
    for path in sorted(STATIC_DIR.iterdir()):
        if path.suffix in types:
            asset = client.get(f"/playground/{path.name}")
            assert asset.status_code == 200 and types[path.suffix] in asset.headers["content-type"]
    assert client.get("/v1/audio/voices").status_code == 401


def _omnistage() -> list[str]:
    script = Path(sys.executable).with_name("omnistage")
    return [str(script)] if script.exists() else [sys.executable, "-m", "omnistage.cli"]


def test_serve_no_playground_flag_gives_404_at_root():
    port = free_port()
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    command = [*_omnistage(), "serve", "--port", str(port), "--no-playground", "--no-warmup"]
    server = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _answers(f"{base_url}/health") == 200 or server.poll() is not None, 60, "the server's start")
        assert server.poll() is None, "the server exited"
        assert _answers(f"{base_url}/") == 404
        assert _answers(f"{base_url}/v1/audio/voices") == 200
    finally:
        server.send_signal(signal.SIGTERM)
        _, stderr = server.communicate(timeout=30)
    assert "Traceback" not in stderr, stderr


def _answers(url: str) -> int:
    try:
        return httpx.get(url, timeout=1.0, trust_env=False).status_code
    except httpx.HTTPError:
        return 0
