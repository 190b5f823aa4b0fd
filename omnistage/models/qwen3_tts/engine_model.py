"""The Qwen3-TTS talker as the AR engine's model (:class:`~omnistage.engine.model_runner.ARModel`).

A thin adapter: the engine's decode step is the talker forward, code 0 from
``codec_head``, the code predictor's 15 sub-steps (:meth:`Talker.complete_frame`) and the
feedback embedding of the frame plus the request's next trailing-text row
(shared/reference/qwen3-tts.md, sections 2-3).
"""

from __future__ import annotations

import torch

from omnistage.engine.attention import AttentionBackend, DenseKVCache
from omnistage.engine.model_runner import ARModelSpec, SampleFn
from omnistage.models.qwen3_tts.modeling.talker import Talker


class Qwen3TTSEngineModel:
    """Args:
    talker: a loaded :class:`Talker` (eval mode, on its serving device and dtype).
    """

    def __init__(self, talker: Talker) -> None:
        self.talker = talker
        decoder = talker.config.decoder
        weight = talker.codec_head.weight
        self.spec = ARModelSpec(
            num_layers=decoder.num_layers,
            num_heads=decoder.num_heads,
            num_kv_heads=decoder.num_kv_heads,
            head_dim=decoder.head_dim,
            hidden_size=decoder.hidden_size,
            vocab_size=decoder.vocab_size,
            num_code_groups=talker.config.num_code_groups,
            code_vocab_size=talker.code_predictor.lm_head[0].out_features,
            dtype=weight.dtype,
            device=weight.device,
        )

    def forward(self, input_embeds: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        return self.talker.forward(input_embeds, positions, attn)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.talker.codec_logits(hidden)

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        """Codec-track ids ``[L]`` -> ``C(ids)`` ``[L, H]`` (prompts are normally embeddings)."""
        return self.talker.codec_embed(token_ids)

    def new_frame_cache(self, batch: int) -> DenseKVCache:
        return self.talker.code_predictor.new_cache(batch, self.spec.dtype, self.spec.device)

    def complete_frame(
        self, hidden: torch.Tensor, code0: torch.Tensor, sample_fn: SampleFn, cache: DenseKVCache | None
    ) -> torch.Tensor:
        assert cache is not None  # new_frame_cache always gives one
        return self.talker.complete_frame(hidden, code0, sample_fn, cache)

    def next_input_embeds(self, codes: torch.Tensor, step_rows: torch.Tensor) -> torch.Tensor:
        return self.talker.frame_embedding(codes) + step_rows
