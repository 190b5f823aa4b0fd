"""The vocoder's Triton kernels (omnistage.engine.triton_vocoder, used by
omnistage.engine.causal_vocoder) against their formulas: SnakeBeta (with a folded conv bias)
and the residual add with a folded conv bias, in ``[B, C, L]`` and channels-last; and the
channels-last decoder on CUDA without cuDNN's layout transposes."""

import pytest
import torch

from omnistage.engine.causal_vocoder import SNAKE_EPS, Carry, ResidualUnit, SnakeBeta, from_rows
from omnistage.engine.paged_attention import triton_available

needs_triton = pytest.mark.skipif(
    not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and triton"
)


def _snake_reference(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """SnakeBeta's formula in fp64 (the docstring's, term by term)."""
    x, alpha, beta = x.double(), alpha.double().exp()[None, :, None], beta.double().exp()[None, :, None]
    return x + torch.sin(x * alpha).pow(2) / (beta + SNAKE_EPS)


def _parameters(channels: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(channels, generator=generator) * 2, torch.randn(channels, generator=generator)


# bf16: the kernel rounds once from fp32 (2^-8 of an element at most); PyTorch's eager bf16
# ops round at every step and land at 2.6e-2 to 4.3e-2 of the scale here, so 1e-2 tells them apart
@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_fused_snake_beta_equals_the_formula_on_strided_input(dtype, tolerance) -> None:
    """A slice of a wider tensor (what a causal transposed conv hands on) and a transposed
    view (no unit stride), lengths around the kernel's block, large arguments of the sine:
    the kernel's output is contiguous and equals the formula (relative to the output's
    scale)."""
    from omnistage.engine.triton_vocoder import snake_beta_triton

    generator = torch.Generator().manual_seed(0)
    alpha, beta = (p.to("cuda", dtype) for p in _parameters(6, generator))
    bias_c = torch.randn(6, generator=generator).to("cuda", dtype)
    for length in (1, 37, 1024, 1500, 4100):
        wide = (torch.randn(3, 6, length + 9, generator=generator) * 4).to("cuda", dtype)
        channels_last = (torch.randn(3, length, 6, generator=generator) * 4).to("cuda", dtype)
        for x in (wide[..., 4 : 4 + length], channels_last.transpose(1, 2)):
            for bias in (None, bias_c):
                out = snake_beta_triton(x, alpha, beta, SNAKE_EPS, bias)
                assert out.is_contiguous() and out.shape == x.shape and out.dtype == dtype
                shifted = x if bias is None else x.double() + bias.double()[None, :, None]
                expected = _snake_reference(shifted, alpha, beta)
                scale = expected.abs().max().item()
                assert (out.double() - expected).abs().max().item() <= tolerance * scale, (length, x.stride())


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_fused_snake_beta_writes_a_causal_convs_input_with_its_history(dtype, tolerance) -> None:
    """With ``past`` (a strided view, as the carried state is) and ``zeros``, the output is
    ``cat([past, snake(x + bias), zeros])``: the past copied exactly, the zeros exact, the
    middle as the formula; the module's PyTorch path gives the same."""
    from omnistage.engine.triton_vocoder import snake_beta_triton

    generator = torch.Generator().manual_seed(4)
    alpha, beta = (p.to("cuda", dtype) for p in _parameters(6, generator))
    bias = torch.randn(6, generator=generator).to("cuda", dtype)
    snake = SnakeBeta(6).to("cuda", dtype)
    with torch.no_grad():
        snake.alpha.copy_(alpha)
        snake.beta.copy_(beta)
    for length, history, zeros in ((1, 6, 0), (37, 54, 5), (1500, 18, 2), (4100, 1, 0)):
        x = (torch.randn(3, 6, length + 3, generator=generator) * 4).to("cuda", dtype)[..., 2 : 2 + length]
        past = torch.randn(3, history, 6, generator=generator).to("cuda", dtype).transpose(1, 2)
        out = snake_beta_triton(x, alpha, beta, SNAKE_EPS, bias, past, zeros)
        assert out.is_contiguous() and out.shape == (3, 6, history + length + zeros) and out.dtype == dtype
        assert torch.equal(out[..., :history], past)
        assert not out[..., history + length :].any()
        expected = _snake_reference(x.double() + bias.double()[None, :, None], alpha, beta)
        middle = out[..., history : history + length].double()
        assert (middle - expected).abs().max().item() <= tolerance * expected.abs().max().item()
        if dtype == torch.float32:  # the module's PyTorch path (with gradients) writes the same
            eager = snake(x, bias, past, zeros)
            assert eager.requires_grad
            assert (eager.detach() - out).abs().max().item() <= 1e-5 * expected.abs().max().item()


@pytest.mark.gpu
@needs_triton
def test_the_module_takes_the_kernel_without_gradients_and_pytorch_with_them() -> None:
    """Under inference mode (how the vocoders decode) SnakeBeta's output is the kernel's,
    bit for bit; with gradients it stays differentiable (PyTorch's ops), and both agree."""
    from omnistage.engine.triton_vocoder import snake_beta_triton

    generator = torch.Generator().manual_seed(1)
    snake = SnakeBeta(5)
    with torch.no_grad():
        for parameter, value in zip((snake.alpha, snake.beta), _parameters(5, generator), strict=True):
            parameter.copy_(value)
    snake = snake.to("cuda")
    x = torch.randn(2, 5, 300, generator=generator).cuda().requires_grad_()
    with torch.inference_mode():
        fused = snake(x)
    assert torch.equal(fused, snake_beta_triton(x.detach(), snake.alpha.detach(), snake.beta.detach(), SNAKE_EPS))
    eager = snake(x)
    eager.sum().backward()
    assert x.grad is not None and snake.alpha.grad is not None
    assert (eager.detach() - fused).abs().max().item() <= 1e-5 * eager.abs().max().item()


@pytest.mark.gpu
@needs_triton
def test_the_kernel_rejects_bad_shapes_dtypes_and_devices() -> None:
    from omnistage.engine.triton_vocoder import snake_beta_triton

    x, alpha = torch.zeros(2, 3, 8, device="cuda"), torch.zeros(3, device="cuda")
    for bad in (
        (x[0], alpha, alpha),  # not [B, C, L]
        (x.double(), alpha, alpha),  # not fp32 / bf16 / fp16
        (x, alpha[:2], alpha),  # alpha not [C]
        (x, alpha, alpha.cpu()),  # beta on another device
    ):
        with pytest.raises(ValueError, match="SnakeBeta needs"):
            snake_beta_triton(*bad, SNAKE_EPS)
    for past, zeros in ((x[:1], 0), (x[..., :2].half(), 0), (x[0], 0), (x, -1)):  # batch, dtype, rank; zeros
        with pytest.raises(ValueError, match="SnakeBeta needs past"):
            snake_beta_triton(x, alpha, alpha, SNAKE_EPS, None, past, zeros)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_fused_residual_add_equals_the_formula_on_strided_input(dtype, tolerance) -> None:
    """``residual + (y + bias)`` over a slice and a transposed view, lengths around the
    block: contiguous output of the residual's dtype, equal to the sum in fp64 (rounded
    once)."""
    from omnistage.engine.triton_vocoder import residual_add_triton

    generator = torch.Generator().manual_seed(2)
    bias = torch.randn(6, generator=generator).to("cuda", dtype)
    for length in (1, 37, 1024, 4100):
        wide = torch.randn(3, 6, length + 9, generator=generator).to("cuda", dtype)
        channels_last = torch.randn(3, length, 6, generator=generator).to("cuda", dtype)
        for residual, y in ((wide[..., 4 : 4 + length], channels_last.transpose(1, 2)),
                            (channels_last.transpose(1, 2), wide[..., :length])):  # fmt: skip
            out = residual_add_triton(residual, y, bias)
            assert out.is_contiguous() and out.shape == residual.shape and out.dtype == dtype
            expected = residual.double() + y.double() + bias.double()[None, :, None]
            scale = expected.abs().max().item()
            assert (out.double() - expected).abs().max().item() <= tolerance * scale, (length, residual.stride())


@pytest.mark.gpu
@needs_triton
def test_a_residual_unit_decodes_the_same_with_the_kernels_as_with_pytorch() -> None:
    """A residual unit on CUDA under inference mode (both kernels, biases folded) equals the
    same unit run by PyTorch's ops with gradients on, in fp32 (cuDNN's TF32 off: its inputs
    rounded to 10 mantissa bits would turn the paths' 1e-7 differences into 1e-4)."""
    torch.manual_seed(3)
    unit = ResidualUnit(8, 9).cuda()
    with torch.no_grad():
        for p in unit.parameters():
            p.normal_(0, 0.3)
    from omnistage.engine.causal_vocoder import Carry

    x = torch.randn(2, 8, 100, device="cuda")
    state = [torch.randn(2, 8, unit.conv1.history, device="cuda")]
    unit.conv1.state_index = 0

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        carry = Carry(state, torch.zeros(2, dtype=torch.int64, device="cuda"))
        return unit(x, carry), carry.new[0]

    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        with torch.inference_mode():
            fused, fused_state = run()
        eager, eager_state = run()
    assert eager.requires_grad
    assert (eager.detach() - fused).abs().max().item() <= 1e-5 * eager.abs().max().item()
    assert (eager_state.detach() - fused_state).abs().max().item() <= 1e-5 * eager_state.abs().max().item()


@pytest.mark.gpu
@needs_triton
def test_the_residual_kernel_rejects_bad_shapes_dtypes_and_devices() -> None:
    from omnistage.engine.triton_vocoder import residual_add_triton

    x, bias = torch.zeros(2, 3, 8, device="cuda"), torch.zeros(3, device="cuda")
    for bad in (
        (x[0], x[0], bias),  # not [B, C, L]
        (x, x[..., :4], bias),  # y not like the residual
        (x, x.half(), bias),  # y of another dtype
        (x, x, bias[:2]),  # bias not [C]
        (x, x, bias.cpu()),  # bias on another device
    ):
        with pytest.raises(ValueError, match="residual add needs"):
            residual_add_triton(*bad)


def _cl(rows: torch.Tensor) -> torch.Tensor:
    """``[B, L, C]`` rows as the channels-last ``[B, C, 1, L]`` (a view)."""
    return from_rows(rows, True)


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_fused_snake_beta_channels_last_equals_the_formula_and_the_pytorch_form(dtype, tolerance) -> None:
    """Channels-last ``x`` (a slice along L of a wider channels-last tensor, as a transposed
    conv's trimmed output), ``past`` (a view of the arena's ``[B, H, C]`` rows), a bias and
    zeros, channel counts on and off the tile, lengths around it: a channels-last output,
    the past copied exactly, the zeros exact, the middle as the formula; in fp32 the
    module's PyTorch form (with gradients) and the NCL kernel give the same. Parameters of
    moderate size: with 100 channels of the NCL test's, some ``|x * e^alpha|`` reach ~10^3,
    where rounding the fp32 product alone moves the sine by ~10^-4 (the NCL test bounds the
    kernel's sine there)."""
    from omnistage.engine.triton_vocoder import snake_beta_triton

    generator = torch.Generator().manual_seed(6)
    for channels in (6, 96, 100):
        alpha, beta = (p.to("cuda", dtype) / 4 for p in _parameters(channels, generator))
        bias = torch.randn(channels, generator=generator).to("cuda", dtype)
        snake = SnakeBeta(channels).to("cuda", dtype)
        with torch.no_grad():
            snake.alpha.copy_(alpha)
            snake.beta.copy_(beta)
        for length, history, zeros in ((1, 6, 0), (37, 54, 5), (1500, 18, 2), (4100, 1, 0), (9, 0, 0)):
            wide = (torch.randn(3, length + 3, channels, generator=generator) * 4).to("cuda", dtype)
            x = _cl(wide)[..., 2 : 2 + length]
            past = _cl(torch.randn(3, history, channels, generator=generator).to("cuda", dtype)) if history else None
            out = snake_beta_triton(x, alpha, beta, SNAKE_EPS, bias, past, zeros)
            assert out.shape == (3, channels, 1, history + length + zeros) and out.dtype == dtype
            assert out.is_contiguous(memory_format=torch.channels_last)
            if past is not None:
                assert torch.equal(out[..., :history], past)
            assert not out[..., history + length :].any()
            expected = _snake_reference(x.squeeze(2).double() + bias.double()[None, :, None], alpha, beta)
            middle = out[..., history : history + length].squeeze(2).double()
            scale = expected.abs().max().item()
            assert (middle - expected).abs().max().item() <= tolerance * scale, (channels, length)
            ncl = snake_beta_triton(x.squeeze(2), alpha, beta, SNAKE_EPS, bias, None if past is None else past.squeeze(2), zeros)
            assert (out.squeeze(2).double() - ncl.double()).abs().max().item() <= tolerance * scale
            if dtype == torch.float32:
                eager = snake(x, bias, past, zeros)
                assert eager.requires_grad and eager.is_contiguous(memory_format=torch.channels_last)
                assert (eager.detach() - out).abs().max().item() <= 1e-5 * scale


@pytest.mark.gpu
@needs_triton
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
def test_fused_residual_add_channels_last_equals_the_formula(dtype, tolerance) -> None:
    """``residual + (y + bias)`` of channels-last tensors (one a slice along L), channel
    counts on and off the tile, lengths around it: a channels-last output equal to the sum
    in fp64 (rounded once)."""
    from omnistage.engine.triton_vocoder import residual_add_triton

    generator = torch.Generator().manual_seed(7)
    for channels in (6, 100):
        bias = torch.randn(channels, generator=generator).to("cuda", dtype)
        for length in (1, 37, 1024, 4100):
            wide = _cl(torch.randn(3, length + 9, channels, generator=generator).to("cuda", dtype))[..., 4 : 4 + length]
            dense = _cl(torch.randn(3, length, channels, generator=generator).to("cuda", dtype))
            for residual, y in ((wide, dense), (dense, wide)):
                out = residual_add_triton(residual, y, bias)
                assert out.shape == residual.shape and out.dtype == dtype
                assert out.is_contiguous(memory_format=torch.channels_last)
                expected = residual.double() + y.double() + bias.double()[None, :, None, None]
                scale = expected.abs().max().item()
                assert (out.double() - expected).abs().max().item() <= tolerance * scale, (channels, length)


@pytest.mark.gpu
@needs_triton
def test_a_channels_last_residual_unit_decodes_the_same_with_the_kernels_as_ncl_with_pytorch() -> None:
    """A channels-last residual unit on CUDA under inference mode (both kernels, the phase
    conv channels-last) equals the NCL unit run by PyTorch's ops with gradients on, output
    and carried state (fp32, cuDNN's TF32 off)."""
    from omnistage.engine.causal_vocoder import _to_channels_last

    torch.manual_seed(8)
    ncl = ResidualUnit(16, 9).cuda()
    with torch.no_grad():
        for p in ncl.parameters():
            p.normal_(0, 0.3)
    cl = ResidualUnit(16, 9).cuda()
    cl.load_state_dict(ncl.state_dict())
    _to_channels_last(cl)
    ncl.conv1.state_index = cl.conv1.state_index = 0
    x = torch.randn(2, 100, 16, device="cuda")  # [B, L, C] rows
    state = torch.randn(2, ncl.conv1.history, 16, device="cuda")  # [B, H, C]
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        eager_carry = Carry([state.transpose(1, 2)], torch.zeros(2, dtype=torch.int64, device="cuda"))
        eager = ncl(x.transpose(1, 2), eager_carry)
        with torch.inference_mode():
            fused_carry = Carry([state], torch.zeros(2, dtype=torch.int64, device="cuda"))
            fused = cl(_cl(x), fused_carry)
    assert fused.is_contiguous(memory_format=torch.channels_last)
    scale = eager.abs().max().item()
    assert (fused.squeeze(2) - eager.detach()).abs().max().item() <= 1e-5 * scale
    new_state = eager_carry.new[0].detach().transpose(1, 2)
    assert (fused_carry.new[0] - new_state).abs().max().item() <= 1e-5 * new_state.abs().max().item()


@pytest.mark.gpu
@needs_triton
def test_the_kernels_reject_mixed_layouts() -> None:
    from omnistage.engine.triton_vocoder import residual_add_triton, snake_beta_triton

    x, alpha = _cl(torch.zeros(2, 8, 3, device="cuda")), torch.zeros(3, device="cuda")
    with pytest.raises(ValueError, match="SnakeBeta needs"):
        snake_beta_triton(torch.zeros(2, 3, 2, 8, device="cuda"), alpha, alpha, SNAKE_EPS)  # not [B, C, 1, L]
    with pytest.raises(ValueError, match="SnakeBeta needs past"):
        snake_beta_triton(x, alpha, alpha, SNAKE_EPS, None, x.squeeze(2))  # past of the other layout
    with pytest.raises(ValueError, match="residual add needs"):
        residual_add_triton(x, x.squeeze(2), alpha)


@pytest.mark.gpu
@needs_triton
def test_the_channels_last_decoder_runs_without_cudnns_layout_transposes() -> None:
    """The point of the layout: one decode of the real-size Qwen3-TTS decoder (random
    weights, bf16, 8 streams x 8 frames) launches cuDNN's NCHW <-> NHWC transposes
    (``nchwToNhwcKernel``, ``nhwcToNchwKernel``) around its convs in ``[B, C, L]`` and,
    channels-last, only at the 96 -> 1 output conv (its one-channel output leaves as NCHW:
    an H100 run of 2026-12-07 traced that one launch to the conv of weight ``[1, 96, 1, 7]``).
    NCL's cost 6.9 ms of a 35.6 ms graph replay at 128 streams on the H100
    (``vocoder_all_kernels`` of benchmarks/results/gpu_share_dense.json)."""
    from torch.profiler import ProfilerActivity, profile

    from omnistage.models.qwen3_tts.modeling.speech_tokenizer.config import SpeechTokenizerConfig
    from omnistage.models.qwen3_tts.modeling.speech_tokenizer.decoder import build_decoder
    from omnistage.models.qwen3_tts.modeling.speech_tokenizer.random_init import (
        random_speech_tokenizer_tensors,
        speech_tokenizer_config,
    )

    config = SpeechTokenizerConfig.from_dict(speech_tokenizer_config("0.6b"))
    tensors = random_speech_tokenizer_tensors("0.6b", seed=0)
    codes = torch.randint(0, 2048, (8, 8, 16), device="cuda")
    def transpose(name: str) -> bool:  # cuDNN's layout conversions
        return "nchwToNhwc" in name or "nhwcToNchw" in name

    weights = {}  # layout -> the weight shape of the op of each transpose launched
    for layout in ("ncl", "cl"):
        decoder = build_decoder(config.decoder, tensors, "cuda", torch.bfloat16)
        if layout == "cl":
            decoder.to_channels_last()
        with torch.inference_mode():
            decoder(codes)  # warm: kernel selection
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
                decoder(codes)
                torch.cuda.synchronize()
        events = prof.events()
        weights[layout] = [tuple(e.input_shapes[1]) for e in events for k in e.kernels if transpose(k.name)]
        launched = [e.name for e in events if e.device_type == torch.autograd.DeviceType.CUDA and transpose(e.name)]
        assert len(launched) == len(weights[layout]), "every transpose is traced to the op that launched it"
        del decoder
    assert weights["ncl"], "the profiler no longer names cuDNN's transposes this way"
    assert set(weights["cl"]) <= {(1, 96, 1, 7)}, weights["cl"]
