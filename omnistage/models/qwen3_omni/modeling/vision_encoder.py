"""Qwen3-Omni's vision encoder (the thinker's ``visual``): image/video patches -> embeddings.

Architecture (shared/reference/qwen3-omni.md, section 1; numerics follow transformers 5.24
``Qwen3OmniMoeVisionEncoder``; weight names are the checkpoint's under ``thinker.visual.``):

- input rows are patches of ``in_channels x temporal_patch_size x patch x patch`` values
  (1536 at real dims) in the Qwen2-VL image processor's order: per image or video, frame
  groups, then 2x2 spatial-merge blocks, then the patches inside a block;
- a patch embedding (``Conv3d`` with kernel = stride, i.e. one linear map per patch) plus a
  learned square position grid (48 x 48 at real dims) resized bilinearly (corners aligned)
  to each image's patch grid;
- ``depth`` pre-LayerNorm blocks with 2-D rotary positions (half the rotary frequencies on
  the patch row, half on the column) whose attention stays inside one frame;
- the merger: LayerNorm per patch, then each 2x2 block's 4 patches concatenated and an MLP
  -> ``out_hidden_size``; after the blocks listed in ``deepstack_visual_indexes`` extra
  mergers (LayerNorm after the concatenation) give the deepstack features, which the thinker
  adds to its hidden states at visual positions after its first decoder layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.engine.model_runner import upload
from omnistage.models.qwen3_omni.modeling.segment_attention import Segments, attend_segments

NORM_EPS = 1e-6  # the blocks' and mergers' LayerNorm epsilon in the reference


@dataclass(frozen=True, slots=True)
class VisionEncoderConfig:
    """The vision encoder's dimensions (real checkpoint values as defaults).

    Attributes:
        depth / hidden_size / num_heads / intermediate_size: [27 / 1152 / 16 / 4304].
        in_channels / patch_size / temporal_patch_size: [3 / 16 / 2].
        spatial_merge_size: patches per side merged into one token [2].
        out_hidden_size: embedding width handed to the thinker [2048].
        num_position_embeddings: learned grid entries, a square [2304 = 48 x 48].
        deepstack_visual_indexes: blocks whose output feeds a deepstack merger [8, 16, 24].
        rope_theta: the 2-D rotary base [10000].
        hidden_act: the blocks' MLP activation ["gelu_pytorch_tanh"].
    """

    depth: int = 27
    hidden_size: int = 1152
    num_heads: int = 16
    intermediate_size: int = 4304
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 2048
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)
    rope_theta: float = 10000.0
    hidden_act: str = "gelu_pytorch_tanh"

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> VisionEncoderConfig:
        """Parse ``thinker_config.vision_config`` (``rope_theta`` read from
        ``rope_parameters`` or ``rope_scaling`` when present); unknown keys are ignored,
        missing ones take the real checkpoint's values.

        Raises:
            ValueError: an activation other than ``gelu_pytorch_tanh``, a non-square
                position grid, heads that do not divide the width, or deepstack indexes
                outside ``[0, depth)``.
        """
        names = set(cls.__dataclass_fields__)
        values = {k: v for k, v in raw.items() if k in names}
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if "rope_theta" in rope:
            values["rope_theta"] = float(rope["rope_theta"])
        if "deepstack_visual_indexes" in values:
            values["deepstack_visual_indexes"] = tuple(
                int(i) for i in values["deepstack_visual_indexes"]
            )
        config = cls(**values)
        side = round(config.num_position_embeddings**0.5)
        if config.hidden_act != "gelu_pytorch_tanh":
            raise ValueError(
                f"vision_config.hidden_act: only 'gelu_pytorch_tanh' is supported, got {config.hidden_act!r}"
            )
        if side * side != config.num_position_embeddings:
            raise ValueError(
                f"vision_config.num_position_embeddings {config.num_position_embeddings} is not a square"
            )
        if config.hidden_size % config.num_heads or (config.hidden_size // config.num_heads) % 4:
            raise ValueError(
                f"vision_config: hidden_size {config.hidden_size} / {config.num_heads} heads is no multiple of 4"
            )
        if any(not 0 <= i < config.depth for i in config.deepstack_visual_indexes):
            raise ValueError(
                f"vision_config.deepstack_visual_indexes {config.deepstack_visual_indexes} outside [0, {config.depth})"
            )
        return config

    @property
    def patch_values(self) -> int:
        """Values per input row: ``in_channels * temporal_patch_size * patch_size^2`` [1536]."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2

    @property
    def grid_side(self) -> int:
        """Side of the learned position grid [48]."""
        return round(self.num_position_embeddings**0.5)


