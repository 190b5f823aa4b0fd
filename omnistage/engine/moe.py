"""A routed mixture-of-experts feed-forward layer (Qwen3-MoE style), reusable by any model.

Routing: router logits ``x @ gate.weight.T`` ``[N, E]``, softmax in fp32, the top ``k``
experts per token, their probabilities renormalized to sum 1 when ``norm_topk_prob`` and cast
back to the activation dtype. Expert ``e`` is a SwiGLU ``down_e(silu(gate_e(x)) * up_e(x))``;
a token's output is the weighted sum over its ``k`` experts (Qwen3 technical report; the
numerical reference is transformers' ``Qwen3OmniMoeThinkerTextSparseMoeBlock``).

Expert weights are stacked at load time into ``expert_gate_up [E, H, 2I]`` (gate columns
first, then up) and ``expert_down [E, I, H]``: the layout a grouped GEMM reads (``x @ W[e]``
per group), so no per-step transposes. Checkpoints store one tensor per expert
(``experts.{e}.{gate,up,down}_proj.weight``, nn.Linear layout); :meth:`SparseMoE.load_expert`
copies one expert in.

Two execution paths, same math:
- ``"grouped"``: tokens sorted by expert, two ``torch.nn.functional.grouped_mm`` calls with
  jagged offsets, put back in assignment order and summed per token (:func:`combine_experts`:
  deterministic, no atomic adds). Device-only (no host sync), so it can be captured
  in a CUDA graph. Used on CUDA for bf16 activations (the kernels' supported dtype); it also
  runs on the CPU for fp32 when sizes are 16-byte aligned (the tests compare both paths).
- ``"loop"``: one plain matmul pair per expert that received tokens (reads the counts on the
  host). The CPU path, and CUDA for dtypes the grouped kernel lacks.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.engine.layers import swiglu

__all__ = ["MoEImpl", "SparseMoE", "combine_experts", "route"]

MoEImpl = Literal["auto", "grouped", "loop"]


def route(
    x: torch.Tensor, router_weight: torch.Tensor, top_k: int, norm_topk_prob: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of ``x [N, H]`` by ``router_weight [E, H]``.

    Returns ``(weights [N, k]`` in ``x.dtype``, ``experts [N, k] int64)``, experts in order of
    decreasing probability."""
    logits = F.linear(x, router_weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), experts


def combine_experts(y: torch.Tensor, order: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each token's weighted sum of its ``k`` expert outputs, in a fixed order.

    Args:
        y: ``[N * k, H]`` expert outputs in expert-sorted order: row ``i`` belongs to
            assignment ``order[i]`` (assignment ``t * k + j``: token ``t``'s ``j``-th expert).
        order: ``[N * k] int64``, a permutation (the stable argsort of the expert ids).
        weights: ``[N, k]`` routing weights (``y.dtype``).

    Returns:
        ``[N, H]`` in ``y.dtype``: ``sum_j weights[:, j] * y_of(t, j)``, summed over ``j`` in
        that order by one reduction, whatever ``order`` is. So the result never depends on
        the batch's routing or on the device's scheduling: ``index_add_`` (the earlier
        combine) adds with atomics on CUDA, in an order that changes from run to run, and
        rounds each add to bf16, so two runs of one step (eager and its CUDA graph) differed
        and greedy tokens flipped.
    """
    n, k = weights.shape
    y = torch.empty_like(y).index_copy_(0, order, y).view(n, k, -1)  # assignment order
    return (y * weights[:, :, None]).sum(dim=1)


class SparseMoE(nn.Module):
    """Router ``gate`` (checkpoint name ``mlp.gate.weight [E, H]``) plus ``E`` SwiGLU experts.

    Args:
        hidden_size: ``H``.
        intermediate_size: ``I``, each expert's width.
        num_experts: ``E``.
        top_k: experts per token (1..E).
        norm_topk_prob: renormalize the top-k probabilities.
        impl: ``"auto"`` (grouped on CUDA for bf16, else loop), ``"grouped"`` or ``"loop"``.

    Raises:
        ValueError: ``top_k`` not in 1..num_experts, or an unknown ``impl``.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        impl: MoEImpl = "auto",
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k = {top_k} is not in 1..{num_experts}")
        if impl not in ("auto", "grouped", "loop"):
            raise ValueError(f"impl = {impl!r} is not 'auto', 'grouped' or 'loop'")
        self.num_experts, self.top_k, self.norm_topk_prob, self.impl = (
            num_experts,
            top_k,
            norm_topk_prob,
            impl,
        )
        self.intermediate_size = intermediate_size
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.expert_gate_up = nn.Parameter(
            torch.empty(num_experts, hidden_size, 2 * intermediate_size)
        )
        self.expert_down = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size))

    @staticmethod
    def expert_names(prefix: str, num_experts: int) -> list[str]:
        """The checkpoint's per-expert tensor names under ``prefix`` (e.g. ``...mlp.``)."""
        return [
            f"{prefix}experts.{e}.{p}_proj.weight"
            for e in range(num_experts)
            for p in ("gate", "up", "down")
        ]

    @torch.no_grad()
    def load_expert(
        self, expert: int, gate_proj: torch.Tensor, up_proj: torch.Tensor, down_proj: torch.Tensor
    ) -> None:
        """Copy expert ``expert`` in from nn.Linear-layout weights: ``gate_proj, up_proj [I, H]``,
        ``down_proj [H, I]`` (any float dtype; cast to the parameters')."""
        i = self.intermediate_size
        self.expert_gate_up[expert, :, :i].copy_(gate_proj.T)
        self.expert_gate_up[expert, :, i:].copy_(up_proj.T)
        self.expert_down[expert].copy_(down_proj.T)

    def _use_grouped(self, x: torch.Tensor) -> bool:
        if self.impl != "auto":
            return self.impl == "grouped"
        return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(F, "grouped_mm")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [N, H]`` -> ``[N, H]`` in ``x.dtype``."""
        weights, experts = route(x, self.gate.weight, self.top_k, self.norm_topk_prob)
        flat = experts.flatten()
        order = flat.argsort(stable=True)  # assignments grouped by expert, token order kept
        tokens = order // self.top_k
        if self._use_grouped(x):
            # counts by index_add, not bincount: bincount sizes its output from the data (a host
            # sync), which would break CUDA-graph capture
            counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
            offsets = counts.index_add_(0, flat, torch.ones_like(flat)).cumsum(0).to(torch.int32)
            gate_up = F.grouped_mm(x[tokens], self.expert_gate_up, offs=offsets)
            y = F.grouped_mm(swiglu(gate_up), self.expert_down, offs=offsets)
        else:
            y = x.new_empty(order.shape[0], x.shape[1])
            start = 0
            for e, count in enumerate(torch.bincount(flat, minlength=self.num_experts).tolist()):
                if count:
                    rows = slice(start, start + count)
                    y[rows] = swiglu(x[tokens[rows]] @ self.expert_gate_up[e]) @ self.expert_down[e]
                    start += count
        return combine_experts(y, order, weights)
