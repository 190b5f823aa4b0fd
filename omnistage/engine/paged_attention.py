"""The paged attention backend: the attention contract of :mod:`omnistage.engine.attention`
over a :class:`~omnistage.engine.kv_cache.PagedKVCache`.

Two kinds of forward, announced by the runner before the first layer:

- prefill (:meth:`PagedAttention.prepare_prefill`): whole prompts of several requests,
  concatenated (variable lengths); each new token attends causally within its own
  sequence. Without a cached prefix, attention needs only the new tokens. On CUDA in half precision it is ONE variable-length flash-attention
  call per layer (``torch.nn.attention.varlen.varlen_attn``, cumulative sequence
  offsets); elsewhere, and where a start-up probe finds that kernel missing or wrong, one
  causal SDPA call per sequence (:func:`varlen_prefill_attention`, also the test oracle; a
  profile at 64 concurrent streams showed that Python loop). (One call with a
  block-diagonal ``[N, N]`` mask was simpler, but a mask sends SDPA to its math path,
  which materializes ``Hq x N x N`` scores: at 64 coalesced voice-clone prompts, ~6,400
  tokens, that ran an H200 out of memory.)
  With a cached prefix (prefix caching: a sequence's first tokens are in shared blocks,
  only the rest is new), each new token attends to its sequence's whole context, the
  prefix read from the pool: on CUDA in half precision the contexts are gathered from the
  pool (one ``index_select`` each for keys and values) and attended to in the same ONE
  varlen flash-attention call, with query and key offsets of their own and the causal
  mask aligned to the context's end; elsewhere (and where the probe finds that wrong)
  :func:`prefix_prefill_attention`, one SDPA call per sequence with a lower-right causal
  mask (the oracle). That per-sequence loop is what made the prefix-cached 0.6B slower
  than no prefix caching on an H200 (benchmarks/README.md): 28 layers x B sequences of
  small kernels in every prefill.
- decode (:meth:`PagedAttention.prepare_decode`): one new token per sequence, attending to
  its whole cached context through its block table.

Either way every layer first writes its new ``k, v`` at the tokens' slots. Decode attention
has a plain PyTorch reference (:func:`paged_decode_reference`, used on CPU and as the test
oracle) and a Triton kernel (:mod:`omnistage.engine.triton_decode`) used on CUDA;
:func:`decode_attention_for` picks one.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import itertools
import logging
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from omnistage.engine.kv_cache import PagedKVCache

logger = logging.getLogger(__name__)

# (q [B, Hq, D], k_cache [S, Hkv, D], v_cache [S, Hkv, D], block_tables [B, MB] int64,
#  context_lens [B] int64, block_size) -> [B, Hq, D]
DecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def paged_decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """Decode attention by gathering each sequence's keys into a padded batch.

    Args:
        q: ``[B, Hq, D]``, one query token per sequence.
        k_cache, v_cache: ``[S, Hkv, D]``, one layer of the pool (``S`` slots).
        block_tables: ``[B, MB] int64``; entries past a sequence's blocks are ignored.
        context_lens: ``[B] int64``, tokens each sequence attends to (its new one included).
        block_size: tokens per block.

    Returns:
        ``[B, Hq, D]``: softmax(q k^T / sqrt(D)) v over each sequence's first
        ``context_len`` tokens (grouped-query: query head h reads kv head h // (Hq/Hkv)).
    """
    offsets = torch.arange(block_tables.shape[1] * block_size, device=q.device)
    slots = block_tables[:, offsets // block_size] * block_size + offsets % block_size  # [B, L]
    keys = k_cache[slots].transpose(1, 2)  # [B, Hkv, L, D]
    values = v_cache[slots].transpose(1, 2)
    mask = (offsets[None, :] < context_lens[:, None])[:, None, None, :]  # [B, 1, 1, L]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], keys, values, attn_mask=mask, enable_gqa=keys.shape[1] != q.shape[1]
    )
    return out[:, :, 0, :]


def varlen_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
    """Causal attention of concatenated sequences: q ``[N, Hq, D]``, k/v ``[N, Hkv, D]``,
    ``seq_lens`` summing to ``N``; returns ``[N, Hq, D]``. Memory is linear in each
    sequence's length (SDPA's fused kernels with ``is_causal``)."""
    gqa = k.shape[1] != q.shape[1]
    outs, start = [], 0
    for n in seq_lens:
        qs, ks, vs = (t[start : start + n].transpose(0, 1) for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa).transpose(0, 1))
        start += n
    return torch.cat(outs)


def prefix_prefill_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, context_slots: torch.Tensor,
    seq_lens: list[int], context_lens: list[int],
) -> torch.Tensor:
    """Causal attention of new tokens over their sequences' whole contexts: q ``[N, Hq,
    D]`` (the new tokens, concatenated), ``k_cache``/``v_cache`` ``[S, Hkv, D]`` (one
    layer of the pool, the new tokens' k/v already written), ``context_slots [C] int64``
    (each sequence's context slots in order, concatenated), ``seq_lens`` (new tokens per
    sequence) and ``context_lens`` (context tokens, new ones included, the new being the
    last). Token ``i`` of ``n`` new ones in a context of ``L`` attends to context tokens
    ``0 .. L - n + i``. Returns ``[N, Hq, D]``."""
    gqa = k_cache.shape[1] != q.shape[1]
    outs, start, context_start = [], 0, 0
    for n, length in zip(seq_lens, context_lens, strict=True):
        slots = context_slots[context_start : context_start + length]
        qs = q[start : start + n].transpose(0, 1)
        ks, vs = k_cache[slots].transpose(0, 1), v_cache[slots].transpose(0, 1)
        mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=gqa).transpose(0, 1))
        start, context_start = start + n, context_start + length
    return torch.cat(outs)


def flash_varlen_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
    cu_seqlens_k: torch.Tensor | None = None, max_len_k: int | None = None,
) -> torch.Tensor:
    """Causal attention of concatenated sequences in one flash-attention call: q ``[N, Hq,
    D]``, k/v ``[N, Hkv, D]`` (fp16/bf16, CUDA), ``cu_seqlens [S + 1] int32`` (cumulative
    sequence lengths from 0), ``max_len`` the longest sequence; returns ``[N, Hq, D]``.

    With ``cu_seqlens_k`` / ``max_len_k``, k/v are each sequence's whole context ``[C,
    Hkv, D]`` (its cumulative lengths, its longest), the queries being its last tokens:
    query ``i`` of ``n`` in a context of ``L`` attends to context tokens ``0 .. L - n + i``
    (flash attention's causal mask is aligned to the bottom right; the probe checks it
    against :func:`prefix_prefill_attention`).

    Raises:
        ImportError: this torch has no ``varlen_attn``.
    """
    from torch.nn.attention.varlen import varlen_attn

    if cu_seqlens_k is None:
        cu_seqlens_k, max_len_k = cu_seqlens, max_len

    q, k, v = (t.contiguous() for t in (q, k, v))  # the kernel's layout; a no-op for most layers
    params = _parameters(varlen_attn)
    if k.shape[1] != q.shape[1] and "enable_gqa" not in params:
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    kwargs: dict[str, object] = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}
    if "is_causal" in params:  # torch 2.9-2.11 spell causal masking so
        kwargs["is_causal"] = True
    else:
        kwargs["window_size"] = (-1, 0)
    return varlen_attn(q, k, v, cu_seqlens, cu_seqlens_k, max_len, max_len_k, **kwargs)


@functools.cache
def _parameters(function: Callable[..., object]) -> Mapping[str, inspect.Parameter]:
    """``function``'s parameters, read once: ``inspect.signature`` took 0.09 ms a call on the
    development machine, paid per layer of every prefill otherwise (about 2 ms of host time
    in the launch of a 20-layer talker's prefill)."""
    return inspect.signature(function).parameters


def flash_varlen_usable(
    device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int,
    with_context: bool = False,
) -> bool:
    """Whether :func:`flash_varlen_prefill` runs here and matches the per-sequence loop,
    checked once on a small random batch (a torch without the kernel, a GPU or dtype it
    does not support, or a signature it changed all answer False, logged with the reason).
    ``with_context``: the cached-prefix form (contexts longer than the queries) against
    :func:`prefix_prefill_attention`."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    lengths = [5, 17, 1, 40]
    contexts = [37, 17, 50, 40] if with_context else lengths  # a context starting with a cached prefix, or not
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(sum(lengths), num_heads, head_dim, device=device, dtype=dtype, generator=g)
    k = torch.randn(sum(contexts), num_kv_heads, head_dim, device=device, dtype=dtype, generator=g)
    v = torch.randn(sum(contexts), num_kv_heads, head_dim, device=device, dtype=dtype, generator=g)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *itertools.accumulate(contexts)], dtype=torch.int32, device=device)
    form = "with cached prefixes" if with_context else "of whole prompts"
    try:
        fused = flash_varlen_prefill(q, k, v, cu, max(lengths), cu_k, max(contexts))
    except (ImportError, AttributeError, AssertionError, RuntimeError, TypeError, ValueError) as exc:
        logger.warning("prefill attention %s: varlen flash attention unavailable (%r); one SDPA call per sequence", form, exc)
        return False
    if with_context:
        slots = torch.arange(sum(contexts), device=device)
        expected = prefix_prefill_attention(q, k, v, slots, lengths, contexts)
    else:
        expected = varlen_prefill_attention(q, k, v, lengths)
    error = (fused.float() - expected.float()).abs().max().item()
    if error > 2e-2:
        logger.warning("prefill attention %s: varlen flash attention differs by %.3g; one SDPA call per sequence", form, error)
        return False
    return True


@functools.cache
def triton_available() -> bool:
    """Whether Triton is installed (looked up once: a fact of the installation; the vocoder's
    SnakeBeta asks on every call, and a path search costs ~24 us)."""
    return importlib.util.find_spec("triton") is not None


#: Input dtypes the elementwise Triton kernels (:mod:`omnistage.engine.triton_layers`,
#: :mod:`omnistage.engine.triton_vocoder`) take on CUDA.
TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def triton_runs(x: torch.Tensor, *params: torch.Tensor | None) -> bool:
    """Whether the elementwise Triton kernels run for input ``x``: on CUDA with Triton
    installed, for :data:`TRITON_DTYPES`, and only when no gradient is needed for ``x`` or
    any given tensor of ``params`` (no autograd through them: models decode under inference
    mode, their weights frozen). Otherwise callers run their PyTorch form, which is also the
    CPU's."""
    grads = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, *params)
    )
    return x.is_cuda and x.dtype in TRITON_DTYPES and not grads and triton_available()


