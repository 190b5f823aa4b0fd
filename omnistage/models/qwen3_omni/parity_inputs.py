"""Seeded inputs shared by the Qwen3-Omni parity script (tools/parity/) and its tests, so
fixtures store only the reference's outputs, never the inputs."""

from __future__ import annotations

import numpy as np
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


def chat_media(seed: int = 4) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Two 16 kHz mono float32 clips (1.3 s: two encoder chunks; 0.3 s) and two RGB uint8
    images (40 x 70: resized up to the minimum pixels; 90 x 50), seeded."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(1.3 * 16000)) / 16000
    clips = [
        (0.3 * np.sin(2 * np.pi * 440 * t) + 0.05 * rng.standard_normal(len(t))).astype(np.float32),
        (0.1 * rng.standard_normal(int(0.3 * 16000))).astype(np.float32),
    ]
    images = [
        rng.integers(0, 256, (40, 70, 3), dtype=np.uint8),
        rng.integers(0, 256, (90, 50, 3), dtype=np.uint8),
    ]
    return clips, images


def chat_conversation() -> list[dict]:
    """The prompt of :func:`chat_media` in transformers' message format: a system text, then
    a user turn with audio, image, text, audio, image."""
    return [
        {"role": "system", "content": [{"type": "text", "text": "You are brief."}]},
        {
            "role": "user",
            "content": [
                {"type": "audio"}, {"type": "image"}, {"type": "text", "text": "Compare these."},
                {"type": "audio"}, {"type": "image"},
            ],
        },
    ]  # fmt: skip
