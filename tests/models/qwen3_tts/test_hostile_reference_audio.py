"""Hostile ``ref_audio`` against a real Qwen3-TTS Base server (tiny random checkpoint):
every bad input is a 400 JSON envelope naming the field, counted in /metrics, and the
server keeps serving (issue 12: a 9-channel WAV used to segfault the process)."""

from __future__ import annotations

import base64
import io
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile

from omnistage.models.qwen3_tts.config import Qwen3TTSPipelineConfig
from omnistage.serve.app import ServerSettings, create_app
from omnistage.serve.decoding import shared_pool
from omnistage.serve.media import MediaPolicy
from omnistage.testing.media_corpus import write_corpus
from tests.models.qwen3_tts.test_pipeline_http import REF_TEXT, metric, tone_clip, wav_data_uri
from tests.serve.conftest import RunningServer, run_uvicorn, wait_health


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("allowed_media")


@pytest.fixture(scope="module")
def base_server(tiny_servable_checkpoints, media_dir) -> Iterator[RunningServer]:
    config = Qwen3TTSPipelineConfig.for_model_path(str(tiny_servable_checkpoints["base"]))
    media = MediaPolicy(allowed_local_media_path=media_dir, allowed_media_domains=("example.com",))
    settings = ServerSettings(playground=False, warmup=False, media_policy=media)
    for server in run_uvicorn(create_app(config, settings)):
        assert wait_health(server.base_url).status_code == 200
        yield server


def speak(server: RunningServer, ref_audio: str, **fields) -> httpx.Response:
    body = {
        "input": "Hi.",
        "ref_audio": ref_audio,
        "ref_text": REF_TEXT,
        "max_new_tokens": 2,
        **fields,
    }
    return httpx.post(f"{server.base_url}/v1/audio/speech", json=body, timeout=60)


def assert_refused(response: httpx.Response, *words: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "ref_audio" and "ref_audio" in error["message"]
    for word in words:
        assert word in error["message"], error["message"]


def rejected_400(server: RunningServer) -> float:
    return metric(server, 'omnistage_requests_total{finish_reason="rejected",status="400"}')


def test_a_path_with_a_nul_byte_is_a_counted_400(base_server):
    before = rejected_400(base_server)
    assert_refused(speak(base_server, "ref\x00.wav"), "NUL")
    assert rejected_400(base_server) == before + 1


def test_a_url_with_an_invalid_idna_host_is_a_counted_400(base_server):
    before = rejected_400(base_server)
    assert_refused(speak(base_server, "http://xn--/"), "malformed URL")
    assert rejected_400(base_server) == before + 1


def test_the_fuzz_corpus_never_gets_a_5xx_and_the_server_keeps_serving(base_server, tmp_path):
    """A slice of the corpus over HTTP (the whole corpus runs against the decoder in
    tests/serve/test_media_fuzz.py): many channels, lying headers, truncations, junk."""
    corpus = {p.name: p for p in write_corpus(tmp_path)}
    names = ["grid-9ch-16000hz.wav", "grid-64ch-96000hz.wav", "header-65535ch.wav",
             "header-rate-4ghz.wav", "header-data-4gb.wav", "cut-half-flac.flac",
             "junk-magic.wav", "junk-random.bin", "codec-adpcm_ms.nut"]  # fmt: skip
    for name in names:
        value = base64.b64encode(corpus[name].read_bytes()).decode()
        response = speak(base_server, value, x_vector_only_mode=True, ref_text=None)
        assert response.status_code in (200, 400), (name, response.status_code, response.text)
        if response.status_code == 400:
            assert_refused(response)
    assert httpx.get(f"{base_server.base_url}/health").status_code == 200
    assert speak(base_server, wav_data_uri(tone_clip(1.0))).status_code == 200


def test_a_decoder_killed_mid_request_is_a_400_with_a_logged_request_id(base_server, caplog):
    pool = shared_pool()
    pool.start()
    stopped = pool.pids
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)  # the next job stays in flight until the kill
    responses: list[httpx.Response] = []
    fresh = wav_data_uri(tone_clip(1.0, seed=12))  # not in the decode cache: reaches a worker
    thread = threading.Thread(target=lambda: responses.append(speak(base_server, fresh)))
    with caplog.at_level(logging.ERROR, logger="omnistage.serve.decoding"):
        thread.start()
        deadline = time.monotonic() + 30
        while pool.jobs_in_flight == 0:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        for pid in stopped:
            os.kill(pid, signal.SIGKILL)
        thread.join(60)
    assert_refused(responses[0], "could not be decoded", "crashed")
    assert "request req-" in caplog.text and "SIGKILL" in caplog.text
    assert speak(base_server, wav_data_uri(tone_clip(1.0))).status_code == 200


def test_the_default_body_cap_fits_the_largest_legitimate_request(base_server):
    """10 MiB of reference audio (the media cap) as base64 with the longest text (2,000
    characters) passes the body cap: the reference's own 30 s limit refuses it (413 naming
    ref_audio), not the body size."""
    rate, pcm_bytes = 16_000, 10 * 1024 * 1024 - 44
    samples = (np.sin(np.arange(pcm_bytes // 2) / 7) * 8000).astype("<i2")
    data = io.BytesIO()
    soundfile.write(data, samples, rate, format="WAV", subtype="PCM_16")
    assert len(data.getvalue()) == 10 * 1024 * 1024
    response = speak(base_server, base64.b64encode(data.getvalue()).decode(), input="a" * 2000)
    assert response.status_code == 413, response.text
    assert (
        response.json()["error"]["param"] == "ref_audio"
        and "30" in response.json()["error"]["message"]
    )
