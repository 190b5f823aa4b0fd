"""The Qwen3-Omni pipeline (seed 001, text prompts) on the tiny seed-0 checkpoint, CPU, one
process: routing by the one predicate (a text-only request never reaches talker or
code2wav), greedy served output equal to the package's unbatched reference generation
(thinker tokens, talker codes, code2wav audio), the talker's partial start, and aborts
while the thinker streams to the talker leave no state."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage.core.errors import RequestAbortedError, RequestValidationError
from omnistage.core.payloads import AudioChunk
from omnistage.models.qwen3_omni.config import Qwen3OmniPipelineConfig
from omnistage.models.qwen3_omni.modeling.audio_encoder import output_lengths
from omnistage.models.qwen3_omni.modeling.generate import talker_generate, thinker_generate
from omnistage.models.qwen3_omni.modeling.model import load_model
from omnistage.models.qwen3_omni.modeling.mrope import MultimodalLayout, prompt_positions
from omnistage.models.qwen3_omni.modeling.prompt import ThinkerRows, build_talker_prompt
from omnistage.models.qwen3_omni.modeling.thinker import EncoderRows
from omnistage.models.qwen3_omni.payload_types import (
    AudioSetup,
    ChatText,
    OmniSampling,
    Qwen3OmniRequest,
    TextDelta,
    ThinkerPrompt,
)
from omnistage.models.qwen3_omni.processing import ChatMessage, ChatPart, Qwen3OmniProcessor
from omnistage.models.qwen3_omni.random_checkpoint import write_random_checkpoint
from omnistage.models.qwen3_omni.random_text_tokenizer import (
    give_role_words_their_ids,
    write_text_tokenizer,
)
from omnistage.models.qwen3_omni.stages import load_code2wav
from omnistage.pipeline.pipeline import Pipeline, build_topology
from omnistage.scheduling.ar import CodeFrames, FrameWithHidden, GenerationSummary
from omnistage.testing.leaks import assert_no_request_state

TOKENS, FRAMES, SPEAKER = 6, 5, "ethan"
MESSAGES = (
    ChatMessage("system", (ChatPart("text", text="You are brief."),)),
    ChatMessage("user", (ChatPart("text", text="Say something nice."),)),
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # the pipeline draws the same weights from the config ("dummy", seed 0) as this writes
    directory = write_random_checkpoint(tmp_path_factory.mktemp("omni_pipeline"), "tiny", seed=0)
    write_text_tokenizer(directory)
    give_role_words_their_ids(directory)
    return directory


def request(
    audio: bool, max_tokens: int = TOKENS, messages=MESSAGES, frames: int = FRAMES
) -> Qwen3OmniRequest:
    return Qwen3OmniRequest(
        messages, audio, SPEAKER, OmniSampling(), max_tokens, frames, stream=True
    )


def _clip() -> np.ndarray:
    """1 s of a 220 Hz tone with a little noise at 16 kHz (the audio encoder's rate)."""
    t = np.arange(16000) / 16000
    noise = np.random.default_rng(0).normal(0, 0.01, t.shape)
    return (0.3 * np.sin(2 * np.pi * 220 * t) + noise).astype(np.float32)


HEARD = (
    ChatMessage("user", (ChatPart("audio", audio=_clip()), ChatPart("text", text="What is it?"))),
)


def _reference(checkpoint: Path, messages: tuple[ChatMessage, ...]) -> dict:
    """Greedy thinker tokens, talker codes and the code2wav waveform of ``messages``, from
    the unbatched loops of modeling/generate.py on the checkpoint's safetensors."""
    model = load_model(checkpoint, parts=("thinker", "talker", "audio_tower"))
    cfg = model.config
    inputs = Qwen3OmniProcessor.from_checkpoint(checkpoint, cfg.thinker.audio)(list(messages))
    ids = inputs.input_ids
    layout = MultimodalLayout(
        audio_lengths=output_lengths(inputs.audio_frames, cfg.thinker.audio).tolist()
    )
    positions = prompt_positions(ids.tolist(), cfg.thinker, layout)
    with torch.no_grad():
        audio_rows = None
        if inputs.audio_features is not None:
            audio_rows = model.audio_tower(inputs.audio_features, inputs.audio_frames).embeddings
        embeds, _ = model.thinker.merge(ids, EncoderRows(audio=audio_rows))
    thinker = thinker_generate(model.thinker, ids, positions, TOKENS, cfg.im_end_id, input_embeds=embeds,
                               capture_layer=cfg.talker.accept_hidden_layer)  # fmt: skip
    rows = ThinkerRows(ids, thinker.tokens, thinker.embeds, thinker.captured)
    with torch.no_grad():
        prompt = build_talker_prompt(
            model.talker, model.thinker.model.embed_tokens, cfg, rows, SPEAKER, layout
        )
        codes = talker_generate(model.talker, prompt, FRAMES).codes
        audio = load_code2wav(str(checkpoint), torch.device("cpu"), "dummy")(codes[None])[0]
    tokens = thinker.tokens[:-1] if thinker.finish_reason == "stop" else thinker.tokens
    return {"tokens": tokens, "codes": codes, "audio": audio.numpy(), "prompt_tokens": ids.shape[0]}


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> dict:
    return _reference(checkpoint, MESSAGES)


@pytest.fixture(scope="module")
def pipeline(checkpoint: Path):
    config = Qwen3OmniPipelineConfig.for_model_path(str(checkpoint), load_format="dummy")
    loop = asyncio.new_event_loop()
    running = Pipeline(config)
    loop.run_until_complete(running.start())
    yield loop, running
    loop.run_until_complete(running.stop())
    loop.close()


async def _run(pipeline: Pipeline, req: Qwen3OmniRequest):
    handle = pipeline.submit(req)
    chunks = [chunk async for chunk in handle.stream()]
    result = await handle.result()
    return handle, chunks, result


def _stages_that_prefilled(handle) -> set[str]:
    return {name.split(".")[0] for name, _ in handle.timeline.marks if name.endswith(".prefill")}


def test_every_edge_is_typed(checkpoint: Path) -> None:
    config = Qwen3OmniPipelineConfig.for_model_path(str(checkpoint), load_format="dummy")
    topology = build_topology(config)
    edges = {(e.source, e.target, e.kind): e.carries for e in topology.edges}
    assert edges == {
        ("preprocessing", "audio_encoder", "next"): (ThinkerPrompt,),
        # the thinker's fan-in: its payload is merge_fn's, checked by its annotation
        ("preprocessing", "thinker", "next"): (),
        ("audio_encoder", "thinker", "next"): (),
        ("preprocessing", "talker", "stream"): (AudioSetup,),
        ("preprocessing", "code2wav", "stream"): (AudioSetup,),
        ("thinker", "decode", "next"): (GenerationSummary,),
        ("thinker", "talker", "next"): (GenerationSummary,),
        ("thinker", "decode", "stream"): (CodeFrames, FrameWithHidden),
        ("thinker", "talker", "stream"): (CodeFrames, FrameWithHidden),
        ("talker", "code2wav", "next"): (GenerationSummary,),
        ("talker", "code2wav", "stream"): (CodeFrames,),
    }
    assert topology.types["thinker"].payload is ThinkerPrompt
    assert topology.types["decode"].streams == (TextDelta,)
    assert topology.types["code2wav"].streams == (AudioChunk,)


def test_text_only_request_never_reaches_talker_or_code2wav(pipeline, reference) -> None:
    loop, running = pipeline
    handle, chunks, result = loop.run_until_complete(_run(running, request(audio=False)))
    assert set(result.outputs) == {"decode"}
    assert _stages_that_prefilled(handle) == {"thinker"}
    assert not [c for c in chunks if isinstance(c.data, AudioChunk)]
    text: ChatText = result.outputs["decode"]
    assert (
        text.text
        and "".join(c.data.text for c in chunks if isinstance(c.data, TextDelta)) == text.text
    )
    torch.testing.assert_close(text.token_ids, reference["tokens"], rtol=0, atol=0)
    assert text.prompt_tokens == reference["prompt_tokens"]
    loop.run_until_complete(assert_no_request_state(running))


def _check_audio_request(running, loop, req: Qwen3OmniRequest, reference: dict) -> None:
    handle, chunks, result = loop.run_until_complete(_run(running, req))
    assert set(result.outputs) == {"decode", "code2wav"}
    assert _stages_that_prefilled(handle) == {"thinker", "talker"}
    text: ChatText = result.outputs["decode"]
    assert "".join(c.data.text for c in chunks if isinstance(c.data, TextDelta)) == text.text
    torch.testing.assert_close(text.token_ids, reference["tokens"], rtol=0, atol=0)
    assert text.prompt_tokens == reference["prompt_tokens"]
    audio = np.concatenate([c.data.samples for c in chunks if isinstance(c.data, AudioChunk)])
    assert (
        len([c for c in chunks if isinstance(c.data, AudioChunk)]) >= 2
    )  # streamed in ramp chunks
    # the stream drops code2wav's first 555 samples (no audio), as offline decoding does
    np.testing.assert_allclose(audio, reference["audio"], rtol=0, atol=1e-5)
    assert result.outputs["code2wav"].num_frames == reference["codes"].shape[0]
    loop.run_until_complete(assert_no_request_state(running))


def test_text_and_audio_equal_the_reference_generation(pipeline, reference) -> None:
    loop, running = pipeline
    _check_audio_request(running, loop, request(audio=True), reference)


def test_audio_prompt_goes_through_the_audio_encoder_and_equals_the_reference(
    pipeline, checkpoint
) -> None:
    loop, running = pipeline
    _check_audio_request(
        running, loop, request(audio=True, messages=HEARD), _reference(checkpoint, HEARD)
    )


def test_text_and_audio_requests_batched_together_equal_the_reference(pipeline, reference) -> None:
    loop, running = pipeline

    async def both():
        return await asyncio.gather(
            *(_run(running, request(audio=a)) for a in (False, True, True, False))
        )

    for (_, _, result), audio in zip(
        loop.run_until_complete(both()), (False, True, True, False), strict=True
    ):
        assert set(result.outputs) == ({"decode", "code2wav"} if audio else {"decode"})
        torch.testing.assert_close(
            result.outputs["decode"].token_ids, reference["tokens"], rtol=0, atol=0
        )
        if audio:
            assert result.outputs["code2wav"].num_frames == reference["codes"].shape[0]
    loop.run_until_complete(assert_no_request_state(running))


def test_non_text_content_is_refused_naming_the_field(pipeline) -> None:
    loop, running = pipeline
    image_part = ChatPart("image", image=Image.new("RGB", (32, 32)))
    bad = Qwen3OmniRequest((ChatMessage("user", (ChatPart("text", text="Hi"), image_part)),), True, SPEAKER,
                           OmniSampling(), TOKENS, FRAMES)  # fmt: skip
    with pytest.raises(RequestValidationError, match=r"messages\.0\.content\.1"):
        loop.run_until_complete(_run(running, bad))
    loop.run_until_complete(assert_no_request_state(running))


def test_abort_while_the_thinker_streams_to_the_talker_leaves_no_state(pipeline) -> None:
    loop, running = pipeline

    async def scenario() -> None:
        # long enough (64 tokens, up to 400 frames) to be running when its first audio arrives
        handle = running.submit(request(audio=True, max_tokens=64, frames=400))
        with pytest.raises(RequestAbortedError):
            async for chunk in handle.stream():
                if isinstance(
                    chunk.data, AudioChunk
                ):  # the talker runs while the thinker still streams
                    running.abort(handle.request_id)
        await assert_no_request_state(running)

    loop.run_until_complete(scenario())
