#!/usr/bin/env python3
"""How close a tree's streaming vocoder decodes to an fp32 decode of the same codes (CUDA).

``decode``: the Qwen3-TTS speech tokenizer decoder at its real dimensions with random
weights (seed 0) in a 16-slot :class:`StreamingDecoderArena` with CUDA graphs, in
``--dtype``; 16 streams of 25 fixed frames decoded in chunks of 1, 8, 8, 8 frames, and four
of them offline (``decode_full``); both saved to ``OUT`` (``{"stream", "full"}``, float32
``[N, 48000]``). Run it with each tree first on ``PYTHONPATH`` (from the tree's folder, so
``omnistage`` is that tree's; the script prints which one it imported).

``compare A B``: per key, the largest absolute difference and the SNR of ``B`` against ``A``
(``10 log10(sum a^2 / sum (a - b)^2)``, dB).

Usage: python benchmarks/vocoder_precision.py decode OUT.pt --dtype bfloat16
       python benchmarks/vocoder_precision.py compare FP32.pt BF16.pt
"""

from __future__ import annotations

import argparse

import torch

import omnistage
from omnistage.engine.vocoder_arena import StreamingDecoderArena
from omnistage.models.qwen3_tts.modeling.speech_tokenizer.config import SpeechTokenizerConfig
from omnistage.models.qwen3_tts.modeling.speech_tokenizer.decoder import build_decoder
from omnistage.models.qwen3_tts.modeling.speech_tokenizer.random_init import (
    random_speech_tokenizer_tensors,
    speech_tokenizer_config,
)

STREAMS, FRAMES = 16, 25
CHUNKS = ((0, 1), (1, 9), (9, 17), (17, 25))


def decode(out: str, dtype: torch.dtype) -> None:
    print(f"omnistage from {omnistage.__file__}", flush=True)
    config = SpeechTokenizerConfig.from_dict(speech_tokenizer_config("0.6b"))
    tensors = random_speech_tokenizer_tensors("0.6b", seed=0)
    decoder = build_decoder(config.decoder, tensors, torch.device("cuda"), dtype)
    arena = StreamingDecoderArena(decoder, num_slots=STREAMS)
    arena.capture_graphs((1, STREAMS), (1, 8))
    codes = torch.randint(0, 2048, (STREAMS, FRAMES, 16), generator=torch.Generator().manual_seed(1))
    slots = arena.allocate_many([None] * STREAMS)
    stream = torch.cat([torch.stack(arena.decode(slots, codes[:, a:b])) for a, b in CHUNKS], dim=1)
    full = torch.stack(arena.decode_full([(codes[i], None) for i in range(4)]))
    torch.save({"stream": stream, "full": full}, out)
    print(f"wrote {out}: stream {tuple(stream.shape)}, full {tuple(full.shape)}")


def compare(reference: str, other: str) -> None:
    a, b = torch.load(reference), torch.load(other)
    for key in a:
        x, y = a[key].double(), b[key].double()
        snr = 10 * torch.log10(x.pow(2).sum() / (x - y).pow(2).sum().clamp_min(1e-30)).item()
        print(f"{key}: max |a| {x.abs().max().item():.4f}  max |a - b| {(x - y).abs().max().item():.5f}  SNR {snr:.1f} dB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("decode")
    run.add_argument("out")
    run.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    pair = commands.add_parser("compare")
    pair.add_argument("reference")
    pair.add_argument("other")
    args = parser.parse_args()
    if args.command == "decode":
        decode(args.out, getattr(torch, args.dtype))
    else:
        compare(args.reference, args.other)


if __name__ == "__main__":
    main()
