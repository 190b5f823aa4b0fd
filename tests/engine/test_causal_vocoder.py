"""The causal vocoder's layers (omnistage.engine.causal_vocoder) against PyTorch's own ops:
dilated convs by phases, chunked causal convs, and residual units with their conv biases
folded into the following pass."""

import pytest
import torch
import torch.nn.functional as F

from omnistage.engine.causal_vocoder import (
    Carry,
    CausalConv,
    CausalTransConv,
    ResidualUnit,
    SnakeBeta,
    conv1d_by_phases,
)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("dilation", [1, 2, 3, 9])
def test_a_conv_by_phases_equals_the_dilated_conv(dilation: int, groups: int) -> None:
    generator = torch.Generator().manual_seed(dilation * 10 + groups)
    weight = torch.randn(6, 4 // groups, 7, generator=generator, dtype=torch.float64)
    bias = torch.randn(6, generator=generator, dtype=torch.float64)
    for periods in (7, 8, 40):
        x = torch.randn(3, 4, periods * dilation, generator=generator, dtype=torch.float64)
        for b in (bias, None):
            expected = F.conv1d(x, weight, b, dilation=dilation, groups=groups)
            got = conv1d_by_phases(x, weight, b, dilation, groups)
            assert got.shape == expected.shape
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("shape", "dilation", "message"),
    [((1, 2, 64), 9, r"got \(1, 2, 64\)"),  # not a multiple of the dilation
     ((1, 2, 45), 9, r"at least 55, got \(1, 2, 45\)"),  # shorter than the kernel's span
     ((2, 63), 9, r"got \(2, 63\)"),  # not [B, C, L]
     ((1, 2, 63), 0, "dilation must be >= 1, got 0")],
)
def test_a_conv_by_phases_refuses_bad_input(shape, dilation, message) -> None:
    with pytest.raises(ValueError, match=message):
        conv1d_by_phases(torch.zeros(shape), torch.zeros(2, 2, 7), None, dilation)


@pytest.mark.parametrize("dilation", [1, 3, 9])
def test_a_dilated_causal_conv_in_chunks_equals_the_conv_over_zero_padded_input(dilation: int) -> None:
    """Chunks of any length (the phase form pads each to its own multiple of the dilation)
    concatenate to the conv of the whole signal after ``(k - 1) * dilation`` zeros."""
    torch.manual_seed(dilation)
    conv = CausalConv(4, 5, 7, dilation=dilation).double()
    conv.state_index = 0
    signal = torch.randn(2, 4, 61, dtype=torch.float64)
    expected = conv.conv(F.pad(signal, (conv.history, 0)))
    state = [torch.zeros(2, 4, conv.history, dtype=torch.float64)]
    pieces, start = [], 0
    for n in (1, 5, 9, 17, 29):
        carry = Carry(state, torch.full((2,), start))
        pieces.append(conv(signal[..., start : start + n], carry))
        state, start = [carry.new[0]], start + n
    torch.testing.assert_close(torch.cat(pieces, dim=-1), expected, rtol=1e-12, atol=1e-12)


def test_a_residual_unit_with_folded_biases_equals_the_unit_with_biased_convs() -> None:
    """``x + conv2(act2(conv1(act1(x))))`` with each conv's bias in the conv (PyTorch's
    modules called as they are) equals the unit, whose passes after the convs add them."""
    torch.manual_seed(0)
    unit = ResidualUnit(6, 3).double()
    with torch.no_grad():
        for p in unit.parameters():
            p.normal_(0, 0.5)
    unit.conv1.state_index = 0
    x = torch.randn(2, 6, 50, dtype=torch.float64)
    past = torch.randn(2, 6, unit.conv1.history, dtype=torch.float64)
    h = unit.act2(unit.conv1.conv(torch.cat([past, unit.act1(x)], dim=-1)))
    expected = x + unit.conv2.conv(h)
    got = unit(x, Carry([past], torch.zeros(2, dtype=torch.int64)))
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dilation", [1, 9])
def test_a_causal_conv_with_an_activation_is_the_conv_of_the_activated_input(dilation: int) -> None:
    """``conv(x, carry, activation=snake)`` (the activation writing the conv's input with
    its history) equals ``conv(snake(x), carry)``, output and carried state alike; so does a
    transposed conv's."""
    torch.manual_seed(dilation)
    snake = SnakeBeta(4).double()
    with torch.no_grad():
        snake.alpha.normal_(0, 0.5)
        snake.beta.normal_(0, 0.5)
    conv = CausalConv(4, 5, 7, dilation=dilation).double()
    trans = CausalTransConv(4, 3, 10, 5).double()
    x = torch.randn(2, 4, 23, dtype=torch.float64)
    for module in (conv, trans):
        module.state_index = 0
        past = torch.randn(2, 4, module.history, dtype=torch.float64)
        fused, plain = (Carry([past], torch.zeros(2, dtype=torch.int64)) for _ in range(2))
        got = module(x, fused, activation=snake)
        expected = module(snake(x), plain)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(fused.new[0], plain.new[0], rtol=0, atol=0)


def test_zero_before_masks_the_activated_samples_of_a_stream_in_progress() -> None:
    """code2wav's ``zero_before`` with an activation: the samples whose stream index is
    below ``samples`` are zero in the conv's input (and in the carried state), the past is
    untouched, for streams at different positions."""
    torch.manual_seed(5)
    snake = SnakeBeta(3).double()
    with torch.no_grad():
        snake.alpha.normal_(0, 0.5)
    conv = CausalConv(3, 2, 7, dilation=3).double()
    conv.state_index, conv.zero_before = 0, (30, 4)  # 30 samples at 4 per frame
    positions = torch.tensor([5, 9])  # stream indices from 20 and from 36
    x = torch.randn(2, 3, 16, dtype=torch.float64)
    past = torch.randn(2, 3, conv.history, dtype=torch.float64)
    carry = Carry([past], positions)
    index = positions[:, None] * 4 + torch.arange(16)
    activated = snake(x) * (index >= 30)[:, None]
    full = torch.cat([past, activated], dim=-1)
    expected = F.conv1d(full, conv.conv.weight, conv.conv.bias, dilation=3)
    torch.testing.assert_close(conv(x, carry, activation=snake), expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(carry.new[0], full[..., -conv.history :], rtol=0, atol=0)
    # the state is the last 18 samples: 2 of the past, then the 16 new; stream 0's new ones
    # are indices 20..35, the first ten zeroed; stream 1's (36..51) none
    state = carry.new[0]
    assert not state[0, :, 2:12].any() and state[0, :, 12:].all() and state[1].all()
