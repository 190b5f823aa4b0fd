"""Qwen3 decoder building blocks shared by the models (Qwen3-TTS talker, Qwen3-Omni thinker,
talker and code predictor), as plain PyTorch modules.

Pre-RMSNorm layers: grouped-query attention with a per-head RMSNorm on q and k and
rotary position embedding (RoPE), SwiGLU MLP, final RMSNorm. Layers never own a KV cache:
each attention layer calls ``attn(layer_index, q, k, v)`` (see
:mod:`omnistage.engine.attention`), and whoever drives a forward ``prepare()``s that backend
first. Tokens are flattened over the batch: a forward takes ``[N, H]`` embeddings and ``[N]``
positions. The per-frame code predictor (Qwen3-TTS and Qwen3-Omni share it: a small decoder,
``G - 1`` codec embeddings and heads) lives here too.

Module and parameter names follow the checkpoints (``...layers.N.self_attn.q_proj`` and so on)
so weights load by name. Source: Qwen3 (Qwen team, 2025).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.engine.attention import AttentionBackend, DenseKVCache
from omnistage.engine.model_runner import SampleFn
from omnistage.engine.paged_attention import triton_runs

__all__ = [
    "MLP",
    "Attention",
    "CodePredictor",
    "CodePredictorConfig",
    "CodePredictorModel",
    "Decoder",
    "DecoderConfig",
    "DecoderLayer",
    "RMSNorm",
    "RotaryEmbedding",
    "apply_rope",
    "fuse_linears",
    "fuse_projections",
    "greedy_sample",
    "MAX_DENSE_DECODE_LEN",
    "MAX_DENSE_DECODE_TILE",
    "MAX_FUSED_WIDTH",
    "dense_decode_fits",
    "qk_norm_rope",
    "qk_norm_rope_fits",
    "rms_norm",
    "rms_norm_fits",
    "swiglu",
    "swiglu_fits",
]


@dataclass(frozen=True)
class DecoderConfig:
    """Geometry of one Qwen3 decoder stack.

    ``head_dim`` is explicit: the Qwen3-TTS 0.6B talker has hidden 1024 and 16 heads but
    head_dim 128.
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    attention_bias: bool


@dataclass(frozen=True)
class CodePredictorConfig:
    """The per-frame code predictor: a Qwen3 decoder plus ``num_code_groups - 1`` codec
    embeddings and lm heads (groups 1..15)."""

    decoder: DecoderConfig
    num_code_groups: int


def greedy_sample(group_index: int, logits: torch.Tensor) -> torch.Tensor:
    """The greedy :data:`SampleFn`: argmax of ``logits [B, V]`` -> ``[B] int64``."""
    return logits.argmax(dim=-1)


#: The widest row :func:`~omnistage.engine.triton_layers.rms_norm_triton` takes as one
#: block (the decoders served here are 2,048 wide at most).
MAX_FUSED_WIDTH = 1 << 16


