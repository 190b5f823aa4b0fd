"""A request the ``tts_engine`` stage could not take (its prompt plus its frames over the
stage's ``max_model_len``) is a 400 naming the field, decided at the request boundary from
token ids and the reference's length: no stage ever sees it, nothing is left behind, and a
request of exactly the limit is served (the boundary counts what the engine counts)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from omnistage.models.qwen3_tts.config import Qwen3TTSPipelineConfig
from omnistage.serve.app import ServerSettings, create_app
from omnistage.testing.leaks import assert_no_request_state
from tests.models.qwen3_tts.test_pipeline_http import REF_AUDIO, REF_TEXT, run_on_server_loop
from tests.serve.conftest import RunningServer, run_uvicorn, wait_health

MAX_MODEL_LEN = 96


@pytest.fixture(scope="module")
def server(tiny_servable_checkpoints: dict[str, Path]) -> Iterator[RunningServer]:
    """A tiny Base server whose tts_engine stage takes prompt + frames of 96 at most, every
    message into any of its stages recorded by request id."""
    config = Qwen3TTSPipelineConfig.for_model_path(str(tiny_servable_checkpoints["base"]))
    config.stage("tts_engine").factory.args["max_model_len"] = MAX_MODEL_LEN
    generator = run_uvicorn(create_app(config, ServerSettings(playground=False)))
    running = next(generator)
    try:
        assert wait_health(running.base_url).status_code == 200
        for stage in running.speech.pipeline.host.stages.values():
            record_inputs(stage.scheduler)
        yield running
    finally:
        generator.close()


SEEN: list[str] = []
"""request ids of the messages every stage of the server got, in order."""


def record_inputs(scheduler) -> None:
    put = scheduler.put

    def recording_put(message):
        SEEN.append(getattr(message, "request_id", "?"))
        put(message)

    scheduler.put = recording_put


def speak(server: RunningServer, **fields) -> httpx.Response:
    body = {"input": "Hello there.", "ref_audio": REF_AUDIO, "ref_text": REF_TEXT, "response_format": "pcm", **fields}
    return httpx.post(f"{server.base_url}/v1/audio/speech", json=body, timeout=60)


def refused(server: RunningServer, param: str, **fields) -> str:
    """Assert the request is a 400 on ``param`` that no stage saw; its message."""
    seen = len(SEEN)
    response = speak(server, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and str(MAX_MODEL_LEN) in error["message"], error
    assert SEEN[seen:] == []  # no stage got a message: no model work ran
    run_on_server_loop(server, assert_no_request_state(server.speech.pipeline))
    return error["message"]


def test_too_many_frames_for_the_prompt_is_a_400_on_max_new_tokens_and_the_limit_itself_is_served(server):
    message = refused(server, "max_new_tokens", max_new_tokens=MAX_MODEL_LEN)
    most = int(re.search(r"ask for at most (\d+)", message)[1])
    assert 0 < most < MAX_MODEL_LEN
    refused(server, "max_new_tokens", max_new_tokens=most + 1)
    served = speak(server, max_new_tokens=most, min_new_tokens=most)
    assert served.status_code == 200, served.text
    assert len(served.content) == 2 * 1920 * most  # every frame: the engine took it whole


def test_a_prompt_over_the_limit_is_a_400_on_input(server):
    refused(server, "input", input="Hello there. " * 5, non_streaming_mode=True, max_new_tokens=2)
    # streaming text: the rows of the text fed to the decode steps count as well
    refused(server, "input", input="Hello there. " * 8, ref_text=None, x_vector_only_mode=True, max_new_tokens=2)


def test_serving_goes_on_after_a_refusal(server):
    refused(server, "input", input="Hello there. " * 8, non_streaming_mode=True)
    assert speak(server, max_new_tokens=2).status_code == 200
