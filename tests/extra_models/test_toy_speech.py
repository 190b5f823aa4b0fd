"""The model contract end to end with a model the framework has never heard of: the toy
speech package in ``tests/extra_models`` (loaded through ``OMNISTAGE_EXTRA_MODELS``) is
written by ``init-random``, served over HTTP, and its own fields show in
``/v1/audio/voices`` and in validation errors; omnistage's code never names it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from typer.testing import CliRunner

import omnistage
from omnistage.cli.main import app
from omnistage.serve.app import ServerSettings, create_app
from omnistage.serve.registry import EXTRA_MODELS_ENV, ModelRegistry
from tests.extra_models.toy_speech.config import ToySpeechConfig
from tests.extra_models.toy_speech.stages import SAMPLE_RATE, TONE_S
from tests.serve.conftest import RunningServer, run_uvicorn, wait_health

ARCH = "ToySpeechForTesting"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("toy") / "tiny"
    result = CliRunner().invoke(
        app, ["init-random", "--arch", ARCH, "--size", "tiny", "--seed", "1", str(out)],
        env={EXTRA_MODELS_ENV: "tests.extra_models"},
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[RunningServer]:
    registry = ModelRegistry.discover(extra="tests.extra_models")
    config = registry.resolve(str(checkpoint))
    assert type(config) is ToySpeechConfig
    for running in run_uvicorn(create_app(config, ServerSettings(playground=False))):
        assert wait_health(running.base_url).status_code == 200
        yield running


def speech(server: RunningServer, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/audio/speech", json=body, timeout=30)


def test_init_random_lists_and_writes_the_toy_model(checkpoint):
    listed = CliRunner().invoke(app, ["init-random", "--list"], env={EXTRA_MODELS_ENV: "tests.extra_models"})
    assert f"--arch {ARCH}: --size tiny | small" in listed.output
    assert (checkpoint / "config.json").is_file()
    refused = CliRunner().invoke(
        app, ["init-random", "--arch", ARCH, "--type", "base", str(checkpoint)],
        env={EXTRA_MODELS_ENV: "tests.extra_models"},
    )  # fmt: skip
    assert refused.exit_code == 2 and "it has one type" in refused.output


def test_voices_show_the_model_own_fields(server):
    voices = httpx.get(f"{server.base_url}/v1/audio/voices").json()
    assert voices["voices"] == ["low", "high"] and voices["default_voice"] == "low"
    assert voices["sample_rate"] == SAMPLE_RATE
    assert {"pitch_shift", "brightness"} <= set(voices["supported_fields"])
    assert voices["fields"]["pitch_shift"] == {
        "default": 0.0, "description": "semitones", "maximum": 12.0, "minimum": -12.0,
        "title": "Pitch Shift", "type": "number",
    }  # fmt: skip
    assert voices["fields"]["brightness"]["maximum"] == 1.0


def test_the_model_speaks_and_its_fields_change_the_audio(server):
    body = {"input": "ab c", "response_format": "pcm", "sample_rate": SAMPLE_RATE, "voice": "high"}
    plain = speech(server, body)
    assert plain.status_code == 200, plain.text
    samples = np.frombuffer(plain.content, dtype=np.int16)
    assert len(samples) == 3 * int(TONE_S * SAMPLE_RATE) and np.abs(samples).max() > 1000
    shifted = speech(server, {**body, "pitch_shift": 5, "brightness": 0.9})
    assert shifted.status_code == 200 and len(shifted.content) == len(plain.content)
    assert shifted.content != plain.content
    assert speech(server, {**body, "pitch_shift": 5, "brightness": 0.9}).content == shifted.content


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"pitch_shift": 13}, "pitch_shift", "less than or equal to 12"),
        ({"brightness": "high"}, "brightness", "valid number"),
        ({"pitch": 1}, "pitch", "this model's own fields: pitch_shift, brightness"),
        ({"voice": "mid"}, "voice", "available voices: low, high"),
        ({"ref_audio": "x"}, "ref_audio", "this model's own fields: pitch_shift, brightness"),
    ],
)
def test_validation_errors_name_the_model_fields(server, body, param, fragment):
    response = speech(server, {"input": "hi", **body})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and fragment in error["message"]


def test_the_framework_never_names_the_toy_model():
    root = Path(omnistage.__file__).parent
    naming = [p for p in root.rglob("*.py") if "toy_speech" in p.read_text() or ARCH in p.read_text()]
    assert naming == []
