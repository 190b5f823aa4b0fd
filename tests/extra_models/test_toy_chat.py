"""The chat model contract end to end with a model the framework has never heard of: the
toy chat package in ``tests/extra_models`` (loaded through ``OMNISTAGE_EXTRA_MODELS``) is
served over HTTP and spoken to with the OpenAI SDK; its own field works, and audio asked of
it (it has no talker) is a 400 naming ``modalities`` before any stage runs."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from omnistage.serve.app import ServerSettings, create_app
from omnistage.serve.registry import ModelRegistry
from omnistage.testing.metrics import stage_batch_totals
from tests.extra_models.toy_chat.config import ARCHITECTURE, ToyChatConfig
from tests.serve.conftest import RunningServer, run_uvicorn, wait_health


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    checkpoint = tmp_path_factory.mktemp("toy_chat") / "echo"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"architectures": [ARCHITECTURE]}))
    config = ModelRegistry.discover(extra="tests.extra_models").resolve(str(checkpoint))
    assert type(config) is ToyChatConfig
    for running in run_uvicorn(create_app(config, ServerSettings(playground=False))):
        assert wait_health(running.base_url).status_code == 200
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def reply_batches(server: RunningServer) -> float:
    registry = server.app.state.server.metrics.registry
    return stage_batch_totals(registry, "reply")[0]


def test_the_toy_model_answers_through_the_sdk_whole_and_streamed(client) -> None:
    messages = [{"role": "system", "content": "be kind"}, {"role": "user", "content": "one two three"}]
    whole = client.chat.completions.create(model="toy-chat", messages=messages, extra_body={"shout": True})
    assert whole.choices[0].message.content == "THREE TWO ONE" and whole.choices[0].finish_reason == "stop"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (5, 3)
    chunks = list(client.chat.completions.create(
        model="toy-chat", messages=messages, stream=True, stream_options={"include_usage": True},
    ))  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "three two one"
    assert chunks[-1].usage.total_tokens == 8


def test_its_own_field_is_in_the_schema_and_an_unknown_one_names_it(server, client) -> None:
    voices = httpx.get(f"{server.base_url}/v1/audio/voices").json()
    assert voices["voices"] == [] and voices["audio_output"] is False and "shout" in voices["fields"]
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(model="toy-chat", messages=[{"role": "user", "content": "x"}], extra_body={"whisper": 1})
    assert excinfo.value.body["param"] == "whisper" and "shout" in excinfo.value.body["message"]


def test_audio_from_a_model_without_a_talker_is_refused_before_any_stage_runs(server, client) -> None:
    before = reply_batches(server)
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(
            model="toy-chat", messages=[{"role": "user", "content": "x"}], modalities=["text", "audio"],
            audio={"voice": "alloy", "format": "wav"},
        )  # fmt: skip
    assert excinfo.value.body["param"] == "modalities"
    assert reply_batches(server) == before


def test_the_framework_names_no_toy_chat_code() -> None:
    root = Path(__file__).resolve().parents[2] / "omnistage"
    assert not [p for p in root.rglob("*.py") if "toy_chat" in p.read_text(encoding="utf-8")]