def _one_dtype_and_device(x: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Every given tensor of ``others`` in ``x``'s dtype and on its device."""
    return all(t is None or (t.dtype == x.dtype and t.device == x.device) for t in others)


def rms_norm_fits(x: torch.Tensor, weight: torch.Tensor, delta: torch.Tensor | None = None) -> bool:
    """Whether the shapes suit :func:`~omnistage.engine.triton_layers.rms_norm_triton`:
    ``x [N, H]`` of unit inner stride with ``0 < H <=`` :data:`MAX_FUSED_WIDTH` (a row is
    one block), ``weight [H]`` of unit stride, ``delta`` (if given) ``x``'s shape, all of one
    dtype and device."""
    return (
        x.dim() == 2
        and 0 < x.shape[1] <= MAX_FUSED_WIDTH
        and x.stride(-1) == 1
        and weight.shape == x.shape[1:]
        and weight.stride(-1) == 1
        and (delta is None or delta.shape == x.shape)
        and _one_dtype_and_device(x, weight, delta)
    )


def qk_norm_rope_fits(
    qkv: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, heads: int
) -> bool:
    """Whether the shapes suit :func:`~omnistage.engine.triton_layers.qk_norm_rope_triton_`:
    ``qkv [N, heads_total, D]`` with ``D`` a power of two >= 2 (the kernel takes each half
    as one block), unit inner stride and heads and tokens that do not overlap (it writes in
    place), ``0 < heads <= heads_total``, ``weight [heads_total, D]`` contiguous, ``cos`` and
    ``signed_sin`` ``[N, D]`` of unit inner stride, all of one dtype and device."""
    if qkv.dim() != 3:
        return False
    n, total, dim = qkv.shape
    return (
        dim >= 2
        and dim & (dim - 1) == 0
        and qkv.stride(-1) == 1
        and qkv.stride(1) >= dim
        and qkv.stride(0) >= total * qkv.stride(1)
        and 0 < heads <= total
        and weight.is_contiguous()
        and weight.shape == (total, dim)
        and all(t.shape == (n, dim) and t.stride(-1) == 1 for t in (cos, signed_sin))
        and _one_dtype_and_device(qkv, weight, cos, signed_sin)
    )


#: The longest dense cache (positions) that
#: :func:`~omnistage.engine.triton_layers.dense_decode_attention_triton` attends over as one
#: block (the code predictor's is ``G + 1 = 17``).
MAX_DENSE_DECODE_LEN = 32
#: The most elements of one program's ``[query heads of a group, positions, D]`` product
#: (each a power of two): the predictor's 2 x 32 x 128 compiles to 167 registers without
#: spills for sm_90, and 8 x 64 x 128 spills 33 KB (Triton 3.5's ``ptxas -v``).
MAX_DENSE_DECODE_TILE = 2 * 32 * 128


def dense_decode_fits(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> bool:
    """Whether the shapes suit :func:`~omnistage.engine.triton_layers.dense_decode_attention_triton`:
    one new token per sequence, ``q [B, Hq, D]``, ``k`` and ``v [B, Hkv, D]``, one layer's
    ``k_cache`` and ``v_cache [B, L, Hkv, D]`` with ``0 < L <=`` :data:`MAX_DENSE_DECODE_LEN`,
    ``Hq`` a positive multiple of ``Hkv``, ``D`` a power of two >= 2, the tile within
    :data:`MAX_DENSE_DECODE_TILE`, every tensor of unit inner stride, the caches two
    buffers whose positions and heads do not overlap (the kernel writes them), all of one
    dtype and device."""
    if q.dim() != 3 or k_cache.dim() != 4 or v_cache.dim() != 4:
        return False
    b, hq, dim = q.shape
    length, hkv = k_cache.shape[1], k_cache.shape[2]
    group = hq // hkv if hkv > 0 else 0
    return (
        dim >= 2
        and dim & (dim - 1) == 0
        and hkv > 0
        and hq > 0
        and hq % hkv == 0
        and 0 < length <= MAX_DENSE_DECODE_LEN
        and _next_power_of_2(group) * _next_power_of_2(length) * dim <= MAX_DENSE_DECODE_TILE
        and k.shape == v.shape == (b, hkv, dim)
        and k_cache.shape == v_cache.shape == (b, length, hkv, dim)
        and all(t.stride(-1) == 1 for t in (q, k, v, k_cache, v_cache))
        and all(c.stride(2) >= dim and c.stride(1) >= hkv * c.stride(2) and c.stride(0) >= length * c.stride(1)
                for c in (k_cache, v_cache))
        and k_cache.data_ptr() != v_cache.data_ptr()
        and _one_dtype_and_device(q, k, v, k_cache, v_cache)
    )


def _next_power_of_2(n: int) -> int:
    """The least power of two >= ``n`` (>= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def swiglu_fits(gate_up: torch.Tensor) -> bool:
    """Whether the shape suits :func:`~omnistage.engine.triton_layers.swiglu_triton`:
    ``[N, 2 I]`` of unit inner stride."""
    return gate_up.dim() == 2 and gate_up.stride(-1) == 1 and gate_up.shape[1] % 2 == 0


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight * rms_norm(s), s)`` over the last dim, with ``s = x + delta`` (a residual
    add; ``s = x`` without ``delta``).

    The norm computes in fp32 and casts back; the weight multiplies after the cast (the
    reference's order, which matters in bf16). On CUDA, for inputs :func:`rms_norm_fits`
    accepts, one Triton kernel does it all
    (:func:`~omnistage.engine.triton_layers.rms_norm_triton`), rounding where these ops do;
    else PyTorch: ``F.rms_norm`` without a weight computes in
    fp32 (opmath) and casts back, the same ops as the reference on the CPU (bit-identical).

    Args:
        x, delta: ``[..., H]``.
        weight: ``[H]``.
        eps: added to the mean square (the checkpoint's ``rms_norm_eps``).
    """
    if rms_norm_fits(x, weight, delta) and triton_runs(x, weight, delta):
        from omnistage.engine.triton_layers import rms_norm_triton

        return rms_norm_triton(x, weight, eps, delta)
    summed = x if delta is None else x + delta
    return weight * F.rms_norm(summed, (summed.shape[-1],), eps=eps), summed


def qk_norm_rope(
    qkv: torch.Tensor,
    weight: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    eps: float,
    heads: int,
) -> torch.Tensor:
    """The first ``heads`` heads of ``qkv [N, heads_total, D]`` (q, then k) normalized per
    head (RMSNorm times ``weight [heads_total, D]``, a row per head) and rotated by
    :func:`apply_rope`; the heads after them are unspecified in the result (take v from
    ``qkv``).

    On CUDA, for inputs :func:`qk_norm_rope_fits` accepts, one Triton kernel writes the
    result into ``qkv``'s own q/k heads and returns ``qkv``
    (:func:`~omnistage.engine.triton_layers.qk_norm_rope_triton_`; its v heads are
    untouched); else PyTorch over all heads into a new tensor (the v heads normalized and
    rotated too: fewer kernels than slicing).
    """
    if qk_norm_rope_fits(qkv, weight, cos, signed_sin, heads) and triton_runs(qkv, weight):
        from omnistage.engine.triton_layers import qk_norm_rope_triton_

        qk_norm_rope_triton_(qkv, weight, cos, signed_sin, eps, heads)
        return qkv
    normed = weight * F.rms_norm(qkv, (qkv.shape[-1],), eps=eps)
    return apply_rope(normed, cos, signed_sin)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` ``[..., 2 I]`` -> ``[..., I]``
    (SwiGLU, Shazeer 2020). On CUDA, for inputs :func:`swiglu_fits` accepts, one Triton
    kernel (:func:`~omnistage.engine.triton_layers.swiglu_triton`); else PyTorch."""
    if swiglu_fits(gate_up) and triton_runs(gate_up):
        from omnistage.engine.triton_layers import swiglu_triton

        return swiglu_triton(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class RMSNorm(nn.Module):
    """RMS normalization over the last dim with a weight (:func:`rms_norm`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)[0]

    def add_and_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A residual add and this norm: ``(norm(x + delta), x + delta)`` (one kernel on
        CUDA, see :func:`rms_norm`); without ``delta``, ``(norm(x), x)``."""
        return rms_norm(x, self.weight, self.eps, delta)


class RotaryEmbedding(nn.Module):
    """cos/sin tables of the rotate-half RoPE for positions ``0 .. max_positions - 1``, looked
    up per forward (one gather instead of recomputing the angles). ``table`` is a
    non-persistent fp32 buffer ``[max_positions, 2, head_dim]`` (not in checkpoints):
    ``cos`` and, with the first half negated, ``sin`` (see :func:`apply_rope`);
    :meth:`reset_buffers` rebuilds it after a meta-device load."""

    def __init__(self, head_dim: int, theta: float, max_positions: int) -> None:
        super().__init__()
        self.head_dim, self.theta, self.max_positions = head_dim, theta, max_positions
        self.register_buffer("table", self._table(None), persistent=False)

    def _table(self, device: torch.device | str | None) -> torch.Tensor:
        """The table on ``device`` (None: the default device, e.g. meta while building)."""
        exponent = (
            torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float()
            / self.head_dim
        )
        inv_freq = 1.0 / (self.theta**exponent)
        # the same fp32 products as computing angles from each forward's positions
        freqs = torch.arange(self.max_positions, device=device).float()[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        return torch.stack((torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)), dim=1)

    def reset_buffers(self, device: torch.device | str) -> None:
        """Recompute ``table`` on ``device`` (fp32)."""
        self.table = self._table(device)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [N] int64`` (< ``max_positions``) -> ``cos, signed sin [N, head_dim]``
        in ``dtype``."""
        cos_sin = self.table.index_select(0, positions).to(dtype)
        return cos_sin[:, 0], cos_sin[:, 1]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [N, heads, D]`` by ``cos, signed_sin [N, D]`` (rotate-half pairing).

    rotate_half(x) * sin == roll(x, D/2) * [-sin, sin]: one roll instead of neg + cat, and
    bit-identical (negating a factor negates the product exactly)."""
    return x * cos[:, None] + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin[:, None]


class Attention(nn.Module):
    """GQA self-attention with per-head q/k RMSNorm and RoPE; the KV cache is the backend's.

    As loaded, q/k/v are three projections. After :meth:`fuse` they are one matmul and the
    q and k norms plus RoPE run once over the q and k heads (:func:`qk_norm_rope`): ~30
    kernels fewer per layer, same values."""

    def __init__(self, config: DecoderConfig, layer_index: int) -> None:
        super().__init__()
        c = config
        self.layer_index, self.num_heads, self.num_kv_heads, self.head_dim = (
            layer_index,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
        )
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.attention_bias)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=c.attention_bias)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.attention_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        # set by fuse(): non-persistent, so state_dict keeps the checkpoint's names
        self.register_buffer("qkv_weight", None, persistent=False)  # [(Hq + 2 Hkv) D, H]
        self.register_buffer("qkv_bias", None, persistent=False)
        self.register_buffer("qkv_norm_weight", None, persistent=False)  # [Hq + 2 Hkv, D]

    def fuse(self) -> None:
        """Make q/k/v one projection (``q_proj``/``k_proj``/``v_proj`` become views of it);
        the per-head norm weights are copied into ``qkv_norm_weight`` (a snapshot: fuse
        after loading and moving the model). Idempotent."""
        if self.qkv_weight is not None:
            return
        self.qkv_weight, self.qkv_bias = fuse_linears((self.q_proj, self.k_proj, self.v_proj))
        heads = (self.num_heads, self.num_kv_heads, self.num_kv_heads)
        weights = (self.q_norm.weight, self.k_norm.weight, torch.ones_like(self.k_norm.weight))
        self.qkv_norm_weight = torch.cat(
            [w.detach().expand(h, -1) for w, h in zip(weights, heads, strict=True)]
        )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        n, hq, hkv = x.shape[0], self.num_heads, self.num_kv_heads
        if self.qkv_weight is None:
            q = apply_rope(self.q_norm(self.q_proj(x).view(n, hq, self.head_dim)), cos, sin)
            k = apply_rope(self.k_norm(self.k_proj(x).view(n, hkv, self.head_dim)), cos, sin)
            v = self.v_proj(x).view(n, hkv, self.head_dim)
        else:
            qkv = F.linear(x, self.qkv_weight, self.qkv_bias).view(n, hq + 2 * hkv, self.head_dim)
            qk = qk_norm_rope(qkv, self.qkv_norm_weight, cos, sin, self.q_norm.eps, hq + hkv)
            q, k, v = qk[:, :hq], qk[:, hq : hq + hkv], qkv[:, hq + hkv :]
        out = attn(self.layer_index, q, k, v)
        return self.o_proj(out.reshape(n, hq * self.head_dim))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``; gate and up are one matmul after :meth:`fuse`."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.register_buffer("gate_up_weight", None, persistent=False)  # [2 I, H], set by fuse()

    def fuse(self) -> None:
        """Make gate/up one projection (the originals become views of it). Idempotent."""
        if self.gate_up_weight is None:
            self.gate_up_weight, _ = fuse_linears((self.gate_proj, self.up_proj))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_weight is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(swiglu(F.linear(x, self.gate_up_weight)))


def fuse_projections(module: nn.Module) -> None:
    """:meth:`Attention.fuse` and :meth:`MLP.fuse` on every such module inside ``module``
    (any model built from these layers): q/k/v and gate/up as one matmul each, same values.
    Call after loading and moving the model, before capturing CUDA graphs; idempotent."""
    for sub in module.modules():
        if isinstance(sub, Attention | MLP):
            sub.fuse()


def fuse_linears(linears: tuple[nn.Linear, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Weight and bias (None without biases) of one Linear computing ``linears`` side by
    side. The originals' parameters are re-pointed to views of them, so no weight is stored
    twice and loading into the originals still reaches the fused weight."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    has_bias = linears[0].bias is not None
    bias = torch.cat([lin.bias.detach() for lin in linears]) if has_bias else None
    start = 0
    for lin in linears:
        rows = slice(start, start + lin.out_features)
        lin.weight = nn.Parameter(weight[rows], requires_grad=False)
        if bias is not None:
            lin.bias = nn.Parameter(bias[rows], requires_grad=False)
        start += lin.out_features
    return weight, bias


class DecoderLayer(nn.Module):
    """One pre-RMSNorm layer: attention, then ``mlp`` (a SwiGLU :class:`MLP` of
    ``intermediate_size`` unless given, e.g. a MoE block), each added to the residual
    stream.

    The stream is carried as ``(x, delta)``, its value ``x + delta``: a layer leaves its
    feed-forward output's add to the next norm, so the add and the norm are one kernel on
    CUDA (:meth:`RMSNorm.add_and_norm`); ``delta`` None is a stream of ``x`` alone.
    """

    def __init__(self, config: DecoderConfig, layer_index: int, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size) if mlp is None else mlp

    def forward(
        self,
        x: torch.Tensor,
        delta: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The stream ``x + delta`` (``[N, H]`` each) through this layer -> ``(x, delta)``
        after it (``delta`` is the feed-forward output, not yet added)."""
        h, x = self.input_layernorm.add_and_norm(x, delta)
        h, x = self.post_attention_layernorm.add_and_norm(x, self.self_attn(h, cos, sin, attn))
        return x, self.mlp(h)


class Decoder(nn.Module):
    """A Qwen3 decoder stack: ``layers`` and the final ``norm``.

    Args:
        config: geometry (``head_dim`` explicit).
        max_positions: positions the RoPE table covers (a forward's positions must be below).
    """

    def __init__(self, config: DecoderConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, max_positions)

    def fuse_projections(self) -> None:
        """Run q/k/v and gate/up as one matmul each (see :meth:`Attention.fuse`): same
        values, ~30 kernels fewer per layer. Call after loading; idempotent."""
        fuse_projections(self)

    def forward(
        self, input_embeds: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """``input_embeds [N, H]`` (any float dtype), ``positions [N] int64`` (absolute, per
        sequence) -> hidden ``[N, H]`` after the final norm. ``attn`` must be prepared for
        this forward by the caller."""
        cos, sin = self.rotary(positions, input_embeds.dtype)
        x, delta = input_embeds, None
        for layer in self.layers:
            x, delta = layer(x, delta, cos, sin, attn)
        return self.norm.add_and_norm(x, delta)[0]

    def new_dense_cache(
        self, batch: int, max_len: int, dtype: torch.dtype, device: torch.device | str, fused_decode: bool = False
    ) -> DenseKVCache:
        """A :class:`DenseKVCache` sized for this stack (``fused_decode``: see there)."""
        c = self.config
        return DenseKVCache(
            c.num_layers, batch, max_len, c.num_kv_heads, c.head_dim, dtype=dtype, device=device,
            fused_decode=fused_decode,
        )


class CodePredictorModel(Decoder):
    """The predictor's decoder plus ``codec_embedding.{0..G-2}``: tables ``[2048, talker H]``
    for code groups 1..G-1 (in talker width; projected on input when widths differ)."""

    def __init__(self, config: CodePredictorConfig, talker_hidden_size: int) -> None:
        # positions 0..G-1 per frame (talker hidden, code 0, codes 1..G-2)
        super().__init__(config.decoder, config.num_code_groups)
        self.codec_embedding = nn.ModuleList(
            nn.Embedding(config.decoder.vocab_size, talker_hidden_size)
            for _ in range(config.num_code_groups - 1)
        )


class CodePredictor(nn.Module):
    """Predicts code groups 1..G-1 of a frame from the talker's hidden state and code 0.

    Checkpoint prefix ``talker.code_predictor``: ``model`` (decoder + codec embeddings),
    ``lm_head.{0..G-2}`` and, when the predictor is narrower than the talker (1.7B),
    ``small_to_mtp_projection`` (Linear with bias, talker H -> predictor H).
    """

    def __init__(self, config: CodePredictorConfig, talker_hidden_size: int) -> None:
        super().__init__()
        hidden = config.decoder.hidden_size
        self.num_groups = config.num_code_groups
        self.model = CodePredictorModel(config, talker_hidden_size)
        self.lm_head = nn.ModuleList(
            nn.Linear(hidden, config.decoder.vocab_size, bias=False)
            for _ in range(config.num_code_groups - 1)
        )
        self.small_to_mtp_projection = (
            nn.Linear(talker_hidden_size, hidden, bias=True)
            if hidden != talker_hidden_size
            else None
        )

    def _project(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.small_to_mtp_projection is None else self.small_to_mtp_projection(x)

    def new_cache(self, batch: int, dtype: torch.dtype, device: torch.device | str) -> DenseKVCache:
        """A per-frame :class:`DenseKVCache` for ``batch`` frames (``G + 1`` positions; only
        ``G`` are used), its one-token forwards through the dense decode kernel on CUDA."""
        return self.model.new_dense_cache(batch, self.num_groups + 1, dtype, device, fused_decode=True)

    def predict(
        self,
        talker_hidden: torch.Tensor,
        code0_embedding: torch.Tensor,
        sample_fn: SampleFn,
        cache: DenseKVCache,
    ) -> torch.Tensor:
        """Codes of groups 1..G-1.

        Prefill ``[talker_hidden, code0_embedding]`` (positions 0, 1), ``lm_head[0]`` at
        position 1 gives group 1; then each step feeds ``codec_embedding[j-1](c_j)`` at
        position ``j + 1`` and ``lm_head[j]`` gives group ``j + 1`` (digest section 3).

        Args:
            talker_hidden: ``[B, H_talker]``, the talker's post-norm hidden state that
                produced code 0.
            code0_embedding: ``[B, H_talker]``, the talker's ``codec_embedding(code0)``.
            sample_fn: picks each group from ``logits [B, vocab]``.
            cache: a :class:`DenseKVCache` of this predictor for batch ``B``; it is reset.

        Returns:
            ``[B, G-1] int64`` on the inputs' device; no host sync.
        """
        b = talker_hidden.shape[0]
        device = talker_hidden.device
        cache.reset()
        cache.prepare(2)
        prefill = self._project(torch.stack((talker_hidden, code0_embedding), dim=1)).reshape(
            2 * b, -1
        )
        positions = torch.arange(2, device=device).repeat(b)
        hidden = self.model(prefill, positions, cache).view(b, 2, -1)[:, 1]
        codes = [sample_fn(1, self.lm_head[0](hidden))]
        for j in range(1, self.num_groups - 1):
            cache.prepare(1)
            x = self._project(self.model.codec_embedding[j - 1](codes[-1]))
            hidden = self.model(x, torch.full((b,), j + 1, dtype=torch.int64, device=device), cache)
            codes.append(sample_fn(j + 1, self.lm_head[j](hidden)))
        return torch.stack(codes, dim=1)
