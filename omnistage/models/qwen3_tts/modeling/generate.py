"""The unbatched reference generation loop: one request, a dense KV cache, plain Python.

It is the oracle the engine's batched decoding is tested against and the path of the
parity tests; it is not the serving path. Semantics of the reference's ``generate`` (digest
section 5):

- code 0 is sampled from the talker's logits with the repetition penalty over the code-0 ids
  generated so far, codec ids ``vocab - 1024 .. vocab - 1`` suppressed except EOS, and EOS
  masked until ``min_new_tokens`` (2) ids were generated;
- a non-EOS code 0 is completed to a frame by the code predictor (no penalty, no EOS) and
  the frame's embedding plus the next trailing-text row (or tts_pad) is fed back;
- EOS ends the request ("stop") and is neither fed back nor returned; ``max_new_frames``
  frames end it with "length".

Greedy: temperature 0 for the talker (the penalty still applies, as in the reference) and
argmax for the predictor. Sampled mode uses :mod:`omnistage.engine.sampler` (seeded,
batch-independent draws), so it matches the engine, not the reference's ``torch.multinomial``.

Length accounting: the reference's ``max_new_tokens = F + 1`` returns the same ``F`` frames
as ``max_new_frames = F`` here (its last sampled code 0 is never completed to a frame).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from omnistage.engine.sampler import SamplingBatch, SamplingParams, sample
from omnistage.models.qwen3_tts.modeling.config import GenerationConfig, TalkerConfig
from omnistage.models.qwen3_tts.modeling.prompt import TalkerPrompt
from omnistage.models.qwen3_tts.modeling.talker import SampleFn, Talker, greedy_sample

__all__ = ["GenerationResult", "TalkerSampling", "generate", "talker_sampling_params"]

MIN_NEW_TOKENS = 2  # the reference's generate() hard-codes it
SUPPRESSED_CODEC_IDS = 1024  # the top 1024 codec ids are control/speaker/language ids


@dataclass(frozen=True)
class TalkerSampling:
    """Sampling of one request: talker (code 0) and predictor (codes 1..15).

    ``greedy()`` gives the parity setting; :meth:`from_generation_config` the checkpoint's
    defaults.
    """

    temperature: float
    top_k: int
    top_p: float
    repetition_penalty: float
    sub_temperature: float
    sub_top_k: int
    sub_top_p: float
    seed: int = 0

    @classmethod
    def greedy(cls, repetition_penalty: float = 1.05) -> TalkerSampling:
        """Argmax everywhere; the reference applies its repetition penalty (1.05) even then."""
        return cls(0.0, 0, 1.0, repetition_penalty, 0.0, 0, 1.0)

    @classmethod
    def from_generation_config(cls, gen: GenerationConfig, seed: int = 0) -> TalkerSampling:
        """The checkpoint's defaults (``do_sample`` false means temperature 0)."""
        return cls(
            temperature=gen.temperature if gen.do_sample else 0.0,
            top_k=gen.top_k,
            top_p=gen.top_p,
            repetition_penalty=gen.repetition_penalty,
            sub_temperature=gen.subtalker_temperature if gen.subtalker_dosample else 0.0,
            sub_top_k=gen.subtalker_top_k,
            sub_top_p=gen.subtalker_top_p,
            seed=seed,
        )


@dataclass(frozen=True)
class GenerationResult:
    """``codes [T, 16] int64`` (generated frames only; ICL reference codes not included)
    and why generation ended."""

    codes: torch.Tensor
    finish_reason: Literal["stop", "length"]


def talker_sampling_params(config: TalkerConfig, sampling: TalkerSampling) -> SamplingParams:
    """The engine sampler's settings for code 0 (suppressed range, EOS, min_new_tokens)."""
    vocab, eos = config.decoder.vocab_size, config.codec_eos_id
    return SamplingParams(
        temperature=sampling.temperature,
        top_k=sampling.top_k,
        top_p=sampling.top_p,
        repetition_penalty=sampling.repetition_penalty,
        min_new_tokens=MIN_NEW_TOKENS,
        stop_token_ids=(eos,),
        suppress_ranges=((vocab - SUPPRESSED_CODEC_IDS, eos), (eos + 1, vocab)),
        seed=sampling.seed,
    )


def _predictor_sampler(talker: Talker, sampling: TalkerSampling, device: torch.device) -> SampleFn:
    if sampling.sub_temperature == 0.0:
        return greedy_sample
    params = SamplingParams(
        temperature=sampling.sub_temperature,
        top_k=sampling.sub_top_k,
        top_p=sampling.sub_top_p,
        seed=(sampling.seed + 1) % 2**31,  # a stream of its own, apart from code 0's
    )
    batch = SamplingBatch.build([params], talker.code_predictor.model.config.vocab_size, device)

    def draw(group_index: int, logits: torch.Tensor) -> torch.Tensor:
        token = sample(logits, batch)
        batch.record(token)  # advances the draw counter; the penalty is off (1.0)
        return token

    return draw


@torch.no_grad()
def generate(talker: Talker, prompt: TalkerPrompt, sampling: TalkerSampling, max_new_frames: int) -> GenerationResult:
    """Generate frames for one prompt.

    Args:
        talker: loaded talker (any device/dtype; logits are sampled in fp32).
        prompt: from :class:`~omnistage.models.qwen3_tts.modeling.prompt.PromptBuilder`.
        sampling: :meth:`TalkerSampling.greedy` for parity.
        max_new_frames: cap on returned frames (>= 1).

    Raises:
        ValueError: ``max_new_frames < 1``.
    """
    if max_new_frames < 1:
        raise ValueError("max_new_frames must be >= 1")
    device, dtype = prompt.prefill.device, prompt.prefill.dtype
    length = prompt.prefill.shape[0]
    cache = talker.model.new_dense_cache(1, length + max_new_frames, dtype, device)
    predictor_cache = talker.code_predictor.new_cache(1, dtype, device)
    code0_batch = SamplingBatch.build([talker_sampling_params(talker.config, sampling)], talker.config.decoder.vocab_size, device)
    sample_rest = _predictor_sampler(talker, sampling, device)
    eos = talker.config.codec_eos_id

    cache.prepare(length)
    hidden = talker(prompt.prefill, torch.arange(length, device=device), cache)[-1:]
    frames: list[torch.Tensor] = []
    for step in range(max_new_frames):
        code0 = sample(talker.codec_logits(hidden), code0_batch)
        if int(code0) == eos:
            return GenerationResult(_stack(frames, talker, device), "stop")
        code0_batch.record(code0)
        frame = talker.complete_frame(hidden, code0, sample_rest, predictor_cache)
        frames.append(frame[0])
        if step + 1 == max_new_frames:
            break
        feedback = talker.frame_embedding(frame) + prompt.text_row(step)
        cache.prepare(1)
        hidden = talker(feedback, torch.tensor([length + step], device=device), cache)
    return GenerationResult(_stack(frames, talker, device), "length")


def _stack(frames: list[torch.Tensor], talker: Talker, device: torch.device) -> torch.Tensor:
    if frames:
        return torch.stack(frames)
    return torch.zeros(0, talker.config.num_code_groups, dtype=torch.int64, device=device)
