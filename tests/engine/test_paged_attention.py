"""Paged attention: the PyTorch reference paths equal dense SDPA; the Triton kernel (GPU)
equals the reference."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from omnistage.engine.attention import DenseKVCache
from omnistage.engine.kv_cache import PagedKVCache
from omnistage.engine.paged_attention import (
    PagedAttention,
    decode_attention_for,
    flash_varlen_prefill,
    flash_varlen_usable,
    paged_decode_reference,
    prefix_prefill_attention,
    triton_available,
    varlen_prefill_attention,
)


def scattered_cache(lengths, hkv, d, block_size, dtype=torch.float32, device="cpu", seed=0):
    """A pool whose sequences own shuffled blocks; returns (k_cache, v_cache, tables,
    dense k, dense v) with dense[i] = [length_i, hkv, d]."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in lengths]
    num_blocks = sum(per_seq) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    k_cache = torch.randn(num_blocks * block_size, hkv, d, generator=g).to(device, dtype)
    v_cache = torch.randn(num_blocks * block_size, hkv, d, generator=g).to(device, dtype)
    width = max(per_seq)
    tables = torch.full((len(lengths), width), order[-1], dtype=torch.int64)
    dense_k, dense_v = [], []
    for i, (n, blocks) in enumerate(zip(lengths, per_seq, strict=True)):
        table = [order.pop() for _ in range(blocks)]
        tables[i, :blocks] = torch.tensor(table)
        slots = torch.tensor([table[t // block_size] * block_size + t % block_size for t in range(n)])
        dense_k.append(k_cache[slots.to(device)])
        dense_v.append(v_cache[slots.to(device)])
    return k_cache, v_cache, tables.to(device), dense_k, dense_v


def dense_decode(q, dense_k, dense_v):
    outs = []
    for i, (k, v) in enumerate(zip(dense_k, dense_v, strict=True)):
        o = F.scaled_dot_product_attention(
            q[i][:, None].float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(), enable_gqa=True
        )
        outs.append(o[:, 0])
    return torch.stack(outs)


@pytest.mark.parametrize("block_size", [4, 16])
def test_reference_decode_matches_sdpa_over_each_sequence(block_size):
    lengths, hq, hkv, d = [1, 5, 16, 37], 8, 2, 16
    k_cache, v_cache, tables, dense_k, dense_v = scattered_cache(lengths, hkv, d, block_size)
    q = torch.randn(len(lengths), hq, d, generator=torch.Generator().manual_seed(1))
    out = paged_decode_reference(q, k_cache, v_cache, tables, torch.tensor(lengths), block_size)
    torch.testing.assert_close(out, dense_decode(q, dense_k, dense_v), rtol=1e-5, atol=1e-5)


def test_varlen_prefill_equals_one_block_diagonal_causal_sdpa():
    """The oracle: every token attends to the tokens of its own sequence not after it, as
    one SDPA over all tokens with a block-diagonal causal mask."""
    g = torch.Generator().manual_seed(2)
    lengths, hq, hkv, d = [3, 1, 6], 4, 2, 8
    q, k, v = (torch.randn(sum(lengths), h, d, generator=g) for h in (hq, hkv, hkv))
    seq_ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    positions = torch.cat([torch.arange(n) for n in lengths])
    mask = (seq_ids[:, None] == seq_ids[None, :]) & (positions[None, :] <= positions[:, None])
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, enable_gqa=True
    ).transpose(0, 1)
    torch.testing.assert_close(varlen_prefill_attention(q, k, v, lengths), expected, rtol=1e-5, atol=1e-6)


def test_paged_backend_prefill_then_decode_equals_the_dense_cache():
    """Two sequences of different lengths: prefill together, then decode steps, through
    the paged backend; each equals its own DenseKVCache run."""
    g = torch.Generator().manual_seed(3)
    hq, hkv, d, bs, lengths, steps = 4, 2, 8, 4, [5, 2], 6
    cache = PagedKVCache(num_layers=1, num_kv_heads=hkv, head_dim=d, num_blocks=8, block_size=bs,
                         dtype=torch.float32, device=torch.device("cpu"))
    tables = [[3, 0, 6], [1, 5, 2]]
    attn = PagedAttention(cache, paged_decode_reference)
    dense = [DenseKVCache(1, 1, 16, hkv, d) for _ in lengths]

    def slot(i, t):
        return tables[i][t // bs] * bs + t % bs

    tokens = [[(torch.randn(1, h, d, generator=g)) for h in (hq, hkv, hkv)] for _ in range(sum(lengths))]
    flat = [torch.cat([t[j] for t in tokens]) for j in range(3)]
    seq_ids = torch.tensor([0] * 5 + [1] * 2)
    positions = torch.tensor(list(range(5)) + list(range(2)))
    attn.prepare_prefill(torch.tensor([slot(i, int(p)) for i, p in zip(seq_ids, positions, strict=True)]), [5, 2])
    out = attn(0, *flat)
    for i, (lo, hi) in enumerate([(0, 5), (5, 7)]):
        dense[i].prepare(hi - lo)
        torch.testing.assert_close(out[lo:hi], dense[i](0, *(x[lo:hi] for x in flat)), rtol=1e-5, atol=1e-6)
    context = list(lengths)
    for _ in range(steps):
        q, k, v = (torch.randn(2, h, d, generator=g) for h in (hq, hkv, hkv))
        attn.prepare_decode(torch.tensor([slot(i, context[i]) for i in range(2)]), torch.tensor(tables),
                            torch.tensor([c + 1 for c in context]))
        out = attn(0, q, k, v)
        for i in range(2):
            dense[i].prepare(1)
            torch.testing.assert_close(out[i : i + 1], dense[i](0, q[i : i + 1], k[i : i + 1], v[i : i + 1]),
                                       rtol=1e-5, atol=1e-6)
            context[i] += 1


def test_cpu_prefills_one_sequence_at_a_time():
    """The fused varlen kernel is CUDA-only; a CPU backend decides for the per-sequence
    loop on its first prefill (the path the other tests pin), for the prefix form too."""
    assert not flash_varlen_usable(torch.device("cpu"), torch.float32, 4, 2, 8)
    cache = PagedKVCache(num_blocks=4, num_layers=1, num_kv_heads=2, head_dim=8, block_size=16, dtype=torch.float32, device="cpu")
    attn = PagedAttention(cache, paged_decode_reference)
    attn.prepare_prefill(torch.arange(5), [2, 3])
    q, k, v = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    torch.testing.assert_close(attn(0, q, k, v), varlen_prefill_attention(q, k, v, [2, 3]))
    assert attn.fused_prefill is False and attn.fused_prefix_prefill is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_decide_fused_probes_both_prefill_forms_before_any_prefill():
    """On CUDA, :meth:`PagedAttention.decide_fused` (the engine's start-up call) settles both
    prefill forms from the pool's geometry and the query heads, before any prefill."""
    hq, hkv, d = 16, 8, 128
    cache = PagedKVCache(num_blocks=4, num_layers=1, num_kv_heads=hkv, head_dim=d, block_size=16,
                         dtype=torch.bfloat16, device=torch.device("cuda"))
    attn = PagedAttention(cache, paged_decode_reference)
    attn.decide_fused(hq)
    device = torch.device("cuda")
    assert attn.fused_prefill is flash_varlen_usable(device, torch.bfloat16, hq, hkv, d)
    assert attn.fused_prefix_prefill is flash_varlen_usable(device, torch.bfloat16, hq, hkv, d, with_context=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("lengths", "hq", "hkv"), [([1], 16, 8), ([7, 64, 65, 300], 16, 8), ([100] * 64, 16, 8)])
def test_fused_varlen_prefill_matches_the_per_sequence_loop(lengths, hq, hkv):
    d = 128
    q = torch.randn(sum(lengths), hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lengths), hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(sum(lengths), hkv, d, device="cuda", dtype=torch.bfloat16)
    assert flash_varlen_usable(q.device, q.dtype, hq, hkv, d)
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")
    out = flash_varlen_prefill(q, k, v, cu, max(lengths))
    torch.testing.assert_close(out.float(), varlen_prefill_attention(q, k, v, lengths).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("lengths", "contexts"), [([1], [33]), ([7, 64, 3, 20], [39, 64, 100, 20]), ([14] * 64, [110] * 64)])
def test_fused_prefill_over_cached_prefixes_matches_the_per_sequence_loop(lengths, contexts):
    """Prefix caching on CUDA: new tokens attend to contexts whose first tokens are in the
    pool (scattered blocks) in one varlen flash call, as the per-sequence SDPA loop does."""
    hq, hkv, d, bs = 16, 8, 128, 16
    per_seq = [-(-n // bs) for n in contexts]
    cache = PagedKVCache(num_layers=1, num_kv_heads=hkv, head_dim=d, num_blocks=sum(per_seq) + 1, block_size=bs,
                         dtype=torch.bfloat16, device=torch.device("cuda"))
    cache.k[0].normal_()
    cache.v[0].normal_()
    order = torch.randperm(sum(per_seq)).tolist()
    context_slots, new_slots = [], []
    for n, length, blocks in zip(lengths, contexts, per_seq, strict=True):
        table = [order.pop() for _ in range(blocks)]
        slots = [table[t // bs] * bs + t % bs for t in range(length)]
        context_slots += slots
        new_slots += slots[length - n :]
    context_d = torch.tensor(context_slots, device="cuda")
    q = torch.randn(sum(lengths), hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(sum(lengths), hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(sum(lengths), hkv, d, device="cuda", dtype=torch.bfloat16)
    attn = PagedAttention(cache, paged_decode_reference)
    attn.prepare_prefill(torch.tensor(new_slots, device="cuda"), lengths, context_d, contexts)
    out = attn(0, q, k, v)
    assert attn.fused_prefix_prefill is True
    expected = prefix_prefill_attention(q, cache.k[0], cache.v[0], context_d, lengths, contexts)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_cpu_selects_the_reference_and_refuses_triton():
    assert decode_attention_for(torch.device("cpu")) is paged_decode_reference
    with pytest.raises(ValueError, match="needs CUDA"):
        decode_attention_for(torch.device("cpu"), use_triton=True)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("lengths", "hq", "hkv"), [
    ([1], 16, 8), ([7, 64, 65, 300], 16, 8), ([1000] * 3 + [17] * 29, 16, 2), ([129] * 128, 8, 8),
])
def test_triton_decode_matches_the_reference(dtype, lengths, hq, hkv):
    d, block_size = 128, 16
    k_cache, v_cache, tables, _, _ = scattered_cache(lengths, hkv, d, block_size, dtype, "cuda")
    q = torch.randn(len(lengths), hq, d, device="cuda").to(dtype)
    context = torch.tensor(lengths, device="cuda")
    out = decode_attention_for(torch.device("cuda"), use_triton=True)(q, k_cache, v_cache, tables, context, block_size)
    expected = paged_decode_reference(q.float(), k_cache.float(), v_cache.float(), tables, context, block_size)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol)
