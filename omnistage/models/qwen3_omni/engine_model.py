"""Qwen3-Omni's thinker and talker as the AR engine's models
(:class:`~omnistage.engine.model_runner.ARModel`), thin adapters over the modules.

- :class:`ThinkerEngineModel`: a token LM (one code group) with 3-D MRoPE positions
  (``position_rows == 3``); with a talker downstream it returns the hidden states the
  talker's prompt needs, ``hidden_layers = (0, accept_hidden_layer)`` (the embeddings and
  the layer whose rows feed the multimodal positions; shared/reference/qwen3-omni.md §2).
  Prompts are embeddings with the encoders' rows merged in (:meth:`Thinker.merge`); the
  vision encoder's deepstack features are the request's hidden additions
  (``GenerationInput.hidden_additions``, ``spec.hidden_addition_layers`` = the deepstack
  levels), added after the first decoder layers at the visual positions.
- :class:`TalkerEngineModel`: code 0 from ``codec_head``, the code predictor's 15 sub-steps,
  and the feedback embedding of the frame plus the request's next text row, as for Qwen3-TTS.
"""

from __future__ import annotations

import torch

from omnistage.engine.attention import AttentionBackend, DenseKVCache
from omnistage.engine.model_runner import ARModelSpec, SampleFn
from omnistage.engine.sequence import HiddenAdditions
from omnistage.models.qwen3_omni.modeling.talker import Talker
from omnistage.models.qwen3_omni.modeling.thinker import Thinker

__all__ = ["TalkerEngineModel", "ThinkerEngineModel"]


class ThinkerEngineModel:
    """Args:
    thinker: a loaded :class:`Thinker` (eval mode, on its serving device and dtype).
    hidden_layers: ``hidden_states`` indices to return per fed token (0 and the talker's
        ``accept_hidden_layer`` when a talker follows; empty: none).
    """

    def __init__(self, thinker: Thinker, hidden_layers: tuple[int, ...] = ()) -> None:
        self.thinker = thinker
        c = thinker.config.text
        weight = thinker.lm_head.weight
        self.spec = ARModelSpec(
            num_layers=c.num_layers, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, hidden_size=c.hidden_size,
            vocab_size=c.vocab_size, num_code_groups=1, code_vocab_size=0, dtype=weight.dtype, device=weight.device,
            position_rows=3, hidden_layers=hidden_layers, hidden_addition_layers=thinker.config.deepstack_layers,
        )  # fmt: skip

    def forward(
        self,
        input_embeds: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        additions: HiddenAdditions | None = None,
    ) -> torch.Tensor:
        return self.thinker.model.decode(input_embeds, positions, attn, deepstack=additions).hidden

    def forward_with_hidden(
        self,
        input_embeds: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        additions: HiddenAdditions | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.thinker.model.decode(
            input_embeds, positions, attn, deepstack=additions, capture_layers=self.spec.hidden_layers
        )
        return out.hidden, torch.stack(out.captured, dim=1)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.thinker.logits(hidden)

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.thinker.embed(token_ids)

    def new_frame_cache(self, batch: int) -> None:
        return None

    def complete_frame(
        self,
        hidden: torch.Tensor,
        code0: torch.Tensor,
        sample_fn: SampleFn,
        cache: DenseKVCache | None,
    ) -> torch.Tensor:
        return code0[:, None]

    def next_input_embeds(self, codes: torch.Tensor, step_rows: torch.Tensor) -> torch.Tensor:
        """The token's embedding (a thinker request has no step rows: they are zeros)."""
        return self.thinker.embed(codes[:, 0]) + step_rows


class TalkerEngineModel:
    """Args:
    talker: a loaded :class:`Talker` (eval mode, on its serving device and dtype).
    """

    def __init__(self, talker: Talker) -> None:
        self.talker = talker
        c = talker.config
        weight = talker.codec_head.weight
        self.spec = ARModelSpec(
            num_layers=c.text.num_layers, num_heads=c.text.num_heads, num_kv_heads=c.text.num_kv_heads, head_dim=c.text.head_dim,
            hidden_size=c.text.hidden_size, vocab_size=c.text.vocab_size, num_code_groups=c.num_code_groups,
            code_vocab_size=c.code_predictor.decoder.vocab_size, dtype=weight.dtype, device=weight.device,
            position_rows=3,
        )  # fmt: skip

    def forward(
        self, input_embeds: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        return self.talker(input_embeds, positions, attn)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.talker.codec_logits(hidden)

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.talker.codec_embed(token_ids)

    def new_frame_cache(self, batch: int) -> DenseKVCache:
        return self.talker.code_predictor.new_cache(batch, self.spec.dtype, self.spec.device)

    def complete_frame(
        self,
        hidden: torch.Tensor,
        code0: torch.Tensor,
        sample_fn: SampleFn,
        cache: DenseKVCache | None,
    ) -> torch.Tensor:
        assert cache is not None  # new_frame_cache always gives one
        return self.talker.complete_frame(hidden, code0, sample_fn, cache)

    def next_input_embeds(self, codes: torch.Tensor, step_rows: torch.Tensor) -> torch.Tensor:
        return self.talker.frame_embedding(codes) + step_rows
