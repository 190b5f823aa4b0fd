"""The reference generation loop: one request, unbatched, a dense KV cache, plain Python.

The oracle the engine's batched, paged decoding is tested against, for any
:class:`~omnistage.engine.model_runner.ARModel` (the toy model, the Qwen3-TTS talker) and
for greedy and seeded sampling alike. It follows :mod:`omnistage.engine.sequence`'s steps
and frames and numbers the draws as the engine does: code 0 of frame ``k`` is drawn with
the request's seed at step ``k`` (the tokens generated so far); code ``g`` of frame ``k``
with the code predictor's own noise stream (``seed ^ PREDICTOR_NOISE_SALT``) at step
``k * G + g``. A sampled stop id ends the request ("stop"; its frame is not emitted);
``max_new_tokens`` frames end it with "length".
"""

from __future__ import annotations

import dataclasses

import torch

from omnistage.engine.attention import DenseKVCache
from omnistage.engine.model_runner import PREDICTOR_NOISE_SALT, ARModel
from omnistage.engine.sampler import SamplingBatch, SamplingParams, sample
from omnistage.engine.sequence import GenerationInput, GenerationResult, HiddenAdditions


@torch.no_grad()
def reference_generate(model: ARModel, inputs: GenerationInput) -> GenerationResult:
    """Generate ``inputs`` alone; returns the emitted frames ``[T, G] int64`` (on the
    model's device) and the finish_reason."""
    spec, prompt = model.spec, inputs.prompt.to(model.spec.device)
    length, groups = prompt.shape[0], spec.num_code_groups
    cache = DenseKVCache(
        spec.num_layers, 1, length + inputs.max_new_tokens, spec.num_kv_heads, spec.head_dim, spec.dtype, spec.device
    )
    code0_batch = SamplingBatch.build([inputs.sampling], spec.vocab_size, spec.device)
    predictor = inputs.predictor_sampling or SamplingParams(temperature=0.0)
    predictor_batch = SamplingBatch.build([predictor], max(spec.code_vocab_size, 1), spec.device)
    predictor_batch.seed ^= PREDICTOR_NOISE_SALT
    rows = [] if inputs.step_rows is None else list(inputs.step_rows)
    pad = inputs.pad_embed if inputs.pad_embed is not None else torch.zeros(spec.hidden_size)
    x = model.embed_tokens(prompt) if prompt.dim() == 1 else prompt.to(spec.dtype)
    cache.prepare(length)
    positions = torch.arange(length, device=spec.device)
    if spec.position_rows == 3:  # MRoPE: the request's [3, L] positions, or text positions
        positions = positions.expand(3, -1) if inputs.positions is None else inputs.positions.to(spec.device)

    def decode_position(k: int) -> torch.Tensor:  # cache length + rope_delta (on every row)
        position = torch.tensor([length + k], device=spec.device)
        return position if spec.position_rows == 1 else (position + inputs.rope_delta).expand(3, -1)

    additions = inputs.hidden_additions
    extra = {} if additions is None else {"additions": HiddenAdditions(
        additions.rows.to(spec.device), tuple(e.to(spec.device, spec.dtype) for e in additions.embeds))}  # fmt: skip
    hidden = model.forward(x, positions, cache, **extra)[-1:]
    frames: list[torch.Tensor] = []
    for k in range(inputs.max_new_tokens):
        code0 = sample(model.head_logits(hidden), code0_batch)
        code0_batch.record(code0)
        if int(code0) in inputs.sampling.stop_token_ids:
            return _result(frames, groups, "stop", length, spec.device)

        def sample_fn(group: int, logits: torch.Tensor, k: int = k) -> torch.Tensor:
            step = torch.tensor([k * groups + group], device=spec.device)
            return sample(logits, dataclasses.replace(predictor_batch, num_generated=step))

        codes = model.complete_frame(hidden, code0, sample_fn, model.new_frame_cache(1))
        frames.append(codes)
        if k + 1 == inputs.max_new_tokens:
            break
        row = (rows[k] if k < len(rows) else pad).to(spec.device, spec.dtype)
        cache.prepare(1)
        hidden = model.forward(model.next_input_embeds(codes, row[None]), decode_position(k), cache)
    return _result(frames, groups, "length", length, spec.device)


def _result(frames: list[torch.Tensor], groups: int, reason, prompt_len: int, device: torch.device) -> GenerationResult:
    codes = torch.cat(frames) if frames else torch.empty(0, groups, dtype=torch.int64, device=device)
    return GenerationResult(codes, reason, prompt_len)
