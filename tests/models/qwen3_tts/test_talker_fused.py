"""fuse_projections: q/k/v and gate/up as one matmul each, bit-identical on the CPU, with the
checkpoint's state_dict untouched."""

from __future__ import annotations

import torch

from omnistage.engine.attention import DenseKVCache
from omnistage.models.qwen3_tts.modeling.talker import Talker, greedy_sample
from omnistage.models.qwen3_tts.modeling.weights import load_checkpoint


def talker_pair(path) -> tuple[Talker, Talker]:
    plain, fused = (load_checkpoint(path).model.talker for _ in range(2))
    fused.fuse_projections()
    return plain, fused


def run(talker: Talker, embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states of a prefill and the greedy frame completed from its last row."""
    cache = talker.model.new_dense_cache(1, embeds.shape[0], embeds.dtype, "cpu")
    cache.prepare(embeds.shape[0])
    with torch.no_grad():
        hidden = talker(embeds, torch.arange(embeds.shape[0]), cache)
        code0 = talker.codec_logits(hidden[-1:]).argmax(-1)
        predictor_cache: DenseKVCache = talker.code_predictor.new_cache(1, embeds.dtype, "cpu")
        frame = talker.complete_frame(hidden[-1:], code0, greedy_sample, predictor_cache)
    return hidden, frame


def test_fused_talker_is_bit_identical_to_the_loaded_one(tiny_checkpoints) -> None:
    plain, fused = talker_pair(tiny_checkpoints["custom_voice"])
    embeds = torch.randn(7, plain.config.decoder.hidden_size, generator=torch.Generator().manual_seed(0))
    (hidden, frame), (fused_hidden, fused_frame) = run(plain, embeds), run(fused, embeds)
    assert torch.equal(hidden, fused_hidden)
    assert torch.equal(frame, fused_frame)


def test_fusing_keeps_the_checkpoint_names_and_is_idempotent(tiny_checkpoints) -> None:
    plain, fused = talker_pair(tiny_checkpoints["custom_voice"])
    fused.fuse_projections()
    expected, state = plain.state_dict(), fused.state_dict()
    assert list(state) == list(expected)
    assert all(torch.equal(state[name], expected[name]) for name in expected)
    attn = fused.model.layers[0].self_attn
    # the projections are views of the fused weight: one copy of the weights, loads reach it
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()
