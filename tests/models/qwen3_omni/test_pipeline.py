"""The Qwen3-Omni pipeline (seed 001, text prompts) on the tiny seed-0 checkpoint, CPU, one
process: routing by the one predicate (a text-only request never reaches talker or
code2wav), greedy served output equal to the package's unbatched reference generation
(thinker tokens, talker codes, code2wav audio), the talker's partial start, and aborts
while the thinker streams to the talker leave no state."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage.core.errors import RequestAbortedError, RequestValidationError
from omnistage.core.messages import StagePayload
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
    TalkerSampling,
    TextDelta,
    ThinkerPrompt,
)
from omnistage.models.qwen3_omni.processing import (
    ChatMessage,
    ChatPart,
    DecodedVideo,
    Qwen3OmniProcessor,
)
from omnistage.models.qwen3_omni.random_checkpoint import write_random_checkpoint
from omnistage.models.qwen3_omni.stages import load_code2wav
from omnistage.pipeline.pipeline import Pipeline, build_topology
from omnistage.pipeline.stage import build_scheduler
from omnistage.scheduling.ar import CodeFrames, FrameWithHidden, GenerationSummary, StopTail
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
    return directory


def request(
    audio: bool,
    max_tokens: int = TOKENS,
    messages=MESSAGES,
    frames: int = FRAMES,
    talker: TalkerSampling = TalkerSampling.greedy(),
    seed: int = 0,
) -> Qwen3OmniRequest:
    return Qwen3OmniRequest(
        messages, audio, SPEAKER, OmniSampling(seed=seed), max_tokens, frames, stream=True,
        talker_sampling=talker,
    )  # fmt: skip


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
    the unbatched loops of modeling/generate.py on the checkpoint's safetensors (the loops
    test_thinker_talker_parity.py holds equal to transformers)."""
    model = load_model(checkpoint, parts=("thinker", "talker", "audio_tower", "visual"))
    cfg = model.config
    inputs = Qwen3OmniProcessor.from_checkpoint(checkpoint, cfg.thinker.audio)(list(messages))
    ids = inputs.input_ids
    layout = MultimodalLayout(
        image_grids=[tuple(g) for g in inputs.image_grid_thw.tolist()],
        video_grids=[tuple(g) for g in inputs.video_grid_thw.tolist()],
        video_seconds_per_grid=inputs.video_second_per_grid.tolist(),
        audio_lengths=output_lengths(inputs.audio_frames, cfg.thinker.audio).tolist(),
        use_audio_in_video=any(inputs.use_audio_in_video),
    )
    positions = prompt_positions(ids.tolist(), cfg.thinker, layout)
    with torch.no_grad():
        rows = {}
        if inputs.audio_features is not None:
            rows["audio"] = model.audio_tower(inputs.audio_features, inputs.audio_frames).embeddings
        for kind, pixels, grid in (("image", inputs.pixel_values, inputs.image_grid_thw),
                                   ("video", inputs.pixel_values_videos, inputs.video_grid_thw)):  # fmt: skip
            if pixels is not None:
                out = model.visual(pixels, grid)
                rows[kind], rows[f"{kind}_deepstack"] = out.embeddings, tuple(out.deepstack)
        embeds, deepstack = model.thinker.merge(ids, EncoderRows(**rows))
    thinker = thinker_generate(model.thinker, ids, positions, TOKENS, cfg.im_end_id, input_embeds=embeds,
                               deepstack=deepstack, capture_layer=cfg.talker.accept_hidden_layer)  # fmt: skip
    rows = ThinkerRows(ids, thinker.tokens, thinker.embeds, thinker.captured)
    with torch.no_grad():
        prompt = build_talker_prompt(
            model.talker, model.thinker.model.embed_tokens, cfg, rows, SPEAKER, layout
        )
        codes = talker_generate(model.talker, prompt, FRAMES).codes
        audio = load_code2wav(str(checkpoint), torch.device("cpu"), "dummy")(codes[None])[0]
    tokens = thinker.tokens[:-1] if thinker.finish_reason == "stop" else thinker.tokens
    return {"tokens": tokens, "codes": codes, "audio": audio.numpy(), "prompt_tokens": ids.shape[0],
            "fractional": bool((positions.positions != positions.positions.round()).any())}  # fmt: skip


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


def _stages_with_a_result(handle) -> set[str]:
    return {name.split(".")[0] for name, _ in handle.timeline.marks if name.endswith(".result")}


