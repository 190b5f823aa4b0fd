#!/usr/bin/env python3
"""Every convolution of the Qwen3-TTS speech tokenizer decoder, timed alone at the shapes one
chunk decode gives it (CUDA): where the vocoder's conv time goes, and what its bias adds and
its dilated convs cost.

The decoder has the real 0.6B dimensions and random weights (seed 0), in ``--dtype``. One
eager decode of ``S`` streams x ``--frames`` frames (per ``--streams`` value) through
:class:`StreamingDecoderArena` records each conv's input shape (history included); each
conv is then timed alone (CUDA events, median of ``--iters`` after 3 warm calls) as
PyTorch runs it (``F.conv1d`` / ``F.conv_transpose1d``) with its bias (``bias_ms``) and
without (``no_bias_ms``: the difference is PyTorch's broadcast bias add after cuDNN's
kernel), and without bias as a 2-D conv over ``[B, C, 1, L]`` in channels-last layout, input
and weight converted beforehand (``channels_last_ms``: cuDNN's NHWC kernels without the
NCHW/NHWC transposes it adds around them for ``[B, C, L]``); a dilated conv also as :func:`~omnistage.engine.causal_vocoder.conv1d_by_phases`
without bias (``phases_ms``, its input right-padded to a multiple of the dilation). Prints a
table per stream count and the sums; writes JSON (default
benchmarks/results/vocoder_convs.json).

Usage: python benchmarks/vocoder_convs.py [--streams 1 8 64 128] [--frames 8] [--output PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.engine.causal_vocoder import CausalConv, conv1d_by_phases
from omnistage.engine.vocoder_arena import StreamingDecoderArena
from omnistage.models.qwen3_tts.modeling.speech_tokenizer.config import SpeechTokenizerConfig
from omnistage.models.qwen3_tts.modeling.speech_tokenizer.decoder import build_decoder
from omnistage.models.qwen3_tts.modeling.speech_tokenizer.random_init import (
    random_speech_tokenizer_tensors,
    speech_tokenizer_config,
)


def cuda_ms(fn, iters: int) -> float:  # noqa: ANN001 -- any callable
    """Median device time of ``fn()`` in ms (CUDA events), after 3 warm calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def conv_inputs(decoder: nn.Module, streams: int, frames: int) -> list[tuple[str, nn.Module, tuple[int, ...]]]:
    """``(name, conv module, input shape)`` of every conv call in one eager decode, a causal
    conv's input with its carried history (a :class:`CausalConv` calls its weights itself)."""
    calls = []

    def record(name: str, module: nn.Module, args: tuple) -> None:
        if isinstance(module, CausalConv):
            b, c, n = args[0].shape
            calls.append((name + ".conv", module.conv, (b, c, n + module.history)))
        elif not name.endswith(".conv") or not isinstance(decoder.get_submodule(name[: -len(".conv")]), CausalConv):
            calls.append((name, module, tuple(args[0].shape)))

    hooks = [
        m.register_forward_pre_hook(lambda mod, args, name=name: record(name, mod, args))
        for name, m in decoder.named_modules()
        if isinstance(m, nn.Conv1d | nn.ConvTranspose1d | CausalConv)
    ]
    arena = StreamingDecoderArena(decoder, num_slots=streams)
    slots = [arena.allocate() for _ in range(streams)]
    arena.decode(slots, torch.randint(0, 2048, (streams, frames, 16), device=arena.device))
    for hook in hooks:
        hook.remove()
    return calls


def conv(m: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(m, nn.ConvTranspose1d):
        return F.conv_transpose1d(x, m.weight, bias, m.stride, m.padding, m.output_padding, m.groups, m.dilation)
    return F.conv1d(x, m.weight, bias, m.stride, m.padding, m.dilation, m.groups)


def conv_channels_last(m: nn.Module, x4: torch.Tensor, w4: torch.Tensor) -> torch.Tensor:
    """``m``'s conv without bias as a 2-D conv over ``[B, C, 1, L]`` in channels-last layout
    (``x4``, ``w4`` converted beforehand): cuDNN's NHWC kernels without its transposes."""
    stride, dilation = (1, m.stride[0]), (1, m.dilation[0])
    if isinstance(m, nn.ConvTranspose1d):
        return F.conv_transpose2d(x4, w4, None, stride, 0, 0, m.groups, dilation)
    return F.conv2d(x4, w4, None, stride, 0, dilation, m.groups)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 64, 128])
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--output", type=Path, default=Path(__file__).parent / "results/vocoder_convs.json")
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    config = SpeechTokenizerConfig.from_dict(speech_tokenizer_config("0.6b"))
    decoder = build_decoder(config.decoder, random_speech_tokenizer_tensors("0.6b", seed=0), device, dtype)
    levels = []
    for streams in args.streams:
        rows = []
        for name, m, shape in conv_inputs(decoder, streams, args.frames):
            x = torch.randn(shape, device=device, dtype=dtype)
            row = {"conv": name, "input": list(shape), "weight": list(m.weight.shape), "dilation": m.dilation[0],
                   "bias_ms": cuda_ms(partial(conv, m, x, m.bias), args.iters),
                   "no_bias_ms": cuda_ms(partial(conv, m, x, None), args.iters)}  # fmt: skip
            last = torch.channels_last
            x4, w4 = x[:, :, None].contiguous(memory_format=last), m.weight[:, :, None].contiguous(memory_format=last)
            row["channels_last_ms"] = cuda_ms(partial(conv_channels_last, m, x4, w4), args.iters)
            d = m.dilation[0]
            if d > 1:
                padded = F.pad(x, (0, -shape[-1] % d))
                row["phases_ms"] = cuda_ms(partial(conv1d_by_phases, padded, m.weight, None, d, m.groups), args.iters)
            rows.append(row)
        sums = {k: sum(r[k] for r in rows) for k in ("bias_ms", "no_bias_ms", "channels_last_ms")}
        dilated = [r for r in rows if "phases_ms" in r]
        sums |= {"dilated_no_bias_ms": sum(r["no_bias_ms"] for r in dilated),
                 "dilated_phases_ms": sum(r["phases_ms"] for r in dilated)}  # fmt: skip
        levels.append({"streams": streams, "frames": args.frames, "convs": rows, "sums": sums})
        print(f"\n{streams} streams x {args.frames} frames: ms per conv (bias, no bias, channels-last, phases)")
        for r in rows:
            phases = f"{r['phases_ms']:8.3f}" if "phases_ms" in r else " " * 8
            print(f"{r['conv'][-34:]:34} {str(r['input']):20} d={r['dilation']} {r['bias_ms']:8.3f} "
                  f"{r['no_bias_ms']:8.3f} {r['channels_last_ms']:8.3f} {phases}")  # fmt: skip
        print("sums: " + ", ".join(f"{k} {v:.2f}" for k, v in sums.items()))
    result = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "cudnn": torch.backends.cudnn.version(), "dtype": args.dtype, "levels": levels}  # fmt: skip
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
