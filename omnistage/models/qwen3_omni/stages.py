"""Stage factories and routing hooks of the Qwen3-Omni pipeline (seed 001).

preprocessing -> image_encoder / audio_encoder (the prompt's images and videos / audios)
-> thinker -> decode (text, terminal; the thinker streams its tokens to it, which streams
text deltas); for a request with ``audio_output`` the thinker also streams to the talker
(token + hidden rows), which streams code frames to code2wav (audio, terminal). One
per-request decision, :func:`route` (:class:`Route`: which encoders, whether it speaks),
decides every hook: preprocessing's targets, the thinker's fan-in waits, both stages'
stream-done targets, the thinker's routes and the terminal set; a text-only request never
reaches talker or code2wav, a text prompt no encoder.

Partial start: the talker's request enters its engine once ``talker_start_tokens`` reply
tokens exist (at least 2: the talker prompt ends with the first reply token, whose
thinker rows come with the second); each later reply token's row is appended to the
running request (``append_step_rows``) and ``tts_eos`` plus stream-done completes them. A
request whose next row has not arrived takes no step (the engine's streamed-rows rule), so
it never holds back the others of a batch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from omnistage.core.errors import RequestValidationError
from omnistage.core.messages import StagePayload, StreamChunk
from omnistage.engine.engine import AREngine, EngineConfig
from omnistage.engine.layers import fuse_projections
from omnistage.engine.model_runner import GREEDY, StepSampling, upload
from omnistage.engine.sampler import SamplerFeatures, SamplingParams
from omnistage.engine.sequence import GenerationInput
from omnistage.engine.vocoder_arena import StreamingDecoderArena
from omnistage.models.qwen3_omni.engine_model import TalkerEngineModel, ThinkerEngineModel
from omnistage.models.qwen3_omni.modeling.audio_encoder import output_lengths
from omnistage.models.qwen3_omni.modeling.code2wav import Code2Wav
from omnistage.models.qwen3_omni.modeling.config import load_config
from omnistage.models.qwen3_omni.modeling.generate import talker_sampling
from omnistage.models.qwen3_omni.modeling.model import LoadedOmni, LoadFormat, ModelPart, load_model
from omnistage.models.qwen3_omni.modeling.mrope import MultimodalLayout, prompt_positions
from omnistage.models.qwen3_omni.modeling.prompt import ThinkerRows, build_talker_prompt
from omnistage.models.qwen3_omni.modeling.talker import Talker
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
from omnistage.models.qwen3_omni.processing import Qwen3OmniProcessor
from omnistage.models.qwen3_omni.request_builders import DEFAULT_MAX_AUDIO_FRAMES
from omnistage.pipeline.stage import StageBuildContext
from omnistage.scheduling import SimpleScheduler, StreamingScheduler, StreamState, ThreadedScheduler
from omnistage.scheduling.ar import (
    ARScheduler,
    CodeFrames,
    FrameWithHidden,
    GenerationSummary,
    RowFeed,
    StopTail,
    StreamInput,
)
from omnistage.scheduling.stop_strings import TokenizerText
from omnistage.scheduling.vocoder import ChunkPlan, VocoderScheduler

SAMPLE_RATE = 24000
TEXT_STAGES = ("preprocessing", "thinker", "decode")
AUDIO_STAGES = ("talker", "code2wav")
ENCODER_STAGES = ("image_encoder", "audio_encoder")


# --------------------------------------------------------------------------- routing hooks


@dataclass(frozen=True)
class Route:
    """The one per-request decision every routing hook reads.

    Attributes:
        encoders: the encoder stages the prompt needs, in :data:`ENCODER_STAGES` order:
            ``image_encoder`` for images and videos, ``audio_encoder`` for audios and the
            audio of a video asked with it (``ChatPart.use_audio``).
        speaks: speech is requested (``audio_output``): talker and code2wav run.
    """

    encoders: tuple[str, ...]
    speaks: bool


def route(request: Qwen3OmniRequest) -> Route:
    """The request's :class:`Route`, from its content and ``audio_output`` alone."""
    parts = [part for message in request.messages for part in message.parts]
    needs = {
        "image_encoder": any(p.kind in ("image", "video") for p in parts),
        "audio_encoder": any(p.kind == "audio" or (p.kind == "video" and p.use_audio) for p in parts),
    }
    return Route(tuple(s for s in ENCODER_STAGES if needs[s]), request.audio_output)


def preprocessing_routes(payload: StagePayload) -> list[str]:
    return list(route(payload.request).encoders) or ["thinker"]


def thinker_waits_for(payload: StagePayload) -> list[str]:
    return list(route(payload.request).encoders) or ["preprocessing"]


