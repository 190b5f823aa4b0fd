"""Parity fixtures for the Qwen3-TTS 12 Hz speech tokenizer, from the official reference.

Runs in the isolated reference environment (``qwen-tts==0.1.1``, ``transformers==4.57.3``)
on the tiny random speech tokenizer and writes
``tests/models/qwen3_tts/fixtures/speech_tokenizer_parity.npz`` (~300 KB):

- ``clip_24k`` [24000] float32: 1 s at 24 kHz (two tones and seeded noise);
  ``codes_24k`` [13, 16] int64: the reference's codes for it.
- ``clip_16k_stereo`` [8000, 2] float32: 0.5 s stereo at 16 kHz; ``codes_16k_stereo``:
  the reference's codes after its own conversion (channel mean, librosa soxr_hq resampling).
- ``codes_batch_short``: the codes of ``clip_24k[:13000]`` when encoded in ONE batch with
  ``clip_24k`` (the reference pads with zeros).
- ``decode_codes`` [100, 16] int64 (seeded) and the reference's decode of them, kept for
  frames ``decode_frames`` (0-3 and 90-99, beyond the 72-frame attention window):
  ``decode_wave`` [len(decode_frames) * 1920] float32.
- ``weights_fingerprint``: sum of |w| over the checkpoint, to detect a changed generator.

Regenerate (from the repository root):

    .venv/bin/python -c "from pathlib import Path; from omnistage.models.qwen3_tts.modeling.\\
speech_tokenizer.random_init import write_random_speech_tokenizer as w; \\
w(Path('/tmp/st_tiny'), 'tiny', 0)"
    /work/refenv/bin/python tools/parity/qwen3_tts_speech_tokenizer_reference.py /tmp/st_tiny
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from qwen_tts import Qwen3TTSTokenizer
from safetensors.torch import load_file

OUT = Path(__file__).resolve().parents[2] / "tests/models/qwen3_tts/fixtures/speech_tokenizer_parity.npz"
SAMPLES_PER_FRAME = 1920


def _signal(rate: int, seconds: float, channels: int, seed: int) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    rng = np.random.default_rng(seed)
    tones = [0.4 * np.sin(2 * np.pi * f * t) + 0.2 * np.sin(2 * np.pi * 3.1 * f * t) for f in (220.0, 330.0)[:channels]]
    wave = np.stack(tones, axis=-1) + 0.05 * rng.standard_normal((len(t), channels))
    return wave.astype(np.float32).squeeze(-1) if channels == 1 else wave.astype(np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="the tiny random speech_tokenizer folder (seed 0)")
    args = parser.parse_args()
    tokenizer = Qwen3TTSTokenizer.from_pretrained(str(args.checkpoint))
    tokenizer.model.float().eval()

    clip = _signal(24000, 1.0, 1, seed=1)
    stereo = _signal(16000, 0.5, 2, seed=2)
    short = clip[:13000]
    codes_24k = tokenizer.encode(clip, sr=24000).audio_codes[0]
    codes_stereo = tokenizer.encode(stereo, sr=16000).audio_codes[0]
    batch = tokenizer.encode([clip, short], sr=24000).audio_codes
    assert torch.equal(batch[0], codes_24k), "the reference's batched and single encodes differ"

    codes = np.random.default_rng(3).integers(0, 2048, size=(100, 16), dtype=np.int64)
    with torch.inference_mode():
        wave = tokenizer.model.decode(torch.from_numpy(codes)[None], return_dict=True).audio_values[0]
    frames = np.r_[0:4, 90:100]
    kept = wave.reshape(-1, SAMPLES_PER_FRAME)[frames].reshape(-1)

    weights = load_file(args.checkpoint / "model.safetensors")
    fingerprint = float(sum(t.double().abs().sum() for t in weights.values()))
    np.savez_compressed(
        OUT,
        clip_24k=clip,
        codes_24k=codes_24k.numpy(),
        clip_16k_stereo=stereo,
        codes_16k_stereo=codes_stereo.numpy(),
        codes_batch_short=batch[1].numpy(),
        decode_codes=codes,
        decode_frames=frames,
        decode_wave=kept.float().numpy(),
        weights_fingerprint=np.float64(fingerprint),
    )
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes); decode peak {wave.abs().max():.4f}")


if __name__ == "__main__":
    main()