def merged_tokens(grid_thw: torch.Tensor, config: VisionEncoderConfig) -> torch.Tensor:
    """Embeddings per image/video: ``t * h * w / spatial_merge_size^2`` (``[n, 3]`` -> ``[n]``)."""
    return grid_thw.prod(-1) // config.spatial_merge_size**2


def _merge_order(h: int, w: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row and column of each patch of an ``h x w`` grid, in merge-block order
    (block row, block column, row in block, column in block): two ``[h * w]`` int64."""
    rows = torch.arange(h).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
    cols = torch.arange(w).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
    return rows.transpose(1, 2).reshape(-1), cols.transpose(1, 2).reshape(-1)


def _bilinear_taps(index: torch.Tensor, size: int, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Source taps ``[n, 2]`` and weights ``[n, 2]`` that sample a ``side``-long axis at
    ``size`` points with corners aligned (as ``F.interpolate(align_corners=True)``)."""
    src = index.float() * (side - 1) / max(size - 1, 1)
    floor = src.floor()
    taps = floor.long()[:, None] + torch.arange(2)
    weights = (1 - (src[:, None] - taps.float()).abs()).clamp(min=0)
    return taps.clamp(max=side - 1), weights


class VisionAttention(nn.Module):
    def __init__(self, config: VisionEncoderConfig) -> None:
        super().__init__()
        self.heads = config.num_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], segments: Segments
    ) -> torch.Tensor:
        """``x [N, hidden]``, ``rope`` = cos, sin ``[N, head_dim]`` fp32, ``segments``:
        the frames (patches per frame), partitioning ``N``."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, -1).unbind(1)
        cos, sin = (t[:, None] for t in rope)
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(x.dtype)  # rotary in fp32
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(x.dtype)
        return self.proj(attend_segments(q, k, v, segments).reshape(n, -1))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class VisionMLP(nn.Module):
    def __init__(self, config: VisionEncoderConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionEncoderConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=NORM_EPS)
        self.attn = VisionAttention(config)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=NORM_EPS)
        self.mlp = VisionMLP(config)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], segments: Segments
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """``[N, hidden]`` patches (merge-block order) -> ``[N / m^2, out_hidden_size]``;
    LayerNorm per patch (``postshuffle=False``) or per concatenated block (True)."""

    def __init__(self, config: VisionEncoderConfig, postshuffle: bool) -> None:
        super().__init__()
        self.width = config.hidden_size * config.spatial_merge_size**2
        self.postshuffle = postshuffle
        self.ln_q = nn.LayerNorm(self.width if postshuffle else config.hidden_size, eps=NORM_EPS)
        self.mlp = nn.ModuleList(
            [
                nn.Linear(self.width, self.width),
                nn.GELU(),
                nn.Linear(self.width, config.out_hidden_size),
            ]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = (
            self.ln_q(x.reshape(-1, self.width))
            if self.postshuffle
            else self.ln_q(x).reshape(-1, self.width)
        )
        for layer in self.mlp:
            x = layer(x)
        return x


@dataclass(frozen=True, slots=True)
class VisionEncoderOutput:
    """Attributes:
    embeddings: ``[sum(merged_tokens), out_hidden_size]`` in the model dtype, images and
        videos end to end in input order.
    deepstack: ``[len(deepstack_visual_indexes), sum(merged_tokens), out_hidden_size]``.
    lengths: ``[n]`` int64 embeddings per image/video (:func:`merged_tokens`).
    """

    embeddings: torch.Tensor
    deepstack: torch.Tensor
    lengths: torch.Tensor


class VisionEncoder(nn.Module):
    """Patches of ``n`` images/videos -> embeddings and deepstack features."""

    def __init__(self, config: VisionEncoderConfig) -> None:
        super().__init__()
        self.config = c = config
        self.patch_embed = _PatchEmbed(c)
        self.pos_embed = nn.Embedding(c.num_position_embeddings, c.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(c) for _ in range(c.depth))
        self.merger = PatchMerger(c, postshuffle=False)
        self.merger_list = nn.ModuleList(
            PatchMerger(c, postshuffle=True) for _ in c.deepstack_visual_indexes
        )

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisionEncoderOutput:
        """Encode images/videos.

        Args:
            pixel_values: ``[sum(t * h * w), patch_values]`` float, the image processor's
                ``pixel_values`` / ``pixel_values_videos``.
            grid_thw: ``[n, 3]`` int64 (frame groups, patch rows, patch columns) per item;
                ``h`` and ``w`` multiples of ``spatial_merge_size``.

        Returns:
            :class:`VisionEncoderOutput`.

        Raises:
            ValueError: shapes that disagree with ``grid_thw`` or the config.
        """
        c = self.config
        grids = [tuple(int(v) for v in row) for row in grid_thw.tolist()]
        patches = sum(t * h * w for t, h, w in grids)
        if pixel_values.dim() != 2 or pixel_values.shape != (patches, c.patch_values):
            raise ValueError(
                f"pixel_values must be [{patches}, {c.patch_values}], got {tuple(pixel_values.shape)}"
            )
        m = c.spatial_merge_size
        if not grids or any(min(g) < 1 or g[1] % m or g[2] % m for g in grids):
            raise ValueError(f"grid_thw rows must be >= 1 with h, w multiples of {m}, got {grids}")
        x = self.patch_embed(pixel_values.to(self.pos_embed.weight.dtype))
        positions, rope = self._positions(grids)
        x = x + positions.to(x.dtype)
        segments = Segments.of([h * w for t, h, w in grids for _ in range(t)], x.device)
        deepstack = []
        for index, block in enumerate(self.blocks):
            x = block(x, rope, segments)
            if index in c.deepstack_visual_indexes:
                deepstack.append(self.merger_list[c.deepstack_visual_indexes.index(index)](x))
        embeddings = self.merger(x)
        stacked = (
            torch.stack(deepstack) if deepstack else embeddings.new_zeros(0, *embeddings.shape)
        )
        return VisionEncoderOutput(embeddings, stacked, merged_tokens(grid_thw.cpu(), c))

    def _positions(
        self, grids: list[tuple[int, int, int]]
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Learned position embeddings ``[N, hidden]`` and rotary cos, sin ``[N, head_dim]``
        fp32 for all patches, in input order."""
        c = self.config
        side, m = c.grid_side, c.spatial_merge_size
        device = self.pos_embed.weight.device
        # rotary frequencies: head_dim / 4 per axis, computed here in fp32 (no buffer to
        # restore after a meta-device load, and exact whatever the weights' dtype)
        rotary = c.hidden_size // c.num_heads // 2
        inv_freq = 1.0 / (
            c.rope_theta ** (torch.arange(0, rotary, 2, dtype=torch.float, device=device) / rotary)
        )
        sizes, taps, weights, rows_cols = [], [], [], []
        for _, h, w in grids:
            rows, cols = _merge_order(h, w, m)
            row_taps, row_weights = _bilinear_taps(rows, h, side)
            col_taps, col_weights = _bilinear_taps(cols, w, side)
            taps.append((row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4))
            weights.append((row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4))
            rows_cols.append(torch.stack([rows, cols], -1))
            sizes.append(h * w)
        # one frame's patches per item, every item's in one upload each (a host-to-device copy
        # that waits would wait for all the work queued on the stream the engines share)
        taps, weights, rows_cols = (upload(torch.cat(x), device) for x in (taps, weights, rows_cols))
        embed = (self.pos_embed(taps) * weights[..., None].to(self.pos_embed.weight.dtype)).sum(1)
        freqs = torch.cat([rows_cols[:, :1] * inv_freq, rows_cols[:, 1:] * inv_freq], -1)
        frames = [t for t, _, _ in grids]
        embeds = torch.cat([e.repeat(t, 1) for e, t in zip(embed.split(sizes), frames, strict=True)])
        angle = torch.cat([a.repeat(t, 1) for a, t in zip(freqs.split(sizes), frames, strict=True)]).float()
        angle = torch.cat([angle, angle], dim=-1)
        return embeds, (angle.cos(), angle.sin())


class _PatchEmbed(nn.Module):
    """``Conv3d(kernel = stride = (temporal, patch, patch))`` on each row's single patch."""

    def __init__(self, config: VisionEncoderConfig) -> None:
        super().__init__()
        c = config
        kernel = (c.temporal_patch_size, c.patch_size, c.patch_size)
        self.proj = nn.Conv3d(c.in_channels, c.hidden_size, kernel, stride=kernel)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        """``[N, patch_values]`` -> ``[N, hidden]`` (one patch per row: the conv is a linear map)."""
        return F.linear(rows, self.proj.weight.reshape(self.proj.out_channels, -1), self.proj.bias)


def expected_weights(config: VisionEncoderConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor names (without the ``thinker.visual.`` prefix) and shapes."""
    with torch.device("meta"):
        return {name: tuple(t.shape) for name, t in VisionEncoder(config).state_dict().items()}