def thinker_merge(payloads: dict[str, StagePayload]) -> ThinkerPrompt:
    """The prompt from the sources this request waits for (:func:`thinker_waits_for`):
    preprocessing's alone, or the encoders' prompts, each with its own rows."""
    prompts = {name: payload.data for name, payload in payloads.items()}
    if "preprocessing" in prompts:
        return prompts["preprocessing"]
    audio, vision = prompts.get("audio_encoder"), prompts.get("image_encoder")
    base = audio or vision
    assert base is not None, f"the thinker merges its encoders' prompts, got {sorted(prompts)}"
    return replace(
        base, audio_features=None, pixel_values=None, pixel_values_videos=None,
        audio_rows=audio.audio_rows if audio is not None else None,
        vision_rows=vision.vision_rows if vision is not None else None,
    )  # fmt: skip


def preprocessing_streams(payload: StagePayload) -> list[str]:
    return list(AUDIO_STAGES) if route(payload.request).speaks else []


def thinker_routes(payload: StagePayload) -> list[str]:
    return ["decode", "talker"] if route(payload.request).speaks else ["decode"]


def thinker_streams(payload: StagePayload) -> list[str]:
    return ["decode", "talker"] if route(payload.request).speaks else ["decode"]


def terminal_stages(request: Qwen3OmniRequest) -> list[str]:
    return ["code2wav", "decode"] if route(request).speaks else ["decode"]


# --------------------------------------------------------------------------- shared loading


def _model_path(ctx: StageBuildContext) -> str:
    assert ctx.pipeline.model_path is not None, "the Qwen3-Omni pipeline needs model_path"
    return ctx.pipeline.model_path


@lru_cache(maxsize=4)
def loaded_model(
    model_path: str, device: torch.device, load_format: LoadFormat, parts: tuple[ModelPart, ...]
) -> LoadedOmni:
    """``parts``, loaded once per process, device, format and parts (the stages asking for
    the same share them), the thinker's and talker's q/k/v and gate/up projections fused
    (:func:`fuse_projections`: same values, fewer kernels per layer)."""
    model = load_model(model_path, device, parts=parts, load_format=load_format)
    for part in (model.thinker, model.talker):
        if part is not None:
            fuse_projections(part)
    return model


def language_parts(ctx: StageBuildContext) -> tuple[ModelPart, ...]:
    """What the thinker and talker stages load: when both are on one device in one process,
    thinker and talker together (one load, one copy of the thinker's token embedding, which
    the talker's prompt reads); else the thinker stage the thinker and the talker stage the
    talker and ``thinker_embed`` (the split variant)."""
    homes = {s.name: (torch.device(s.device), s.process) for s in ctx.pipeline.stages}
    if "talker" not in homes:
        return ("thinker",)
    if homes["thinker"] == homes["talker"]:
        return ("thinker", "talker")
    return ("thinker",) if ctx.stage.name == "thinker" else ("talker", "thinker_embed")


def thinker_sampling(sampling: OmniSampling, stop_id: int) -> SamplingParams:
    """The thinker's token sampling: the client's values, ``<|im_end|>`` stops."""
    return SamplingParams(
        temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
        stop_token_ids=(stop_id,), seed=sampling.seed,
    )  # fmt: skip


def talker_sampling_params(
    talker: Talker, sampling: TalkerSampling, seed: int
) -> tuple[SamplingParams, SamplingParams]:
    """The engine's code-0 and code-predictor sampling of a talker request: ``sampling``'s
    values over the reference's code-0 rules (:func:`talker_sampling`: control ids
    suppressed, codec EOS stops), both with ``seed``."""
    code0 = replace(
        talker_sampling(talker, sampling.repetition_penalty), temperature=sampling.temperature,
        top_k=sampling.top_k, top_p=sampling.top_p, seed=seed,
    )  # fmt: skip
    predictor = SamplingParams(
        temperature=sampling.predictor_temperature, top_k=sampling.predictor_top_k,
        top_p=sampling.predictor_top_p, seed=seed,
    )  # fmt: skip
    return code0, predictor


# --------------------------------------------------------------------------- preprocessing


