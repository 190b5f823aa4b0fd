"""Loading the Hugging Face layout strictly, sharded checkpoints, and dummy (random in place) weights."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import omnistage.models.qwen3_omni.random_checkpoint as omni_random
from omnistage.cli.main import app
from omnistage.models.qwen3_omni.config import Qwen3OmniPipelineConfig
from omnistage.models.qwen3_omni.modeling.model import PARTS, load_model
from omnistage.models.qwen3_omni.modeling.weights import CheckpointWeightsError
from omnistage.models.qwen3_omni.processing import Qwen3OmniProcessor
from omnistage.models.qwen3_omni.random_checkpoint import (
    build_config_dict,
    checkpoint_tensor_shapes,
    write_config,
    write_random_checkpoint,
)
from omnistage.models.qwen3_omni.random_text_tokenizer import give_role_words_their_ids

ARCH = "Qwen3OmniMoeForConditionalGeneration"


@pytest.fixture(scope="module")
def tiny_copy(tmp_path_factory):
    root = write_random_checkpoint(tmp_path_factory.mktemp("omni_weights"), "tiny", seed=3)
    return root, load_file(str(root / "model.safetensors"))


def rewrite(root, tensors) -> None:
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})


def test_experts_are_stored_one_tensor_per_expert_with_the_router(tiny_copy) -> None:
    _, tensors = tiny_copy
    assert tensors["thinker.model.layers.0.mlp.gate.weight"].shape == (8, 64)
    assert tensors["thinker.model.layers.3.mlp.experts.7.down_proj.weight"].shape == (64, 32)
    assert tensors["talker.model.layers.1.mlp.shared_expert_gate.weight"].shape == (1, 32)
    assert "talker.code_predictor.lm_head.14.weight" in tensors


def test_missing_unexpected_and_misshapen_tensors_are_listed(tiny_copy, tmp_path) -> None:
    root, tensors = tiny_copy
    broken = write_config(tmp_path, "tiny")
    bad = dict(tensors)
    del bad["thinker.model.layers.2.mlp.experts.5.up_proj.weight"]
    bad["talker.model.layers.0.mlp.surprise.weight"] = torch.zeros(2)
    rewrite(broken, bad)
    with pytest.raises(
        CheckpointWeightsError,
        match=r"1 missing: thinker\.model\.layers\.2\.mlp\.experts\.5\.up_proj",
    ):
        load_model(broken, parts=("thinker",))
    with pytest.raises(
        CheckpointWeightsError, match=r"1 unexpected: talker\.model\.layers\.0\.mlp\.surprise"
    ):
        load_model(broken, parts=("talker",))
    bad = dict(tensors)
    bad["thinker.lm_head.weight"] = torch.zeros(10, 64)
    rewrite(broken, bad)
    with pytest.raises(
        CheckpointWeightsError, match=r"thinker\.lm_head\.weight .*shape \(10, 64\).*\(152064, 64\)"
    ):
        load_model(broken, parts=("thinker",))
    bad = dict(tensors)
    bad["vision_tower.stray.weight"] = torch.zeros(1)
    rewrite(broken, bad)
    with pytest.raises(CheckpointWeightsError, match=r"unexpected: vision_tower\.stray\.weight"):
        load_model(broken, parts=("thinker",))


def test_a_stage_reads_only_its_part(tiny_copy, tmp_path) -> None:
    """A thinker-only load ignores a broken talker (its tensors are not read)."""
    _, tensors = tiny_copy
    root = write_config(tmp_path, "tiny")
    rewrite(root, {k: v for k, v in tensors.items() if not k.startswith("talker.")})
    loaded = load_model(root, parts=("thinker",))
    assert loaded.talker is None and loaded.thinker is not None


def test_sharded_checkpoint_loads_like_a_single_file(tiny_copy, tmp_path, monkeypatch) -> None:
    root, _ = tiny_copy
    monkeypatch.setattr(omni_random, "SHARD_BYTES", 16 * 1024**2)
    sharded = write_random_checkpoint(tmp_path, "tiny", seed=3)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    a, b = load_model(root), load_model(sharded)
    for x, y in ((a.thinker, b.thinker), (a.talker, b.talker)):
        assert all(
            torch.equal(p, q)
            for p, q in zip(x.state_dict().values(), y.state_dict().values(), strict=True)
        )


def test_dummy_load_equals_the_written_checkpoint(tiny_copy) -> None:
    """--load-format dummy draws the bytes init-random writes (same seed): no file read."""
    root, _ = tiny_copy
    written, dummy = (
        load_model(root, parts=PARTS),
        load_model(root, parts=PARTS, load_format="dummy", seed=3),
    )
    for x, y in ((getattr(written, p), getattr(dummy, p)) for p in PARTS):
        assert all(
            torch.equal(p, q)
            for p, q in zip(x.state_dict().values(), y.state_dict().values(), strict=True)
        )
    other = load_model(root, load_format="dummy", seed=4)
    assert not torch.equal(other.thinker.lm_head.weight, dummy.thinker.lm_head.weight)


def test_real_dims_spec_counts_every_written_part() -> None:
    """30B-A3B: 35.26 B parameters, the shipped checkpoint's count, one tensor per expert."""
    shapes = checkpoint_tensor_shapes(build_config_dict("30b-a3b"))
    assert round(sum(math.prod(s) for s in shapes.values()) / 1e9, 2) == 35.26
    assert shapes["code2wav.code_embedding.weight"] == (16 * 2048, 1024)
    assert shapes["code2wav.pre_transformer.layers.7.mlp.down_proj.weight"] == (1024, 3072)
    assert shapes["thinker.audio_tower.conv_out.weight"] == (1280, 7680)
    assert shapes["thinker.visual.merger_list.2.mlp.2.weight"] == (2048, 4608)
    assert shapes["thinker.model.layers.47.mlp.experts.127.gate_proj.weight"] == (768, 2048)
    assert shapes["talker.model.layers.19.mlp.experts.127.down_proj.weight"] == (1024, 384)
    assert shapes["talker.hidden_projection.linear_fc1.weight"] == (2048, 2048)


