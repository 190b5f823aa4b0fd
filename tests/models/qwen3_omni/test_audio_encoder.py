"""Qwen3-Omni audio encoder: parity with transformers 5.24 (fixture from
tools/parity/qwen3_omni_encoders_reference.py), output lengths, input errors."""

from __future__ import annotations

import pytest
import torch
from encoder_fixtures import check_inputs, load_fixture, rel_error, seeded_module
from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as hf_config
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
    _get_feat_extract_output_lengths,
)

from omnistage.models.qwen3_omni.modeling.audio_encoder import (
    AudioEncoder,
    AudioEncoderConfig,
    expected_weights,
    output_lengths,
)
from omnistage.models.qwen3_omni.parity_inputs import audio_features


@pytest.fixture(scope="module")
def reference() -> dict:
    return load_fixture("audio_encoder.npz")


@pytest.fixture(scope="module")
def encoder(reference: dict) -> AudioEncoder:
    return seeded_module(reference, lambda raw: AudioEncoder(AudioEncoderConfig.from_hf(raw)))


def test_embeddings_match_transformers(encoder: AudioEncoder, reference: dict) -> None:
    features, frames = audio_features(encoder.config.num_mel_bins)
    check_inputs(reference, features)
    with torch.inference_mode():
        out = encoder(features, frames)
    assert out.lengths.tolist() == [33, 5, 130]
    assert rel_error(out.embeddings, reference["embeddings"]) <= 1e-4


def test_output_lengths_follow_the_reference_formula() -> None:
    frames = torch.arange(1, 3001)
    expected = _get_feat_extract_output_lengths(frames, 50)
    assert torch.equal(output_lengths(frames, AudioEncoderConfig()), expected)
    assert AudioEncoderConfig().tokens_per_chunk == 13 and AudioEncoderConfig().window_tokens == 104


def test_expected_weights_are_the_checkpoint_names() -> None:
    shapes = expected_weights(AudioEncoderConfig())
    assert shapes["conv_out.weight"] == (1280, 480 * 16)
    assert shapes["proj2.weight"] == (2048, 1280)
    assert "layers.31.self_attn.out_proj.bias" in shapes and "layers.32.fc1.weight" not in shapes


@pytest.mark.parametrize(
    ("features", "frames", "message"),
    [
        (torch.zeros(128, 10), torch.tensor([11]), r"features must be \[128, 11\]"),
        (torch.zeros(80, 10), torch.tensor([10]), r"features must be \[128, 10\]"),
        (torch.zeros(128, 10), torch.tensor([10, 0]), "every audio needs >= 1 mel frame"),
    ],
)
def test_bad_inputs_name_the_problem(encoder: AudioEncoder, features, frames, message) -> None:
    with pytest.raises(ValueError, match=message):
        encoder(features, frames)


def test_config_rejects_what_is_not_implemented() -> None:
    with pytest.raises(ValueError, match="activation_function"):
        AudioEncoderConfig.from_hf({"activation_function": "relu"})
    with pytest.raises(ValueError, match="n_window_infer"):
        AudioEncoderConfig.from_hf({"n_window_infer": 150})


def test_real_size_weights_have_the_reference_names_and_shapes() -> None:
    with torch.device("meta"):
        reference = hf.Qwen3OmniMoeAudioEncoder(
            hf_config.Qwen3OmniMoeAudioEncoderConfig(output_dim=2048)
        )
    assert expected_weights(AudioEncoderConfig()) == {
        k: tuple(v.shape) for k, v in reference.state_dict().items()
    }
