"""Random speech tokenizers: deterministic, every tensor random, the real layout."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.mimi.modeling_mimi import MimiConv1d

from omnistage.models.qwen3_tts.modeling.speech_tokenizer.config import SpeechTokenizerConfig
from omnistage.models.qwen3_tts.modeling.speech_tokenizer.decoder import load_decoder
from omnistage.models.qwen3_tts.modeling.speech_tokenizer.encoder import load_encoder
from omnistage.models.qwen3_tts.modeling.speech_tokenizer.random_init import (
    random_speech_tokenizer_tensors,
    speech_tokenizer_config,
    write_random_speech_tokenizer,
)


def test_the_same_seed_gives_the_same_tensors_and_another_seed_others() -> None:
    first, again, other = (random_speech_tokenizer_tensors("tiny", s) for s in (0, 0, 1))
    assert first.keys() == other.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["decoder.pre_conv.conv.weight"], other["decoder.pre_conv.conv.weight"])


def test_every_tensor_is_random_where_defaults_would_hide_bugs() -> None:
    tensors = random_speech_tokenizer_tensors("tiny", 0)
    for name, tensor in tensors.items():
        if name.endswith("cluster_usage"):
            assert tensor.min() >= 0.5
        elif not name.endswith("initialized"):
            assert tensor.abs().min() > 0 and (tensor.numel() == 1 or tensor.std() > 0), name  # no zero or constant tensor
    snake = [k for k in tensors if k.endswith(".alpha") or k.endswith(".beta")]
    assert snake and all(tensors[k].abs().min() > 0 for k in snake)


def test_written_files_have_the_real_layout(tmp_path: Path) -> None:
    write_random_speech_tokenizer(tmp_path, "tiny", seed=0)
    assert {p.name for p in tmp_path.iterdir()} == {"config.json", "model.safetensors", "preprocessor_config.json"}
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["architectures"] == ["Qwen3TTSTokenizerV2Model"] and raw["model_type"] == "qwen3_tts_tokenizer_12hz"
    config = SpeechTokenizerConfig.from_dict(raw)
    assert config.decoder.samples_per_frame == 1920 and config.encoder_valid_num_quantizers == 16


def test_real_sizes_have_the_released_dimensions() -> None:
    config = SpeechTokenizerConfig.from_dict(speech_tokenizer_config("0.6b"))
    d = config.decoder
    assert (d.latent_dim, d.codebook_dim, d.hidden_size, d.num_hidden_layers, d.decoder_dim) == (1024, 512, 512, 8, 1536)
    assert (d.num_attention_heads, d.head_dim, d.sliding_window) == (16, 64, 72)
    assert config.encoder["num_quantizers"] == 32 and config.encoder["upsampling_ratios"] == [8, 6, 5, 4]


def test_tiny_decoder_audio_depends_on_the_codes(tmp_path: Path) -> None:
    """Two different random code sequences decode to clearly different audio on the tiny
    checkpoint (max difference far above one int16 step, 3.05e-5), with the output clamp
    at +-1 inactive: audio compared within 1 LSB tells right codes from wrong ones.
    (The older init gave a bias-driven waveform, peak 0.013, moved < 1e-5 by the codes.)"""
    write_random_speech_tokenizer(tmp_path, "tiny", seed=0)
    decoder = load_decoder(tmp_path)
    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 2048, (2, 10, 16), generator=generator)
    with torch.inference_mode():
        audio = decoder(codes)
    assert torch.isfinite(audio).all()
    assert audio.abs().max() < 0.9  # the clamp hides nothing
    difference = audio[0] - audio[1]
    assert difference.abs().max() > 1e-3
    assert difference.std() > 0.2 * audio.std()  # the code-dependent part is not a sliver


def _tone_clip(frequency: float, seed: int) -> torch.Tensor:
    """1 s at 24 kHz: a tone and its 3.1x partial (rms ~0.32) plus seeded noise."""
    t = np.arange(24000) / 24000
    noise = np.random.default_rng(seed).standard_normal(t.size)
    wave = 0.4 * np.sin(2 * np.pi * frequency * t) + 0.2 * np.sin(2 * np.pi * 3.1 * frequency * t) + 0.05 * noise
    return torch.from_numpy(wave.astype(np.float32))


def test_tiny_encoder_codes_depend_on_the_audio(tmp_path: Path) -> None:
    """The tiny encoder's codes follow the audio: a clip's 13 frames take many distinct codes
    in every one of the 16 groups, and two different clips share few codes. (The older init
    gave 3..7 distinct codes per group, mostly one frame repeated, and two different clips
    shared ~70% of their codes: the nearest codeword was the one of smallest norm, whatever
    the audio, so the encoder parity test proved little.) Measured on seed 0: 12.6 distinct
    codes per group on average (at least 10), ~1% shared."""
    write_random_speech_tokenizer(tmp_path, "tiny", seed=0)
    encoder = load_encoder(tmp_path)
    first, second = encoder.encode_batch([_tone_clip(220.0, seed=1), _tone_clip(587.0, seed=2)])
    assert first.shape == second.shape == (13, 16)
    for codes in (first, second):
        distinct = [len(set(codes[:, group].tolist())) for group in range(16)]
        assert np.mean(distinct) >= 10 and min(distinct) >= 6, distinct
    assert (first == second).float().mean() < 0.1  # different clips: different codes almost everywhere


def test_the_encoders_conv_lengths_stay_on_the_host_when_it_moves(tmp_path: Path) -> None:
    """Each Mimi conv's padding is computed from its length tensors and read back as ints:
    they stay CPU tensors wherever the encoder's weights go (on a GPU: no sync per conv;
    the codes are those of the reference, test_speech_tokenizer_parity.py)."""
    write_random_speech_tokenizer(tmp_path, "tiny", seed=0)
    encoder = load_encoder(tmp_path)
    convs = [m for m in encoder.modules() if isinstance(m, MimiConv1d)]
    assert len(convs) >= 5
    encoder.to("meta")  # moves every parameter and buffer, as .to("cuda") would
    lengths = [getattr(conv, name) for conv in convs for name in ("stride", "kernel_size", "padding_total")]
    assert {length.device.type for length in lengths} == {"cpu"}
    assert all(conv.conv.weight.device.type == "meta" for conv in convs)


class _DeviceReads(TorchDispatchMode):
    """Counts the ops that read a device tensor back to the host (each a sync)."""

    READS = ("aten._local_scalar_dense", "aten.item", "aten.is_nonzero")

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = args[0] if args else None
        if str(func).startswith(self.READS) and isinstance(first, torch.Tensor) and first.is_cuda:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.gpu
def test_the_encoder_on_cuda_does_not_sync_per_conv(tmp_path: Path) -> None:
    """On CUDA one encode reads at most one value back before its codes: transformers'
    packed-sequence check of the attention mask, not two per conv as before."""
    write_random_speech_tokenizer(tmp_path, "tiny", seed=0)
    encoder = load_encoder(tmp_path, "cuda")
    clip = _tone_clip(220.0, seed=1).cuda()
    encoder.encode(clip)  # warm-up
    reads = _DeviceReads()
    with torch.inference_mode(), reads:
        codes = encoder.encode(clip)
    assert len(reads.reads) <= 1, reads.reads
    assert codes.shape == (13, 16) and codes.is_cuda
