"""Bidirectional attention within segments of a packed sequence (the encoders' ``cu_seqlens``).

The audio encoder attends within windows of 104 tokens, the vision encoder within each
image or video frame; many segments share a length, so segments are batched by length and
each batch is one plain ``scaled_dot_product_attention`` call without a mask (exact, and no
``[N, N]`` block-diagonal mask for long inputs).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.nn.functional as F


def attend_segments(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[int]
) -> torch.Tensor:
    """Full attention inside each segment, none across.

    Args:
        q, k, v: ``[N, heads, head_dim]``, the segments laid end to end.
        lengths: segment lengths in order, summing to ``N`` (each >= 1).

    Returns:
        ``[N, heads, head_dim]`` in the dtype of ``q``.

    Raises:
        ValueError: ``lengths`` does not sum to ``N`` or holds a length below 1.
    """
    if sum(lengths) != q.shape[0] or any(n < 1 for n in lengths):
        raise ValueError(f"segment lengths {lengths} do not partition {q.shape[0]} positions")
    starts_by_length: dict[int, list[int]] = defaultdict(list)
    start = 0
    for n in lengths:
        starts_by_length[n].append(start)
        start += n
    out = torch.empty_like(q)
    for n, starts in starts_by_length.items():
        index = (
            torch.tensor(starts, device=q.device)[:, None] + torch.arange(n, device=q.device)
        ).reshape(-1)
        # [S * n, heads, d] -> [S, heads, n, d]
        qs, ks, vs = (
            t.index_select(0, index).view(len(starts), n, *t.shape[1:]).transpose(1, 2)
            for t in (q, k, v)
        )
        attended = F.scaled_dot_product_attention(qs, ks, vs)
        out.index_copy_(0, index, attended.transpose(1, 2).reshape(-1, *q.shape[1:]))
    return out
