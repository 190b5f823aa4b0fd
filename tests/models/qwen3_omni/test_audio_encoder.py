"""Qwen3-Omni audio encoder: parity with transformers 5.24 (fixture from
tools/parity/qwen3_omni_encoders_reference.py), output lengths, input errors."""

from __future__ import annotations

import copy

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


def test_a_batch_of_prompts_gives_each_the_rows_it_gets_alone(encoder: AudioEncoder) -> None:
    # the first convolution's bias raised so that its activations of padding frames (which
    # the later convolutions see) move a tail chunk's rows well above rounding
    encoder = copy.deepcopy(encoder)
    with torch.no_grad():
        encoder.conv2d1.bias.fill_(1.0)
    # prompts of a tail-only clip (alone padded to its own 45 / 37 frames), of two clips
    # (a whole chunk and a tail), of whole chunks and a tail, of whole chunks only
    frames = [[45], [250, 70], [130], [37], [300]]
    generator = torch.Generator().manual_seed(5)
    features = [
        torch.randn(encoder.config.num_mel_bins, sum(f), generator=generator) for f in frames
    ]
    every = (torch.cat(features, dim=1), torch.tensor([n for f in frames for n in f]))
    with torch.inference_mode():
        alone = [encoder(x, torch.tensor(f)) for x, f in zip(features, frames, strict=True)]
        batched = encoder(*every, prompts=[len(f) for f in frames])
        shared = encoder(*every)  # one prompt: every chunk padded to 100 frames
    sizes = [int(out.lengths.sum()) for out in alone]
    assert torch.equal(batched.lengths, torch.cat([out.lengths for out in alone]))
    for ours, out in zip(batched.embeddings.split(sizes), alone, strict=True):
        # the same computation per row, but a matmul over more rows may take another CPU
        # kernel (blocking, gemv for a 2-row prompt alone), so equal up to fp32 rounding
        # (measured <= 6e-7 on rows of magnitude ~1), not bitwise
        torch.testing.assert_close(ours, out.embeddings, rtol=1e-5, atol=1e-5)
    # padding the short prompts' chunks with the others' changes their rows: the
    # per-prompt padding is what the equality rests on
    first = shared.embeddings[: sizes[0]]
    assert float((first - alone[0].embeddings).abs().max()) > 1e-2


def test_prompts_must_partition_the_audios(encoder: AudioEncoder) -> None:
    with pytest.raises(ValueError, match=r"prompts \[1\] do not partition 2 audios"):
        encoder(torch.zeros(128, 10), torch.tensor([4, 6]), prompts=[1])


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
