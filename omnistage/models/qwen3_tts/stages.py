"""Stage factories of the Qwen3-TTS pipeline (seed 000): [reference_encoder ->]
preprocessing -> tts_engine -> vocoder.

- ``reference_encoder`` (Base checkpoints only; the stock batching scheduler): the
  request's reference clip -> x-vector + reference codes (:class:`ReferenceEncoder`),
  clips of concurrent requests in one batch, cached by content.
- ``preprocessing`` (batched): the typed request -> the talker prompt (a
  :class:`TalkerStart`: the whole :class:`~omnistage.engine.sequence.GenerationInput`, or
  for a request whose text is still arriving the prompt before its text), built without
  waiting for the device: it launches on the CUDA stream the engine's steps are queued
  on (:class:`~.modeling.prompt.PromptBuilder`); the requests waiting are built together.
  It also streams the vocoder its setup (first chunk size, the ICL reference codes as left
  context, on the host, stream or not) at once, so the vocoder is ready before the first
  frame.
- ``tts_engine`` (the AR engine): one frame of 16 codes per step, each streamed to the
  vocoder as it exists; the client's text of a live request enters here while it runs
  (:mod:`.live_text`); its result (a summary: the frames travelled already) becomes the
  vocoder's payload, and the framework carries its finish_reason ("length") to the client.
- ``vocoder`` (terminal, streaming): exact incremental decoding, chunk ramp 1, 2, 4, 8.

Build order: the vocoder is listed first in the pipeline config, so its weights, state
arena and CUDA graphs are resident before the engine sizes its KV pool from the free
device memory (``mem_fraction_static``).
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from omnistage.core.lru import BoundedLRU
from omnistage.core.messages import StagePayload
from omnistage.engine.engine import AREngine, EngineConfig
from omnistage.engine.model_runner import StepSampling
from omnistage.engine.sampler import SamplerFeatures
from omnistage.engine.sequence import GenerationInput
from omnistage.engine.vocoder_arena import (
    DEFAULT_CONTEXT_CACHE_SIZE,
    DEFAULT_GRAPH_CONTEXT_LENGTHS,
    StreamingDecoderArena,
)
from omnistage.models.qwen3_tts.capabilities import MAX_MODEL_LEN, SAMPLE_RATE, Qwen3TTSModelFacts
from omnistage.models.qwen3_tts.engine_model import Qwen3TTSEngineModel
from omnistage.models.qwen3_tts.live_text import LiveTextFeed
from omnistage.models.qwen3_tts.modeling.prompt import PromptBuilder, PromptHead
from omnistage.models.qwen3_tts.modeling.speaker_encoder import SpeakerEncoder
from omnistage.models.qwen3_tts.modeling.speech_tokenizer.decoder import load_decoder
from omnistage.models.qwen3_tts.modeling.speech_tokenizer.encoder import (
    SpeechTokenizerEncoder,
    load_encoder,
)
from omnistage.models.qwen3_tts.modeling.weights import (
    LoadedCheckpoint,
    default_dtype,
    load_checkpoint,
)
from omnistage.models.qwen3_tts.payload_types import (
    EncodedReference,
    LivePrompt,
    Qwen3TTSRequest,
    Qwen3TTSSampling,
    SamplingOverrides,
    TalkerStart,
)
from omnistage.models.qwen3_tts.request_builders import (
    REFERENCE_MIN_NEW_TOKENS,
    resolve_sampling,
    sampling_params,
)
from omnistage.pipeline.stage import StageBuildContext
from omnistage.scheduling import SimpleScheduler
from omnistage.scheduling.ar import ARScheduler
from omnistage.scheduling.base import ItemFailure
from omnistage.scheduling.vocoder import ChunkPlan, VocoderScheduler, VocoderSetup


def resolve_device(ctx: StageBuildContext) -> torch.device:
    """The stage's ``device`` (``--<stage>.device``).

    Raises:
        ValueError: CUDA asked for but not available.
    """
    device = ctx.stage.device
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available")
    return resolved


@lru_cache(maxsize=2)
def loaded_checkpoint(model_path: str, device: torch.device) -> LoadedCheckpoint:
    """The checkpoint, loaded once per process and device (preprocessing and tts_engine
    share the talker's weights), with the talker's projections fused for serving (same
    values, ~30 kernels fewer per layer)."""
    checkpoint = load_checkpoint(model_path, device)
    checkpoint.model.talker.fuse_projections()
    return checkpoint


def _model_path(ctx: StageBuildContext) -> str:
    assert ctx.pipeline.model_path is not None, "the Qwen3-TTS pipeline needs model_path"
    return ctx.pipeline.model_path


# --------------------------------------------------------------------------- preprocessing


class ReferenceEncoder:
    """x-vectors and reference codes of voice-clone clips, a batch at a time, cached by
    content (the compute of the ``reference_encoder`` stage, which the stock batching
    scheduler feeds).

    Cache: keyed by the clip's content key (:attr:`Qwen3TTSRequest.ref_key`, the SHA-256
    the request builder took of what the request sent, so it is not hashed again here;
    architecture rule 8: a key derived from content, so one user's voice can never be
    served for another's clip); ``cache_size`` entries, least recently used out first
    (:class:`~omnistage.core.lru.BoundedLRU`; a batch's clips are the most recent, the
    bound enforced after the whole batch). A hit skips both encoders (the "cached
    reference" case of time to first audio).

    Batching: the clips of a batch not in the cache are encoded together, the
    speech-tokenizer encoder in one zero-padded batch (as the reference implementation's
    batched encode does; a clip whose length is not a multiple of 1,920 samples can get
    other codes in its last frame than alone: a 3.0 s clip beside a 10 s one did, on the
    tiny checkpoint), the speaker encoder clip by clip (padding would change its
    statistics pooling). A clip twice in one batch is encoded once. The
    stage's scheduler holds a batch open for more clips only for a clip to encode
    (:meth:`cached`): a batch of cache hits is answered at once.

    Args:
        speaker_encoder: the checkpoint's ECAPA-TDNN.
        codec_encoder: the speech tokenizer's encoder.
        cache_size: cached clips (0 = no cache).

    Raises:
        ValueError: ``cache_size`` is negative.
    """

    def __init__(self, speaker_encoder: SpeakerEncoder, codec_encoder: SpeechTokenizerEncoder, cache_size: int = 256) -> None:
        self.speaker_encoder, self.codec_encoder, self.cache_size = speaker_encoder, codec_encoder, cache_size
        self._cache: BoundedLRU[str, EncodedReference] = BoundedLRU(max_entries=cache_size)

    def cached(self, key: str) -> bool:
        """Whether the clip of content key ``key`` is in the cache (its encode is a look-up)."""
        return key in self._cache

    @torch.inference_mode()
    def encode(self, clips: list[np.ndarray], keys: list[str]) -> list[EncodedReference]:
        """``clips``: mono float32 ``[S]`` at 24 kHz each, ``keys`` their content keys
        (equal keys: equal clips) -> their x-vectors and reference codes, in order.

        Raises:
            ValueError / RuntimeError: the encoders failed (on the whole batch).
        """
        known = {key: entry for key in keys if (entry := self._cache.get(key)) is not None}
        missing = {key: clip for key, clip in zip(keys, clips, strict=True) if key not in known}
        fresh = dict(zip(missing, self._encode(list(missing.values())), strict=True)) if missing else {}
        results = [known[key] if key in known else fresh[key] for key in keys]
        self._cache.put_many(zip(keys, results, strict=True))  # the batch's are the most recent
        return results

    def _encode(self, clips: list[np.ndarray]) -> list[EncodedReference]:
        device = next(self.codec_encoder.parameters()).device
        tensors = [torch.tensor(c, dtype=torch.float32, device=device) for c in clips]  # clips may be read-only
        codes = self.codec_encoder.encode_batch(tensors)
        # the codes go to the host once here (the reference stage's sync), not on the
        # vocoder's or the engine's thread: the prompt copies them back, the vocoder
        # hashes them (its left-context cache) and copies them in on its own stream
        return [EncodedReference(self.speaker_encoder.embed(t), c.cpu()) for t, c in zip(tensors, codes, strict=True)]


def reference_scheduler(encoder: ReferenceEncoder, max_batch_size: int, max_batch_wait_ms: float) -> SimpleScheduler:
    """The stock batching scheduler over ``encoder``: a request's payload is its
    :class:`EncodedReference`. Only a clip not in the cache holds a batch open for
    ``max_batch_wait_ms`` (a hit gains nothing from company: at concurrency 1 every
    cached-reference request waited the whole 2 ms)."""

    def compute(batch: list[StagePayload]) -> list[EncodedReference]:
        return encoder.encode([p.request.ref_audio for p in batch], [p.request.ref_key for p in batch])

    def to_encode(payload: StagePayload) -> bool:
        return not encoder.cached(payload.request.ref_key)

    return SimpleScheduler(compute, max_batch_size, max_batch_wait_ms, waits_for=to_encode)


def create_reference_encoder_stage(
    ctx: StageBuildContext, max_batch_size: int = 8, max_batch_wait_ms: float = 2.0, cache_size: int = 256
) -> SimpleScheduler:
    """Base checkpoints: the request's reference clip -> :class:`EncodedReference`, clips of
    concurrent requests batched (``max_batch_size`` clips, waiting ``max_batch_wait_ms``
    for more after the first when a clip of the batch is not cached)."""
    model_path, where = _model_path(ctx), resolve_device(ctx)
    checkpoint = loaded_checkpoint(model_path, where)
    assert checkpoint.model.speaker_encoder is not None, "a Base checkpoint has a speaker encoder"
    codec_encoder = load_encoder(Path(model_path) / "speech_tokenizer", where)
    return reference_scheduler(ReferenceEncoder(checkpoint.model.speaker_encoder, codec_encoder, cache_size), max_batch_size, max_batch_wait_ms)


def create_preprocessing_stage(ctx: StageBuildContext, max_batch_size: int = 64, head_cache_mib: float = 64.0) -> SimpleScheduler:
    """Requests (and, for Base, their :class:`EncodedReference`) -> :class:`TalkerStart` s
    (and each one's vocoder setup, streamed before its result), for up to
    ``max_batch_size`` waiting requests at once: the ids of a batch's prompts go up in one
    copy and through the text embedding at once
    (:meth:`~.modeling.prompt.PromptBuilder.whole_many`: the same prompts as built alone).

    Why one thread and not one request per worker thread (benchmarks/README.md, "Device runs
    of 2026-12-07, fifth session"): a prompt's work is launches and host-to-device copies,
    0.93 ms of a thread's CPU per voice-clone prompt on an H100 host, holding the GIL
    between its ~27 torch calls; eight workers took a request through in the same time as
    two (18.0 against 4.6 ms each at concurrency 128, about 2.3 ms a request either way,
    ``results/qwen3_tts_gpu_0.6b_compare_layouts.json``), so a burst of 128 requests
    queued here about 0.3 s whatever the worker count. Served on an H100 at concurrency
    128, one batching thread against the eight workers: TTFA p50 533 against 717 ms, p99
    807 against 1,005, mostly through the engine, whose prefill steps no longer contend
    with eight threads for the GIL (47.9 against 182.7 ms each;
    ``results/qwen3_tts_gpu_0.6b_compare_batched_prefill_graphs.json``).

    A voice's prompt head (everything before the text: :class:`PromptHead`) is kept, up to
    ``head_cache_mib`` MiB of its tensors (0: none; a voice-clone head of a 3 s reference
    is about 100 KB at the 0.6B's width, an instruction of 2,000 characters a few MB),
    keyed by what it is made of (:func:`head_key`), so a known voice's request builds only
    its text: about half of a voice-clone prompt's torch calls (``host_cost.py --prompt``).
    A clone's kept head is used only by a request that carries the very
    :class:`EncodedReference` it was built from (the reference encoder's cache hit): a clip
    encoded again (out of that cache) may get other codes, since the encoder's batches are
    zero-padded, and then its head is built again, so every request's prompt is built from
    its own encoding.

    A request the builder rejects (``ValueError``: an unknown language or an empty text,
    say; the request builder refuses these before admission) fails alone; any other error
    fails the batch (the scheduler's batch boundary)."""
    model_path = _model_path(ctx)
    where = resolve_device(ctx)
    checkpoint = loaded_checkpoint(model_path, where)
    builder = PromptBuilder(checkpoint.model.talker, checkpoint.config, checkpoint.tokenizer)
    facts, defaults = Qwen3TTSModelFacts.from_config(checkpoint.config), checkpoint.generation
    heads: BoundedLRU[tuple, tuple[EncodedReference | None, PromptHead]] = BoundedLRU(
        max_cost=int(head_cache_mib * 2**20), cost=_head_bytes
    )

    def known_head(reference: EncodedReference | None, request: Qwen3TTSRequest) -> PromptHead:
        key = head_key(request)
        kept = heads.get(key)
        if kept is not None and kept[0] is reference:
            return kept[1]
        head = _head(builder, reference, request)
        heads.put(key, (reference, head))
        return head

    @torch.inference_mode()
    def compute(batch: list[StagePayload]) -> list[TalkerStart | ItemFailure]:
        outputs: dict[int, TalkerStart | ItemFailure] = {}
        whole: list[tuple[int, PromptHead, list[int], list[int], Qwen3TTSRequest, Qwen3TTSSampling]] = []
        for index, payload in enumerate(batch):
            request: Qwen3TTSRequest = payload.request
            try:
                head = known_head(payload.data, request)
                sampling = resolve_sampling(request, defaults, facts)
                if not request.more_text:
                    role_ids, ids = request.target_ids
                    if not ids:
                        raise ValueError("text is empty: no tokens to speak")
                    whole.append((index, head, role_ids, ids, request, sampling))
                    continue
            except ValueError as exc:
                outputs[index] = ItemFailure(exc)
                continue
            # its input tokens are the prompt's positions before the text (still coming)
            known = head.positions_before_text
            setup = VocoderSetup(request.initial_codec_chunk_frames or 0, head.ref_codes, request.stream, known)
            scheduler.outbox.stream(payload.request_id, setup)
            text_cap_limit = defaults.max_new_tokens if request.max_new_tokens is None else None
            outputs[index] = TalkerStart(live=LivePrompt(head, request.text, sampling, request.min_new_tokens, text_cap_limit))
        prompts = builder.whole_many([(head, role_ids, ids) for _, head, role_ids, ids, _, _ in whole]) if whole else []
        for (index, _, _, _, request, sampling), prompt in zip(whole, prompts, strict=True):
            positions = prompt.prefill.shape[0] + prompt.step_rows.shape[0]
            setup = VocoderSetup(request.initial_codec_chunk_frames or 0, prompt.ref_codes, request.stream, positions)
            scheduler.outbox.stream(batch[index].request_id, setup)
            outputs[index] = TalkerStart(whole=GenerationInput(
                prompt=prompt.prefill,
                sampling=sampling.talker,
                max_new_tokens=sampling.max_new_tokens,
                step_rows=prompt.step_rows if prompt.step_rows.shape[0] else None,
                pad_embed=prompt.tts_pad,
                predictor_sampling=sampling.code_predictor,
                # a voice's prompt begins with the same rows every time (role, speaker,
                # reference): the engine computes their KV once (prefix caching)
                cache_prompt=True,
            ))  # fmt: skip
        return [outputs[index] for index in range(len(batch))]

    scheduler = SimpleScheduler(compute, max_batch_size)
    return scheduler


def head_key(request: Qwen3TTSRequest) -> tuple:
    """What ``request``'s :class:`PromptHead` is made of (architecture rule 8): the mode,
    the language, the CustomVoice speaker, the instructions, the text mode, and for a clone
    the reference clip's content key and, in ICL mode, its transcript. A clone's head also
    depends on the clip's :class:`EncodedReference`, which the preprocessing stage checks
    by identity."""
    clone = (request.ref_key, request.ref_text if request.icl else None) if request.model_type == "base" else None
    return (request.model_type, request.language, request.voice, request.instructions, request.non_streaming_mode, clone)


def _head_bytes(kept: tuple[EncodedReference | None, PromptHead]) -> int:
    """A kept head's tensors (device rows, the reference codes on the host; its shared
    special rows are the builder's), bytes."""
    reference, head = kept
    tensors = (*head.instructions, head.codec_rows, head.icl_codec)
    if reference is not None:
        tensors += (reference.x_vector, reference.ref_codes)
    return sum(t.nbytes for t in tensors if t is not None)


def _head(builder: PromptBuilder, reference: EncodedReference | None, request: Qwen3TTSRequest) -> PromptHead:
    """The talker prompt of ``request``'s mode before its text (shared/reference/qwen3-tts.md,
    section 4)."""
    non_streaming_mode = request.non_streaming_mode
    if request.model_type == "custom_voice":
        assert request.voice is not None
        return builder.custom_voice_head(request.voice, request.language, request.instructions, non_streaming_mode)
    if request.model_type == "voice_design":
        assert request.instructions is not None
        return builder.voice_design_head(request.instructions, request.language, non_streaming_mode)
    assert reference is not None, "Base pipelines run the reference_encoder stage first"
    x_vector, ref_codes = reference.x_vector, reference.ref_codes
    if request.icl:
        return builder.voice_clone_head(x_vector, request.language, request.ref_text, ref_codes, non_streaming_mode)
    return builder.voice_clone_head(x_vector, request.language, non_streaming_mode=non_streaming_mode)


# --------------------------------------------------------------------------- tts_engine


PREFILL_GRAPH_TOKENS = (16, 32, 64, 128, 256, 512, 1024)
"""The tts_engine's prefill graph buckets by default (with ``max_prefill_tokens`` 1024): a
burst of arrivals is prefilled a graph replay per step, up to 1,024 computed tokens (about
60 known-voice requests), where the engine's default buckets stop at 128 and a larger step
ran eagerly. On an H100 at 128 concurrent streams that made a burst's mixed steps 15.7-33.2
ms against 47.9-70.0 (benchmarks/README.md, "Device runs of 2026-12-07, sixth session")."""


def _prefill_buckets(given: tuple[int, ...] | None, max_prefill_tokens: int) -> tuple[int, ...]:
    if given is not None:
        return given
    return tuple(t for t in PREFILL_GRAPH_TOKENS if t <= max_prefill_tokens)


def create_tts_engine_stage(
    ctx: StageBuildContext,
    max_num_seqs: int | None = None,
    mem_fraction_static: float = 0.5,
    kv_cache_bytes: int | None = None,
    block_size: int = 16,
    prefill_hold_ms: float = 5.0,
    max_model_len: int = MAX_MODEL_LEN,
    max_prefill_tokens: int = 1024,
    cuda_graphs: bool = True,
    cuda_graph_prefill_tokens: tuple[int, ...] | None = None,
    prefix_caching: bool = True,
    overlap: bool | None = None,
) -> ARScheduler:
    """The talker + code predictor on the AR engine.

    ``max_num_seqs``: running requests at most; None is 64 on CUDA and 4 on CPU (a CPU
    runs few streams at once, and 4 keeps the real 0.6B's fp32 CPU pool at 15 GB of
    address space).
    KV pool (:func:`~omnistage.engine.kv_cache.kv_pool_blocks`): ``kv_cache_bytes`` when
    given; else ``max_num_seqs`` requests of ``max_model_len`` tokens, on CUDA at most
    ``mem_fraction_static`` of the device memory free once every stage before this one (the
    vocoder) is built; on CPU committed as tokens are written (a tiny checkpoint: 256 bytes
    per token; the real 0.6B in fp32: 229 KB).
    ``max_model_len``: prompt + frames per request at most (:data:`MAX_MODEL_LEN`; the
    request builder refuses a request over it before any model work).
    ``max_prefill_tokens``: prompt tokens computed per prefill step at most (a burst of
    arrivals is prefilled this many tokens a step; a longer single prompt runs alone).
    ``cuda_graph_prefill_tokens``: the prefill buckets captured as CUDA graphs, in tokens
    computed by one prefill step (each at most ``max_prefill_tokens``; () for none); None:
    :data:`PREFILL_GRAPH_TOKENS` up to ``max_prefill_tokens``. A prefill step of more
    tokens than the largest runs eagerly. Ignored without ``cuda_graphs`` (no graphs at
    all). A bad value fails the stage's build before the weights load (ValueError naming
    the field).
    ``prefix_caching``: the KV of full blocks of prompt rows is shared between requests
    whose prompts begin with the same rows (a known voice's prefix is not prefilled
    again; keyed by the rows' content).
    ``overlap``: the engine launches step t+1 before it reads step t's frames, and a
    prefill step also decodes the running streams (the same frames, each handed on a step
    later; :attr:`~omnistage.engine.engine.EngineConfig.overlap`); None: on CUDA.
    """
    where = resolve_device(ctx)
    if max_num_seqs is None:
        max_num_seqs = 64 if where.type == "cuda" else 4
    # checked before the weights load: a bad knob fails the start at once
    config = EngineConfig(
        kv_cache_bytes=kv_cache_bytes,
        mem_fraction_static=mem_fraction_static,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        # one request's step rows are at most max_model_len (the request builder checks
        # it), so the shared pool always holds at least one request
        num_step_rows=max(EngineConfig.num_step_rows, max_model_len),
        max_prefill_tokens=max_prefill_tokens,
        prefill_hold_ms=prefill_hold_ms,
        cuda_graph_batch_sizes=None if cuda_graphs else (),
        cuda_graph_prefill_tokens=_prefill_buckets(cuda_graph_prefill_tokens, max_prefill_tokens) if cuda_graphs else (),
        prefix_caching=prefix_caching,
        overlap=overlap,
    )
    checkpoint = loaded_checkpoint(_model_path(ctx), where)
    config = dataclasses.replace(config, graph_sampling=_default_step_sampling(checkpoint))
    builder = PromptBuilder(checkpoint.model.talker, checkpoint.config, checkpoint.tokenizer)
    engine = AREngine(Qwen3TTSEngineModel(checkpoint.model.talker), config)
    return ARScheduler(engine, stream_input=lambda request_id: LiveTextFeed(builder))


def _default_step_sampling(checkpoint: LoadedCheckpoint) -> tuple[StepSampling, ...]:
    """The graph variants of the checkpoint's default sampling and of greedy requests
    (``temperature: 0``): captured at start-up, so neither pauses a live request."""
    facts = Qwen3TTSModelFacts.from_config(checkpoint.config)
    variants = []
    for overrides in (SamplingOverrides(), SamplingOverrides(temperature=0.0)):
        talker, predictor = sampling_params(overrides, 0, REFERENCE_MIN_NEW_TOKENS, checkpoint.generation, facts)
        variants.append(StepSampling(SamplerFeatures.of([talker]), SamplerFeatures.of([predictor])))
    return tuple(variants)


# --------------------------------------------------------------------------- vocoder


def create_vocoder_stage(
    ctx: StageBuildContext,
    num_slots: int = 64,
    ramp: tuple[int, ...] = (1, 2, 4),
    steady: int = 8,
    cuda_graphs: bool = True,
    left_context_cache_size: int = DEFAULT_CONTEXT_CACHE_SIZE,
    channels_last: bool | None = None,
) -> VocoderScheduler:
    """The speech-tokenizer decoder, streaming (bf16 on CUDA, fp32 on CPU). ``num_slots``:
    concurrent streams with decoder state (more wait for a slot, buffering frames);
    ``left_context_cache_size``: decoder states after a voice clone's reference codes,
    cached by their content (0: decode the reference codes for every stream).
    ``channels_last``: the decoder's activations as channels-last ``[B, C, 1, L]`` tensors
    and its convs as cuDNN's NHWC kernels, without the NCHW <-> NHWC transposes cuDNN adds
    around each conv of a ``[B, C, L]`` input but the one-channel output conv's (6.9 ms of
    a 35.6 ms graph replay at 128 streams x 8 frames on the H100: ``vocoder_all_kernels``
    of benchmarks/results/gpu_share_dense.json); the same audio up to rounding
    (:meth:`~omnistage.engine.causal_vocoder.CarriedStateVocoder.to_channels_last`).
    None (the default): channels-last on CUDA with ``cuda_graphs``, where it was measured
    faster (H100, torch 2.11, graph replays: 128 streams x 8 frames 36.3 -> 28.6 ms, 16 x 8
    7.4 -> 6.0 ms, 1 x 1 2.32 -> 2.05 ms; benchmarks/results/vocoder_gpu_layouts.json),
    ``[B, C, L]`` otherwise (eager decoding, launch-bound at small batches, was slower
    channels-last there: 1 stream x 1 frame 13.4 -> 19.1 ms, 1 x 8 14.0 -> 19.9 ms, though
    128 x 8 40.5 -> 32.3 ms). A non-streaming response is decoded eagerly at its end
    (``decode_full``, in 128-frame chunks), in the stage's layout; not timed in either."""
    where = resolve_device(ctx)
    decoder = load_decoder(Path(_model_path(ctx)) / "speech_tokenizer", where, default_dtype(where))
    if channels_last is None:
        channels_last = where.type == "cuda" and cuda_graphs
    if channels_last:
        decoder.to_channels_last()
    arena = StreamingDecoderArena(decoder, num_slots, left_context_cache_size)
    if where.type == "cuda" and cuda_graphs:
        # and longer chunks for a fresh reference's codes: replays of 32 + 6 frames for 3 s
        arena.capture_graphs(context_lengths=DEFAULT_GRAPH_CONTEXT_LENGTHS)
    return VocoderScheduler(arena, SAMPLE_RATE, ChunkPlan(tuple(ramp), steady))