def create_preprocessing_stage(ctx: StageBuildContext, num_workers: int = 4) -> ThreadedScheduler:
    """Request -> :class:`ThinkerPrompt` (prompt ids with media placeholders expanded,
    Whisper features, image / video patches, MRoPE positions); for an audio request it also
    streams the talker and code2wav their :class:`AudioSetup` at once. With the
    ``image_encoder`` stage on CUDA the patches are made in pinned host memory.

    Raises (per request): RequestValidationError naming ``messages.<i>.content.<j>``: the
    videos of one prompt differ in whether their audio is asked (transformers' positions
    take one ``use_audio_in_video`` per prompt), or the processor's media errors."""
    model_path = _model_path(ctx)
    config = load_config(model_path)
    audio_config = config.thinker.audio
    # patches made pinned for a CUDA vision encoder: its upload then neither copies nor waits
    encoder = next((s for s in ctx.pipeline.stages if s.name == "image_encoder"), None)
    pinned = encoder is not None and torch.device(encoder.device).type == "cuda"
    processor = Qwen3OmniProcessor.from_checkpoint(model_path, audio_config, pin_memory=pinned)

    def compute(payload: StagePayload) -> ThinkerPrompt:
        request: Qwen3OmniRequest = payload.request
        videos = [part for message in request.messages for part in message.parts if part.kind == "video"]
        for part in videos[1:]:
            if part.use_audio != videos[0].use_audio:
                raise RequestValidationError(
                    f"{part.param}: every video of a prompt is sent with its audio or none is", param=part.param
                )
        inputs = processor(list(request.messages))
        ids = inputs.input_ids
        layout = MultimodalLayout(
            image_grids=[tuple(g) for g in inputs.image_grid_thw.tolist()],
            video_grids=[tuple(g) for g in inputs.video_grid_thw.tolist()],
            video_seconds_per_grid=inputs.video_second_per_grid.tolist(),
            audio_lengths=output_lengths(inputs.audio_frames, audio_config).tolist(),
            use_audio_in_video=any(inputs.use_audio_in_video),
        )  # fmt: skip
        positions = prompt_positions(ids.tolist(), config.thinker, layout)
        if route(request).speaks:
            setup = AudioSetup(
                prompt_ids=ids, layout=layout, voice=request.voice, sampling=request.talker_sampling,
                seed=request.sampling.seed, max_frames=talker_max_frames(request), stream=request.stream,
                input_tokens=int(ids.shape[0]),
            )  # fmt: skip
            scheduler.outbox.stream(payload.request_id, setup)
        return ThinkerPrompt(
            ids, positions.positions, float(positions.delta), layout,
            inputs.audio_features, inputs.audio_frames if inputs.audio_features is not None else None,
            pixel_values=inputs.pixel_values,
            image_grid_thw=inputs.image_grid_thw if inputs.pixel_values is not None else None,
            pixel_values_videos=inputs.pixel_values_videos,
            video_grid_thw=inputs.video_grid_thw if inputs.pixel_values_videos is not None else None,
        )  # fmt: skip

    scheduler = ThreadedScheduler(compute, num_workers)
    return scheduler


# --------------------------------------------------------------------------- image_encoder


def create_image_encoder_stage(
    ctx: StageBuildContext,
    max_batch_size: int = 8,
    max_batch_wait_ms: float = 2.0,
    load_format: LoadFormat = "safetensors",
) -> SimpleScheduler:
    """The vision encoder over a batch of prompts: every image and video of the batch in one
    call (attention stays within each frame, so an item's rows do not depend on the others)
    -> each prompt's ``vision_rows`` (image / video rows ``[N, H]`` and their deepstack
    levels)."""
    model = load_model(
        _model_path(ctx), torch.device(ctx.stage.device), parts=("visual",), load_format=load_format
    )
    visual = model.visual
    assert visual is not None
    device = next(visual.parameters()).device

    @torch.inference_mode()
    def compute(batch: list[StagePayload]) -> list[ThinkerPrompt]:
        prompts: list[ThinkerPrompt] = [payload.data for payload in batch]
        items = [(pixels, grid) for p in prompts for pixels, grid in
                 ((p.pixel_values, p.image_grid_thw), (p.pixel_values_videos, p.video_grid_thw)) if pixels is not None]  # fmt: skip
        # each item uploaded without waiting (a copy that waits would wait for the engines'
        # work queued on the stream), then joined on the device: one host copy (the pinning)
        pixels = torch.cat([upload(pixels, device) for pixels, _ in items])
        out = visual(pixels, torch.cat([grid for _, grid in items]))
        # rows per item (a prompt's images, or its videos), from the rows per grid
        per_grid, sizes = iter(out.lengths.tolist()), []
        for _, grid in items:
            sizes.append(sum(next(per_grid) for _ in range(grid.shape[0])))
        rows = iter(out.embeddings.split(sizes))
        deepstack = iter(zip(*(level.split(sizes) for level in out.deepstack), strict=True))
        results = []
        for prompt in prompts:
            found = {}
            for kind, pixels in (("image", prompt.pixel_values), ("video", prompt.pixel_values_videos)):
                if pixels is not None:
                    found[kind], found[f"{kind}_deepstack"] = next(rows), tuple(next(deepstack))
            results.append(
                replace(prompt, pixel_values=None, pixel_values_videos=None, vision_rows=EncoderRows(**found))
            )
        return results

    return SimpleScheduler(compute, max_batch_size, max_batch_wait_ms)


# --------------------------------------------------------------------------- audio_encoder


