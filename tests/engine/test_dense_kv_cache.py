"""DenseKVCache: incremental forwards equal one causal forward over the whole sequence."""

import pytest
import torch
import torch.nn.functional as F

from omnistage.engine.attention import DenseKVCache


def test_incremental_forwards_equal_one_causal_forward() -> None:
    torch.manual_seed(0)
    b, hq, hkv, d, lengths = 3, 4, 2, 8, [5, 1, 3]
    total = sum(lengths)
    q, k, v = torch.randn(b, total, hq, d), torch.randn(b, total, hkv, d), torch.randn(b, total, hkv, d)
    cache = DenseKVCache(num_layers=2, batch=b, max_len=16, num_kv_heads=hkv, head_dim=d)
    outs, start = [], 0
    for n in lengths:
        cache.prepare(n)
        sl = slice(start, start + n)
        flat = [t[:, sl].reshape(b * n, *t.shape[2:]) for t in (q, k, v)]
        outs.append(cache(1, *flat).view(b, n, hq, d))
        start += n
    expected = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
    ).transpose(1, 2)
    torch.testing.assert_close(torch.cat(outs, dim=1), expected, rtol=1e-5, atol=1e-6)


def test_prepare_beyond_capacity_raises() -> None:
    cache = DenseKVCache(num_layers=1, batch=1, max_len=4, num_kv_heads=1, head_dim=2)
    cache.prepare(3)
    with pytest.raises(ValueError, match="holds 4 tokens"):
        cache.prepare(2)
