"""Unbatched reference generation loops (one request, a dense KV cache, plain Python): the
oracle for parity tests and for the engine's batched path, not the serving path.

Thinker: greedy (argmax) decoding until ``eos_id`` or ``max_new_tokens``; it returns what
the talker needs (layer-0 rows and the captured layer's rows of every fed token).

Talker (transformers' ``generate`` of the talker, greedy): code 0 by argmax after the
repetition penalty over the code-0 ids generated so far (1.05 by default, applied even when
greedy, as the reference does) with codec ids ``vocab - 1024 .. vocab - 1`` suppressed except
EOS; a non-EOS code 0 is completed to a frame by the code predictor (greedy) and the frame's
embedding plus the next trailing text row is fed back. ``max_new_frames = F`` returns the
frames of the reference's ``max_new_tokens = F + 1`` (its last code 0 is never completed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from omnistage.engine.attention import DenseKVCache
from omnistage.engine.layers import greedy_sample
from omnistage.engine.sampler import SamplingBatch, SamplingParams, sample
from omnistage.engine.sequence import HiddenAdditions
from omnistage.models.qwen3_omni.modeling.mrope import PromptPositions
from omnistage.models.qwen3_omni.modeling.prompt import TalkerPrompt
from omnistage.models.qwen3_omni.modeling.talker import Talker
from omnistage.models.qwen3_omni.modeling.thinker import Thinker

__all__ = [
    "SUPPRESSED_CODEC_IDS",
    "TalkerResult",
    "ThinkerResult",
    "talker_generate",
    "talker_sampling",
    "thinker_generate",
]

SUPPRESSED_CODEC_IDS = (
    1024  # the top 1024 codec ids are control/speaker ids (the reference's suppress list)
)


@dataclass(frozen=True)
class ThinkerResult:
    """``tokens [G] int64``; ``logits [G, V] float32`` of each step; ``embeds``, ``captured``
    ``[L + G - 1, H]``: layer-0 rows and the captured layer's rows of every token fed."""

    tokens: torch.Tensor
    logits: torch.Tensor
    embeds: torch.Tensor
    captured: torch.Tensor | None
    finish_reason: Literal["stop", "length"]


def _dense_cache(
    layers: int, kv_heads: int, head_dim: int, length: int, like: torch.Tensor
) -> DenseKVCache:
    return DenseKVCache(layers, 1, length, kv_heads, head_dim, dtype=like.dtype, device=like.device)


@torch.no_grad()
def thinker_generate(
    thinker: Thinker,
    input_ids: torch.Tensor,
    positions: PromptPositions,
    max_new_tokens: int,
    eos_id: int,
    input_embeds: torch.Tensor | None = None,
    deepstack: HiddenAdditions | None = None,
    capture_layer: int | None = None,
) -> ThinkerResult:
    """Greedy thinker generation for one prompt.

    Args:
        input_ids: ``[L] int64``.
        positions: :func:`~omnistage.models.qwen3_omni.modeling.mrope.prompt_positions` of it.
        max_new_tokens: >= 1.
        eos_id: ends generation (returned as the last token).
        input_embeds: ``[L, H]`` with encoder rows merged in (default: token embeddings).
        deepstack: visual features of the prompt (rows index the prompt).
        capture_layer: the ``hidden_states`` index to return (talker: ``accept_hidden_layer``).

    Raises: ValueError: ``max_new_tokens < 1``.
    """
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    c = thinker.config.text
    embeds = thinker.embed(input_ids) if input_embeds is None else input_embeds
    length = input_ids.shape[0]
    cache = _dense_cache(c.num_layers, c.num_kv_heads, c.head_dim, length + max_new_tokens, embeds)
    cache.prepare(length)
    capture = () if capture_layer is None else (capture_layer,)
    out = thinker.model.decode(
        embeds, positions.positions.to(embeds.device), cache, deepstack, capture
    )
    rows, captured = [embeds], [out.captured]
    tokens, logits = [], []
    hidden = out.hidden[-1:]
    for step in range(max_new_tokens):
        step_logits = thinker.logits(hidden)[0].float()
        token = step_logits.argmax()
        tokens.append(token)
        logits.append(step_logits)
        if int(token) == eos_id or step + 1 == max_new_tokens:
            break
        x = thinker.embed(token[None])
        cache.prepare(1)
        out = thinker.model.decode(
            x, positions.decode(length + step).to(x.device), cache, capture_layers=capture
        )
        rows.append(x)
        captured.append(out.captured)
        hidden = out.hidden
    return ThinkerResult(
        tokens=torch.stack(tokens),
        logits=torch.stack(logits),
        embeds=torch.cat(rows),
        captured=torch.cat([c[0] for c in captured]) if capture else None,
        finish_reason="stop" if int(tokens[-1]) == eos_id else "length",
    )


@dataclass(frozen=True)
class TalkerResult:
    """``codes [F, G] int64`` and ``first_logits [vocab] float32`` (code-0 logits after the
    prefill, before any penalty)."""

    codes: torch.Tensor
    first_logits: torch.Tensor
    finish_reason: Literal["stop", "length"]


def talker_sampling(talker: Talker, repetition_penalty: float = 1.05) -> SamplingParams:
    """Greedy code-0 settings of the reference: penalty, suppressed control ids, EOS stop."""
    vocab, eos = talker.config.text.vocab_size, talker.config.codec_eos_id
    return SamplingParams(
        temperature=0.0,
        repetition_penalty=repetition_penalty,
        stop_token_ids=(eos,),
        suppress_ranges=((vocab - SUPPRESSED_CODEC_IDS, eos), (eos + 1, vocab)),
    )


@torch.no_grad()
def talker_generate(
    talker: Talker, prompt: TalkerPrompt, max_new_frames: int, repetition_penalty: float = 1.05
) -> TalkerResult:
    """Greedy talker + code predictor for one prompt (module docstring).

    Raises: ValueError: ``max_new_frames < 1``."""
    if max_new_frames < 1:
        raise ValueError("max_new_frames must be >= 1")
    c = talker.config.text
    prefill = prompt.prefill
    device, length = prefill.device, prefill.shape[0]
    cache = _dense_cache(c.num_layers, c.num_kv_heads, c.head_dim, length + max_new_frames, prefill)
    predictor_cache = talker.code_predictor.new_cache(1, prefill.dtype, device)
    batch = SamplingBatch.build([talker_sampling(talker, repetition_penalty)], c.vocab_size, device)
    eos = talker.config.codec_eos_id
    cache.prepare(length)
    hidden = talker(prefill, prompt.positions.positions.to(device), cache)[-1:]
    first_logits = talker.codec_logits(hidden)[0].float()
    frames: list[torch.Tensor] = []
    for step in range(max_new_frames):
        code0 = sample(talker.codec_logits(hidden), batch)
        if int(code0) == eos:
            return TalkerResult(
                _stack(frames, talker.config.num_code_groups, device), first_logits, "stop"
            )
        batch.record(code0)
        frame = talker.complete_frame(hidden, code0, greedy_sample, predictor_cache)
        frames.append(frame[0])
        if step + 1 == max_new_frames:
            break
        feedback = talker.frame_embedding(frame) + prompt.text_row(step)
        cache.prepare(1)
        hidden = talker(feedback, prompt.positions.decode(length + step).to(device), cache)
    return TalkerResult(
        _stack(frames, talker.config.num_code_groups, device), first_logits, "length"
    )


def _stack(frames: list[torch.Tensor], groups: int, device: torch.device) -> torch.Tensor:
    return (
        torch.stack(frames) if frames else torch.zeros(0, groups, dtype=torch.int64, device=device)
    )