def create_audio_encoder_stage(
    ctx: StageBuildContext,
    max_batch_size: int = 16,
    max_batch_wait_ms: float = 2.0,
    load_format: LoadFormat = "safetensors",
) -> SimpleScheduler:
    """The audio tower over a batch of prompts: every audio of the batch in one call (each
    prompt's chunks padded as when it is encoded alone, attention within each audio's
    windows, so a prompt's rows do not depend on the others) -> each prompt's ``[Na, H]``
    audio rows.

    ``max_batch_size`` 16 (twice the image encoder's 8: a 3 s clip is 39 rows, an image
    hundreds) and ``max_batch_wait_ms`` 2.0: one tower call for up to 16 waiting prompts,
    where one call a prompt queued 64 concurrent requests behind 64 tower calls."""
    model = load_model(
        _model_path(ctx),
        torch.device(ctx.stage.device),
        parts=("audio_tower",),
        load_format=load_format,
    )
    tower = model.audio_tower
    assert tower is not None
    device = next(tower.parameters()).device

    @torch.inference_mode()
    def compute(batch: list[StagePayload]) -> list[ThinkerPrompt]:
        prompts: list[ThinkerPrompt] = [payload.data for payload in batch]
        features, frames = [], []
        for prompt in prompts:
            assert prompt.audio_features is not None and prompt.audio_frames is not None
            features.append(prompt.audio_features)
            frames.append(prompt.audio_frames)
        counts = [len(f) for f in frames]
        joined = torch.cat([upload(f, device) for f in features], dim=1)  # uploads that do not wait
        out = tower(joined, torch.cat(frames), prompts=counts)
        sizes = [int(n.sum()) for n in out.lengths.split(counts)]
        return [
            replace(prompt, audio_features=None, audio_rows=rows)
            for prompt, rows in zip(prompts, out.embeddings.split(sizes), strict=True)
        ]

    return SimpleScheduler(compute, max_batch_size, max_batch_wait_ms)


# --------------------------------------------------------------------------- thinker, decode


def engine_config(
    max_num_seqs: int, kv_cache_bytes: int | None, max_model_len: int, cuda_graphs: bool,
    graph_sampling: tuple[tuple[SamplingParams, SamplingParams], ...],
    num_step_rows: int = EngineConfig.num_step_rows,
    mem_fraction_static: float = EngineConfig.mem_fraction_static,
    own_stream: bool = False,
    max_prefill_tokens: int = EngineConfig.max_prefill_tokens,
    cuda_graph_prefill_tokens: tuple[int, ...] | None = None,
) -> EngineConfig:
    """The thinker's and the talker's engine config. With ``cuda_graphs`` (used on CUDA
    only) decode steps and prefill tails run as CUDA graphs per batch bucket (1, 2, 4, 8,
    then every 8 up to ``max_num_seqs``), captured at start-up for the general sampler and
    for the step sampling of each ``(code 0, code predictor)`` pair of ``graph_sampling``
    (:func:`step_variants`; the stage's common requests; any other mix is captured when
    first used), and so are prefills per token bucket: ``cuda_graph_prefill_tokens``
    (tokens computed by one prefill step, each at most ``max_prefill_tokens``; () for none),
    None: the engine's, 16 to 128 up to ``max_prefill_tokens``
    (``EngineConfig.cuda_graph_prefill_tokens``). Without ``cuda_graphs`` no bucket is
    captured and ``cuda_graph_prefill_tokens`` is ignored.
    ``max_prefill_tokens``: prompt tokens computed per prefill step at most (8,192, the
    engine's default).
    ``num_step_rows``: the step-row pool (the talker's: :func:`talker_step_rows`).
    KV pool (:func:`~omnistage.engine.kv_cache.kv_pool_blocks`): ``kv_cache_bytes`` when
    given; else ``max_num_seqs`` requests of ``max_model_len`` tokens, on CUDA at most
    ``mem_fraction_static`` of the device memory free when the engine is built (the
    thinker's after every weight of its process; the talker's also after the thinker's
    pool and graphs when colocated). At real dimensions in bf16 a token takes 96 KiB in the
    thinker and 20 KiB in the talker: 12 and 2.5 GiB at the defaults (16 x 8192).
    ``own_stream`` (CUDA only; ``EngineConfig.own_stream``): the engine's device work on a
    CUDA stream of its own. Colocated, the thinker's and the talker's engines share one
    device; on one stream their steps run one after the other and each step's wait also
    waits for the other engine's queued kernels. Off by default until measured on the
    device (docs/qwen3_omni.md, "Own streams")."""
    return EngineConfig(
        kv_cache_bytes=kv_cache_bytes, mem_fraction_static=mem_fraction_static,
        max_model_len=max_model_len, max_num_seqs=max_num_seqs, max_prefill_tokens=max_prefill_tokens,
        prefill_hold_ms=0.0, cuda_graph_batch_sizes=None if cuda_graphs else (), graph_sampling=step_variants(graph_sampling),
        cuda_graph_prefill_tokens=cuda_graph_prefill_tokens if cuda_graphs else (), num_step_rows=num_step_rows,
        own_stream=own_stream,
    )  # fmt: skip