def decode_attention_for(device: torch.device, use_triton: bool | None = None) -> DecodeAttention:
    """The decode attention for ``device``: the Triton kernel on CUDA when Triton is
    installed (``use_triton=None``), else the PyTorch reference.

    Raises:
        ValueError: ``use_triton=True`` on a CPU device or without Triton installed.
    """
    if use_triton is None:
        use_triton = device.type == "cuda" and triton_available()
    if not use_triton:
        return paged_decode_reference
    if device.type != "cuda" or not triton_available():
        raise ValueError(f"the Triton decode kernel needs CUDA and triton (device {device})")
    from omnistage.engine.triton_decode import paged_decode_triton

    return paged_decode_triton


class PagedAttention:
    """The attention backend over a paged pool (see the module docstring).

    Args:
        cache: the pool.
        decode_attention: from :func:`decode_attention_for`.
        fused_prefill: prefill with :func:`flash_varlen_prefill` instead of one SDPA call
            per sequence; None: decided by :meth:`decide_fused`, or else by the first
            prefill (from its query heads).
        fused_prefix_prefill: the same for a prefill over cached prefixes (instead of
            :func:`prefix_prefill_attention`), decided with it.

    The engine decides both when it is built (:meth:`decide_fused`, from the model's heads):
    its first eager prefill comes with live traffic (a prefill of a few tokens replays a
    graph that does not come here), and in a served run on an H100 (benchmarks/README.md,
    2026-12-07 third session) the first probe held the GIL for 0.4 s, importing
    ``torch.nn.attention.varlen``.
    """

    def __init__(
        self, cache: PagedKVCache, decode_attention: DecodeAttention, fused_prefill: bool | None = None,
        fused_prefix_prefill: bool | None = None,
    ) -> None:
        self.cache = cache
        self.decode_attention = decode_attention
        self.fused_prefill, self.fused_prefix_prefill = fused_prefill, fused_prefix_prefill
        self._slots = torch.empty(0, dtype=torch.int64)
        self._seq_lens: list[int] | None = None  # set for a prefill forward
        self._cu_seqlens: torch.Tensor | None = None  # set for a fused prefill forward
        self._context: tuple[torch.Tensor, list[int]] | None = None  # a prefill over cached prefixes
        self._block_tables = self._context_lens = self._slots

    def prepare_prefill(
        self, slot_mapping: torch.Tensor, seq_lens: list[int],
        context_slots: torch.Tensor | None = None, context_lens: list[int] | None = None,
    ) -> None:
        """A prefill forward of ``N`` new tokens: ``slot_mapping [N] int64`` and the new
        tokens of each sequence (host ints summing to ``N``, in token order); where some
        sequences begin with a cached prefix, also every sequence's context slots
        (``context_slots``, concatenated, device int64) and lengths (``context_lens``,
        host ints; see :func:`prefix_prefill_attention`)."""
        self._slots = slot_mapping
        self._seq_lens = list(seq_lens)
        self._cu_seqlens = None
        self._context = None if context_slots is None else (context_slots, list(context_lens or ()))
        fused = self.fused_prefill if self._context is None else self.fused_prefix_prefill
        if fused is not False and slot_mapping.is_cuda:
            # the queries' offsets, then (with cached prefixes) the contexts': one upload
            offsets = [0, *itertools.accumulate(seq_lens)]
            if self._context is not None:
                offsets += [0, *itertools.accumulate(self._context[1])]
            host = torch.tensor(offsets, dtype=torch.int32).pin_memory()
            self._cu_seqlens = host.to(slot_mapping.device, non_blocking=True)

    def prepare_decode(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor) -> None:
        """A decode forward of ``B`` tokens, one per sequence: ``slot_mapping [B]``,
        ``block_tables [B, MB]``, ``context_lens [B]`` (all int64, the new token counted)."""
        # contiguous once per forward, not once per layer in the Triton kernel's wrapper
        # (the runner passes a column of its [B, 3] step index)
        self._slots, self._block_tables = slot_mapping, block_tables.contiguous()
        self._context_lens = context_lens.contiguous()
        self._seq_lens, self._context = None, None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]
        k_cache.index_copy_(0, self._slots, k)
        v_cache.index_copy_(0, self._slots, v)
        if self._seq_lens is not None:
            self.decide_fused(q.shape[1])
        if self._seq_lens is not None and self._context is not None:
            return self._prefix_prefill(q, k_cache, v_cache, self._seq_lens, *self._context)
        if self._seq_lens is not None:
            if self.fused_prefill and self._cu_seqlens is not None:
                return flash_varlen_prefill(q, k, v, self._cu_seqlens[: len(self._seq_lens) + 1], max(self._seq_lens))
            return varlen_prefill_attention(q, k, v, self._seq_lens)
        return self.decode_attention(
            q, k_cache, v_cache, self._block_tables, self._context_lens, self.cache.block_size
        )

    def decide_fused(self, num_heads: int) -> None:
        """Decide both prefill forms where not decided yet (:func:`flash_varlen_usable`
        with the pool's dtype, device, KV heads and head size, and ``num_heads`` query
        heads; on a CPU pool both are False at once)."""
        if self.fused_prefill is not None and self.fused_prefix_prefill is not None:
            return  # the common case: every prefill layer asks
        _, _, num_kv_heads, head_dim = self.cache.k.shape
        geometry = (self.cache.k.device, self.cache.k.dtype, num_heads, num_kv_heads, head_dim)
        if self.fused_prefill is None:
            self.fused_prefill = flash_varlen_usable(*geometry)
        if self.fused_prefix_prefill is None:
            self.fused_prefix_prefill = flash_varlen_usable(*geometry, with_context=True)

    def _prefix_prefill(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq_lens: list[int],
        context_slots: torch.Tensor, context_lens: list[int],
    ) -> torch.Tensor:
        if not (self.fused_prefix_prefill and self._cu_seqlens is not None):
            return prefix_prefill_attention(q, k_cache, v_cache, context_slots, seq_lens, context_lens)
        cu_q, cu_k = self._cu_seqlens[: len(seq_lens) + 1], self._cu_seqlens[len(seq_lens) + 1 :]
        keys, values = k_cache.index_select(0, context_slots), v_cache.index_select(0, context_slots)
        return flash_varlen_prefill(q, keys, values, cu_q, max(seq_lens), cu_k, max(context_lens))
