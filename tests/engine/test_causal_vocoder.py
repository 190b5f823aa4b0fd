"""The causal vocoder's layers (omnistage.engine.causal_vocoder) against PyTorch's own ops:
dilated convs by phases, chunked causal convs, and residual units with their conv biases
folded into the following pass; and each layer channels-last against the same layer in
``[B, C, L]``."""

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from omnistage.engine.causal_vocoder import (
    Carry,
    CausalConv,
    CausalTransConv,
    ConvNeXtBlock,
    ResidualUnit,
    SnakeBeta,
    VocoderBlock,
    _Stateful,
    _to_channels_last,
    _with_history,
    conv1d_by_phases,
    from_rows,
    to_rows,
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


def channels_last(x: torch.Tensor) -> torch.Tensor:
    """``x [B, C, L]`` as the channels-last ``[B, C, 1, L]`` (a copy, memory ``[B, L, C]``)."""
    return from_rows(x.transpose(1, 2).contiguous(), True)


def assert_channels_last(t: torch.Tensor) -> None:
    """``t`` is ``[B, C, 1, L]`` in memory order ``[B, L, C]``: channel stride 1, sample
    stride C (channels-last, or a slice along L of such a tensor; the stride of a dimension
    of size 1 does not matter)."""
    assert t.dim() == 4 and t.shape[2] == 1, t.shape
    channels, length = t.shape[1], t.shape[3]
    assert channels == 1 or t.stride(1) == 1, (t.shape, t.stride())
    assert length == 1 or t.stride(3) == channels, (t.shape, t.stride())


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("dilation", [1, 2, 3, 9])
def test_a_conv_by_phases_channels_last_is_the_same_conv(dilation: int, groups: int) -> None:
    """Channels-last input and a channels-last weight (laid out as the vocoder's switch
    does): the same sums, a channels-last output, the input's phases a view (no copy)."""
    generator = torch.Generator().manual_seed(dilation * 10 + groups)
    weight = torch.randn(6, 4 // groups, 7, generator=generator, dtype=torch.float64)
    laid_out = weight.transpose(1, 2).contiguous().transpose(1, 2)
    assert laid_out.unsqueeze(2).is_contiguous(memory_format=torch.channels_last)
    bias = torch.randn(6, generator=generator, dtype=torch.float64)
    for periods in (7, 8, 40):
        x = torch.randn(3, 4, periods * dilation, generator=generator, dtype=torch.float64)
        expected = F.conv1d(x, weight, bias, dilation=dilation, groups=groups)
        x_cl = channels_last(x)
        assert x_cl.squeeze(2).unflatten(-1, (-1, dilation)).data_ptr() == x_cl.data_ptr()
        got = conv1d_by_phases(x_cl, laid_out, bias, dilation, groups)
        assert got.shape == (3, 6, 1, expected.shape[-1])
        assert_channels_last(got)
        torch.testing.assert_close(got.squeeze(2), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("shape", "dilation", "message"),
    [((1, 2, 64), 9, r"got \(1, 2, 64\)"),  # not a multiple of the dilation
     ((1, 2, 45), 9, r"at least 55, got \(1, 2, 45\)"),  # shorter than the kernel's span
     ((2, 63), 9, r"got \(2, 63\)"),  # not [B, C, L]
     ((1, 2, 2, 63), 9, r"got \(1, 2, 2, 63\)"),  # 4-D but not [B, C, 1, L]
     ((1, 2, 1, 64), 9, r"got \(1, 2, 1, 64\)"),  # channels-last, not a multiple
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


def _random(module: nn.Module, seed: int) -> nn.Module:
    """``module`` in fp64 with every parameter drawn from N(0, 0.5^2)."""
    generator = torch.Generator().manual_seed(seed)
    module = module.double()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator, dtype=torch.float64) * 0.5)
    return module


def _conv_with_snake(dilation: int, groups: int, zero_before: tuple[int, int] | None = None):
    conv = CausalConv(4, 6, 7, dilation=dilation, groups=groups)
    conv.zero_before = zero_before
    layer = nn.ModuleDict({"conv": conv, "snake": SnakeBeta(4)})
    return layer, lambda m, x, carry: m["conv"](x, carry, activation=m["snake"])


def _trans_with_snake(kernel: int, stride: int):
    layer = nn.ModuleDict({"conv": CausalTransConv(4, 3, kernel, stride), "snake": SnakeBeta(4)})
    return layer, lambda m, x, carry: m["conv"](x, carry, activation=m["snake"])


def _called(module: nn.Module):
    return module, lambda m, x, carry: m(x, carry)


LAYERS: dict[str, Callable[[], tuple[nn.Module, Callable]]] = {
    "conv k7": lambda: _called(CausalConv(4, 6, 7)),
    "conv k1": lambda: _called(CausalConv(4, 6, 1)),
    "conv k7 dilation 3, 2 groups": lambda: _called(CausalConv(4, 6, 7, dilation=3, groups=2)),
    "conv k7 dilation 9 after snake": lambda: _conv_with_snake(9, 1),
    "conv k7 dilation 3 after snake, zero_before": lambda: _conv_with_snake(3, 1, (23, 1)),
    "conv k7 after snake, zero_before": lambda: _conv_with_snake(1, 2, (40, 1)),
    "transposed conv k10 s5": lambda: _called(CausalTransConv(4, 3, 10, 5)),
    "transposed conv k2 s2 (no state)": lambda: _called(CausalTransConv(4, 3, 2, 2)),
    "transposed conv k6 s3 after snake": lambda: _trans_with_snake(6, 3),
    "residual unit dilation 9": lambda: _called(ResidualUnit(4, 9)),
    "convnext": lambda: _called(ConvNeXtBlock(4)),
    "vocoder block rate 3": lambda: _called(VocoderBlock(4, 2, 3)),
}


def _in_chunks(layer: nn.Module, call: Callable, signal: torch.Tensor, sizes: list[int], cl: bool):
    """The layer's output for ``signal [B, C, T]`` in chunks of ``sizes`` with carried state
    (positions are samples: ``zero_before`` rates of 1), in the layout ``cl`` says, given and
    returned as ``[B, C, *]``; and its final state (``[C, H]`` per stream as NCL's)."""
    stateful = [m for m in layer.modules() if isinstance(m, _Stateful) and m.carries_state()]
    for index, module in enumerate(stateful):
        module.state_index = index
    batch = signal.shape[0]
    state = [torch.zeros(batch, *m.state_shape(), dtype=signal.dtype) for m in stateful]
    pieces, start = [], 0
    for n in sizes:
        x = signal[..., start : start + n]
        carry = Carry(state, torch.full((batch,), start))
        out = call(layer, channels_last(x) if cl else x, carry)
        if cl:
            assert_channels_last(out)
            out = out.squeeze(2)
        pieces.append(out)
        state, start = carry.new, start + n
    assert all(t is not None for t in state)
    return torch.cat(pieces, dim=-1), [t.transpose(1, 2) if cl else t for t in state]


@pytest.mark.parametrize("name", list(LAYERS))
def test_a_channels_last_layer_equals_the_layer_in_ncl(name: str) -> None:
    """Each layer kind, channels-last (weights laid out as the vocoder's switch lays them,
    its conv states ``[H, C]``) and in ``[B, C, L]``, decoding a signal in uneven chunks
    with carried state: every output channels-last, the same outputs and final states (fp64:
    the same sums in another order, so to rounding)."""
    layer, call = LAYERS[name]()
    ncl = _random(layer, seed=len(name))
    cl = copy.deepcopy(ncl)
    _to_channels_last(cl)
    for module in cl.modules():
        if isinstance(module, CausalConv | CausalTransConv):
            assert module.conv.weight.unsqueeze(2).is_contiguous(memory_format=torch.channels_last)
            if module.carries_state():
                assert module.state_shape() == (module.history, module.conv.in_channels)
    signal = torch.randn(2, 4, 61, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    sizes = [1, 5, 9, 17, 29]
    expected, expected_state = _in_chunks(ncl, call, signal, sizes, cl=False)
    got, got_state = _in_chunks(cl, call, signal, sizes, cl=True)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    for g, e in zip(got_state, expected_state, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=1e-12)


def test_channels_last_survives_cat_elementwise_ops_and_rows() -> None:
    """What the channels-last path relies on: ``cat`` along L of channels-last parts (the
    carried past a view of ``[B, H, C]``, the zero padding) and elementwise ops with
    per-channel parameters keep the layout; ``to_rows`` of a channels-last tensor is its
    memory as a contiguous ``[B, L, C]`` and ``from_rows`` its inverse view."""
    x = channels_last(torch.randn(2, 5, 9, dtype=torch.float64))
    past = from_rows(torch.randn(2, 4, 5, dtype=torch.float64), True)
    joined = _with_history(past, x[..., 2:7], 3)
    assert joined.shape == (2, 5, 1, 12) and joined.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(joined[..., :4], past) and not joined[..., 9:].any()
    assert torch.equal(joined[..., 4:9], x[..., 2:7])
    # one sample: [2, 5, 1, 1] is both layouts; an elementwise op may give it NCL strides,
    # from which cat alone would infer NCL for the whole output
    one = x[..., :1] * torch.ones(5, 1, 1, dtype=torch.float64)
    joined = _with_history(past, one, 0)
    assert joined.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(joined, torch.cat([past, x[..., :1]], dim=-1))
    assert (x[..., 1:8] * torch.randn(5, 1, 1, dtype=torch.float64) + x[..., :7]).is_contiguous(
        memory_format=torch.channels_last
    )
    rows = to_rows(x)
    assert rows.is_contiguous() and rows.data_ptr() == x.data_ptr()
    assert from_rows(rows, True).stride() == x.stride()