def step_variants(graph_sampling: tuple[tuple[SamplingParams, SamplingParams], ...]) -> tuple[StepSampling, ...]:
    """The engine's graph variants of ``(code 0, code predictor)`` sampling pairs."""
    return tuple(
        StepSampling(SamplerFeatures.of([code0]), SamplerFeatures.of([predictor]))
        for code0, predictor in graph_sampling
    )


def talker_step_rows(max_num_seqs: int) -> int:
    """The talker's step-row pool: ``max_num_seqs`` requests of the most frames a request
    may ask for (:data:`~.request_builders.DEFAULT_MAX_AUDIO_FRAMES`), so the pool never
    admits fewer requests than ``max_num_seqs``. A streamed talker request keeps one row a
    frame from its admission (``GenerationInput.more_rows``); with the engine's default
    pool (65536 rows) a talker of ``max_num_seqs`` 32 ran 16 requests and the others waited
    for a whole reply (H200, text prompt at concurrency 32: TTFA p50 6-7 s). 2 KiB a row at
    real dimensions: 256 MiB at 32 requests."""
    return max_num_seqs * DEFAULT_MAX_AUDIO_FRAMES


def thinker_graph_sampling(stop_id: int) -> tuple[tuple[SamplingParams, SamplingParams], ...]:
    """The thinker's common requests for :func:`engine_config`: greedy (the default) and
    sampled without top-k (it has no code predictor)."""
    return tuple((thinker_sampling(s, stop_id), GREEDY) for s in (OmniSampling(), OmniSampling(temperature=1.0)))


def talker_graph_sampling(talker: Talker) -> tuple[tuple[SamplingParams, SamplingParams], ...]:
    """The talker's common requests for :func:`engine_config`: the reference's sampling
    (the pipeline's default), greedy (a chat request's default) and sampled without top-k."""
    common = (TalkerSampling(), TalkerSampling.greedy(), TalkerSampling(temperature=1.0, top_k=0))
    return tuple(talker_sampling_params(talker, t, 0) for t in common)


#: The thinker and talker stages' default ``max_model_len`` (prompt + generated positions of
#: one request); the request boundary checks against each stage's own value.
MAX_MODEL_LEN = 8192


def create_thinker_stage(
    ctx: StageBuildContext,
    max_num_seqs: int = 16,
    kv_cache_bytes: int | None = None,
    mem_fraction_static: float = EngineConfig.mem_fraction_static,
    max_model_len: int = MAX_MODEL_LEN,
    load_format: LoadFormat = "safetensors",
    cuda_graphs: bool = True,
    own_stream: bool = False,
    max_prefill_tokens: int = EngineConfig.max_prefill_tokens,
    cuda_graph_prefill_tokens: tuple[int, ...] | None = None,
) -> ARScheduler:
    """The thinker on the AR engine; in a pipeline with a talker stage it returns the hidden
    states of layers 0 and ``accept_hidden_layer`` for audio requests (``return_hidden``).
    ``cuda_graphs``, ``kv_cache_bytes``, ``mem_fraction_static``, ``own_stream``,
    ``max_prefill_tokens``, ``cuda_graph_prefill_tokens``: see :func:`engine_config`; a bad
    value fails the stage's build before the weights load (ValueError naming the field;
    the buckets only with ``cuda_graphs``)."""
    config = engine_config(max_num_seqs, kv_cache_bytes, max_model_len, cuda_graphs, (), mem_fraction_static=mem_fraction_static,
                           own_stream=own_stream, max_prefill_tokens=max_prefill_tokens,
                           cuda_graph_prefill_tokens=cuda_graph_prefill_tokens)  # fmt: skip
    model = loaded_model(_model_path(ctx), torch.device(ctx.stage.device), load_format, language_parts(ctx))
    assert model.thinker is not None
    speaks = model.config.talker is not None and any(s.name == "talker" for s in ctx.pipeline.stages)
    layers = (0, model.config.talker.accept_hidden_layer) if speaks else ()
    stop = model.config.im_end_id
    engine = AREngine(
        ThinkerEngineModel(model.thinker, layers),
        replace(config, graph_sampling=step_variants(thinker_graph_sampling(stop))),
    )
    thinker = model.thinker

    @torch.inference_mode()
    def build_input(payload: StagePayload) -> GenerationInput:
        request: Qwen3OmniRequest = payload.request
        prompt: ThinkerPrompt = payload.data
        ids, deepstack = prompt.input_ids, None
        if prompt.audio_rows is not None or prompt.vision_rows is not None:
            # embeddings with the encoders' rows at their placeholders; the deepstack
            # features become the request's hidden additions at the visual positions (the
            # placeholders found in the host ids: no wait for the device on this thread)
            rows = replace(prompt.vision_rows or EncoderRows(), audio=prompt.audio_rows)
            ids, deepstack = thinker.merge(ids, rows)
        return GenerationInput(
            ids, thinker_sampling(request.sampling, stop), request.max_tokens,
            positions=prompt.positions, rope_delta=prompt.rope_delta, return_hidden=route(request).speaks,
            hidden_additions=deepstack, stop_strings=request.stop,
        )  # fmt: skip

    tokenizer = Qwen3OmniProcessor.from_checkpoint(_model_path(ctx)).tokenizer
    return ARScheduler(engine, build_input, token_text=TokenizerText(tokenizer))


