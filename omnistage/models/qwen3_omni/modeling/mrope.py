"""Qwen3-Omni's multimodal RoPE: the 3-D position ids of a prompt and the interleaved rotary
tables (shared/reference/qwen3-omni.md, section 4; numerical reference: transformers 5.24
``Qwen3OmniMoePreTrainedModelForConditionalGeneration.get_rope_index`` and
``Qwen3OmniMoeThinkerTextRotaryEmbedding``).

Positions have three rows (T, H, W). Text advances all three by one per token. An image is a
block at one time index with H/W the row/column in the merged patch grid; a video block's T
is ``t * seconds_per_grid * position_id_per_seconds`` (fractional when a grid spans a fraction
of a second); audio is linear. With audio in video, the video and audio positions of one clip
are merged in order of T (video first on ties). After each block, counting resumes at the
maximum of the block's last piece + 1, exactly as the reference does. Positions are float32
because video T can be fractional; the decode position of step ``s`` after a prompt of
``L`` tokens is ``L + s + delta`` with ``delta = max + 1 - L``.

Frequencies: ``inv_freq[j] = theta ** (-2j / D)`` for ``j < D/2``; frequency ``j`` rotates by
the H row when ``j % 3 == 1`` and ``j < 3 * sections[1]``, by the W row when ``j % 3 == 2`` and
``j < 3 * sections[2]``, else by the T row (interleaved MRoPE).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from omnistage.models.qwen3_omni.modeling.config import RopeConfig, ThinkerConfig

__all__ = ["MRotaryEmbedding", "MultimodalLayout", "PromptPositions", "prompt_positions"]


class MRotaryEmbedding(nn.Module):
    """cos / signed sin tables ``[N, D]`` for positions ``[3, N]`` (or ``[N]``: text only),
    in the rotate-half layout of :func:`omnistage.engine.layers.apply_rope`
    (``sin`` with its first half negated). ``axis`` (non-persistent ``[D/2] int64``) says which
    position row rotates each frequency."""

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        if rope.mrope_section is None:
            raise ValueError("MRotaryEmbedding needs an mrope_section")
        self.head_dim, self.theta, self.sections = head_dim, rope.theta, rope.mrope_section
        self.register_buffer("inv_freq", self._inv_freq(None), persistent=False)
        self.register_buffer("axis", self._axis(None), persistent=False)

    def _inv_freq(self, device: torch.device | str | None) -> torch.Tensor:
        exponent = (
            torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float()
            / self.head_dim
        )
        return 1.0 / (self.theta**exponent)

    def _axis(self, device: torch.device | str | None) -> torch.Tensor:
        j = torch.arange(self.head_dim // 2, device=device)
        axis = torch.zeros_like(j)
        axis[(j % 3 == 1) & (j < 3 * self.sections[1])] = 1
        axis[(j % 3 == 2) & (j < 3 * self.sections[2])] = 2
        return axis

    def reset_buffers(self, device: torch.device | str) -> None:
        """Recompute the buffers on ``device`` (after a meta-device build)."""
        self.inv_freq, self.axis = self._inv_freq(device), self._axis(device)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions [3, N]`` or ``[N]`` (any real dtype) -> ``cos, signed sin [N, D]`` in
        ``dtype``; computed in fp32 as the reference does."""
        if positions.dim() == 1:
            positions = positions[None].expand(3, -1)
        freqs = positions[..., None].float() * self.inv_freq  # [3, N, D/2]
        n = freqs.shape[1]
        freqs = freqs.gather(0, self.axis.view(1, 1, -1).expand(1, n, -1))[0]  # [N, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        return torch.cat((cos, cos), dim=-1).to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)


@dataclass(frozen=True)
class MultimodalLayout:
    """What the positions of a prompt's multimodal blocks depend on, in prompt order.

    Attributes:
        image_grids: per image ``(t, h, w)`` in patches (before the spatial merge).
        video_grids: per video ``(t, h, w)`` in patches.
        video_seconds_per_grid: per video, seconds one temporal grid step spans.
        audio_lengths: per audio (including the audio of a video), its number of audio tokens
            (the encoder's output length).
        use_audio_in_video: videos are followed by their own audio, interleaved by time.
    """

    image_grids: Sequence[tuple[int, int, int]] = ()
    video_grids: Sequence[tuple[int, int, int]] = ()
    video_seconds_per_grid: Sequence[float] = ()
    audio_lengths: Sequence[int] = ()
    use_audio_in_video: bool = False


@dataclass(frozen=True)
class PromptPositions:
    """``positions [3, L] float32``; ``delta``: add to ``L + step`` for decode step ``step``."""

    positions: torch.Tensor
    delta: float = field(default=0.0)

    def decode(self, index: int) -> torch.Tensor:
        """Position ``[3, 1] float32`` of the token at sequence index ``index`` >= L."""
        return torch.full((3, 1), float(index), dtype=torch.float32) + self.delta


def _linear(start: float, length: int) -> torch.Tensor:
    return (torch.arange(length, dtype=torch.float32) + start).expand(3, -1)


