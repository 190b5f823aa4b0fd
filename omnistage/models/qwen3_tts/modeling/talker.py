"""The Qwen3-TTS talker, as plain PyTorch modules over the shared Qwen3 layers
(:mod:`omnistage.engine.layers`: decoder stack and code predictor).

The talker's config declares a multimodal RoPE (``mrope_section``, interleaved) but TTS
always feeds three equal position rows, which makes it the plain 1-D RoPE of the shared
decoder (checked against the reference in ``tests/models/qwen3_tts/test_talker_parity.py``).

Module and parameter names follow the checkpoint (``talker.model.layers.N.self_attn.q_proj``
and so on; digest section 1) so weights load by name. Sources: Qwen3 (Qwen team, 2025) and
the Qwen3-TTS technical report; frame semantics from the digest sections 2-3.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.engine.attention import AttentionBackend, DenseKVCache
from omnistage.engine.layers import (
    CodePredictor,
    Decoder,
    RMSNorm,
    RotaryEmbedding,
    greedy_sample,
)
from omnistage.engine.model_runner import SampleFn
from omnistage.models.qwen3_tts.modeling.config import (
    CodePredictorConfig,
    TalkerConfig,
)

__all__ = [
    "CodePredictor",
    "Decoder",
    "RMSNorm",
    "RotaryEmbedding",
    "Talker",
    "greedy_sample",
]

# the checkpoints' max_position_embeddings: the talker's RoPE table (32 MB in fp32)
TALKER_MAX_POSITIONS = 32768


class TalkerModel(Decoder):
    """The talker's decoder plus its two input tables (checkpoint prefix ``talker.model``):
    ``codec_embedding [vocab 3072, H]`` and ``text_embedding [text_vocab, text_hidden]``."""

    def __init__(self, config: TalkerConfig) -> None:
        super().__init__(config.decoder, TALKER_MAX_POSITIONS)
        self.codec_embedding = nn.Embedding(config.decoder.vocab_size, config.decoder.hidden_size)
        self.text_embedding = nn.Embedding(config.text_vocab_size, config.text_hidden_size)


class TextProjection(nn.Module):
    """``linear_fc2(silu(linear_fc1(x)))``: text_hidden -> text_hidden -> talker hidden, with
    biases."""

    def __init__(self, text_hidden_size: int, hidden_size: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(text_hidden_size, text_hidden_size, bias=True)
        self.linear_fc2 = nn.Linear(text_hidden_size, hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class Talker(nn.Module):
    """The talker (checkpoint prefix ``talker``): decoder + embeddings (``model``),
    ``text_projection``, ``codec_head`` (untied) and the ``code_predictor``.

    Building blocks for an engine's decode step (all on device, no host sync):
    :meth:`forward`, :meth:`codec_logits`, :meth:`complete_frame`, :meth:`frame_embedding`,
    :meth:`text_embed`, :meth:`codec_embed`.
    """

    def __init__(self, config: TalkerConfig, predictor_config: CodePredictorConfig) -> None:
        super().__init__()
        if predictor_config.num_code_groups != config.num_code_groups:
            raise ValueError(
                f"talker has {config.num_code_groups} code groups, its predictor {predictor_config.num_code_groups}"
            )
        self.config = config
        self.model = TalkerModel(config)
        self.text_projection = TextProjection(config.text_hidden_size, config.decoder.hidden_size)
        self.codec_head = nn.Linear(config.decoder.hidden_size, config.decoder.vocab_size, bias=False)
        self.code_predictor = CodePredictor(predictor_config, config.decoder.hidden_size)

    def fuse_projections(self) -> None:
        """Fuse q/k/v and gate/up in the talker and the code predictor (see
        :meth:`Decoder.fuse_projections`). Opt-in after loading (the engine runs fused;
        ``state_dict`` keeps the checkpoint names); idempotent."""
        self.model.fuse_projections()
        self.code_predictor.model.fuse_projections()

    def forward(self, input_embeds: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """``input_embeds [N, H]``, ``positions [N] int64`` -> post-norm hidden ``[N, H]``.
        ``attn`` (the talker's KV backend) must be prepared for this forward."""
        return self.model(input_embeds, positions, attn)

    def codec_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Code-0 logits ``[B, vocab 3072]`` (activation dtype) from hidden ``[B, H]``."""
        return self.codec_head(hidden)

    def text_embed(self, text_ids: torch.Tensor) -> torch.Tensor:
        """The text track ``T(x) = text_projection(text_embedding(x))``: ids ``[M] int64`` ->
        ``[M, H]``."""
        return self.text_projection(self.model.text_embedding(text_ids))

    def codec_embed(self, codec_ids: torch.Tensor) -> torch.Tensor:
        """The codec track ``C(x) = codec_embedding(x)``: ids ``[M] int64`` -> ``[M, H]``."""
        return self.model.codec_embedding(codec_ids)

    def complete_frame(
        self, talker_hidden: torch.Tensor, code0: torch.Tensor, sample_fn: SampleFn, cache: DenseKVCache
    ) -> torch.Tensor:
        """The whole frame: ``[code0, predictor codes]`` -> ``[B, G] int64``.

        Args:
            talker_hidden: ``[B, H]`` post-norm hidden state whose logits gave ``code0``.
            code0: ``[B] int64`` (must not be EOS: the EOS frame is never completed).
            sample_fn: :data:`SampleFn` for groups 1..G-1 (:func:`greedy_sample` for greedy).
            cache: from ``code_predictor.new_cache(B, ...)``; reset here.
        """
        rest = self.code_predictor.predict(talker_hidden, self.codec_embed(code0), sample_fn, cache)
        return torch.cat((code0[:, None], rest), dim=1)

    def frame_embedding(self, codes: torch.Tensor) -> torch.Tensor:
        """Feedback of a frame ``codes [B, G] int64`` -> ``[B, H]``:
        ``C(c0) + sum_{i=1..G-1} code_predictor.codec_embedding[i-1](c_i)`` (digest
        section 2). Add the next trailing-text row (or tts_pad) to get the next input."""
        total = self.codec_embed(codes[:, 0])
        for i, table in enumerate(self.code_predictor.model.codec_embedding, start=1):
            total = total + table(codes[:, i])
        return total
