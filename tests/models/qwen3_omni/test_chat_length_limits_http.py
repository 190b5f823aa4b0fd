"""A Qwen3-Omni chat request the thinker or talker stage could not take (its prompt plus its
reply tokens, or the talker's prompt plus its speech frames, over the stage's
``max_model_len``) is a 400 naming the field, decided at the request boundary from token
ids and the media's placeholder counts (known from the decoded media's sizes, before any
encoder runs): no stage ever sees it, nothing is left behind, and a request of exactly the
limit is served (the boundary counts what the engines count)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator

import httpx
import pytest

from omnistage.models.qwen3_omni.random_checkpoint import write_random_checkpoint
from omnistage.models.qwen3_omni.random_text_tokenizer import (
    give_role_words_their_ids,
    write_text_tokenizer,
)
from omnistage.serve.app import ServerSettings, create_app
from omnistage.serve.registry import ModelRegistry
from omnistage.testing.leaks import assert_no_request_state
from tests.models.qwen3_omni.test_chat_api import HELLO, SPEECH, wav_clip
from tests.models.qwen3_tts.test_request_limits_http import (  # every stage's inputs
    SEEN,
    record_inputs,
)
from tests.serve.conftest import RunningServer, run_uvicorn, wait_health

THINKER_LEN, TALKER_LEN = 64, 96
FRAMES_PER_SECOND = 12.5

@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """The tiny random Qwen3-Omni whose thinker takes prompt + reply of 64 at most and whose
    talker takes prompt + frames of 96, every message into any of its stages recorded."""
    checkpoint = write_random_checkpoint(tmp_path_factory.mktemp("omni_limits"), "tiny", seed=0)
    write_text_tokenizer(checkpoint)
    give_role_words_their_ids(checkpoint)
    config = ModelRegistry.discover().resolve(str(checkpoint), load_format="dummy")
    for stage, limit in (("thinker", THINKER_LEN), ("talker", TALKER_LEN)):
        config.stage(stage).factory.args.update(max_model_len=limit, kv_cache_bytes=8 << 20)
    for running in run_uvicorn(create_app(config, ServerSettings(playground=False, data_dir=None))):
        assert wait_health(running.base_url, timeout_s=300).status_code == 200
        for stage in running.speech.pipeline.host.stages.values():
            record_inputs(stage.scheduler)
        yield running


def chat(server: RunningServer, **fields) -> httpx.Response:
    body = {"model": "qwen3-omni", "messages": HELLO, **fields}
    return httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=120)


def assert_nothing_left(server: RunningServer) -> None:
    pipeline = server.speech.pipeline
    asyncio.run_coroutine_threadsafe(
        assert_no_request_state(pipeline), pipeline.coordinator.loop
    ).result(30)


def refused(server: RunningServer, param: str, limit: int | None, **fields) -> str:
    """Assert the request is a 400 on ``param`` (naming ``limit``) that no stage saw; its
    message."""
    seen = len(SEEN)
    response = chat(server, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and (limit is None or f"at most {limit} " in error["message"]), (
        error
    )
    assert SEEN[seen:] == []  # no stage got a message: no model work ran
    assert_nothing_left(server)
    return error["message"]


def spoken(seconds: float) -> list[dict]:
    clip = {"type": "input_audio", "input_audio": {"data": wav_clip(seconds), "format": "wav"}}
    return [{"role": "user", "content": [clip, {"type": "text", "text": "What is it?"}]}]


def test_a_reply_over_the_thinker_limit_is_a_400_on_max_tokens_and_the_most_is_served(
    server,
) -> None:
    message = refused(server, "max_tokens", THINKER_LEN)  # the default 1024
    assert "the default max_tokens 1024" in message
    most = int(re.search(r"ask for at most (\d+)", message)[1])
    assert 0 < most < THINKER_LEN
    refused(server, "max_tokens", THINKER_LEN, max_tokens=most + 1)
    refused(server, "max_completion_tokens", THINKER_LEN, max_completion_tokens=most + 1)
    served = chat(server, max_tokens=most)
    assert served.status_code == 200, served.text
    assert served.json()["usage"]["prompt_tokens"] == THINKER_LEN - most  # the engine's count
    assert_nothing_left(server)


def test_audio_placeholders_count_before_the_audio_is_encoded(server) -> None:
    # 6 s: 78 audio placeholders (13 a second) leave no room in 64 positions
    refused(server, "messages", THINKER_LEN, messages=spoken(6.0), max_tokens=2)
    message = refused(
        server, "max_tokens", THINKER_LEN, messages=spoken(2.0), max_tokens=THINKER_LEN
    )
    most = int(re.search(r"ask for at most (\d+)", message)[1])
    served = chat(server, messages=spoken(2.0), max_tokens=most)
    assert served.status_code == 200, served.text
    prompt = served.json()["usage"]["prompt_tokens"]
    assert (
        prompt == THINKER_LEN - most and prompt > 26
    )  # the engine's count, the clip's 26 included


def test_speech_over_the_talker_limit_is_a_400_on_max_audio_seconds_and_the_most_is_served(
    server,
) -> None:
    message = refused(
        server, "max_audio_seconds", None, max_tokens=4, **SPEECH
    )  # the default 4096 frames
    assert "max_audio_seconds unset" in message and f"at most {TALKER_LEN} " in message
    most = int(re.search(r"ask for at most (\d+) frames", message)[1])
    assert 0 < most < TALKER_LEN
    refused(
        server,
        "max_audio_seconds",
        TALKER_LEN,
        max_tokens=4,
        max_audio_seconds=(most + 1) / FRAMES_PER_SECOND,
        **SPEECH,
    )
    served = chat(server, max_tokens=4, max_audio_seconds=most / FRAMES_PER_SECOND, **SPEECH)
    assert served.status_code == 200, served.text  # the talker engine took most frames
    assert_nothing_left(server)


def test_an_audio_under_the_feature_extractor_window_is_a_400_not_a_stage_failure(server) -> None:
    message = refused(server, "messages.0.content.0", None, messages=spoken(0.012), max_tokens=2)
    assert "shorter than 12.6 ms" in message
    assert chat(server, max_tokens=2).status_code == 200
