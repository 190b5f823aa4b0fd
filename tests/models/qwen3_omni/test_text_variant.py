"""The text-only variant (``--variant text``) on the tiny random checkpoint, CPU: its
pipeline has no talker or code2wav stage and loads none of their weights; a text request
gives the default variant's tokens; a request for speech is a 400 naming ``modalities``
before any stage runs."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch
from omni_fixtures import openai_client, serve_dummy

import omnistage.models.qwen3_omni.stages as omni_stages
from omnistage.models.qwen3_omni.config import Qwen3OmniPipelineConfig, Qwen3OmniTextPipelineConfig
from omnistage.models.qwen3_omni.modeling.model import LoadedOmni
from omnistage.models.qwen3_omni.payload_types import ChatText, OmniSampling, Qwen3OmniRequest
from omnistage.models.qwen3_omni.processing import ChatMessage, ChatPart
from omnistage.models.qwen3_omni.random_checkpoint import write_random_checkpoint
from omnistage.pipeline.pipeline import Pipeline, build_topology
from omnistage.serve.registry import ModelRegistry
from omnistage.testing.leaks import assert_no_request_state
from omnistage.testing.metrics import stage_batch_totals
from tests.serve.conftest import RunningServer

MESSAGES = (ChatMessage("user", (ChatPart("text", text="Say something nice."),)),)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("omni_text"), "tiny", seed=0)


def test_the_text_variant_is_registered_and_has_no_speech_side(checkpoint) -> None:
    config = ModelRegistry.discover().resolve(str(checkpoint), "text", "dummy")
    assert isinstance(config, Qwen3OmniTextPipelineConfig) and not config.speaks
    names = {stage.name for stage in config.stages}
    assert names == {"preprocessing", "image_encoder", "audio_encoder", "thinker", "decode"}
    topology = build_topology(config)
    assert {e.target for e in topology.edges} <= names
    caps = config.capabilities()
    assert not caps.audio_output and caps.voices == ()


def test_the_text_variant_refuses_the_split_placement(checkpoint) -> None:
    with pytest.raises(ValueError, match="no speech side"):
        Qwen3OmniTextPipelineConfig.for_model_path(str(checkpoint), placement="split")


def _run(config: Qwen3OmniPipelineConfig, requests: list[Qwen3OmniRequest]) -> list[ChatText]:
    async def scenario() -> list[ChatText]:
        running = Pipeline(config)
        await running.start()
        try:
            texts = []
            for req in requests:
                result = await running.submit(req).result()
                assert set(result.outputs) == {"decode"}
                texts.append(result.outputs["decode"])
            await assert_no_request_state(running)
            return texts
        finally:
            await running.stop()

    return asyncio.run(scenario())


def test_text_requests_give_the_default_variant_s_tokens_without_loading_the_speech_side(
    checkpoint, monkeypatch
) -> None:
    loads: list[tuple[tuple[str, ...], LoadedOmni]] = []
    real_load = omni_stages.load_model

    def recording_load(*args, **kwargs) -> LoadedOmni:
        model = real_load(*args, **kwargs)
        loads.append((tuple(kwargs["parts"]), model))
        return model

    monkeypatch.setattr(omni_stages, "load_model", recording_load)
    omni_stages.loaded_model.cache_clear()  # every load of this test goes through the recorder
    requests = [
        Qwen3OmniRequest(MESSAGES, False, "", OmniSampling(), max_tokens=8, max_audio_frames=4),
        Qwen3OmniRequest(MESSAGES, False, "", OmniSampling(temperature=1.0, top_k=5, seed=7), 8, 4),
    ]
    text_only = _run(Qwen3OmniTextPipelineConfig.for_model_path(str(checkpoint), load_format="dummy"), requests)
    text_loads = list(loads)
    assert sorted(parts for parts, _ in text_loads) == [("audio_tower",), ("thinker",), ("visual",)]
    assert all(model.talker is None and model.code2wav is None for _, model in text_loads)
    default = _run(Qwen3OmniPipelineConfig.for_model_path(str(checkpoint), load_format="dummy"), requests)
    assert any("talker" in parts for parts, _ in loads[len(text_loads) :])  # the default loads it
    for ours, theirs in zip(text_only, default, strict=True):
        assert ours.text and ours.text == theirs.text
        torch.testing.assert_close(ours.token_ids, theirs.token_ids, rtol=0, atol=0)
        assert ours.completion_tokens == theirs.completion_tokens == 8
    omni_stages.loaded_model.cache_clear()


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[RunningServer]:
    yield from serve_dummy(checkpoint, "text")


def _batches(server: RunningServer) -> dict[str, float]:
    registry = server.app.state.server.metrics.registry
    stages = ("preprocessing", "thinker", "decode")
    return {s: stage_batch_totals(registry, s)[0] for s in stages}


@pytest.mark.parametrize(
    "fields",
    [{"modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "wav"}}, {"modalities": ["text", "audio"]},
     {"extra_body": {"audio": {"voice": "ethan", "format": "wav"}}}],
)  # fmt: skip
def test_a_request_for_speech_is_refused_naming_modalities_before_any_stage_runs(server, fields) -> None:
    client = openai_client(server)
    before = _batches(server)
    with pytest.raises(openai.APIStatusError) as excinfo:
        client.chat.completions.create(model="qwen3-omni", messages=[{"role": "user", "content": "Hi"}], **fields)
    assert (excinfo.value.status_code, excinfo.value.body["param"]) == (400, "modalities")
    assert "no audio output" in excinfo.value.body["message"]
    assert _batches(server) == before


def test_the_text_variant_serves_text_and_lists_no_voices(server) -> None:
    client = openai_client(server)
    reply = client.chat.completions.create(model="qwen3-omni", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert reply.choices[0].message.content and reply.choices[0].message.audio is None
    assert reply.usage.completion_tokens_details.audio_tokens == 0
    voices = httpx.get(f"{server.base_url}/v1/audio/voices").json()
    assert voices["audio_output"] is False and voices["voices"] == []