def test_unknown_part_and_format_are_refused(tiny_copy) -> None:
    root, _ = tiny_copy
    with pytest.raises(ValueError, match="unknown parts"):
        load_model(root, parts=("vocoder",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="load_format"):
        load_model(root, load_format="pt")  # type: ignore[arg-type]


def test_init_random_writes_a_checkpoint_that_loads_strictly_and_in_transformers(tmp_path) -> None:
    """``omnistage init-random --arch Qwen3OmniMoeForConditionalGeneration --size tiny`` (the
    writer EntryClass declares) writes every part transformers' model has: it loads with no
    missing or unexpected tensor, ours loads it strictly (code2wav included, equal to the
    written bytes), and it has the tokenizer the pipeline reads."""
    from transformers import Qwen3OmniMoeForConditionalGeneration

    root = tmp_path / "tiny"
    result = CliRunner().invoke(
        app, ["init-random", "--arch", ARCH, "--size", "tiny", "--seed", "0", str(root)]
    )
    assert result.exit_code == 0, result.output
    assert Qwen3OmniPipelineConfig.random_checkpoint.sizes == ("tiny", "30b-a3b")
    ref, info = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
        str(root), dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"], info["missing_keys"]
    assert not info["unexpected_keys"] and not info["mismatched_keys"], info
    ours = load_model(root, parts=PARTS)
    written = load_file(str(root / "model.safetensors"))
    for name, tensor in ours.code2wav.state_dict().items():
        assert torch.equal(tensor, written[f"code2wav.{name}"]), name
        assert torch.equal(tensor, ref.code2wav.state_dict()[name]), name
    before = (root / "vocab.json").read_text()
    give_role_words_their_ids(root)  # idempotent: the tests' fixtures call it again
    assert (root / "vocab.json").read_text() == before
    tokenizer = Qwen3OmniProcessor.from_checkpoint(root).tokenizer
    assert tokenizer.convert_tokens_to_ids(["user", "assistant", "<|im_end|>"]) == [872, 77091, 151645]
    assert len(set(tokenizer.get_vocab().values())) == len(tokenizer.get_vocab())
    refused = CliRunner().invoke(app, ["init-random", "--arch", ARCH, "--type", "base", str(tmp_path / "t")])
    assert refused.exit_code != 0 and "one type" in refused.output
