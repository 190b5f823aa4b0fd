"""The decoder layers' Triton kernels (omnistage.engine.triton_layers, used by
omnistage.engine.layers) against the PyTorch form they replace: RMSNorm with its weight and
residual add, the q/k norms with RoPE, SwiGLU, and a whole decoder stack either way.

The kernels round where PyTorch's ops round, so in bf16 nearly every element is the same
bits; what may differ is a rounding flipped by the fp32 reduction order or ``rsqrt``/``exp``
approximations: one unit in the last place of an element, rarely."""

import copy
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from omnistage.engine import layers
from omnistage.engine.layers import Decoder, DecoderConfig, RMSNorm, RotaryEmbedding, apply_rope
from omnistage.engine.paged_attention import triton_available

needs_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and triton"
)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _ulp(t: torch.Tensor) -> torch.Tensor:
    """One unit in the last place of each element of ``t`` (its dtype's), as fp32."""
    mantissa = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[t.dtype]
    magnitude = t.float().abs().clamp_min(torch.finfo(t.dtype).tiny)
    return torch.exp2(torch.floor(torch.log2(magnitude)) - mantissa)


def assert_same_roundings(out: torch.Tensor, expected: torch.Tensor) -> None:
    """``out`` equals ``expected`` (same dtype and shape) but for rare one-ulp flips."""
    assert out.dtype == expected.dtype and out.shape == expected.shape
    diff = (out.float() - expected.float()).abs()
    assert (diff <= _ulp(expected) * 1.01).all(), diff.max().item()
    assert (out == expected).float().mean().item() >= 0.98


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [80, 1024, 2048])
def test_rms_norm_kernel_matches_pytorch_with_and_without_a_residual(dtype, cols) -> None:
    """Rows that are a slice of a wider tensor (strided), widths not a power of two: the
    norm with its weight as ``weight * F.rms_norm(x)``, the residual sum exactly ``x +
    delta``."""
    from omnistage.engine.triton_layers import rms_norm_triton

    g = torch.Generator().manual_seed(cols)
    wide = (torch.randn(37, cols + 16, generator=g) * 3).to("cuda", dtype)
    x = wide[:, 8 : 8 + cols]
    delta = torch.randn(37, cols, generator=g).to("cuda", dtype)
    weight = (torch.rand(cols, generator=g) + 0.5).to("cuda", dtype)
    normed, summed = rms_norm_triton(x, weight, 1e-6)
    assert summed is x
    assert_same_roundings(normed, weight * F.rms_norm(x, (cols,), eps=1e-6))
    normed, summed = rms_norm_triton(x, weight, 1e-6, delta)
    assert torch.equal(summed, x + delta)
    assert_same_roundings(normed, weight * F.rms_norm(x + delta, (cols,), eps=1e-6))


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope_kernel_matches_pytorch_and_leaves_v_alone(dtype) -> None:
    """16 q + 8 k + 8 v heads of 128 (the 0.6B talker's), positions anywhere in the table:
    the q/k heads become ``apply_rope(weight * rms_norm(x))`` in place, the v heads keep
    their bits."""
    from omnistage.engine.triton_layers import qk_norm_rope_triton_

    g = torch.Generator().manual_seed(1)
    n, hq, hkv, d = 45, 16, 8, 128
    qkv = (torch.randn(n, hq + 2 * hkv, d, generator=g) * 2).to("cuda", dtype)
    weight = (torch.rand(hq + 2 * hkv, d, generator=g) + 0.5).to("cuda", dtype)
    rotary = RotaryEmbedding(d, 1_000_000.0, 4096)
    rotary.reset_buffers("cuda")
    cos, sin = rotary(torch.randint(0, 4096, (n,), generator=g).cuda(), dtype)
    expected = apply_rope(weight * F.rms_norm(qkv, (d,), eps=1e-6), cos, sin)
    out = qkv.clone()
    qk_norm_rope_triton_(out, weight, cos, sin, 1e-6, hq + hkv)
    assert_same_roundings(out[:, : hq + hkv], expected[:, : hq + hkv])
    assert torch.equal(out[:, hq + hkv :], qkv[:, hq + hkv :])


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cols", [100, 768, 3072])
def test_swiglu_kernel_matches_pytorch(dtype, cols) -> None:
    from omnistage.engine.triton_layers import swiglu_triton

    g = torch.Generator().manual_seed(cols)
    gate_up = (torch.randn(21, 2 * cols, generator=g) * 4).to("cuda", dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    assert_same_roundings(swiglu_triton(gate_up), F.silu(gate) * up)


@pytest.mark.gpu
@needs_triton
def test_kernels_refuse_what_they_cannot_index() -> None:
    from omnistage.engine.triton_layers import qk_norm_rope_triton_, rms_norm_triton, swiglu_triton

    x = torch.randn(4, 64, device="cuda")
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(x, torch.ones(64, device="cuda", dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="unit inner stride"):
        rms_norm_triton(x.t(), torch.ones(4, device="cuda"), 1e-6)
    with pytest.raises(ValueError, match="heads 5"):
        qk_norm_rope_triton_(x.view(4, 2, 32), torch.ones(2, 32, device="cuda"), x[:, :32], x[:, :32], 1e-6, 5)
    with pytest.raises(ValueError, match=r"\[N, 2 I\]"):
        swiglu_triton(x[:, :63].contiguous())


@pytest.mark.gpu
@needs_triton
def test_a_decoder_with_the_kernels_matches_its_pytorch_form() -> None:
    """Four fused Qwen3 layers in bf16 over a prefill of 3 sequences and a decode step: the
    hidden states with the kernels differ from the PyTorch form's (every kernel replaced,
    ``triton_runs`` false) by less than bf16 itself differs from fp32."""
    config = DecoderConfig(hidden_size=256, intermediate_size=768, num_layers=4, num_heads=4, num_kv_heads=2,
                           head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6, vocab_size=16, attention_bias=False)
    torch.manual_seed(0)
    decoder = Decoder(config, 64).to("cuda").eval().requires_grad_(False)
    for p in decoder.parameters():
        p.uniform_(0.5, 1.5) if p.dim() == 1 else p.normal_(0, 0.05)
    embeds = torch.randn(3, 9, 256, device="cuda")

    def run(model: Decoder, dtype: torch.dtype) -> torch.Tensor:
        model.rotary.reset_buffers("cuda")
        model.fuse_projections()
        cache = model.new_dense_cache(3, 10, dtype, "cuda")
        cache.prepare(9)
        x = embeds.to(dtype)
        prefill = model(x.reshape(27, 256), torch.arange(9, device="cuda").repeat(3), cache)
        cache.prepare(1)
        step = model(x[:, -1], torch.full((3,), 9, device="cuda"), cache)
        return torch.cat((prefill, step)).float()

    with torch.inference_mode():
        exact = run(copy.deepcopy(decoder), torch.float32)
        bf16 = decoder.to(torch.bfloat16)
        fused = run(bf16, torch.bfloat16)
        with mock.patch.object(layers, "triton_runs", return_value=False):
            eager = run(bf16, torch.bfloat16)
    assert not torch.equal(fused, exact)
    assert (fused - eager).abs().max() < (eager - exact).abs().max()


def test_add_and_norm_is_the_residual_sum_and_its_norm() -> None:
    """The PyTorch form (CPU): ``(norm(x + delta), x + delta)``, in bf16 bit for bit."""
    norm = RMSNorm(32, 1e-6).to(torch.bfloat16)
    norm.weight.data.uniform_(0.5, 1.5)
    x, delta = (torch.randn(5, 32, dtype=torch.bfloat16) for _ in range(2))
    normed, summed = norm.add_and_norm(x, delta)
    assert torch.equal(summed, x + delta)
    assert torch.equal(normed, norm(x + delta))
