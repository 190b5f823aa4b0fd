"""The speech tokenizer matches the official reference on the tiny random checkpoint.

Fixtures come from ``tools/parity/qwen3_tts_speech_tokenizer_reference.py`` (its docstring
says how to regenerate them). Tolerances: codes exact; waveform relative error <= 1e-4
(max |ours - reference| / max |reference|; measured ~5e-7 in fp32).
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch
from safetensors.torch import load_file

from omnistage.models.qwen3_tts.modeling.speech_tokenizer.decoder import load_decoder
from omnistage.models.qwen3_tts.modeling.speech_tokenizer.encoder import load_encoder
from omnistage.models.qwen3_tts.modeling.speech_tokenizer.random_init import (
    write_random_speech_tokenizer,
)
from omnistage.models.qwen3_tts.request_builders import load_reference
from omnistage.serve.media import MediaPolicy

FIXTURE = Path(__file__).parent / "fixtures" / "speech_tokenizer_parity.npz"


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    with np.load(FIXTURE) as data:
        return dict(data)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, reference: dict[str, np.ndarray]) -> Path:
    directory = tmp_path_factory.mktemp("speech_tokenizer")
    write_random_speech_tokenizer(directory, "tiny", seed=0)
    weights = load_file(directory / "model.safetensors")
    fingerprint = float(sum(t.double().abs().sum() for t in weights.values()))
    assert fingerprint == pytest.approx(float(reference["weights_fingerprint"]), rel=1e-9), (
        "the random checkpoint changed (generator or layout): regenerate the fixtures"
    )
    return directory


def test_encoder_codes_equal_the_reference_at_24k(checkpoint: Path, reference: dict[str, np.ndarray]) -> None:
    codes = load_encoder(checkpoint).encode(torch.from_numpy(reference["clip_24k"]))
    assert codes.dtype == torch.int64 and codes.shape == (13, 16)  # ceil(24000 / 1920)
    assert np.array_equal(codes.numpy(), reference["codes_24k"])


def test_encoder_codes_equal_the_reference_for_16k_stereo(checkpoint: Path, reference: dict[str, np.ndarray]) -> None:
    """Through the serving path: the clip sent as a float WAV, decoded, downmixed and
    resampled to 24 kHz by the request builder, then encoded."""
    wav = io.BytesIO()
    soundfile.write(wav, reference["clip_16k_stereo"], 16000, format="WAV", subtype="FLOAT")
    audio = load_reference(base64.b64encode(wav.getvalue()).decode(), MediaPolicy()).samples
    assert audio.shape == (12000,)
    codes = load_encoder(checkpoint).encode(torch.tensor(audio))  # a copy: the clip is read-only
    assert np.array_equal(codes.numpy(), reference["codes_16k_stereo"])


def test_batched_encode_equals_the_reference_batch(checkpoint: Path, reference: dict[str, np.ndarray]) -> None:
    clip = torch.from_numpy(reference["clip_24k"])
    full, short = load_encoder(checkpoint).encode_batch([clip, clip[:13000]])
    assert np.array_equal(full.numpy(), reference["codes_24k"])
    assert short.shape == (7, 16)  # ceil(13000 / 1920)
    assert np.array_equal(short.numpy(), reference["codes_batch_short"])


def test_decoder_waveform_matches_the_reference(checkpoint: Path, reference: dict[str, np.ndarray]) -> None:
    codes = torch.from_numpy(reference["decode_codes"])[None]
    with torch.inference_mode():
        wave = load_decoder(checkpoint)(codes)[0]
    assert wave.dtype == torch.float32 and wave.shape == (100 * 1920,)
    kept = wave.reshape(100, 1920)[torch.from_numpy(reference["decode_frames"])].reshape(-1).numpy()
    expected = reference["decode_wave"]
    assert np.abs(expected).max() > 1e-3  # the random weights produce a real signal
    assert np.abs(kept - expected).max() / np.abs(expected).max() <= 1e-4