class TextDecodeScheduler(StreamingScheduler[tuple[list[int], str]]):
    """The thinker's tokens -> reply text, streamed: each new token's text is emitted as a
    :class:`TextDelta` as soon as it decodes to whole characters (a byte token that ends
    mid-character waits for the next), then a :class:`ChatText` result (its prompt media
    counts: the request's, counted at the request boundary).

    Stream items: :class:`CodeFrames` (a text-only request) or :class:`FrameWithHidden`
    (an audio request; its frame None on the stop step), and a :class:`StopTail` when a stop
    string cut the reply inside a token. Payload: the thinker's :class:`GenerationSummary`.

    Args:
        tokenizer: the checkpoint's text tokenizer (special tokens are skipped).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        super().__init__()
        self.tokenizer = tokenizer

    def step(self, states: list[StreamState]) -> None:
        for state in states:
            tokens, sent = state.model_state or ([], "")
            for chunk in state.chunks:
                data = chunk.data
                if isinstance(data, CodeFrames):
                    tokens.extend(data.codes[:, 0].tolist())
                elif isinstance(data, FrameWithHidden) and data.frame is not None:
                    tokens.append(int(data.frame[0, 0]))
                elif isinstance(data, StopTail):
                    tokens.extend(data.token_ids.tolist())
            state.chunks.clear()
            text = self.tokenizer.decode(tokens, skip_special_tokens=True)
            finishing = self.ready_to_finish(state)
            if (
                text.startswith(sent)
                and len(text) > len(sent)
                and (finishing or not text.endswith("\ufffd"))
            ):
                self.emit(state, TextDelta(text[len(sent) :]))
                sent = text
            state.model_state = (tokens, sent)
            if finishing:
                assert state.payload is not None
                summary: GenerationSummary = state.payload.data
                request: Qwen3OmniRequest = state.payload.request
                ids = torch.tensor(tokens, dtype=torch.int64)
                self.complete(state, ChatText(
                    text=text, token_ids=ids, prompt_tokens=summary.num_prompt_tokens, completion_tokens=len(tokens),
                    prompt_audio_tokens=request.prompt_audio_tokens, prompt_image_tokens=request.prompt_image_tokens,
                ))  # fmt: skip


def create_decode_stage(ctx: StageBuildContext) -> TextDecodeScheduler:
    """The thinker's stream and result -> text deltas and :class:`ChatText` (terminal)."""
    return TextDecodeScheduler(Qwen3OmniProcessor.from_checkpoint(_model_path(ctx)).tokenizer)


# --------------------------------------------------------------------------- talker


#: The talker's cap in proportion to the reply (:func:`talker_frame_cap`).
TALKER_LEAD_FRAMES = 25  # 2 s
TALKER_FRAMES_PER_TOKEN = 10  # 0.8 s


def talker_frame_cap(reply_tokens: int) -> int:
    """Frames the talker may make for a reply of ``reply_tokens`` text tokens:
    ``25 + 10 * reply_tokens`` (2 s, plus 0.8 s a token), applied once the thinker's stream
    is done (until then the talker cannot run ahead of the text: it takes one reply row a
    frame); the request's own ``max_audio_frames`` caps it further.

    Why these numbers: transformers bounds the talker only by a fixed
    ``talker_max_new_tokens`` (4096 frames, 327 s), so a reply whose talker misses EOS runs
    for minutes. A Qwen tokenizer token is about 4 characters of English (1.5 Han
    characters), about 0.3 s of read speech at 14 characters/s; 0.8 s a token is the
    slow-pace margin (2.5x) of Qwen3-TTS's text-proportional cap, and the 2 s lead covers
    the silences around a one-word reply. The cap is at least ``reply_tokens + 1``, the
    frames that read every reply row and ``tts_eos``.
    """
    return TALKER_LEAD_FRAMES + TALKER_FRAMES_PER_TOKEN * reply_tokens


def talker_max_frames(request: Qwen3OmniRequest) -> int:
    """The talker request's frame limit, known before the reply: the request's
    ``max_audio_frames``, and at most :func:`talker_frame_cap` of a ``max_tokens`` reply
    (the reply cap applied later can only be lower). The engine reserves KV and step rows
    for this many frames when it admits the request, so a short ``max_tokens`` reserves
    little (48 tokens: 505 frames, not 4096)."""
    return min(request.max_audio_frames, talker_frame_cap(request.max_tokens))


