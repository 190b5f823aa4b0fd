"""A tiny random multi-codebook AR model built from the Qwen3-TTS talker's own layers, and
the unbatched reference generation loop that is the engine's oracle.

:class:`ToyTalker` implements :class:`~omnistage.engine.model_runner.ARModel` with the real
talker's modules (:mod:`omnistage.engine.layers`, projections fused as the engine runs
them): a Qwen3 :class:`Decoder` calling the attention contract, a code-0 head,
and a :class:`CodePredictor` (its own Qwen3 layers and a
:class:`~omnistage.engine.attention.DenseKVCache` per frame: prefill of [talker hidden,
C(code 0)], then G-2 single-token steps); the feedback embedding is the sum of the G
codebook embeddings plus the request's step row (shared/reference/qwen3-tts.md, sections
2-3). With ``num_code_groups=1`` it is a plain token LM; with ``mrope`` it takes
multimodal RoPE positions ``[3, N]`` (T, H, W), interleaved over the rotary frequencies as
in Qwen3-Omni but over every frequency (``j`` rotates by row ``j % 3``; qwen3-omni.md,
section 4; fractional positions too) and, with ``hidden_addition_layers``, hidden additions
(:class:`~omnistage.engine.sequence.HiddenAdditions` added after its first layers). The same
classes at the real Qwen3-TTS 0.6B sizes drive ``benchmarks/engine_gpu.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from omnistage.engine.attention import AttentionBackend, DenseKVCache
from omnistage.engine.layers import CodePredictor, CodePredictorConfig, Decoder, DecoderConfig
from omnistage.engine.model_runner import ARModelSpec, SampleFn
from omnistage.engine.sequence import HiddenAdditions


@dataclass(frozen=True)
class ToyARConfig:
    """Sizes of the toy model (defaults: tiny; :meth:`qwen3_tts_0b6` for the real ones)."""

    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 8
    intermediate_size: int = 64
    vocab_size: int = 64
    num_code_groups: int = 4
    code_vocab_size: int = 16
    predictor_layers: int = 1
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    max_positions: int = 4096
    mrope: bool = False
    hidden_layers: tuple[int, ...] = ()
    hidden_addition_layers: int = 0  # with mrope only

    @classmethod
    def qwen3_tts_0b6(cls) -> ToyARConfig:
        """Talker and code predictor sizes of Qwen3-TTS-12Hz-0.6B (qwen3-tts.md, section 1)."""
        return cls(1024, 28, 16, 8, 128, 3072, 3072, 16, 2048, 5, 1e6, 1e-6)

    def decoder(self, num_layers: int, vocab_size: int) -> DecoderConfig:
        return DecoderConfig(self.hidden_size, self.intermediate_size, num_layers, self.num_heads, self.num_kv_heads,
                             self.head_dim, self.rms_eps, self.rope_theta, vocab_size, attention_bias=False)


class ToyTalker(nn.Module):
    """The toy model (see the module docstring); weights random from ``seed``."""

    def __init__(self, c: ToyARConfig, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 seed: int = 0) -> None:
        super().__init__()
        self.c = c
        # built on the target device: initializing the 0.6B sizes on the CPU takes seconds
        with torch.random.fork_rng(devices=[]), torch.device(device):
            torch.manual_seed(seed)
            self.codec_embedding = nn.Embedding(c.vocab_size, c.hidden_size)
            self.backbone = Decoder(c.decoder(c.num_layers, c.vocab_size), c.max_positions)
            self.codec_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
            self.predictor = None
            if c.num_code_groups > 1:
                predictor = CodePredictorConfig(c.decoder(c.predictor_layers, c.code_vocab_size), c.num_code_groups)
                self.predictor = CodePredictor(predictor, c.hidden_size)
        self.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.backbone.fuse_projections()
        if self.predictor is not None:
            self.predictor.model.fuse_projections()
        self.spec = ARModelSpec(
            c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size, c.vocab_size,
            c.num_code_groups, c.code_vocab_size, dtype, torch.device(device), position_rows=3 if c.mrope else 1,
            hidden_layers=c.hidden_layers, hidden_addition_layers=c.hidden_addition_layers,
        )

    def forward(self, input_embeds: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
                additions: HiddenAdditions | None = None) -> torch.Tensor:
        if not self.c.mrope:
            return self.backbone(input_embeds, positions, attn)
        return self.forward_with_hidden(input_embeds, positions, attn, additions)[0]

    def forward_with_hidden(
        self, input_embeds: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend,
        additions: HiddenAdditions | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The backbone, and the states after the first ``i`` layers for ``i`` in
        ``hidden_layers``, ``[N, K, H]`` (taken before that layer's additions)."""
        cos, sin = self._rope(positions, input_embeds.dtype)
        x, states = input_embeds, {0: input_embeds}
        for i, layer in enumerate(self.backbone.layers, start=1):
            x, delta = layer(x, None, cos, sin, attn)
            x = x + delta
            states[i] = x
            if additions is not None and i <= len(additions.embeds):
                x = x.index_add(0, additions.rows, additions.embeds[i - 1].to(x.dtype))
        kept = [states[i] for i in self.c.hidden_layers]
        return self.backbone.norm(x), torch.stack(kept, dim=1) if kept else x[:, None, :0]

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.c.mrope:
            return self.backbone.rotary(positions, dtype)
        # frequency j (and j + D/2) rotates by row j % 3; the angles from the positions
        # themselves (they may be fractional), the same fp32 products as the RoPE table
        half = self.c.head_dim // 2
        inv_freq = 1.0 / (self.c.rope_theta ** (torch.arange(0, self.c.head_dim, 2, device=positions.device).float()
                                                / self.c.head_dim))  # fmt: skip
        row = torch.arange(half, device=positions.device) % 3
        freqs = positions.float()[..., None] * inv_freq  # [3, N, D/2]
        freqs = freqs.gather(0, row.expand(1, positions.shape[1], -1))[0]
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat((cos, cos), -1).to(dtype), torch.cat((-sin, sin), -1).to(dtype)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.codec_head(hidden)

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.codec_embedding(token_ids)

    def new_frame_cache(self, batch: int) -> DenseKVCache | None:
        if self.predictor is None:
            return None
        return self.predictor.new_cache(batch, self.spec.dtype, self.spec.device)

    def complete_frame(
        self, hidden: torch.Tensor, code0: torch.Tensor, sample_fn: SampleFn, cache: DenseKVCache | None
    ) -> torch.Tensor:
        if self.predictor is None or cache is None:
            return code0[:, None]
        rest = self.predictor.predict(hidden, self.codec_embedding(code0), sample_fn, cache)
        return torch.cat((code0[:, None], rest), dim=1)

    def next_input_embeds(self, codes: torch.Tensor, step_rows: torch.Tensor) -> torch.Tensor:
        x = self.codec_embedding(codes[:, 0]) + step_rows
        if self.predictor is not None:
            for group, embedding in enumerate(self.predictor.model.codec_embedding, start=1):
                x = x + embedding(codes[:, group])
        return x
