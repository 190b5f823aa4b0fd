"""Supervision of stage processes (issue 12: after a kill -9 the server answered 503
forever): a dead stage process is restarted with backoff, requests in the gap get 503
with Retry-After, ``/health`` names the stages down, and past the restart limit the
pipeline gives up (``/health`` ``failed``, ``on_fatal`` called)."""

from __future__ import annotations

import time

import httpx

from omnistage.serve.app import ServerSettings, create_app
from omnistage.testing.tone import ToneConfig
from tests.serve.conftest import run_uvicorn, wait_health
from tests.serve.test_server import expected_pcm, speech


def tone_in_a_process(**overrides) -> ToneConfig:
    config = ToneConfig.for_model_path("tone-test")
    config.stages[0].process = "synth"
    return config.model_copy(update={"process_death_timeout_s": 0.4, **overrides})


def health_until(base_url: str, predicate, timeout_s: float = 60.0) -> httpx.Response:
    deadline = time.monotonic() + timeout_s
    while not predicate(response := httpx.get(f"{base_url}/health")):
        assert time.monotonic() < deadline, response.text
        time.sleep(0.05)
    return response


def test_a_killed_stage_process_is_restarted_and_past_the_limit_the_pipeline_gives_up():
    reasons: list[str] = []
    config = tone_in_a_process(max_stage_restarts=1, stage_restart_backoff_s=2.0)
    app = create_app(
        config, ServerSettings(warmup=False, playground=False), on_fatal=reasons.append
    )
    for server in run_uvicorn(app):
        assert wait_health(server.base_url).status_code == 200
        pipeline = server.speech.pipeline
        assert speech(server, {"input": "hi", "response_format": "pcm"}).content == expected_pcm(
            "hi"
        )
        old = pipeline.processes["synth"]
        old.kill()
        down = health_until(server.base_url, lambda r: r.status_code != 200)
        assert down.status_code == 503 and down.json()["status"] == "unhealthy"
        assert down.json()["stages_down"] == ["tone"] and "synth" in down.json()["reason"]
        assert int(down.headers["retry-after"]) >= 1
        refused = speech(server, {"input": "hi"})  # within the 2 s backoff
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["type"] == "service_unavailable"
        health_until(server.base_url, lambda r: r.status_code == 200)
        assert pipeline.processes["synth"].pid != old.pid and pipeline.fatal_error is None
        assert speech(server, {"input": "ok", "response_format": "pcm"}).content == expected_pcm(
            "ok"
        )

        pipeline.processes["synth"].kill()  # a second death within the window: past the limit
        failed = health_until(server.base_url, lambda r: r.json()["status"] == "failed")
        assert failed.status_code == 503 and "giving up" in failed.json()["reason"]
        assert len(reasons) == 1 and "synth" in reasons[0]
        refused = speech(server, {"input": "hi"})
        assert refused.status_code == 503 and "retry-after" not in refused.headers
