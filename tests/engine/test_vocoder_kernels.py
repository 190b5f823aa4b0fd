"""The vocoder's Triton SnakeBeta (omnistage.engine.triton_vocoder, used by
omnistage.engine.causal_vocoder) against its formula."""

import pytest
import torch

from omnistage.engine.causal_vocoder import SNAKE_EPS, SnakeBeta


def _snake_reference(x: torch.Tensor, snake: SnakeBeta) -> torch.Tensor:
    """SnakeBeta's formula in fp64 (the docstring's, term by term)."""
    alpha = snake.alpha.double().exp()[None, :, None]
    beta = snake.beta.double().exp()[None, :, None]
    x = x.double()
    return x + torch.sin(x * alpha).pow(2) / (beta + SNAKE_EPS)


@pytest.mark.gpu
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)])
def test_fused_snake_beta_equals_the_formula_on_strided_input(dtype, tolerance) -> None:
    """A slice of a wider tensor (what a causal transposed conv hands on), lengths around
    the kernel's block, large arguments of the sine: the fused kernel's output is
    contiguous and equals the formula (relative to the output's scale)."""
    generator = torch.Generator().manual_seed(0)
    snake = SnakeBeta(6)
    with torch.no_grad():
        snake.alpha.copy_(torch.randn(6, generator=generator) * 2)
        snake.beta.copy_(torch.randn(6, generator=generator))
    snake = snake.to("cuda", dtype)
    for length in (1, 37, 1024, 1500, 4100):
        wide = (torch.randn(3, 6, length + 9, generator=generator) * 4).to("cuda", dtype)
        x = wide[..., 4 : 4 + length]
        out = snake(x)
        assert out.is_contiguous() and out.shape == x.shape and out.dtype == dtype
        expected = _snake_reference(x, snake)
        scale = expected.abs().max().item()
        assert (out.double() - expected).abs().max().item() <= tolerance * scale, length
