"""The Qwen3-MoE decoder stack shared by the thinker's text model and the talker.

Pre-RMSNorm layers: grouped-query attention with per-head q/k RMSNorm and interleaved MRoPE
(the shared :class:`~omnistage.engine.layers.Attention`, which calls the
engine's attention contract ``attn(layer, q, k, v)``), then a feed-forward block chosen per
layer (routed experts, the talker's shared-expert MoE, or a dense SwiGLU), then a final norm.
Tokens are flattened over the batch: ``[N, H]`` rows with positions ``[3, N]``.

Deepstack (DeepStack, Meng et al. 2024; transformers' ``_deepstack_process``), given as the
engine's :class:`~omnistage.engine.sequence.HiddenAdditions`: after decoder layer ``l <
len(deepstack.embeds)``, ``deepstack.embeds[l]`` is added to the rows at ``deepstack.rows``. A *captured* hidden state follows the reference's ``hidden_states`` tuple:
index 0 is the input embeddings, ``k`` in 1..L-1 the output of layer ``k - 1`` before its
deepstack addition, ``L`` the final-norm output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.engine.attention import AttentionBackend
from omnistage.engine.layers import MLP, DecoderConfig, DecoderLayer, RMSNorm
from omnistage.engine.moe import SparseMoE
from omnistage.engine.sequence import HiddenAdditions
from omnistage.models.qwen3_omni.modeling.config import MoEDecoderConfig
from omnistage.models.qwen3_omni.modeling.mrope import MRotaryEmbedding

__all__ = ["DecoderOutput", "MoEDecoder", "SharedExpertMoE", "attention_config"]


def attention_config(config: MoEDecoderConfig) -> DecoderConfig:
    """The attention geometry in the form the shared attention module reads (its
    ``intermediate_size`` and ``rope_theta`` are unused by attention)."""
    return DecoderConfig(
        hidden_size=config.hidden_size, intermediate_size=config.intermediate_size, num_layers=config.num_layers,
        num_heads=config.num_heads, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope.theta, vocab_size=config.vocab_size,
        attention_bias=config.attention_bias,
    )  # fmt: skip


class SharedExpertMoE(SparseMoE):
    """The talker's feed-forward: routed experts plus a shared SwiGLU expert gated per token by
    ``sigmoid(shared_expert_gate(x))`` (transformers' ``Qwen3OmniMoeTalkerTextSparseMoeBlock``)."""

    def __init__(self, config: MoEDecoderConfig) -> None:
        super().__init__(
            config.hidden_size,
            config.moe_intermediate_size,
            config.num_experts,
            config.top_k,
            config.norm_topk_prob,
        )
        assert (
            config.shared_expert_intermediate_size is not None
        )  # parse() requires it for the talker
        self.shared_expert = MLP(config.hidden_size, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return super().forward(x) + shared


FeedForwardFactory = Callable[[MoEDecoderConfig, int], nn.Module]


def routed_or_dense(config: MoEDecoderConfig, layer: int) -> nn.Module:
    """The thinker's rule: routed experts where :meth:`MoEDecoderConfig.is_moe_layer`, else a
    dense SwiGLU of ``intermediate_size``."""
    if config.is_moe_layer(layer):
        return SparseMoE(
            config.hidden_size,
            config.moe_intermediate_size,
            config.num_experts,
            config.top_k,
            config.norm_topk_prob,
        )
    return MLP(config.hidden_size, config.intermediate_size)


def shared_expert_moe(config: MoEDecoderConfig, layer: int) -> nn.Module:
    """The talker's rule: every layer is a :class:`SharedExpertMoE`."""
    return SharedExpertMoE(config)


@dataclass(frozen=True)
class DecoderOutput:
    """``hidden [N, H]`` after the final norm; ``captured``: one ``[N, H]`` per requested
    ``hidden_states`` index (see the module docstring), in the order asked."""

    hidden: torch.Tensor
    captured: tuple[torch.Tensor, ...] = ()


class MoEDecoder(nn.Module):
    """``layers``, ``norm`` and the MRoPE tables of one stack.

    Args:
        config: the stack's geometry.
        feed_forward: builds layer ``l``'s feed-forward block (:func:`routed_or_dense` or
            :func:`shared_expert_moe`).
    """

    def __init__(self, config: MoEDecoderConfig, feed_forward: FeedForwardFactory) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(
            DecoderLayer(attention_config(config), i, feed_forward(config, i))
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = MRotaryEmbedding(config.head_dim, config.rope)

    def reset_buffers(self, device: torch.device | str) -> None:
        """Rebuild the non-persistent RoPE buffers on ``device``."""
        self.rotary.reset_buffers(device)

    def decode(
        self,
        input_embeds: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        deepstack: HiddenAdditions | None = None,
        capture_layers: tuple[int, ...] = (),
    ) -> DecoderOutput:
        """``input_embeds [N, H]``, ``positions [3, N]`` (or ``[N]`` for text-only rows) ->
        :class:`DecoderOutput`, with the ``hidden_states`` indices ``capture_layers``
        captured in that order. ``attn`` must be prepared for this forward.

        Raises: ValueError when a capture index is not in 0..num_layers or deepstack has
        more levels than layers."""
        n_layers = len(self.layers)
        if any(not 0 <= i <= n_layers for i in capture_layers):
            raise ValueError(f"capture_layers {capture_layers} are not all in 0..{n_layers}")
        if deepstack is not None and len(deepstack.embeds) > n_layers:
            raise ValueError(f"{len(deepstack.embeds)} deepstack levels for {n_layers} layers")
        cos, sin = self.rotary(positions, input_embeds.dtype)
        x, delta = input_embeds, None  # the residual stream x + delta (see DecoderLayer)
        states = {0: x} if 0 in capture_layers else {}
        for index, layer in enumerate(self.layers):
            x, delta = layer(x, delta, cos, sin, attn)
            captured = index + 1 in capture_layers and index + 1 < n_layers
            stacked = deepstack is not None and index < len(deepstack.embeds)
            if captured or stacked:
                x, delta = x + delta, None
            if captured:
                states[index + 1] = x
            if stacked:
                x = x.index_add(0, deepstack.rows, deepstack.embeds[index].to(x.dtype))
        hidden = self.norm.add_and_norm(x, delta)[0]
        states[n_layers] = hidden
        return DecoderOutput(hidden=hidden, captured=tuple(states[i] for i in capture_layers))

    def forward(
        self, input_embeds: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """The engine contract: hidden ``[N, H]`` after the final norm."""
        return self.decode(input_embeds, positions, attn).hidden
