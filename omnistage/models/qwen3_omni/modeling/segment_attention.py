"""Bidirectional attention within segments of a packed sequence (the encoders' ``cu_seqlens``).

The audio encoder attends within windows of 104 tokens, the vision encoder within each
image or video frame; many segments share a length, so segments are batched by length and
each batch is one plain ``scaled_dot_product_attention`` call without a mask (exact, and no
``[N, N]`` block-diagonal mask for long inputs).

The segments' positions are copied to the device once per encoder call (:class:`Segments`),
not once per layer: a host-to-device copy waits for all the work queued on the device's
stream before it, which the engines of the other stages share (at real size a
32-layer audio tower call waited 32 times behind the thinker's and talker's steps).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from omnistage.engine.model_runner import upload


@dataclass(frozen=True)
class Segments:
    """A packed sequence's segments, batched by length, positions on the device.

    Attributes:
        total: positions ``N`` the segments partition.
        groups: ``(n, index)`` per distinct segment length ``n``, in first-seen order:
            ``index [S * n]`` int64, the positions of its ``S`` segments, segment by segment.
    """

    total: int
    groups: tuple[tuple[int, torch.Tensor], ...]

    @classmethod
    def of(cls, lengths: list[int], device: torch.device) -> Segments:
        """From the segment lengths in order (one host-to-device copy, which does not wait:
        :func:`~omnistage.engine.model_runner.upload`).

        Raises:
            ValueError: ``lengths`` is empty or holds a length below 1.
        """
        if not lengths or any(n < 1 for n in lengths):
            raise ValueError(f"segment lengths must be >= 1, got {lengths}")
        starts_by_length: dict[int, list[int]] = defaultdict(list)
        start = 0
        for n in lengths:
            starts_by_length[n].append(start)
            start += n
        indexes = [
            (torch.tensor(starts)[:, None] + torch.arange(n)).reshape(-1)
            for n, starts in starts_by_length.items()
        ]
        on_device = upload(torch.cat(indexes), device).split([len(i) for i in indexes])
        return cls(start, tuple(zip(starts_by_length, on_device, strict=True)))


def attend_segments(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments
) -> torch.Tensor:
    """Full attention inside each segment, none across.

    Args:
        q, k, v: ``[N, heads, head_dim]``, the segments laid end to end.
        segments: their :class:`Segments` (on the device of ``q``).

    Returns:
        ``[N, heads, head_dim]`` in the dtype of ``q``.

    Raises:
        ValueError: ``segments`` does not partition the ``N`` positions.
    """
    if segments.total != q.shape[0]:
        raise ValueError(f"segments of {segments.total} positions do not partition {q.shape[0]}")
    out = torch.empty_like(q)
    for n, index in segments.groups:
        # [S * n, heads, d] -> [S, heads, n, d]
        qs, ks, vs = (
            t.index_select(0, index).view(-1, n, *t.shape[1:]).transpose(1, 2) for t in (q, k, v)
        )
        attended = F.scaled_dot_product_attention(qs, ks, vs)
        out.index_copy_(0, index, attended.transpose(1, 2).reshape(-1, *q.shape[1:]))
    return out
