"""The decoder layers' Triton kernels (omnistage.engine.triton_layers, used by
omnistage.engine.layers) against the PyTorch form they replace: RMSNorm with its weight and
residual add, the q/k norms with RoPE, SwiGLU, the MoE experts' SwiGLU, and decoder stacks
either way.

In bf16 and fp16 the kernels round where PyTorch's ops round, so nearly every element is the
same bits; a rounding may flip where a row's fp32 scale differs in its last bit (the sum's
order, ``rsqrt``), by a unit or two of the row's scale. In fp32 the results differ in their
last few bits."""

import collections
import contextlib
import copy
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from omnistage.engine import layers
from omnistage.engine.layers import Decoder, DecoderConfig, RMSNorm, RotaryEmbedding, apply_rope
from omnistage.engine.moe import SparseMoE
from omnistage.engine.paged_attention import triton_available

needs_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and triton"
)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _ulp(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One unit in the last place of ``dtype`` at each magnitude of ``t``, as fp32."""
    mantissa = {torch.bfloat16: 7, torch.float16: 10, torch.float32: 23}[dtype]
    magnitude = t.float().abs().clamp_min(torch.finfo(dtype).tiny)
    return torch.exp2(torch.floor(torch.log2(magnitude)) - mantissa)


def assert_same_roundings(out: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    """``out`` equals ``expected`` (same dtype and shape) within two units in the last place
    of ``scale`` (default: each element's own magnitude) and, in bf16/fp16, bit for bit in
    99% of the elements; in fp32 within eight units (Triton's interpreter on the CPU gave
    up to three against PyTorch's CPU ops, with numpy's arithmetic: not yet seen on a GPU)."""
    assert out.dtype == expected.dtype and out.shape == expected.shape
    diff = (out.float() - expected.float()).abs()
    units = 8 if expected.dtype == torch.float32 else 2
    bound = units * _ulp(expected if scale is None else scale, expected.dtype)
    assert (diff <= bound).all(), (diff / bound).max().item()
    if expected.dtype != torch.float32:
        assert (out == expected).float().mean().item() >= 0.99


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
    for d in (delta, delta.t().contiguous().t()):  # rows of unit stride, then a strided view
        normed, summed = rms_norm_triton(x, weight, 1e-6, d)
        assert torch.equal(summed, x + delta) and summed.is_contiguous()
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
    qk = expected[:, : hq + hkv]
    # RoPE's two products may cancel: a flipped product is a unit of the row, not the sum
    assert_same_roundings(out[:, : hq + hkv], qk, scale=qk.abs().amax(-1, keepdim=True))
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
    with pytest.raises(ValueError, match=r"rms_norm_triton cannot take .*weight \(64,\) .*bfloat16.*rms_norm_fits"):
        rms_norm_triton(x, torch.ones(64, device="cuda", dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match=r"x \(64, 4\) stride \(1, 64\)"):
        rms_norm_triton(x.t(), torch.ones(4, device="cuda"), 1e-6)
    with pytest.raises(ValueError, match=r"qk_norm_rope_triton_ cannot take .*heads 5: .*qk_norm_rope_fits"):
        qk_norm_rope_triton_(x.view(4, 2, 32), torch.ones(2, 32, device="cuda"), x[:, :32], x[:, :32], 1e-6, 5)
    with pytest.raises(ValueError, match=r"gate_up \(4, 63\).*swiglu_fits"):
        swiglu_triton(x[:, :63].contiguous())
    with pytest.raises(ValueError, match="on cpu"):
        swiglu_triton(x.cpu())


@contextlib.contextmanager
def _spied() -> Iterator[collections.Counter]:
    """Count the calls of each layer kernel's wrapper (they still run)."""
    from omnistage.engine import triton_layers

    calls: collections.Counter = collections.Counter()
    with contextlib.ExitStack() as stack:
        for name in ("rms_norm_triton", "qk_norm_rope_triton_", "swiglu_triton", "dense_decode_attention_triton"):
            kernel = getattr(triton_layers, name)

            def counted(*args, _kernel=kernel, _name=name, **kwargs):
                calls[_name] += 1
                return _kernel(*args, **kwargs)

            stack.enter_context(mock.patch.object(triton_layers, name, counted))
        yield calls


def _eager() -> contextlib.AbstractContextManager:
    """Every layer kernel replaced by its PyTorch form (the dispatch sees no Triton)."""
    return mock.patch.object(layers, "triton_runs", return_value=False)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("num_layers", [1, 4])
def test_a_decoder_with_the_kernels_matches_its_pytorch_form(num_layers) -> None:
    """Fused Qwen3 layers in bf16 over a prefill of 3 sequences and a decode step: the hidden
    states with the kernels differ from the PyTorch form's by less than bf16 itself differs
    from fp32; after one layer nearly all of them are the same bits."""
    config = DecoderConfig(hidden_size=256, intermediate_size=768, num_layers=num_layers, num_heads=4,
                           num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6, vocab_size=16,
                           attention_bias=False)
    torch.manual_seed(0)
    decoder = Decoder(config, 64).to("cuda").eval().requires_grad_(False)
    for p in decoder.parameters():
        p.uniform_(0.5, 1.5) if p.dim() == 1 else p.normal_(0, 0.05)
    embeds = torch.randn(3, 9, 256, device="cuda")

    def run(model: Decoder, dtype: torch.dtype) -> torch.Tensor:
        model.rotary.reset_buffers("cuda")
        model.fuse_projections()
        cache = model.new_dense_cache(3, 10, dtype, "cuda", fused_decode=True)
        cache.prepare(9)
        x = embeds.to(dtype)
        prefill = model(x.reshape(27, 256), torch.arange(9, device="cuda").repeat(3), cache)
        cache.prepare(1)
        step = model(x[:, -1], torch.full((3,), 9, device="cuda"), cache)
        return torch.cat((prefill, step))

    with torch.inference_mode():
        exact = run(copy.deepcopy(decoder), torch.float32)
        bf16 = decoder.to(torch.bfloat16)
        with _spied() as calls:
            fused = run(bf16, torch.bfloat16)
        # per forward: 2 norms a layer and the final one; a q/k kernel and a SwiGLU a layer;
        # the decode step's attention a layer (the prefill's is SDPA)
        assert calls == {"rms_norm_triton": 2 * (2 * num_layers + 1), "qk_norm_rope_triton_": 2 * num_layers,
                         "swiglu_triton": 2 * num_layers, "dense_decode_attention_triton": num_layers}
        with _eager():
            eager = run(bf16, torch.bfloat16)
    assert (fused.float() - eager.float()).abs().max() < (eager.float() - exact).abs().max()
    if num_layers == 1:  # the prefill's 27 rows: the elementwise kernels round as PyTorch does
        # (the decode rows' attention is the dense decode kernel, fp32 throughout and rounded
        # once at its output, unlike SDPA's kernels: the interpreter gave 95% bit-equal overall)
        assert (fused[:27] == eager[:27]).float().mean().item() >= 0.95


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("batch", "hq", "hkv", "dim", "length", "position"),
                         [(128, 16, 8, 128, 17, 2), (1, 16, 8, 128, 17, 15), (2, 16, 8, 128, 32, 31),
                          (5, 6, 2, 64, 9, 0), (3, 3, 3, 16, 5, 4)])
def test_dense_decode_kernel_matches_the_dense_caches_pytorch_form(dtype, batch, hq, hkv, dim, length, position) -> None:
    """One decode token over a dense cache: the kernel writes k and v at ``position`` (and
    nothing else) and its attention is within a few units of the input dtype of the
    PyTorch form (two copies and SDPA), in fp32 within 1e-5."""
    from omnistage.engine.attention import DenseKVCache
    from omnistage.engine.triton_layers import dense_decode_attention_triton

    torch.manual_seed(0)
    cache = DenseKVCache(1, batch, length, hkv, dim, dtype=dtype, device="cuda")
    cache.k.normal_()
    cache.v.normal_()
    k_cache, v_cache = cache.k[0].clone(), cache.v[0].clone()
    qkv = torch.randn(batch, hq + 2 * hkv, dim, device="cuda").to(dtype)
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
    cache.length = position
    cache.prepare(1)
    with _eager():
        expected = cache(0, q, k, v)
    out = dense_decode_attention_triton(q, k, v, k_cache, v_cache, position)
    assert torch.equal(k_cache, cache.k[0]) and torch.equal(v_cache, cache.v[0])
    tolerance = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.gpu
@needs_triton
def test_moe_experts_swiglu_kernel_matches_pytorch() -> None:
    """The routed experts' grouped path (bf16 ``grouped_mm``) with the SwiGLU kernel against
    the same path in PyTorch's form."""
    torch.manual_seed(0)
    moe = SparseMoE(256, 128, 8, 2, True).to("cuda", torch.bfloat16).requires_grad_(False)
    for p in moe.parameters():
        p.normal_(0, 0.05)
    x = torch.randn(50, 256, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        with _spied() as calls:
            fused = moe(x)
        assert calls["swiglu_triton"] == 1
        with _eager():
            eager = moe(x)
    assert (fused == eager).float().mean().item() >= 0.95
    torch.testing.assert_close(fused, eager, rtol=2e-2, atol=2e-2 * eager.abs().max().item())


@pytest.mark.gpu
@needs_triton
def test_what_the_kernels_cannot_index_runs_in_pytorchs_form() -> None:
    """The dispatch takes PyTorch's form, with its exact result, for a 3-D RMSNorm input, a
    delta that only broadcasts, a head dim not a power of two, and a SwiGLU input whose
    rows are not of unit stride."""
    g = torch.Generator().manual_seed(2)
    cuda = dict(device="cuda", dtype=torch.bfloat16)
    weight = torch.rand(64, generator=g).to(**cuda)
    x3 = torch.randn(2, 5, 64, generator=g).to(**cuda)
    with torch.inference_mode():
        assert torch.equal(layers.rms_norm(x3, weight, 1e-6)[0], weight * F.rms_norm(x3, (64,), eps=1e-6))
        x, row = x3[0], x3[1, :1]
        assert torch.equal(layers.rms_norm(x, weight, 1e-6, row)[0], weight * F.rms_norm(x + row, (64,), eps=1e-6))
        qkv = torch.randn(5, 3, 48, generator=g).to(**cuda)
        norm_weight = torch.rand(3, 48, generator=g).to(**cuda)
        cos, sin = torch.randn(2, 5, 48, generator=g).to(**cuda)
        expected = apply_rope(norm_weight * F.rms_norm(qkv, (48,), eps=1e-6), cos, sin)
        assert torch.equal(layers.qk_norm_rope(qkv, norm_weight, cos, sin, 1e-6, 2), expected)
        gate_up = torch.randn(128, 4, generator=g).to(**cuda).t()
        gate, up = gate_up.chunk(2, dim=-1)
        assert torch.equal(layers.swiglu(gate_up), F.silu(gate) * up)


def test_add_and_norm_is_the_residual_sum_and_its_norm() -> None:
    """The PyTorch form (CPU): ``(norm(x + delta), x + delta)``, in bf16 bit for bit."""
    norm = RMSNorm(32, 1e-6).to(torch.bfloat16)
    norm.weight.data.uniform_(0.5, 1.5)
    x, delta = (torch.randn(5, 32, dtype=torch.bfloat16) for _ in range(2))
    normed, summed = norm.add_and_norm(x, delta)
    assert torch.equal(summed, x + delta)
    assert torch.equal(normed, norm(x + delta))


def _bf16(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("case", "fits"),
    [
        ("rows", True),
        ("fp32 weight", False),
        ("broadcast delta", False),
        ("3-D", False),
        ("strided rows", False),
        ("zero width", False),
        ("strided weight", False),
    ],
)
def test_rms_norm_fits_only_what_its_kernel_indexes(case, fits) -> None:
    x, weight, delta = _bf16(4, 64), _bf16(64), None
    if case == "fp32 weight":
        weight = weight.float()
    elif case == "broadcast delta":
        delta = _bf16(1, 64)
    elif case == "3-D":
        x = _bf16(2, 4, 64)
    elif case == "strided rows":
        x = _bf16(64, 4).t()
    elif case == "zero width":
        x, weight = _bf16(4, 0), _bf16(0)
    elif case == "strided weight":
        weight = _bf16(128)[::2]
    assert layers.rms_norm_fits(x, weight, delta) is fits


@pytest.mark.parametrize(
    ("case", "fits"),
    [
        ("q, k and v", True),
        ("head dim 48", False),
        ("weight of the q/k heads only", False),
        ("1-D weight", False),
        ("broadcast cos", False),
        ("overlapping heads", False),
        ("no heads", False),
        ("more heads than qkv", False),
    ],
)
def test_qk_norm_rope_fits_only_what_its_kernel_indexes(case, fits) -> None:
    n, total, dim, heads = 5, 4, 64, 3
    if case == "head dim 48":
        dim = 48
    qkv, weight, cos = _bf16(n, total, dim), _bf16(total, dim), _bf16(n, dim)
    if case == "weight of the q/k heads only":
        weight = _bf16(heads, dim)
    elif case == "1-D weight":
        weight = _bf16(dim)
    elif case == "broadcast cos":
        cos = _bf16(n, 1, dim)
    elif case == "overlapping heads":
        qkv = _bf16(n, 1, dim).expand(n, total, dim)
    elif case == "no heads":
        heads = 0
    elif case == "more heads than qkv":
        heads = total + 1
    assert layers.qk_norm_rope_fits(qkv, weight, cos, _bf16(n, dim), heads) is fits


@pytest.mark.parametrize(
    ("gate_up", "fits"),
    [(_bf16(4, 64), True), (_bf16(4, 63), False), (_bf16(64, 4).t(), False), (_bf16(64), False)],
    ids=["rows", "odd width", "strided rows", "1-D"],
)
def test_swiglu_fits_only_what_its_kernel_indexes(gate_up, fits) -> None:
    assert layers.swiglu_fits(gate_up) is fits


@pytest.mark.parametrize(
    ("case", "fits"),
    [
        ("one token a sequence", True),
        ("head dim 48", False),
        ("heads that do not group", False),
        ("cache of another batch", False),
        ("cache longer than a block", False),
        ("strided head dim", False),
        ("fp32 cache beside bf16 q", False),
        ("one buffer for k and v", False),
        ("a group of 8 heads (tile too large)", False),
        ("no query heads", False),
    ],
)
def test_dense_decode_fits_only_what_its_kernel_indexes(case, fits) -> None:
    b, hq, hkv, dim, length = 3, 4, 2, 64, 17
    if case == "head dim 48":
        dim = 48
    elif case == "heads that do not group":
        hq = 3
    elif case == "cache longer than a block":
        length = layers.MAX_DENSE_DECODE_LEN + 1
    elif case == "a group of 8 heads (tile too large)":
        hq, hkv, dim = 16, 2, 128
    elif case == "no query heads":
        hq = 0
    q, k, v = _bf16(b, hq, dim), _bf16(b, hkv, dim), _bf16(b, hkv, dim)
    k_cache, v_cache = _bf16(b, length, hkv, dim), _bf16(b, length, hkv, dim)
    if case == "cache of another batch":
        k_cache = v_cache = _bf16(b + 1, length, hkv, dim)
    elif case == "strided head dim":
        q = _bf16(b, hq, 2 * dim)[..., ::2]
    elif case == "fp32 cache beside bf16 q":
        v_cache = v_cache.float()
    elif case == "one buffer for k and v":
        v_cache = k_cache
    assert layers.dense_decode_fits(q, k, v, k_cache, v_cache) is fits

