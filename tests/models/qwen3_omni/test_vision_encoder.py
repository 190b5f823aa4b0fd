"""Qwen3-Omni vision encoder: parity with transformers 5.24 including the deepstack
features (fixture from tools/parity/qwen3_omni_encoders_reference.py), input errors."""

from __future__ import annotations

import pytest
import torch
from encoder_fixtures import check_inputs, load_fixture, rel_error, seeded_module
from transformers.models.qwen3_omni_moe import configuration_qwen3_omni_moe as hf_config
from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as hf

from omnistage.models.qwen3_omni.modeling.vision_encoder import (
    VisionEncoder,
    VisionEncoderConfig,
    expected_weights,
)
from omnistage.models.qwen3_omni.parity_inputs import vision_patches


@pytest.fixture(scope="module")
def reference() -> dict:
    return load_fixture("vision_encoder.npz")


@pytest.fixture(scope="module")
def encoder(reference: dict) -> VisionEncoder:
    return seeded_module(reference, lambda raw: VisionEncoder(VisionEncoderConfig.from_hf(raw)))


def test_embeddings_and_deepstack_match_transformers(
    encoder: VisionEncoder, reference: dict
) -> None:
    pixels, grid = vision_patches(encoder.config.patch_values)
    check_inputs(reference, pixels)
    with torch.inference_mode():
        out = encoder(pixels, grid)
    assert out.lengths.tolist() == [15, 12, 24]
    assert out.deepstack.shape == (2, 51, 64)
    assert rel_error(out.embeddings, reference["embeddings"]) <= 1e-4
    for ours, theirs in zip(out.deepstack, reference["deepstack"], strict=True):
        assert rel_error(ours, theirs) <= 1e-4


def test_each_frame_attends_only_to_itself(encoder: VisionEncoder) -> None:
    pixels, grid = vision_patches(encoder.config.patch_values)
    first = 6 * 10
    with torch.inference_mode():
        together = encoder(pixels, grid).embeddings
        image = encoder(pixels[:first], grid[:1]).embeddings
    torch.testing.assert_close(image, together[:15], rtol=1e-5, atol=1e-6)


def test_expected_weights_are_the_checkpoint_names() -> None:
    shapes = expected_weights(VisionEncoderConfig())
    assert shapes["patch_embed.proj.weight"] == (1152, 3, 2, 16, 16)
    assert shapes["pos_embed.weight"] == (2304, 1152)
    assert shapes["merger.mlp.2.weight"] == (2048, 4608)
    assert shapes["merger.ln_q.weight"] == (1152,) and shapes["merger_list.2.ln_q.weight"] == (
        4608,
    )
    assert "merger_list.3.mlp.0.weight" not in shapes and "blocks.26.attn.qkv.weight" in shapes


def test_bad_inputs_name_the_problem(encoder: VisionEncoder) -> None:
    width = encoder.config.patch_values
    with pytest.raises(ValueError, match="pixel_values must be"):
        encoder(torch.zeros(15, width), torch.tensor([[1, 4, 4]]))
    with pytest.raises(ValueError, match="multiples of 2"):
        encoder(torch.zeros(12, width), torch.tensor([[1, 3, 4]]))


def test_config_rejects_what_is_not_implemented() -> None:
    with pytest.raises(ValueError, match="not a square"):
        VisionEncoderConfig.from_hf({"num_position_embeddings": 60})
    with pytest.raises(ValueError, match="deepstack_visual_indexes"):
        VisionEncoderConfig.from_hf({"depth": 2, "deepstack_visual_indexes": [0, 2]})
    assert (
        VisionEncoderConfig.from_hf({"rope_parameters": {"rope_theta": 500.0}}).rope_theta == 500.0
    )


def test_real_size_weights_have_the_reference_names_and_shapes() -> None:
    with torch.device("meta"):
        reference = hf.Qwen3OmniMoeVisionEncoder(
            hf_config.Qwen3OmniMoeVisionEncoderConfig(out_hidden_size=2048)
        )
    assert expected_weights(VisionEncoderConfig()) == {
        k: tuple(v.shape) for k, v in reference.state_dict().items()
    }
