"""config.json parsing: both RoPE spellings, the real and tiny geometries, errors that name the field."""

from __future__ import annotations

import copy

import pytest

from omnistage.models.qwen3_omni.modeling.config import (
    CheckpointConfigError,
    Qwen3OmniConfig,
    load_config,
)
from omnistage.models.qwen3_omni.random_checkpoint import build_config_dict, write_config


def hub_spelling(raw: dict) -> dict:
    """Rewrite every rope_parameters as the Hub's rope_scaling + rope_theta."""
    out = copy.deepcopy(raw)
    sections = [out["thinker_config"]["text_config"], out["talker_config"]["text_config"],
                out["talker_config"]["code_predictor_config"]]  # fmt: skip
    for section in sections:
        rope = section.pop("rope_parameters")
        section["rope_theta"] = rope.pop("rope_theta")
        if "mrope_section" in rope:
            section["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    return out


def test_both_rope_spellings_give_the_same_config() -> None:
    raw = build_config_dict("tiny")
    assert Qwen3OmniConfig.from_dict(hub_spelling(raw)) == Qwen3OmniConfig.from_dict(raw)


def test_real_geometry(tmp_path) -> None:
    config = load_config(write_config(tmp_path, "30b-a3b"))
    text, talker = config.thinker.text, config.talker
    assert (text.num_layers, text.hidden_size, text.head_dim, text.num_experts, text.top_k) == (
        48,
        2048,
        128,
        128,
        8,
    )
    assert text.rope.mrope_section == (24, 20, 20) and text.rope.theta == 1e6
    assert (
        talker.text.num_layers,
        talker.text.top_k,
        talker.text.shared_expert_intermediate_size,
    ) == (20, 6, 768)
    assert talker.accept_hidden_layer == 24 and talker.code_predictor.decoder.num_layers == 5
    assert config.thinker.deepstack_layers == 3 and talker.speaker_id["ethan"] == 2302


def test_a_sliding_window_size_without_use_sliding_window_is_accepted() -> None:
    raw = build_config_dict("tiny")
    raw["thinker_config"]["text_config"].update(
        {"sliding_window": 4096, "use_sliding_window": False}
    )
    assert Qwen3OmniConfig.from_dict(raw).thinker.text.num_layers == 4
    raw["thinker_config"]["text_config"]["use_sliding_window"] = True
    with pytest.raises(CheckpointConfigError, match="use_sliding_window is set"):
        Qwen3OmniConfig.from_dict(raw)


def test_talker_num_local_experts_spelling_is_accepted() -> None:
    raw = build_config_dict("tiny")
    raw["talker_config"]["text_config"]["num_local_experts"] = raw["talker_config"][
        "text_config"
    ].pop("num_experts")
    assert Qwen3OmniConfig.from_dict(raw).talker.text.num_experts == 4


def mutate(path: list[str], value=None, delete: bool = False) -> dict:
    raw = build_config_dict("tiny")
    section = raw
    for key in path[:-1]:
        section = section[key]
    if delete:
        del section[path[-1]]
    else:
        section[path[-1]] = value
    return raw


@pytest.mark.parametrize(
    ("path", "value", "delete", "match"),
    [
        (
            ["thinker_config", "text_config", "head_dim"],
            None,
            True,
            r"thinker_config\.text_config\.head_dim is missing",
        ),
        (
            ["thinker_config", "text_config", "rope_parameters", "mrope_section"],
            [4, 2, 1],
            False,
            "does not sum to head_dim/2",
        ),
        (
            ["thinker_config", "text_config", "rope_parameters", "interleaved"],
            False,
            False,
            "only interleaved MRoPE",
        ),
        (
            ["thinker_config", "text_config", "rope_parameters", "rope_type"],
            "yarn",
            False,
            "only 'default' RoPE",
        ),
        (
            ["thinker_config", "text_config", "rope_parameters"],
            None,
            True,
            "neither rope_parameters nor rope_theta",
        ),
        (
            ["thinker_config", "text_config", "num_experts_per_tok"],
            9,
            False,
            r"num_experts_per_tok = 9 is not in 1\.\.8",
        ),
        (["thinker_config", "text_config", "num_key_value_heads"], 3, False, "do not group"),
        (["thinker_config", "text_config", "hidden_size"], 0, False, "hidden_size = 0 must be > 0"),
        (
            ["thinker_config", "text_config", "vocab_size"],
            "big",
            False,
            r"vocab_size = 'big' is not a int",
        ),
        (
            ["talker_config", "accept_hidden_layer"],
            5,
            False,
            r"accept_hidden_layer = 5 is not in 0\.\.4",
        ),
        (["talker_config", "thinker_hidden_size"], 32, False, "thinker_hidden_size = 32"),
        (["talker_config", "speaker_id"], {"x": 5000}, False, r"speaker_id\.x = 5000"),
        (
            ["talker_config", "code_predictor_config", "num_code_groups"],
            8,
            False,
            "code predictor has 8",
        ),
        (["tts_pad_token_id"], 10**7, False, "tts_pad_token_id = 10000000 is not below"),
        (
            ["architectures"],
            ["Qwen3TTSForConditionalGeneration"],
            False,
            "lack 'Qwen3OmniMoeForConditionalGeneration'",
        ),
    ],
)
def test_bad_fields_are_named(path, value, delete, match) -> None:
    with pytest.raises(CheckpointConfigError, match=match):
        Qwen3OmniConfig.from_dict(mutate(path, value, delete))


def test_no_talker_without_audio_output() -> None:
    raw = build_config_dict("tiny")
    raw["enable_audio_output"] = False
    del raw["talker_config"]
    assert Qwen3OmniConfig.from_dict(raw).talker is None


def test_load_config_names_the_file(tmp_path) -> None:
    with pytest.raises(CheckpointConfigError, match="config.json is missing"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("[1]", encoding="utf-8")
    with pytest.raises(CheckpointConfigError, match="not an object"):
        load_config(tmp_path)
