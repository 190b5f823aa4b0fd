"""The thinker's and talker's engine configs capture, at start-up, the CUDA-graph variant of
every default request's step (greedy, and sampled without top-k), so serving such a
request never pauses to capture one. (Capture itself needs CUDA:
benchmarks/qwen3_omni_gpu.py checks graph steps against eager ones there.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.config.hooks import factory_args
from omnistage.config.overrides import resolve_config
from omnistage.engine.model_runner import StepSampling
from omnistage.engine.sampler import SamplingParams
from omnistage.engine.sequence import GenerationInput, Sequence
from omnistage.models.qwen3_omni.config import Qwen3OmniPipelineConfig
from omnistage.models.qwen3_omni.modeling.config import load_config
from omnistage.models.qwen3_omni.modeling.model import load_model
from omnistage.models.qwen3_omni.payload_types import OmniSampling, TalkerSampling
from omnistage.models.qwen3_omni.request_builders import talker_sampling_of
from omnistage.models.qwen3_omni.stages import (
    engine_config,
    step_variants,
    talker_graph_sampling,
    talker_sampling_params,
    thinker_graph_sampling,
    thinker_sampling,
)
from omnistage.pipeline.stage import build_scheduler

CLIENT_SAMPLING = [
    OmniSampling(),
    OmniSampling(temperature=0.7, top_p=0.8, seed=3),
    OmniSampling(temperature=1.0),
]


def step_sampling(code0: SamplingParams, predictor: SamplingParams | None) -> StepSampling:
    inputs = GenerationInput(
        torch.zeros(2, dtype=torch.int64), code0, 4, predictor_sampling=predictor
    )
    return StepSampling.of([Sequence("r", inputs, 0.0)])


@pytest.mark.parametrize("sampling", CLIENT_SAMPLING)
def test_thinker_requests_find_their_graph_variant(sampling: OmniSampling) -> None:
    config = engine_config(4, 1 << 20, 64, True, thinker_graph_sampling(7))
    assert config.cuda_graph_batch_sizes is None  # the default buckets
    assert step_sampling(thinker_sampling(sampling, 7), None) in config.graph_sampling


@pytest.mark.parametrize("sampling", CLIENT_SAMPLING)
def test_talker_requests_find_their_graph_variant(
    omni_tiny_checkpoint: Path, sampling: OmniSampling
) -> None:
    talker = load_model(str(omni_tiny_checkpoint), torch.device("cpu"), parts=("talker",)).talker
    assert talker is not None
    config = engine_config(4, 1 << 20, 64, True, talker_graph_sampling(talker))
    # a chat request's talker: code 0 from the client's values, greedy predictor; and the
    # pipeline's default, the reference's sampling
    for talker_sampling in (talker_sampling_of(sampling), TalkerSampling()):
        wanted = step_sampling(*talker_sampling_params(talker, talker_sampling, sampling.seed))
        assert wanted in config.graph_sampling


def test_graphs_off_is_no_buckets() -> None:
    config = engine_config(4, 1 << 20, 64, False, thinker_graph_sampling(7))
    assert config.cuda_graph_batch_sizes == ()


def test_own_stream_is_off_unless_asked_and_reaches_the_engine_config() -> None:
    """The stages' ``own_stream`` knob (off by default until measured: docs/qwen3_omni.md)."""
    assert engine_config(4, 1 << 20, 64, True, thinker_graph_sampling(7)).own_stream is False
    config = engine_config(4, 1 << 20, 64, True, thinker_graph_sampling(7), own_stream=True)
    assert config.own_stream is True


def test_own_stream_is_a_thinker_and_talker_knob_of_the_pipeline(omni_tiny_checkpoint: Path) -> None:
    """``--thinker.factory.args.own_stream true`` and the talker's are taken (checked against
    the factories' parameters) and reach the stages' factory args as booleans."""
    config = Qwen3OmniPipelineConfig.for_model_path(str(omni_tiny_checkpoint), load_format="dummy")
    cli = [("thinker.factory.args.own_stream", "true"), ("talker.factory.args.own_stream", "true")]
    stages = {stage.name: stage for stage in resolve_config(config, None, cli).config.stages}
    for name in ("thinker", "talker"):
        assert factory_args(stages[name])["own_stream"] is True


def test_the_prefill_budget_and_its_graph_buckets_reach_the_engine_config() -> None:
    """``max_prefill_tokens`` and ``cuda_graph_prefill_tokens``: the engine's defaults (8,192
    tokens a step; buckets 16 to 128) unless given; no prefill graphs without graphs."""
    default = engine_config(4, 1 << 20, 64, True, thinker_graph_sampling(7))
    assert (default.max_prefill_tokens, default.prefill_graph_tokens()) == (8192, [16, 32, 64, 128])
    given = engine_config(4, 1 << 20, 64, True, (), max_prefill_tokens=1024, cuda_graph_prefill_tokens=(256, 1024))
    assert (given.max_prefill_tokens, given.prefill_graph_tokens()) == (1024, [256, 1024])
    assert engine_config(4, 1 << 20, 64, False, (), cuda_graph_prefill_tokens=(256,)).cuda_graph_prefill_tokens == ()


@pytest.mark.parametrize("stage", ["thinker", "talker"])
def test_a_bad_prefill_knob_fails_the_stage_before_its_weights_load(omni_tiny_checkpoint: Path, stage: str) -> None:
    """Given on the command line, a prefill bucket over the prefill budget fails the stage's
    build naming the field, before the checkpoint is read (a missing one here)."""
    config = Qwen3OmniPipelineConfig.for_model_path(str(omni_tiny_checkpoint), load_format="dummy")
    cli = [(f"{stage}.factory.args.max_prefill_tokens", "512"), (f"{stage}.factory.args.cuda_graph_prefill_tokens", "[1024]")]
    resolved = resolve_config(config, None, cli).config
    resolved = resolved.model_copy(update={"model_path": str(omni_tiny_checkpoint / "missing")})
    with pytest.raises(ValueError, match="cuda_graph_prefill_tokens must be token counts in 1..max_prefill_tokens"):
        build_scheduler(resolved, resolved.stage(stage))


@pytest.mark.parametrize("stage", ["thinker", "talker"])
def test_the_stages_engine_gets_the_prefill_knobs_and_its_graph_sampling(omni_tiny_checkpoint: Path, stage: str) -> None:
    """The knobs given on the command line and the stage's common sampling variants reach
    the engine its factory builds (the config is made before the weights load, the
    variants after)."""
    config = Qwen3OmniPipelineConfig.for_model_path(str(omni_tiny_checkpoint), load_format="dummy")
    cli = [(f"{stage}.factory.args.max_prefill_tokens", "512"), (f"{stage}.factory.args.cuda_graph_prefill_tokens", "[64, 512]")]
    resolved = resolve_config(config, None, cli).config
    engine = build_scheduler(resolved, resolved.stage(stage)).engine
    assert (engine.config.max_prefill_tokens, tuple(engine.config.cuda_graph_prefill_tokens)) == (512, (64, 512))
    model = load_model(str(omni_tiny_checkpoint), torch.device("cpu"), parts=("talker",)).talker if stage == "talker" else None
    pairs = talker_graph_sampling(model) if model is not None else thinker_graph_sampling(load_config(omni_tiny_checkpoint).im_end_id)
    assert engine.config.graph_sampling == step_variants(pairs) and engine.config.graph_sampling
