"""The Qwen3-Omni talker (checkpoint prefix ``talker``): a shared-expert MoE decoder over
codec rows, the two projections that bring thinker rows into its width, ``codec_head`` and the
code predictor.

- ``model``: :class:`~omnistage.models.qwen3_omni.modeling.decoder.MoEDecoder` whose every
  layer is a :class:`~omnistage.models.qwen3_omni.modeling.decoder.SharedExpertMoE`, plus
  ``codec_embedding [3072, H]``.
- ``text_projection`` / ``hidden_projection``: ``fc2(silu(fc1(x)))``, thinker hidden ->
  ``projection_size`` -> talker hidden (text rows take the thinker's token embeddings, multimodal
  rows its layer-``accept_hidden_layer`` hidden states; shared/reference/qwen3-omni.md §2).
- ``codec_head [3072, H]``: code-0 logits (untied from ``codec_embedding``).
- ``code_predictor``: the shared dense predictor (:class:`~omnistage.engine.layers.CodePredictor`,
  as in Qwen3-TTS: 15 embeddings, 15 heads, identical names and math).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.engine.attention import AttentionBackend, DenseKVCache
from omnistage.engine.layers import CodePredictor
from omnistage.engine.model_runner import SampleFn
from omnistage.models.qwen3_omni.modeling.config import TalkerConfig
from omnistage.models.qwen3_omni.modeling.decoder import MoEDecoder, shared_expert_moe

__all__ = ["ResizeMLP", "Talker", "TalkerModel"]


class ResizeMLP(nn.Module):
    """``linear_fc2(silu(linear_fc1(x)))`` with biases: ``in -> mid -> out``."""

    def __init__(self, in_size: int, mid_size: int, out_size: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(in_size, mid_size, bias=True)
        self.linear_fc2 = nn.Linear(mid_size, out_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.silu(self.linear_fc1(x)))


class TalkerModel(MoEDecoder):
    """Decoder stack plus ``codec_embedding`` (prefix ``talker.model``)."""

    def __init__(self, config: TalkerConfig) -> None:
        super().__init__(config.text, shared_expert_moe)
        self.codec_embedding = nn.Embedding(config.text.vocab_size, config.text.hidden_size)


class Talker(nn.Module):
    """Building blocks of a talker step (device-only, any batch): :meth:`forward`,
    :meth:`codec_logits`, :meth:`complete_frame`, :meth:`frame_embedding`, the projections."""

    def __init__(self, config: TalkerConfig) -> None:
        super().__init__()
        self.config = config
        h = config.text.hidden_size
        self.model = TalkerModel(config)
        self.text_projection = ResizeMLP(config.thinker_hidden_size, config.projection_size, h)
        self.hidden_projection = ResizeMLP(config.thinker_hidden_size, config.projection_size, h)
        self.codec_head = nn.Linear(h, config.text.vocab_size, bias=False)
        self.code_predictor = CodePredictor(config.code_predictor, h)

    def reset_buffers(self, device: torch.device | str) -> None:
        """Rebuild the RoPE buffers of the talker and the predictor on ``device``."""
        self.model.reset_buffers(device)
        self.code_predictor.model.rotary.reset_buffers(device)

    def forward(
        self, input_embeds: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """``[N, H]`` rows, positions ``[3, N]`` or ``[N]`` -> post-norm hidden ``[N, H]``."""
        return self.model(input_embeds, positions, attn)

    def codec_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, H]`` -> code-0 logits ``[B, 3072]``."""
        return self.codec_head(hidden)

    def codec_embed(self, codec_ids: torch.Tensor) -> torch.Tensor:
        """``[M] int64`` -> ``codec_embedding(ids) [M, H]``."""
        return self.model.codec_embedding(codec_ids)

    def complete_frame(
        self, hidden: torch.Tensor, code0: torch.Tensor, sample_fn: SampleFn, cache: DenseKVCache
    ) -> torch.Tensor:
        """``[code0, codes 1..G-1]`` ``[B, G] int64`` from the hidden ``[B, H]`` that gave
        ``code0 [B]`` (the code predictor: prefill [hidden, emb(code0)], then G-2 steps)."""
        rest = self.code_predictor.predict(hidden, self.codec_embed(code0), sample_fn, cache)
        return torch.cat((code0[:, None], rest), dim=1)

    def frame_embedding(self, codes: torch.Tensor) -> torch.Tensor:
        """Feedback of ``codes [B, G]`` -> ``[B, H]``: ``codec_embedding(c0)`` plus the code
        predictor's embeddings of ``c1..c{G-1}``; add the next text row to get the next input."""
        total = self.codec_embed(codes[:, 0])
        for i, table in enumerate(self.code_predictor.model.codec_embedding, start=1):
            total = total + table(codes[:, i])
        return total
