"""Qwen3-TTS generation through the engine's reference loop
(:func:`omnistage.engine.reference.reference_generate`): one request, unbatched, a dense
KV cache. It is the oracle the engine's batched decoding is tested against (greedy and
seeded sampling) and the path of the parity tests; it is not the serving path. Semantics
of the reference's ``generate`` (digest section 5):

- code 0 is sampled from the talker's logits with the repetition penalty over the code-0 ids
  generated so far, codec ids ``vocab - 1024 .. vocab - 1`` suppressed except EOS, and EOS
  masked until ``min_new_tokens`` (2) ids were generated;
- a non-EOS code 0 is completed to a frame by the code predictor (no penalty, no EOS) and
  the frame's embedding plus the next step row (trailing text, then tts_pad) is fed back;
- EOS ends the request ("stop") and is neither fed back nor returned; ``max_new_frames``
  frames end it with "length".

Greedy: temperature 0 for the talker (the penalty still applies, as in the reference) and
argmax for the predictor. Sampled mode uses :mod:`omnistage.engine.sampler` with the
engine's numbering of the draws (seeded, batch-independent), so it matches the engine, not
the reference's ``torch.multinomial``.

Length accounting: the reference's ``max_new_tokens = F + 1`` returns the same ``F`` frames
as ``max_new_frames = F`` here (its last sampled code 0 is never completed to a frame).
"""

from __future__ import annotations

from dataclasses import dataclass

from omnistage.engine.reference import reference_generate
from omnistage.engine.sampler import SamplingParams
from omnistage.engine.sequence import GenerationInput, GenerationResult
from omnistage.models.qwen3_tts.engine_model import Qwen3TTSEngineModel
from omnistage.models.qwen3_tts.modeling.config import GenerationConfig, TalkerConfig
from omnistage.models.qwen3_tts.modeling.prompt import TalkerPrompt
from omnistage.models.qwen3_tts.modeling.talker import Talker

__all__ = ["TalkerSampling", "generate", "generation_input", "talker_sampling_params"]

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


def generation_input(talker: Talker, prompt: TalkerPrompt, sampling: TalkerSampling, max_new_frames: int) -> GenerationInput:
    """What the engine generates ``prompt`` from with ``sampling`` (as the serving stage
    builds it)."""
    predictor = SamplingParams(
        temperature=sampling.sub_temperature, top_k=sampling.sub_top_k, top_p=sampling.sub_top_p, seed=sampling.seed
    )
    return GenerationInput(
        prompt=prompt.prefill,
        sampling=talker_sampling_params(talker.config, sampling),
        max_new_tokens=max_new_frames,
        step_rows=prompt.step_rows if prompt.step_rows.shape[0] else None,
        pad_embed=prompt.tts_pad,
        predictor_sampling=predictor,
    )


def generate(talker: Talker, prompt: TalkerPrompt, sampling: TalkerSampling, max_new_frames: int) -> GenerationResult:
    """Generate frames for one prompt: ``codes [T, 16] int64`` (generated frames only; ICL
    reference codes not included) and the finish_reason.

    Args:
        talker: loaded talker (any device/dtype; logits are sampled in fp32).
        prompt: from :class:`~omnistage.models.qwen3_tts.modeling.prompt.PromptBuilder`.
        sampling: :meth:`TalkerSampling.greedy` for parity.
        max_new_frames: cap on returned frames (>= 1).

    Raises:
        RequestValidationError: ``max_new_frames < 1``.
    """
    return reference_generate(Qwen3TTSEngineModel(talker), generation_input(talker, prompt, sampling, max_new_frames))
