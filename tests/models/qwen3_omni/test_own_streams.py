"""The colocated Qwen3-Omni pipeline with the thinker and the talker each on a CUDA stream of
its own (``own_stream``, docs/engine.md "Own stream"): the reproducer of the hang of commit
``debf0be`` (every engine thread and the vocoder thread stuck in a CUDA synchronize at
concurrency 8). Several rounds of concurrent spoken replies on the tiny checkpoint; each
round is awaited for a bounded time, and a round that does not end fails the test with every
thread's stack (also written straight to the process's stderr, past pytest's capture, so a
run killed while the hung pipeline stops still shows them).

Equality: with one request per engine at a time (``max_num_seqs`` 1) every request runs
alone in each engine, whatever the timing, so its greedy reply and audio do not depend on the
streams; with own streams they must equal the one-stream run's, request by request (text
tokens exactly, audio to 1e-4: code2wav, fp32 without TF32, batches the live streams by
timing). With batching (``max_num_seqs`` 16 at concurrency 16) which requests share a step
depends on timing and a bf16 step's rounding on its batch bucket, so there every request is
checked to end with its text and audio, not against another run."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch

from omnistage.core.payloads import AudioChunk
from omnistage.models.qwen3_omni.config import Qwen3OmniPipelineConfig
from omnistage.models.qwen3_omni.payload_types import (
    ChatText,
    OmniSampling,
    Qwen3OmniRequest,
    TalkerSampling,
)
from omnistage.models.qwen3_omni.processing import ChatMessage, ChatPart
from omnistage.pipeline.pipeline import Pipeline
from omnistage.testing.waits import thread_stacks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MAX_TOKENS, MAX_FRAMES = 12, 40
ROUND_TIMEOUT_S = 60.0  # a round of 16 tiny requests takes a few seconds on the H200


def request(i: int) -> Qwen3OmniRequest:
    """Request ``i``: its own text (distinct prompts, so a mix-up between requests shows),
    greedy thinker and talker."""
    text = f"Say something nice about the number {i}."
    messages = (ChatMessage("user", (ChatPart("text", text=text),)),)
    return Qwen3OmniRequest(messages, True, "ethan", OmniSampling(), MAX_TOKENS, MAX_FRAMES,
                            stream=True, talker_sampling=TalkerSampling.greedy())  # fmt: skip


def config_for(checkpoint: Path, own_stream: bool, max_num_seqs: int) -> Qwen3OmniPipelineConfig:
    config = Qwen3OmniPipelineConfig.for_model_path(str(checkpoint), load_format="dummy")
    for name in ("thinker", "talker"):
        stage = config.stage(name)
        stage.factory.args = {**stage.factory.args, "own_stream": own_stream,
                              "max_num_seqs": max_num_seqs, "max_model_len": 1024}  # fmt: skip
    code2wav = config.stage("code2wav")
    code2wav.factory.args = {**code2wav.factory.args, "num_slots": 16}
    return config


async def one(pipeline: Pipeline, req: Qwen3OmniRequest) -> tuple[torch.Tensor, np.ndarray]:
    """The request's reply token ids and its streamed audio."""
    handle = pipeline.submit(req)
    pieces = [c.data.samples async for c in handle.stream() if isinstance(c.data, AudioChunk)]
    result = await handle.result()
    text: ChatText = result.outputs["decode"]
    return text.token_ids, np.concatenate(pieces) if pieces else np.zeros(0, np.float32)


def serve_rounds(
    config: Qwen3OmniPipelineConfig, concurrency: int, rounds: int
) -> list[tuple[torch.Tensor, np.ndarray]]:
    """``rounds`` rounds of ``concurrency`` requests at once (request ``i`` of each round is
    :func:`request`'s ``i``); fails with the thread stacks when a round does not end within
    :data:`ROUND_TIMEOUT_S`."""

    async def run() -> list[tuple[torch.Tensor, np.ndarray]]:
        outputs: list[tuple[torch.Tensor, np.ndarray]] = []
        async with Pipeline(config) as pipeline:
            for number in range(rounds):
                calls = asyncio.gather(*(one(pipeline, request(i)) for i in range(concurrency)))
                try:
                    outputs += await asyncio.wait_for(calls, ROUND_TIMEOUT_S)
                except TimeoutError:
                    pytest.fail(
                        f"round {number} of {concurrency} requests did not end within "
                        f"{ROUND_TIMEOUT_S:.0f} s; thread stacks:\n{thread_stacks()}"
                    )
        return outputs

    return asyncio.run(run())


@pytest.fixture
def no_tf32(monkeypatch: pytest.MonkeyPatch) -> None:
    """code2wav (fp32) and the engines' fp32 parts in true fp32, so a batch's size changes
    no rounding beyond fp32's."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


def test_own_streams_at_concurrency_8_equal_one_stream_request_by_request(
    omni_tiny_checkpoint: Path, no_tf32: None
) -> None:
    one_stream = serve_rounds(config_for(omni_tiny_checkpoint, False, 1), concurrency=8, rounds=2)
    own = serve_rounds(config_for(omni_tiny_checkpoint, True, 1), concurrency=8, rounds=2)
    for index, ((tokens, audio), (own_tokens, own_audio)) in enumerate(
        zip(one_stream, own, strict=True)
    ):
        assert tokens.numel() >= 2 and audio.size > 0, index
        assert torch.equal(own_tokens, tokens), (index, own_tokens.tolist(), tokens.tolist())
        assert own_audio.shape == audio.shape, index
        np.testing.assert_allclose(own_audio, audio, rtol=0, atol=1e-4, err_msg=f"request {index}")


def test_own_streams_with_batching_at_concurrency_16_end_every_request(
    omni_tiny_checkpoint: Path, no_tf32: None
) -> None:
    outputs = serve_rounds(config_for(omni_tiny_checkpoint, True, 16), concurrency=16, rounds=3)
    assert len(outputs) == 48
    for index, (tokens, audio) in enumerate(outputs):
        assert tokens.numel() >= 2 and audio.size > 0 and np.isfinite(audio).all(), index
