"""The split placement (thinker side on cuda:0, talker and code2wav on cuda:1 in a process
of their own) on this GPU-less machine: with two CUDA devices reported the config resolves
with those devices (knobs and overrides too) and its topology builds; with every device
overridden to the CPU it runs, its speech side in a second process, equal to the colocated
pipeline; the thinker and talker stages then load apart, the talker beside the thinker's
token embedding, which loads alone, strictly, equal to the thinker's; without two devices
the split is refused, never silently colocated."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from omnistage.config.overrides import resolve_config
from omnistage.config.pipeline import PipelineConfig
from omnistage.core.payloads import AudioChunk
from omnistage.models.qwen3_omni.config import (
    SPEECH_PROCESS,
    SPEECH_SIDE,
    Qwen3OmniPipelineConfig,
    Qwen3OmniSplitPipelineConfig,
)
from omnistage.models.qwen3_omni.modeling.model import load_model
from omnistage.models.qwen3_omni.payload_types import OmniSampling, Qwen3OmniRequest, TalkerSampling
from omnistage.models.qwen3_omni.processing import ChatMessage, ChatPart
from omnistage.models.qwen3_omni.random_checkpoint import write_random_checkpoint
from omnistage.models.qwen3_omni.stages import language_parts
from omnistage.pipeline.pipeline import Pipeline, build_topology
from omnistage.pipeline.stage import StageBuildContext
from omnistage.serve.registry import ModelRegistry
from omnistage.testing.leaks import assert_no_request_state


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("omni_split"), "tiny", seed=2)


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """What torch reports on a two-GPU host (the config only reads the count)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_split_resolves_with_the_thinker_and_the_speech_side_apart(checkpoint, two_gpus) -> None:
    config = Qwen3OmniPipelineConfig.for_model_path(str(checkpoint), load_format="dummy", placement="split")
    devices = {stage.name: stage.device for stage in config.stages}
    assert set(devices) == {"preprocessing", "image_encoder", "audio_encoder", "thinker", "decode", "talker", "code2wav"}
    assert {name for name, d in devices.items() if d == "cuda:1"} == set(SPEECH_SIDE)
    assert {d for name, d in devices.items() if name not in SPEECH_SIDE} == {"cuda:0"}
    processes = {stage.name: stage.process for stage in config.stages}
    assert {name for name, p in processes.items() if p == SPEECH_PROCESS} == set(SPEECH_SIDE)
    assert {p for name, p in processes.items() if name not in SPEECH_SIDE} == {None}  # the server's
    build_topology(config)
    resolved = resolve_config(config, None, [("talker.factory.args.max_num_seqs", "4"), ("code2wav.device", "cuda:0")])
    stages = {stage.name: stage for stage in resolved.config.stages}
    assert stages["talker"].factory.args["max_num_seqs"] == 4
    assert (stages["talker"].device, stages["code2wav"].device) == ("cuda:1", "cuda:0")
    parts = {name: language_parts(StageBuildContext(config, stages[name])) for name in ("thinker", "talker")}
    assert parts == {"thinker": ("thinker",), "talker": ("talker", "thinker_embed")}


def test_the_split_variant_is_registered_and_resolves(checkpoint, two_gpus) -> None:
    registry = ModelRegistry.discover()
    config = registry.resolve(str(checkpoint), "split", "dummy")
    assert isinstance(config, Qwen3OmniSplitPipelineConfig)
    assert {stage.name for stage in config.stages if stage.device == "cuda:1"} == set(SPEECH_SIDE)
    assert {stage.factory.args.get("load_format") for stage in config.stages if stage.factory.args} == {"dummy"}


def test_colocated_stages_share_one_load(checkpoint) -> None:
    config = Qwen3OmniPipelineConfig.for_model_path(str(checkpoint), load_format="dummy")
    assert len({stage.device for stage in config.stages}) == 1
    stages = {stage.name: stage for stage in config.stages}
    for name in ("thinker", "talker"):
        assert language_parts(StageBuildContext(config, stages[name])) == ("thinker", "talker")


def test_split_is_refused_without_two_gpus(checkpoint, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="two CUDA devices; 1 visible"):
        Qwen3OmniPipelineConfig.for_model_path(str(checkpoint), placement="split")


@pytest.mark.parametrize("load_format", ["safetensors", "dummy"])
def test_the_thinker_embedding_loads_alone_equal_to_the_thinker_s(checkpoint, load_format) -> None:
    apart = load_model(checkpoint, parts=("talker", "thinker_embed"), load_format=load_format, seed=2)
    whole = load_model(checkpoint, parts=("thinker", "talker"), load_format=load_format, seed=2)
    assert apart.thinker is None and apart.thinker_embed is not None
    assert torch.equal(apart.thinker_embed.weight, whole.thinker.model.embed_tokens.weight)
    assert torch.equal(apart.talker.codec_head.weight, whole.talker.codec_head.weight)


def _split_on_the_cpu(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> PipelineConfig:
    """The split variant as a two-GPU host resolves it, every stage's device then set to
    the CPU by the product's own ``<stage>.device`` overrides (its process groups kept)."""
    with monkeypatch.context() as m:
        m.setattr(torch.cuda, "is_available", lambda: True)
        m.setattr(torch.cuda, "device_count", lambda: 2)
        split = ModelRegistry.discover().resolve(str(checkpoint), "split", "dummy")
    overrides = [(f"{stage.name}.device", "cpu") for stage in split.stages]
    return resolve_config(split, None, overrides).config


def _speak(config: PipelineConfig, request: Qwen3OmniRequest, processes: set[str]):
    async def scenario():
        running = Pipeline(config)
        await running.start()
        try:
            assert set(running.processes) == processes
            assert all(process.is_alive() for process in running.processes.values())
            handle = running.submit(request)
            audio = [chunk.data.samples async for chunk in handle.stream() if isinstance(chunk.data, AudioChunk)]
            result = await handle.result()
            await assert_no_request_state(running)
            return result, np.concatenate(audio)
        finally:
            await running.stop()

    return asyncio.run(scenario())


def test_split_runs_its_speech_side_in_a_second_process_equal_to_colocated(checkpoint, monkeypatch) -> None:
    split = _split_on_the_cpu(checkpoint, monkeypatch)
    assert {stage.device for stage in split.stages} == {"cpu"}
    build_topology(split)  # validated, with its sample requests
    assert {s.name for s in split.stages if s.process == SPEECH_PROCESS} == set(SPEECH_SIDE)
    stages = {stage.name: stage for stage in split.stages}
    assert language_parts(StageBuildContext(split, stages["talker"])) == ("talker", "thinker_embed")
    messages = (ChatMessage("user", (ChatPart("text", text="Say something nice."),)),)
    request = Qwen3OmniRequest(
        messages, True, "ethan", OmniSampling(), max_tokens=6, max_audio_frames=5, stream=True,
        talker_sampling=TalkerSampling.greedy(),
    )  # fmt: skip
    apart, apart_audio = _speak(split, request, {SPEECH_PROCESS})
    colocated = Qwen3OmniPipelineConfig.for_model_path(str(checkpoint), load_format="dummy")
    together, together_audio = _speak(colocated, request, set())
    assert set(apart.outputs) == {"decode", "code2wav"}
    torch.testing.assert_close(apart.outputs["decode"].token_ids, together.outputs["decode"].token_ids, rtol=0, atol=0)
    assert apart.outputs["code2wav"].num_frames == together.outputs["code2wav"].num_frames == 5
    np.testing.assert_allclose(apart_audio, together_audio, rtol=0, atol=1e-5)