def _vision_block(
    start: float, grid: tuple[int, int, int], merge: int, t_step: torch.Tensor
) -> torch.Tensor:
    """``[3, t * h/merge * w/merge]``: T from ``t_step [t]``, H/W the merged grid row/column."""
    t, h, w = grid[0], grid[1] // merge, grid[2] // merge
    rows = torch.arange(h, dtype=torch.float32).view(1, -1, 1).expand(t, h, w).flatten()
    cols = torch.arange(w, dtype=torch.float32).view(1, 1, -1).expand(t, h, w).flatten()
    times = t_step.view(-1, 1).expand(t, h * w).flatten()
    return torch.stack((times, rows, cols)) + start


def _merge_by_time(video: torch.Tensor, audio: torch.Tensor) -> list[torch.Tensor]:
    """The pieces of an audio-in-video block in the reference's order: one column at a time by
    T (video first on ties), then the remainder of whichever is left as one piece."""
    pieces, v, a = [], 0, 0
    while v < video.shape[1] and a < audio.shape[1]:
        if video[0, v] <= audio[0, a]:
            pieces.append(video[:, v : v + 1])
            v += 1
        else:
            pieces.append(audio[:, a : a + 1])
            a += 1
    if v < video.shape[1]:
        pieces.append(video[:, v:])
    if a < audio.shape[1]:
        pieces.append(audio[:, a:])
    return pieces


def prompt_positions(
    input_ids: Sequence[int], config: ThinkerConfig, layout: MultimodalLayout = MultimodalLayout()
) -> PromptPositions:
    """3-D positions of a prompt (thinker, or the talker over its own ids).

    Blocks start at ``vision_start`` (then an image token, a video token, or with
    ``use_audio_in_video`` an ``audio_start``) or at ``audio_start``; each consumes its
    placeholder tokens plus one start and one end token (two each for audio in video), and the
    next entry of ``layout``.

    Raises:
        ValueError: a block has no layout entry left, a block's tokens run past the prompt,
            or layout entries are left over.
    """
    c = config
    ids = list(input_ids)
    pieces: list[torch.Tensor] = []
    nxt = 0.0  # the next position: max of the last piece + 1
    image = video = audio = 0
    i = 0

    def take(lengths: Sequence, index: int, what: str):
        if index >= len(lengths):
            raise ValueError(
                f"the prompt has more {what} blocks than the layout describes ({len(lengths)})"
            )
        return lengths[index]

    def block_end(i: int, length: int) -> int:
        if i + length > len(ids):
            raise ValueError(
                f"a multimodal block of {length} tokens at index {i} runs past the prompt ({len(ids)} tokens)"
            )
        return i + length

    while i < len(ids):
        tok, after = ids[i], ids[i + 1] if i + 1 < len(ids) else None
        merge = c.spatial_merge_size
        if (
            tok == c.vision_start_token_id
            and after == c.audio_start_token_id
            and layout.use_audio_in_video
        ):
            grid, seconds = (
                take(layout.video_grids, video, "video"),
                take(layout.video_seconds_per_grid, video, "video"),
            )
            n_audio = take(layout.audio_lengths, audio, "audio")
            pieces.append(_linear(nxt, 2))
            start = nxt + 2
            t_step = (
                torch.arange(grid[0]) * torch.tensor(float(seconds)) * c.position_id_per_seconds
            )
            vid = _vision_block(start, grid, merge, t_step.float())
            pieces.extend(_merge_by_time(vid, _linear(start, n_audio)))
            i = block_end(i, 2 + vid.shape[1] + n_audio + 2)
            video, audio = video + 1, audio + 1
            pieces.append(_linear(float(pieces[-1].max()) + 1, 2))
        elif tok == c.vision_start_token_id and after in (c.image_token_id, c.video_token_id):
            is_image = after == c.image_token_id
            if is_image:
                grid = take(layout.image_grids, image, "image")
                t_step = (torch.arange(grid[0]) * 1 * c.position_id_per_seconds).float()
                image += 1
            else:
                grid, seconds = (
                    take(layout.video_grids, video, "video"),
                    take(layout.video_seconds_per_grid, video, "video"),
                )
                t_step = (
                    torch.arange(grid[0]) * torch.tensor(float(seconds)) * c.position_id_per_seconds
                ).float()
                video += 1
            pieces.append(_linear(nxt, 1))
            block = _vision_block(nxt + 1, grid, merge, t_step)
            pieces.append(block)
            i = block_end(i, 1 + block.shape[1] + 1)
            pieces.append(_linear(float(block.max()) + 1, 1))
        elif tok == c.audio_start_token_id:
            n_audio = take(layout.audio_lengths, audio, "audio")
            audio += 1
            pieces.append(_linear(nxt, 1 + n_audio + 1))
            i = block_end(i, 1 + n_audio + 1)
        else:
            run = 1  # a run of text tokens is one linear piece
            while i + run < len(ids) and ids[i + run] not in (
                c.vision_start_token_id,
                c.audio_start_token_id,
            ):
                run += 1
            pieces.append(_linear(nxt, run))
            i += run
        nxt = float(pieces[-1].max()) + 1
    left = {"image": len(layout.image_grids) - image, "video": len(layout.video_grids) - video,
            "audio": len(layout.audio_lengths) - audio}  # fmt: skip
    extra = {k: v for k, v in left.items() if v}
    if extra:
        raise ValueError(f"layout entries without a block in the prompt: {extra}")
    positions = torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0)
    delta = float(positions.max()) + 1 - len(ids) if ids else 0.0
    return PromptPositions(positions=positions, delta=delta)
