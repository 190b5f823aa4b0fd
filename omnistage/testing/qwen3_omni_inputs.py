"""Seeded inputs shared by the Qwen3-Omni parity script (tools/parity/) and its tests, so
fixtures store only the reference's outputs, never the inputs."""

from __future__ import annotations

import torch

AUDIO_FRAMES = (250, 37, 1000)  # a tail chunk; one short chunk; two attention windows (tiny)
VISION_GRIDS = ((1, 6, 10), (3, 4, 4), (1, 12, 8))  # (t, h, w) patches: images and a video
CODE2WAV_FRAMES = 40


def audio_features(num_mel_bins: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-mel-like features ``[num_mel_bins, sum(AUDIO_FRAMES)]`` fp32 ~ N(0, 1) and the
    frames per audio ``[3]`` int64."""
    frames = torch.tensor(AUDIO_FRAMES)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_mel_bins, int(frames.sum()), generator=generator), frames


def vision_patches(patch_values: int, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalized-pixel-like patches ``[sum(t * h * w), patch_values]`` fp32 ~ N(0, 1) and
    ``grid_thw [3, 3]`` int64."""
    grid = torch.tensor(VISION_GRIDS)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(int(grid.prod(-1).sum()), patch_values, generator=generator), grid


def code_frames(num_quantizers: int, codebook_size: int, seed: int = 3) -> torch.Tensor:
    """Random codes ``[CODE2WAV_FRAMES, num_quantizers]`` int64 in ``[0, codebook_size)``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, codebook_size, (CODE2WAV_FRAMES, num_quantizers), generator=generator)
