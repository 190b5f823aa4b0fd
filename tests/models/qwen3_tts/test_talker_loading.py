"""Checkpoint loading: config parsing, mandatory files, strict tensor names, sharded layout."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from omnistage.models.qwen3_tts.modeling.config import (
    CheckpointConfigError,
    load_config,
    load_generation_config,
)
from omnistage.models.qwen3_tts.modeling.weights import CheckpointWeightsError, load_checkpoint


@pytest.fixture
def base_copy(tiny_checkpoints, tmp_path: Path) -> Path:
    return Path(shutil.copytree(tiny_checkpoints["base"], tmp_path / "base"))


def test_missing_generation_config_is_an_error_naming_the_file(base_copy: Path) -> None:
    (base_copy / "generation_config.json").unlink()
    with pytest.raises(CheckpointConfigError, match="generation_config.json is missing"):
        load_checkpoint(base_copy)


def test_generation_config_without_a_key_names_the_key(base_copy: Path) -> None:
    path = base_copy / "generation_config.json"
    raw = json.loads(path.read_text())
    del raw["subtalker_top_k"]
    path.write_text(json.dumps(raw))
    with pytest.raises(CheckpointConfigError, match="subtalker_top_k"):
        load_checkpoint(base_copy)


def edit_json(path: Path, edit) -> None:
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


def test_talker_head_dim_is_required_not_derived(base_copy: Path) -> None:
    edit_json(base_copy / "config.json", lambda raw: raw["talker_config"].pop("head_dim"))
    with pytest.raises(CheckpointConfigError, match="config.json: talker_config.head_dim is missing"):
        load_config(base_copy)


def test_malformed_value_is_an_error_naming_the_field(base_copy: Path) -> None:
    edit_json(base_copy / "config.json", lambda raw: raw["talker_config"].update(head_dim="wide"))
    with pytest.raises(CheckpointConfigError, match="config.json: talker_config.head_dim = 'wide'"):
        load_config(base_copy)


def test_config_of_the_25hz_tokenizer_is_refused_naming_the_file(base_copy: Path) -> None:
    edit_json(base_copy / "config.json", lambda raw: raw.update(tokenizer_type="qwen3_tts_tokenizer_25hz"))
    with pytest.raises(CheckpointConfigError, match="config.json: tokenizer_type 'qwen3_tts_tokenizer_25hz'"):
        load_config(base_copy)


def test_config_of_another_architecture_is_refused(base_copy: Path) -> None:
    edit_json(base_copy / "config.json", lambda raw: raw.update(architectures=["Qwen3ForCausalLM"]))
    with pytest.raises(CheckpointConfigError, match="config.json: architectures .* lack 'Qwen3TTSForConditionalGeneration'"):
        load_config(base_copy)


def test_malformed_speaker_id_is_refused_naming_the_field(tiny_checkpoints, tmp_path: Path) -> None:
    path = Path(shutil.copytree(tiny_checkpoints["custom_voice"], tmp_path / "cv"))
    edit_json(path / "config.json", lambda raw: raw["talker_config"]["spk_id"].update(vivian=[1, 2]))
    with pytest.raises(CheckpointConfigError, match="talker_config.spk_id.vivian must be an int or a 1-element list"):
        load_config(path)


@pytest.mark.parametrize(
    ("key", "value"),
    [("top_p", 0), ("subtalker_top_p", 1.5), ("temperature", -0.1), ("subtalker_temperature", 1e39),
     ("top_k", -1), ("repetition_penalty", 0), ("max_new_tokens", 0), ("max_new_tokens", 8193)],
)  # fmt: skip
def test_generation_config_out_of_range_is_refused_naming_the_key(base_copy: Path, key: str, value: float) -> None:
    edit_json(base_copy / "generation_config.json", lambda raw: raw.update({key: value}))
    with pytest.raises(CheckpointConfigError, match=f"generation_config.json: {key} = "):
        load_generation_config(base_copy)


def test_speaker_ids_accept_ints_and_one_element_lists(tiny_checkpoints) -> None:
    raw = json.loads((tiny_checkpoints["custom_voice"] / "config.json").read_text())
    spellings = {type(v) for v in raw["talker_config"]["spk_id"].values()}
    assert spellings == {int, list}
    config = load_config(tiny_checkpoints["custom_voice"])
    assert config.talker.spk_id["vivian"] == 3065 and config.talker.spk_id["ryan"] == 3061
    assert config.talker.spk_is_dialect == {**dict.fromkeys(config.talker.spk_id), "eric": "sichuan_dialect", "dylan": "beijing_dialect"}


def test_missing_tensor_is_listed(base_copy: Path) -> None:
    tensors = load_file(base_copy / "model.safetensors")
    del tensors["talker.codec_head.weight"]
    tensors["talker.extra.weight"] = torch.zeros(1)
    save_file(tensors, base_copy / "model.safetensors")
    with pytest.raises(CheckpointWeightsError, match=r"1 missing: talker\.codec_head\.weight; 1 unexpected: talker\.extra\.weight"):
        load_checkpoint(base_copy)


def test_wrong_shape_is_an_error(base_copy: Path) -> None:
    tensors = load_file(base_copy / "model.safetensors")
    tensors["talker.model.norm.weight"] = torch.ones(7)
    save_file(tensors, base_copy / "model.safetensors")
    with pytest.raises(CheckpointWeightsError, match="talker.model.norm.weight .* has shape \\(7,\\)"):
        load_checkpoint(base_copy)


def test_no_weight_file_is_an_error(base_copy: Path) -> None:
    (base_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointWeightsError, match="neither model.safetensors nor"):
        load_checkpoint(base_copy)


def test_sharded_checkpoint_loads_the_same_weights(base_copy: Path, tiny_checkpoints) -> None:
    tensors = load_file(base_copy / "model.safetensors")
    (base_copy / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, base_copy / file)
        weight_map.update(dict.fromkeys(part, file))
    (base_copy / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    sharded = load_checkpoint(base_copy).model.state_dict()
    single = load_checkpoint(tiny_checkpoints["base"]).model.state_dict()
    assert sharded.keys() == single.keys()
    for name in single:
        assert torch.equal(sharded[name], single[name]), name


def test_missing_shard_is_named(base_copy: Path) -> None:
    (base_copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00009.safetensors"}}))
    with pytest.raises(CheckpointWeightsError, match="model-00009.safetensors"):
        load_checkpoint(base_copy)


def test_custom_voice_has_no_speaker_encoder_and_loads_in_requested_dtype(tiny_checkpoints) -> None:
    loaded = load_checkpoint(tiny_checkpoints["custom_voice"], dtype=torch.bfloat16)
    assert loaded.model.speaker_encoder is None
    assert loaded.model.talker.codec_head.weight.dtype == torch.bfloat16
    # the RoPE table stays fp32 whatever the weights' dtype
    assert loaded.model.talker.model.rotary.table.dtype == torch.float32