class TalkerFeed(StreamInput):
    """One request's talker hand-off: :class:`AudioSetup` from preprocessing, then the
    thinker's :class:`FrameWithHidden` items (module docstring), and a :class:`StopTail`
    when a stop string cut the reply inside a token (its tokens' rows are their thinker
    embeddings, the layer-0 rows the thinker would have sent). The thinker's
    :class:`GenerationSummary` (the payload) adds nothing.

    Args:
        model: the loaded talker (and config).
        embed_tokens: the thinker's token embedding (on the talker's device).
        start_tokens: reply tokens before the talker starts (>= 2).
    """

    def __init__(self, model: LoadedOmni, embed_tokens: nn.Embedding, start_tokens: int) -> None:
        self.model, self.embed_tokens, self.start_tokens = model, embed_tokens, start_tokens
        self.setup: AudioSetup | None = None
        self.tokens: list[int] = []
        # layer-0 and accept_hidden_layer rows [n, Ht] per chunk: until the start all of
        # them (the prompt reads both), after it the layer-0 rows not yet appended
        self.embeds: list[torch.Tensor] = []
        self.hidden: list[torch.Tensor] = []
        self.started = False

    def on_payload(self, payload: StagePayload) -> RowFeed:
        return RowFeed()

    def on_chunk(self, chunk: StreamChunk) -> RowFeed:
        data = chunk.data
        if isinstance(data, AudioSetup):
            self.setup = data
        elif isinstance(data, FrameWithHidden):
            # the thinker's rows, moved once to the talker's device (split placement)
            hidden = data.hidden.to(self.embed_tokens.weight.device)
            self.embeds.append(hidden[:, 0])
            if not self.started:
                self.hidden.append(hidden[:, 1])
            if data.frame is not None:
                self.tokens.append(int(data.frame[0, 0]))
        elif isinstance(data, StopTail):
            with torch.inference_mode():
                rows = self.embed_tokens(upload(data.token_ids, self.embed_tokens.weight.device))
            self.embeds.append(rows)
            if not self.started:
                # a reply token's accept_hidden_layer row is never read by the talker's
                # prompt (only the prompt's media positions' are); it keeps the row count
                self.hidden.append(rows)
            self.tokens.extend(data.token_ids.tolist())
        else:
            # CodeFrames: the thinker ran without return_hidden, so the talker has no prompt
            raise TypeError(
                f"the talker takes AudioSetup and FrameWithHidden items, got {type(data).__name__}"
            )
        return self._advance(done=False)

    def on_done(self) -> RowFeed:
        return self._advance(done=True)

    @torch.inference_mode()
    def _advance(self, done: bool) -> RowFeed:
        if self.setup is None:
            if done:
                raise ValueError("the talker's setup never arrived")
            return RowFeed()
        if done and not self.started and not self.tokens:
            return RowFeed(empty=True)  # the reply has no text (a stop string cut it to none): no speech
        start, rows = None, None
        if not self.started and (len(self.tokens) >= self.start_tokens or done):
            start = self._start(int(self.setup.prompt_ids.shape[0]))
        if self.started and self.embeds:
            rows = self.model.talker.text_projection(torch.cat(self.embeds))
            self.embeds = []
        if done:
            eos = self._tts_eos()
            rows = eos if rows is None else torch.cat((rows, eos))
        cap = talker_frame_cap(len(self.tokens)) if done else None  # the reply is known
        return RowFeed(start, rows, done, max_new_tokens=cap)

    def _start(self, length: int) -> GenerationInput:
        """The talker's request from the prompt and the first reply token's rows; the
        later fed rows stay in ``self.embeds`` to be appended.

        Raises: ValueError: the thinker never fed back a reply token (its reply is empty,
        or ``max_tokens`` 1 cut it)."""
        setup, model = self.setup, self.model
        assert setup is not None and model.talker is not None
        embeds, hidden = torch.cat(self.embeds), torch.cat(self.hidden)
        if embeds.shape[0] < length + 1:
            raise ValueError(
                "the talker needs a reply token fed back by the thinker (max_tokens >= 2, a non-empty reply)"
            )
        # the prompt reads the reply ids' count only: the first reply token and the next one
        reply = self.tokens[:2] if len(self.tokens) >= 2 else self.tokens + [model.config.im_end_id]
        rows = ThinkerRows(
            setup.prompt_ids, torch.tensor(reply), embeds[: length + 1], hidden[: length + 1]
        )
        prompt = build_talker_prompt(
            model.talker, self.embed_tokens, model.config, rows, setup.voice, setup.layout
        )  # fmt: skip
        self.started, self.embeds, self.hidden = True, [embeds[length + 1 :]], []
        code0, predictor = talker_sampling_params(model.talker, setup.sampling, setup.seed)
        return GenerationInput(
            # step_rows[:-1] is empty here (one reply token fed); the later rows are appended
            prompt.prefill, code0, setup.max_frames, step_rows=prompt.step_rows[:-1], pad_embed=prompt.tts_pad,
            more_rows=True, positions=prompt.positions.positions, rope_delta=float(prompt.positions.delta),
            predictor_sampling=predictor,
        )  # fmt: skip

    def _tts_eos(self) -> torch.Tensor:
        model = self.model
        ids = upload([model.config.tts_eos_id], model.talker.codec_head.weight.device)
        return model.talker.text_projection(self.embed_tokens(ids))


