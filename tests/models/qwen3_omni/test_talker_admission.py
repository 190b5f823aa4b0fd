"""The talker stage admits as many concurrent requests as its ``max_num_seqs``: its step-row
pool holds that many requests of the most frames a request may ask for, and a request's
frame limit is known (and reserved) from its ``max_tokens`` before the reply exists."""

from __future__ import annotations

from pathlib import Path

import torch

from omnistage.engine.engine import AREngine
from omnistage.engine.model_runner import GREEDY
from omnistage.engine.sequence import GenerationInput
from omnistage.models.qwen3_omni.engine_model import TalkerEngineModel
from omnistage.models.qwen3_omni.modeling.model import load_model
from omnistage.models.qwen3_omni.payload_types import OmniSampling, Qwen3OmniRequest, TalkerSampling
from omnistage.models.qwen3_omni.processing import ChatMessage, ChatPart
from omnistage.models.qwen3_omni.request_builders import DEFAULT_MAX_AUDIO_FRAMES
from omnistage.models.qwen3_omni.stages import (
    engine_config,
    talker_frame_cap,
    talker_graph_sampling,
    talker_max_frames,
    talker_sampling_params,
    talker_step_rows,
)


def test_the_talker_engine_admits_max_num_seqs_requests_of_the_most_frames(omni_tiny_checkpoint: Path) -> None:
    # 20 > 16: the engine's default pool (65536 rows) holds 16 requests of 4096 frames
    count, prompt_len = 20, 8
    talker = load_model(str(omni_tiny_checkpoint), torch.device("cpu"), parts=("talker",)).talker
    assert talker is not None
    model = TalkerEngineModel(talker)
    spec = model.spec
    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * torch.finfo(spec.dtype).bits // 8
    max_model_len = prompt_len + DEFAULT_MAX_AUDIO_FRAMES
    kv_bytes = per_token * (count * max_model_len + 1024)
    config = engine_config(count, kv_bytes, max_model_len, False, talker_graph_sampling(talker), talker_step_rows(count))
    engine = AREngine(model, config)
    code0, _ = talker_sampling_params(talker, TalkerSampling.greedy(), 0)
    prompt = 0.02 * torch.randn(prompt_len, spec.hidden_size, generator=torch.Generator().manual_seed(0))
    for n in range(count):
        engine.add_request(f"r{n}", GenerationInput(
            prompt.to(spec.dtype), code0, DEFAULT_MAX_AUDIO_FRAMES, step_rows=prompt[:0], pad_embed=prompt[0],
            more_rows=True, positions=torch.arange(prompt_len).expand(3, -1).contiguous(), predictor_sampling=GREEDY,
        ))  # fmt: skip
    plan = engine.schedule()
    assert plan.batch is not None and plan.batch.kind == "prefill"
    assert len(plan.batch.seqs) == count


def test_a_talker_request_reserves_the_frames_its_max_tokens_allows() -> None:
    messages = (ChatMessage("user", (ChatPart("text", text="Hi."),)),)

    def frames(max_tokens: int, max_audio_frames: int) -> int:
        request = Qwen3OmniRequest(messages, True, "ethan", OmniSampling(), max_tokens, max_audio_frames)
        return talker_max_frames(request)

    assert frames(48, DEFAULT_MAX_AUDIO_FRAMES) == talker_frame_cap(48) == 505
    assert frames(48, 100) == 100
    assert frames(1024, DEFAULT_MAX_AUDIO_FRAMES) == DEFAULT_MAX_AUDIO_FRAMES
