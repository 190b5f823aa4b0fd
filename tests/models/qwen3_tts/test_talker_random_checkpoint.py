"""Random checkpoints: determinism, real layout and dims, and the ``init-random`` command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from talker_fixtures import SEED, weights_digest
from typer.testing import CliRunner

from omnistage.cli.main import app
from omnistage.models.qwen3_tts.modeling.config import Qwen3TTSConfig
from omnistage.models.qwen3_tts.modeling.model import Qwen3TTSModel
from omnistage.models.qwen3_tts.modeling.weights import load_checkpoint
from omnistage.models.qwen3_tts.random_checkpoint import build_config_dict, write_model_files


def meta_param_count(size: str, model_type: str) -> tuple[Qwen3TTSConfig, int]:
    config = Qwen3TTSConfig.from_dict(build_config_dict(size, model_type))
    with torch.device("meta"):
        model = Qwen3TTSModel(config)
    return config, sum(p.numel() for p in model.parameters())


def test_same_seed_writes_identical_weights(tiny_checkpoints, tmp_path: Path) -> None:
    again = write_model_files(tmp_path / "again", "tiny", "base", seed=SEED)
    assert weights_digest(again) == weights_digest(tiny_checkpoints["base"])
    other = write_model_files(tmp_path / "other", "tiny", "base", seed=SEED + 1)
    assert weights_digest(other) != weights_digest(again)


@pytest.mark.parametrize("model_type", ["base", "custom_voice", "voice_design"])
def test_tiny_checkpoint_loads_with_every_tensor_random_and_finite(tiny_checkpoints, model_type: str) -> None:
    model = load_checkpoint(tiny_checkpoints[model_type]).model
    for name, tensor in model.state_dict().items():
        assert torch.isfinite(tensor).all(), name
        assert tensor.float().std() > 0 if tensor.numel() > 1 else True, f"{name} is constant"
    assert (model.speaker_encoder is not None) == (model_type == "base")


def test_tiny_predictor_is_narrower_than_the_talker_so_the_projection_exists(tiny_checkpoints) -> None:
    talker = load_checkpoint(tiny_checkpoints["voice_design"]).model.talker
    assert talker.code_predictor.small_to_mtp_projection is not None
    assert talker.config.text_hidden_size != talker.config.decoder.hidden_size


def test_real_0_6b_base_config_and_parameter_count() -> None:
    """Digest section 1: 0.6B-Base has 914.6 M parameters, 311 M of them text_embedding."""
    config, params = meta_param_count("0.6b", "base")
    t = config.talker
    assert (t.decoder.hidden_size, t.decoder.intermediate_size, t.decoder.num_layers) == (1024, 3072, 28)
    assert (t.decoder.num_heads, t.decoder.num_kv_heads, t.decoder.head_dim) == (16, 8, 128)
    assert (t.text_vocab_size, t.text_hidden_size, t.mrope_section) == (151936, 2048, (24, 20, 20))
    assert (config.tts_pad_id, config.tts_bos_id, config.tts_eos_id) == (151671, 151672, 151673)
    assert config.code_predictor.decoder.num_layers == 5 and config.speaker_encoder.enc_dim == 1024
    assert round(params / 1e6, 1) == 914.6


def test_real_1_7b_base_parameter_count_and_projection() -> None:
    """Digest section 1: 1.7B-Base has 1.93 G parameters; its predictor (1024) is narrower
    than the talker (2048), hence small_to_mtp_projection."""
    config, params = meta_param_count("1.7b", "base")
    assert config.talker.decoder.hidden_size == 2048
    assert round(params / 1e9, 2) == 1.93


def test_custom_voice_and_voice_design_have_no_speaker_encoder_weights() -> None:
    _, base = meta_param_count("0.6b", "base")
    _, custom = meta_param_count("0.6b", "custom_voice")
    _, design = meta_param_count("0.6b", "voice_design")
    assert custom == design < base


def test_init_random_command_writes_a_complete_checkpoint(tmp_path: Path) -> None:
    out = tmp_path / "cv"
    args = ["init-random", "--arch", "Qwen3TTSForConditionalGeneration", "--size", "tiny", "--type", "custom_voice"]
    result = CliRunner().invoke(app, [*args, "--seed", "3", str(out)])
    assert result.exit_code == 0, result.output
    for name in ("config.json", "generation_config.json", "vocab.json", "merges.txt", "tokenizer_config.json",
                 "preprocessor_config.json", "model.safetensors", "speech_tokenizer/config.json",
                 "speech_tokenizer/model.safetensors"):
        assert (out / name).is_file(), name
    assert len(json.loads((out / "generation_config.json").read_text())) == 10
    assert load_checkpoint(out).config.tts_model_type == "custom_voice"


def test_init_random_rejects_an_unknown_architecture(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["init-random", "--arch", "Nope", str(tmp_path)])
    assert result.exit_code == 2 and "unknown --arch 'Nope'" in result.output
    assert "--arch Qwen3TTSForConditionalGeneration: --size tiny | 0.6b | 1.7b" in result.output


def test_init_random_lists_what_each_model_offers_and_refuses_what_it_does_not(tmp_path: Path) -> None:
    listed = CliRunner().invoke(app, ["init-random", "--list"])
    assert listed.exit_code == 0
    assert "--type base | custom_voice | voice_design" in listed.output
    arch = ["init-random", "--arch", "Qwen3TTSForConditionalGeneration"]
    result = CliRunner().invoke(app, [*arch, "--size", "3b", str(tmp_path)])
    assert result.exit_code == 2 and "sizes: tiny, 0.6b, 1.7b" in result.output
    result = CliRunner().invoke(app, [*arch, "--type", "omni", str(tmp_path)])
    assert result.exit_code == 2 and "types: base, custom_voice, voice_design" in result.output