def create_talker_stage(
    ctx: StageBuildContext,
    max_num_seqs: int = 16,
    kv_cache_bytes: int | None = None,
    mem_fraction_static: float = EngineConfig.mem_fraction_static,
    max_model_len: int = MAX_MODEL_LEN,
    talker_start_tokens: int = 2,
    load_format: LoadFormat = "safetensors",
    cuda_graphs: bool = True,
    own_stream: bool = False,
    max_prefill_tokens: int = EngineConfig.max_prefill_tokens,
    cuda_graph_prefill_tokens: tuple[int, ...] | None = None,
) -> ARScheduler:
    """The talker + code predictor on the AR engine, fed by the thinker's stream.

    Sampling: the request's :class:`TalkerSampling` (the reference's by default) and seed
    (:func:`talker_sampling_params`). ``cuda_graphs``, ``kv_cache_bytes``,
    ``mem_fraction_static``, ``own_stream``, ``max_prefill_tokens``,
    ``cuda_graph_prefill_tokens``: see :func:`engine_config`.

    Raises: ValueError (before the weights load): ``talker_start_tokens < 2``, or a bad
    engine knob (naming the field)."""
    if talker_start_tokens < 2:
        raise ValueError(
            "talker_start_tokens must be >= 2 (the prompt ends with the first reply token)"
        )
    config = engine_config(max_num_seqs, kv_cache_bytes, max_model_len, cuda_graphs, (), talker_step_rows(max_num_seqs),
                           mem_fraction_static, own_stream, max_prefill_tokens, cuda_graph_prefill_tokens)  # fmt: skip
    model = loaded_model(_model_path(ctx), torch.device(ctx.stage.device), load_format, language_parts(ctx))
    assert model.talker is not None
    talker = model.talker
    embed = model.thinker.model.embed_tokens if model.thinker is not None else model.thinker_embed
    assert embed is not None  # language_parts loads one or the other
    engine = AREngine(TalkerEngineModel(talker), replace(config, graph_sampling=step_variants(talker_graph_sampling(talker))))
    return ARScheduler(
        engine, stream_input=lambda request_id: TalkerFeed(model, embed, talker_start_tokens)
    )


# --------------------------------------------------------------------------- code2wav


def load_code2wav(
    model_path: str, device: torch.device, load_format: LoadFormat, seed: int = 0
) -> Code2Wav:
    """code2wav (fp32) from the checkpoint's ``code2wav.`` tensors, or with ``"dummy"`` the
    random weights ``init-random`` writes with ``seed``.

    Raises: CheckpointWeightsError: tensors missing or of the wrong shape."""
    model = load_model(
        model_path, device, torch.float32, parts=("code2wav",), load_format=load_format, seed=seed
    )
    assert model.code2wav is not None
    return model.code2wav


def create_code2wav_stage(
    ctx: StageBuildContext,
    num_slots: int = 16,
    ramp: tuple[int, ...] = (1, 2, 4),
    steady: int = 8,
    load_format: LoadFormat = "safetensors",
    cuda_graphs: bool = True,
    channels_last: bool = False,
) -> VocoderScheduler:
    """code2wav through the shared streaming vocoder (exact streaming, chunk ramp).
    ``cuda_graphs`` (on CUDA only): chunk decodes replay a CUDA graph per (batch bucket up to
    ``num_slots``, chunk of 1..8 frames), captured at start-up
    (:meth:`~omnistage.engine.vocoder_arena.StreamingDecoderArena.capture_graphs`); eager
    decoding held 20% of a c=64 server's busy samples, all of them on the code2wav thread
    (H200, 30B-A3B, ``benchmarks/results/qwen3_omni_served.json``, 2026-12-02).
    ``channels_last``: the vocoder's activations channels-last, as Qwen3-TTS's vocoder stage
    takes it (:meth:`~omnistage.engine.causal_vocoder.CarriedStateVocoder.to_channels_last`;
    the same layers; off by default, not yet timed on a GPU)."""
    device = torch.device(ctx.stage.device)
    code2wav = load_code2wav(_model_path(ctx), device, load_format)
    if channels_last:
        code2wav.to_channels_last()
    arena = StreamingDecoderArena(code2wav, num_slots)
    if device.type == "cuda" and cuda_graphs:
        arena.capture_graphs()
    return VocoderScheduler(arena, SAMPLE_RATE, ChunkPlan(tuple(ramp), steady))
