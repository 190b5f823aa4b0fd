"""The playground's chat tab against the served tiny Qwen3-Omni (``--load-format dummy``), in
headless Chromium: the tab follows the model, the reply text streams in, its speech plays
as it streams (every sample the server sends, scheduled), an attached audio clip reaches the
prompt, a server error is shown, and Stop aborts the request on the server."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile
from PIL import Image

from omnistage.models.qwen3_omni.random_checkpoint import write_random_checkpoint
from omnistage.models.qwen3_omni.random_text_tokenizer import (
    give_role_words_their_ids,
    write_text_tokenizer,
)
from omnistage.serve.app import ServerSettings, create_app
from omnistage.serve.registry import ModelRegistry
from omnistage.testing.waits import wait_until
from tests.playground.test_playground import (
    aborted_requests,
    open_playground,
    status,
    wait_final,
)
from tests.serve.conftest import RunningServer, run_uvicorn, wait_health

MESSAGE = "Say something nice."


@pytest.fixture(scope="module")
def omni_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    directory = write_random_checkpoint(tmp_path_factory.mktemp("omni_playground"), "tiny", seed=0)
    write_text_tokenizer(directory)
    give_role_words_their_ids(directory)
    config = ModelRegistry.discover().resolve(str(directory), load_format="dummy")
    for running in run_uvicorn(create_app(config, ServerSettings(data_dir=None))):
        assert wait_health(running.base_url, timeout_s=300).status_code == 200
        yield running


def whole_reply(server: RunningServer, content, voice: str | None, max_tokens: int) -> dict:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
    if voice:
        body |= {"modalities": ["text", "audio"], "audio": {"voice": voice, "format": "pcm16"}}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def send(page, text: str, voice: str, max_tokens: int) -> dict:
    page.fill("#chat-text", text)
    page.select_option("#chat-voice", voice)
    page.fill("#chat-max-tokens", str(max_tokens))
    page.click("#chat-send")
    return wait_final(page, timeout_ms=120_000)


def test_the_chat_tab_follows_the_served_model(page, omni_server):
    state = open_playground(page, omni_server)
    assert state["kind"] == "chat" and state["state"] == "idle", state
    assert page.is_visible("#chat-form") and page.is_hidden("#speech-form")
    assert page.get_attribute("#tab-chat", "aria-pressed") == "true"
    options = page.eval_on_selector_all("#chat-voice option", "options => options.map(o => o.value)")
    assert options == ["", "chelsie", "ethan", "aiden"] and page.input_value("#chat-voice") == "chelsie"
    assert page.is_visible("#chat-audio") and page.is_visible("#chat-image")


def test_reply_text_streams_and_its_speech_plays_as_it_streams(page, omni_server):
    expected = whole_reply(omni_server, MESSAGE, "ethan", 5)
    open_playground(page, omni_server)
    state = send(page, MESSAGE, "ethan", 5)
    assert state["state"] == "done", state
    assert state["reply"] == expected["choices"][0]["message"]["content"] == page.inner_text("#chat-reply")
    samples = len(base64.b64decode(expected["choices"][0]["message"]["audio"]["data"])) // 2
    assert state["samplesReceived"] == state["samplesScheduled"] == samples > 0
    assert 0 < state["ttftMs"] and 0 < state["ttfaMs"] and state["finishReason"] == "length"
    assert state["usage"]["completion_tokens_details"]["audio_tokens"] == expected["usage"]["completion_tokens_details"]["audio_tokens"]


def test_text_only_reply_plays_nothing(page, omni_server):
    open_playground(page, omni_server)
    state = send(page, MESSAGE, "", 4)
    assert state["state"] == "done" and state["reply"] and state["samplesReceived"] == 0, state


def test_a_refused_request_shows_the_servers_message(page, omni_server):
    open_playground(page, omni_server)
    state = send(page, MESSAGE, "ethan", 10**6)
    assert state["state"] == "error" and "max_tokens" in state["error"] and "HTTP 400" in state["error"], state
    assert page.is_visible("#error")


def test_stop_aborts_the_chat_request_on_the_server(page, omni_server):
    before = aborted_requests(omni_server)
    open_playground(page, omni_server)
    page.fill("#chat-text", MESSAGE)
    page.select_option("#chat-voice", "ethan")
    page.fill("#chat-max-tokens", "400")
    page.click("#chat-send")
    page.wait_for_function("() => window.playground.samplesReceived > 0", timeout=120_000)
    page.click("#chat-stop")
    assert status(page)["state"] == "stopped"
    wait_until(lambda: aborted_requests(omni_server) > before, 30, "the request's abort")




def _tone(path: Path) -> dict:
    t = np.arange(16000) / 16000
    soundfile.write(path, (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32), 16000, subtype="FLOAT")
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(path.read_bytes()).decode(), "format": "wav"}}


def _dots(path: Path) -> dict:
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8), "RGB").save(path)
    return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()}}


@pytest.mark.parametrize(("field", "name", "make"), [("#chat-audio", "tone.wav", _tone), ("#chat-image", "dots.png", _dots)])
def test_an_attachment_is_in_the_prompt(page, omni_server, tmp_path: Path, field, name, make):
    """The page sends the attached file as the part a direct request with it has: the same
    prompt length and the same greedy reply."""
    part = make(tmp_path / name)
    expected = whole_reply(omni_server, [{"type": "text", "text": MESSAGE}, part], "", 3)
    open_playground(page, omni_server)
    page.set_input_files(field, str(tmp_path / name))
    state = send(page, MESSAGE, "", 3)
    assert state["state"] == "done", state
    assert state["usage"]["prompt_tokens"] == expected["usage"]["prompt_tokens"]
    assert state["reply"] == expected["choices"][0]["message"]["content"]