def test_every_edge_is_typed(checkpoint: Path) -> None:
    config = Qwen3OmniPipelineConfig.for_model_path(str(checkpoint), load_format="dummy")
    topology = build_topology(config)
    edges = {(e.source, e.target, e.kind): e.carries for e in topology.edges}
    assert edges == {
        ("preprocessing", "image_encoder", "next"): (ThinkerPrompt,),
        ("preprocessing", "audio_encoder", "next"): (ThinkerPrompt,),
        # the thinker's fan-in: its payload is merge_fn's, checked by its annotation
        ("preprocessing", "thinker", "next"): (),
        ("image_encoder", "thinker", "next"): (),
        ("audio_encoder", "thinker", "next"): (),
        ("preprocessing", "talker", "stream"): (AudioSetup,),
        ("preprocessing", "code2wav", "stream"): (AudioSetup,),
        ("thinker", "decode", "next"): (GenerationSummary,),
        ("thinker", "talker", "next"): (GenerationSummary,),
        ("thinker", "decode", "stream"): (CodeFrames, FrameWithHidden, StopTail),
        ("thinker", "talker", "stream"): (CodeFrames, FrameWithHidden, StopTail),
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


def _check_audio_request(
    running, loop, req: Qwen3OmniRequest, reference: dict, encoders: set[str] = frozenset()
) -> None:
    handle, chunks, result = loop.run_until_complete(_run(running, req))
    assert set(result.outputs) == {"decode", "code2wav"}
    assert _stages_that_prefilled(handle) == {"thinker", "talker"}
    assert _stages_with_a_result(handle) & {"image_encoder", "audio_encoder"} == encoders
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
        running, loop, request(audio=True, messages=HEARD), _reference(checkpoint, HEARD), {"audio_encoder"}
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


def _picture(seed: int, size: tuple[int, int] = (64, 48)) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _video(seed: int, with_audio: bool) -> DecodedVideo:
    """4 frames at 3 fps: 2/3 s per temporal grid, so the video's T positions are fractional."""
    frames = np.random.default_rng(seed).integers(0, 256, (4, 48, 64, 3), dtype=np.uint8)
    return DecodedVideo(frames, 3.0, _clip()[:8000] if with_audio else None)


SEEN = (ChatMessage("user", (ChatPart("image", image=_picture(1)), ChatPart("text", text="What is it?"))),)
WATCHED = (ChatMessage("user", (ChatPart("video", video=_video(2, False)), ChatPart("text", text="And this?"))),)
WATCHED_AND_HEARD = (
    ChatMessage("user", (ChatPart("video", video=_video(3, True), use_audio=True), ChatPart("text", text="So?"))),
)
EVERYTHING = (
    ChatMessage("system", (ChatPart("text", text="You are brief."),)),
    ChatMessage("user", (ChatPart("image", image=_picture(4)), ChatPart("audio", audio=_clip()),
                         ChatPart("video", video=_video(5, False)), ChatPart("text", text="All of it?"))),
)  # fmt: skip


@pytest.mark.parametrize(
    ("messages", "encoders"),
    [(SEEN, {"image_encoder"}), (WATCHED, {"image_encoder"}),
     (WATCHED_AND_HEARD, {"image_encoder", "audio_encoder"}), (EVERYTHING, {"image_encoder", "audio_encoder"})],
    ids=["image", "video", "video with its audio", "image, audio and video"],
)  # fmt: skip
def test_media_prompts_go_through_their_encoders_and_equal_the_reference(
    pipeline, checkpoint, messages, encoders
) -> None:
    """Images and videos through image_encoder (deepstack as the thinker's hidden additions,
    fractional video positions), audio through audio_encoder, the thinker waiting for the
    encoders the request needs: served greedy output equals the reference loops."""
    loop, running = pipeline
    reference = _reference(checkpoint, messages)
    assert reference["fractional"] == any(p.kind == "video" for m in messages for p in m.parts)
    _check_audio_request(running, loop, request(audio=True, messages=messages), reference, encoders)


def test_media_requests_batched_in_the_encoders_equal_their_references(pipeline, checkpoint) -> None:
    """Concurrent image and video requests (a text-only one among them) each get their own
    output, however the stages batch them."""
    loop, running = pipeline
    distinct = [SEEN, WATCHED, MESSAGES, WATCHED_AND_HEARD]
    cases = [0, 1, 2, 3, 0]
    references = [_reference(checkpoint, m) for m in distinct]

    async def together():
        return await asyncio.gather(
            *(_run(running, request(audio=False, messages=distinct[c])) for c in cases)
        )

    for (_, _, result), case in zip(loop.run_until_complete(together()), cases, strict=True):
        assert set(result.outputs) == {"decode"}
        torch.testing.assert_close(
            result.outputs["decode"].token_ids, references[case]["tokens"], rtol=0, atol=0
        )
    loop.run_until_complete(assert_no_request_state(running))


def test_the_audio_encoder_encodes_a_batch_as_each_prompt_alone(checkpoint) -> None:
    """One audio-tower call over several prompts' audios (1 s; a video's 0.5 s track, one
    tail chunk; two clips of 1.3 s and 0.37 s in one prompt) gives every prompt the rows it
    gets alone."""
    config = Qwen3OmniPipelineConfig.for_model_path(str(checkpoint), load_format="dummy")
    stages = {stage.name: stage for stage in config.stages}
    prepare = build_scheduler(config, stages["preprocessing"]).compute
    encode = build_scheduler(config, stages["audio_encoder"]).compute
    two_clips = (
        ChatMessage("user", (ChatPart("audio", audio=np.tile(_clip(), 2)[:20800]), ChatPart("text", text="And?"),
                             ChatPart("audio", audio=_clip()[:5920]))),
    )  # fmt: skip
    batch = [
        StagePayload(f"r{i}", req, prepare(StagePayload(f"r{i}", req, None)))
        for i, req in enumerate(request(audio=False, messages=m) for m in (HEARD, WATCHED_AND_HEARD, two_clips))
    ]  # fmt: skip
    assert [p.data.audio_frames.tolist() for p in batch] == [[100], [50], [130, 37]]
    together = encode(batch)
    for payload, batched in zip(batch, together, strict=True):
        (alone,) = encode([payload])
        assert batched.audio_features is None and batched.audio_rows.shape == alone.audio_rows.shape
        # a matmul over more rows may take another CPU kernel: fp32 rounding, not bitwise
        torch.testing.assert_close(batched.audio_rows, alone.audio_rows)


def test_the_image_encoder_encodes_a_batch_as_each_prompt_alone(checkpoint) -> None:
    """One vision-encoder call over several prompts' images and videos gives every prompt the
    rows (and deepstack levels) it gets alone."""
    config = Qwen3OmniPipelineConfig.for_model_path(str(checkpoint), load_format="dummy")
    stages = {stage.name: stage for stage in config.stages}
    prepare = build_scheduler(config, stages["preprocessing"]).compute
    encode = build_scheduler(config, stages["image_encoder"]).compute
    batch = [
        StagePayload(f"r{i}", req, prepare(StagePayload(f"r{i}", req, None)))
        for i, req in enumerate(request(audio=False, messages=m) for m in (SEEN, EVERYTHING, WATCHED))
    ]
    together = encode(batch)
    for payload, batched in zip(batch, together, strict=True):
        (alone,) = encode([payload])
        assert batched.pixel_values is None and batched.pixel_values_videos is None
        for name in ("image", "video"):
            a, b = getattr(alone.vision_rows, name), getattr(batched.vision_rows, name)
            assert (a is None) == (b is None) == (getattr(payload.data, f"{name}_grid_thw") is None)
            if a is not None:
                torch.testing.assert_close(b, a)
                levels = getattr(batched.vision_rows, f"{name}_deepstack")
                assert len(levels) == 2
                torch.testing.assert_close(levels, getattr(alone.vision_rows, f"{name}_deepstack"))


def test_videos_that_differ_in_their_audio_are_refused_naming_the_field(pipeline) -> None:
    loop, running = pipeline
    mixed = (ChatMessage("user", (ChatPart("video", video=_video(6, True), use_audio=True, param="messages.0.content.0"),
                                  ChatPart("video", video=_video(7, False), param="messages.0.content.1"))),)  # fmt: skip
    with pytest.raises(RequestValidationError, match=r"messages\.0\.content\.1"):
        loop.run_until_complete(_run(running, request(audio=True, messages=mixed)))
    loop.run_until_complete(assert_no_request_state(running))


def test_the_talker_samples_as_the_reference_reproducibly_by_seed(pipeline, reference) -> None:
    """The default talker sampling (the reference's: code 0 at temperature 0.9, top-k 50) and
    a sampled code predictor: the same seed gives the same codes and audio, concurrently or
    not; another seed, or a sampled instead of greedy predictor, other codes; the thinker's
    greedy text is unchanged."""
    loop, running = pipeline
    sampled = TalkerSampling(predictor_temperature=1.0)
    frames = 12

    async def codes_of(*reqs: Qwen3OmniRequest) -> list:
        runs = await asyncio.gather(*(_run(running, r) for r in reqs))
        out = []
        for _, chunks, result in runs:
            torch.testing.assert_close(result.outputs["decode"].token_ids, reference["tokens"], rtol=0, atol=0)
            out.append(np.concatenate([c.data.samples for c in chunks if isinstance(c.data, AudioChunk)]))
        return out

    def req(seed: int, talker: TalkerSampling = sampled) -> Qwen3OmniRequest:
        return request(audio=True, frames=frames, talker=talker, seed=seed)

    (alone,) = loop.run_until_complete(codes_of(req(7)))
    twin, other, default, greedy = loop.run_until_complete(
        codes_of(req(7), req(8), req(7, TalkerSampling()), req(7, TalkerSampling.greedy()))
    )
    # the same codes: the same audio, up to the vocoder's batching (as streamed == offline)
    np.testing.assert_allclose(twin, alone, rtol=0, atol=1e-5)
    for name, audio in (("another seed", other), ("greedy predictor", default), ("greedy", greedy)):
        assert audio.shape != alone.shape or np.abs(audio - alone).max() > 1e-2, name
    loop.run_until_complete(assert_no_request_state(running))


def test_bad_talker_sampling_is_refused_naming_the_field() -> None:
    with pytest.raises(RequestValidationError, match=r"talker_sampling\.predictor_top_p") as caught:
        TalkerSampling(predictor_top_p=0.0)
    assert caught.value.param == "talker_sampling.predictor_top_p"
    with pytest.raises(RequestValidationError, match=r"talker_sampling\.temperature"):
        TalkerSampling(temperature=-1.0)


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


@contextmanager
def gated(running: Pipeline, stage: str) -> Iterator[tuple[threading.Event, threading.Event]]:
    """Hold ``stage``'s compute (a batch or threaded stage) until ``opened`` is set;
    ``entered`` is set when a request reached it."""
    scheduler = running.host.stages[stage].scheduler
    original, entered, opened = scheduler.compute, threading.Event(), threading.Event()

    def compute(arg):
        entered.set()
        assert opened.wait(30.0), f"{stage}'s gate was never opened"
        return original(arg)

    scheduler.compute = compute
    try:
        yield entered, opened
    finally:
        opened.set()
        scheduler.compute = original


@pytest.mark.parametrize("stage", ["preprocessing", "image_encoder", "audio_encoder"])
def test_abort_while_a_stage_before_the_thinker_holds_the_request_leaves_no_state(pipeline, stage) -> None:
    """Aborted while preprocessing or an encoder computes it (the other encoder may have
    finished: the thinker's fan-in holds its half) -> the request ends as aborted and no
    stage keeps anything of it, the gated stage's late output included."""
    loop, running = pipeline

    async def scenario() -> None:
        with gated(running, stage) as (entered, opened):
            handle = running.submit(request(audio=True, messages=EVERYTHING))
            assert await asyncio.to_thread(entered.wait, 30.0)
            running.abort(handle.request_id)
            opened.set()
            with pytest.raises(RequestAbortedError):
                await handle.result()
        await assert_no_request_state(running)

    loop.run_until_complete(scenario())


@pytest.mark.parametrize("when", ["first text", "first audio, thinker done"])
def test_abort_while_the_engines_and_terminals_run_leaves_no_state(pipeline, when) -> None:
    """Aborted at its first text delta (thinker and decode running, the talker not started
    or starting) or at its first audio with a 2-token reply (the thinker done, talker and
    code2wav running) -> no state left."""
    loop, running = pipeline
    tokens = 64 if when == "first text" else 2
    kind = TextDelta if when == "first text" else AudioChunk

    async def scenario() -> None:
        handle = running.submit(request(audio=True, max_tokens=tokens, frames=400))
        with pytest.raises(RequestAbortedError):
            async for chunk in handle.stream():
                if isinstance(chunk.data, kind):
                    running.abort(handle.request_id)
        await assert_no_request_state(running)

    loop.run_until_complete(scenario())
