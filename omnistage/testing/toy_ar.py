"""A tiny random multi-codebook AR model with the Qwen3-TTS talker's structure, and the
unbatched reference generation loop that is the engine's oracle.

:class:`ToyTalker` implements :class:`~omnistage.engine.model_runner.ARModel`: Qwen3
decoder layers (pre-RMSNorm, GQA with per-head q/k RMSNorm, RoPE, SwiGLU) that call the
attention contract, a code-0 head, and a code predictor (its own Qwen3 layers and a
:class:`~omnistage.engine.attention.DenseKVCache` per frame: prefill of [talker hidden,
C(code 0)], then G-2 single-token steps); the feedback embedding is the sum of the G
codebook embeddings plus the request's step row (shared/reference/qwen3-tts.md, sections
2-3). With ``num_code_groups=1`` it is a plain token LM. The same classes at the real
Qwen3-TTS 0.6B sizes drive ``benchmarks/engine_gpu.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.engine.attention import AttentionBackend, DenseKVCache
from omnistage.engine.model_runner import ARModelSpec, SampleFn
from omnistage.engine.sampler import SamplingBatch, SamplingParams, sample
from omnistage.engine.sequence import GenerationInput
from omnistage.pipeline.messages import FinishReason


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

    @classmethod
    def qwen3_tts_0b6(cls) -> ToyARConfig:
        """Talker and code predictor sizes of Qwen3-TTS-12Hz-0.6B (qwen3-tts.md, section 1)."""
        return cls(1024, 28, 16, 8, 128, 3072, 3072, 16, 2048, 5, 1e6, 1e-6)


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half form, as in Qwen3) of ``x [N, heads, D]``."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[:, None] * freqs[None, :]
    cos, sin = angles.cos().to(x.dtype)[:, None, :], angles.sin().to(x.dtype)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Qwen3Layer(nn.Module):
    def __init__(self, c: ToyARConfig, index: int) -> None:
        super().__init__()
        self.c, self.index = c, index
        h, d = c.hidden_size, c.head_dim
        self.input_norm = nn.RMSNorm(h, eps=c.rms_eps)
        self.q_proj = nn.Linear(h, c.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, c.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, c.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(c.num_heads * d, h, bias=False)
        self.q_norm = nn.RMSNorm(d, eps=c.rms_eps)
        self.k_norm = nn.RMSNorm(d, eps=c.rms_eps)
        self.post_norm = nn.RMSNorm(h, eps=c.rms_eps)
        self.gate_up = nn.Linear(h, 2 * c.intermediate_size, bias=False)
        self.down = nn.Linear(c.intermediate_size, h, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        c, n = self.c, x.shape[0]
        y = self.input_norm(x)
        q = self.q_norm(self.q_proj(y).view(n, c.num_heads, c.head_dim))
        k = self.k_norm(self.k_proj(y).view(n, c.num_kv_heads, c.head_dim))
        v = self.v_proj(y).view(n, c.num_kv_heads, c.head_dim)
        q, k = _rope(q, positions, c.rope_theta), _rope(k, positions, c.rope_theta)
        x = x + self.o_proj(attn(self.index, q, k, v).reshape(n, -1))
        gate, up = self.gate_up(self.post_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Backbone(nn.Module):
    def __init__(self, c: ToyARConfig, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Qwen3Layer(c, i) for i in range(num_layers))
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, positions, attn)
        return self.norm(x)


class ToyCodePredictor(nn.Module):
    """Codes 1..G-1 of a frame from the talker's hidden state and code 0."""

    def __init__(self, c: ToyARConfig) -> None:
        super().__init__()
        self.c = c
        self.backbone = Backbone(c, c.predictor_layers)
        groups = c.num_code_groups - 1
        self.codec_embeddings = nn.ModuleList(nn.Embedding(c.code_vocab_size, c.hidden_size) for _ in range(groups))
        self.heads = nn.ModuleList(nn.Linear(c.hidden_size, c.code_vocab_size, bias=False) for _ in range(groups))

    def complete_frame(
        self, hidden: torch.Tensor, code0_embed: torch.Tensor, sample_fn: SampleFn, cache: DenseKVCache
    ) -> list[torch.Tensor]:
        """``[B] int64`` codes 1..G-1 (prefill [hidden, C(code 0)], then one step per code)."""
        b = hidden.shape[0]
        cache.reset()
        cache.prepare(2)
        x = torch.stack([hidden, code0_embed], dim=1).reshape(2 * b, -1)
        positions = torch.arange(2, device=hidden.device).repeat(b)
        h = self.backbone(x, positions, cache).view(b, 2, -1)[:, 1]
        codes = [sample_fn(1, self.heads[0](h))]
        for group in range(2, self.c.num_code_groups):
            cache.prepare(1)
            positions = torch.full((b,), group, dtype=torch.int64, device=hidden.device)
            h = self.backbone(self.codec_embeddings[group - 2](codes[-1]), positions, cache)
            codes.append(sample_fn(group, self.heads[group - 1](h)))
        return codes


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
            self.backbone = Backbone(c, c.num_layers)
            self.codec_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
            self.predictor = ToyCodePredictor(c) if c.num_code_groups > 1 else None
        self.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.spec = ARModelSpec(
            c.num_layers, c.num_kv_heads, c.head_dim, c.hidden_size, c.vocab_size,
            c.num_code_groups, c.code_vocab_size, dtype, torch.device(device),
        )

    def forward(self, input_embeds: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        return self.backbone(input_embeds, positions, attn)

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.codec_head(hidden)

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.codec_embedding(token_ids)

    def new_frame_cache(self, batch: int) -> DenseKVCache | None:
        if self.predictor is None:
            return None
        c, spec = self.c, self.spec
        return DenseKVCache(c.predictor_layers, batch, c.num_code_groups, c.num_kv_heads, c.head_dim, spec.dtype,
                            spec.device)

    def complete_frame(
        self, hidden: torch.Tensor, code0: torch.Tensor, sample_fn: SampleFn, cache: DenseKVCache | None
    ) -> torch.Tensor:
        if self.predictor is None or cache is None:
            return code0[:, None]
        rest = self.predictor.complete_frame(hidden, self.codec_embedding(code0), sample_fn, cache)
        return torch.stack([code0, *rest], dim=1)

    def next_input_embeds(self, codes: torch.Tensor, step_rows: torch.Tensor) -> torch.Tensor:
        x = self.codec_embedding(codes[:, 0]) + step_rows
        if self.predictor is not None:
            for group, embedding in enumerate(self.predictor.codec_embeddings, start=1):
                x = x + embedding(codes[:, group])
        return x


def reference_generate(model: ToyTalker, inputs: GenerationInput) -> tuple[torch.Tensor, FinishReason]:
    """The oracle: one request, unbatched, with a dense KV cache; returns the emitted
    frames ``[T, G] int64`` and the finish_reason."""
    spec, prompt = model.spec, inputs.prompt.to(model.spec.device)
    length, steps, groups = prompt.shape[0], inputs.max_new_tokens, spec.num_code_groups
    cache = DenseKVCache(spec.num_layers, 1, length + steps, spec.num_kv_heads, spec.head_dim, spec.dtype, spec.device)
    sampling = SamplingBatch.build([inputs.sampling], spec.vocab_size, spec.device)
    sub = SamplingBatch.build([inputs.predictor_sampling or SamplingParams(temperature=0.0)],
                              max(spec.code_vocab_size, 1), spec.device)
    rows = [inputs.step_embeds[k] for k in range(0 if inputs.step_embeds is None else len(inputs.step_embeds))]
    pad = inputs.pad_embed if inputs.pad_embed is not None else torch.zeros(spec.hidden_size)
    x = model.embed_tokens(prompt) if prompt.dim() == 1 else prompt.to(spec.dtype)
    cache.prepare(length)
    hidden = model(x, torch.arange(length, device=spec.device), cache)[-1:]
    frames = []
    for k in range(steps):
        code0 = sample(model.head_logits(hidden), sampling)
        sampling.record(code0)
        if int(code0) in inputs.sampling.stop_token_ids:
            return _frames(frames, groups), "stop"

        def sample_fn(group: int, logits: torch.Tensor, k: int = k) -> torch.Tensor:
            step = torch.tensor([k * groups + group], device=spec.device)
            return sample(logits, dataclasses.replace(sub, num_generated=step))

        codes = model.complete_frame(hidden, code0, sample_fn, model.new_frame_cache(1))
        frames.append(codes)
        row = (rows[k] if k < len(rows) else pad).to(spec.device, spec.dtype)
        cache.prepare(1)
        hidden = model(model.next_input_embeds(codes, row[None]), torch.tensor([length + k], device=spec.device), cache)
    return _frames(frames, groups), "length"


def _frames(frames: list[torch.Tensor], groups: int) -> torch.Tensor:
    return torch.cat(frames) if frames else torch.empty(0, groups, dtype=torch.int64)

