"""MRoPE positions and the talker prompt: shapes of the blocks, and the errors that name
what is wrong (the values themselves are pinned against transformers in
test_thinker_talker_parity.py)."""

from __future__ import annotations

import pytest
import torch

from omnistage.models.qwen3_omni.modeling.config import Qwen3OmniConfig
from omnistage.models.qwen3_omni.modeling.model import load_model
from omnistage.models.qwen3_omni.modeling.mrope import (
    MRotaryEmbedding,
    MultimodalLayout,
    prompt_positions,
)
from omnistage.models.qwen3_omni.modeling.prompt import (
    ThinkerRows,
    build_talker_prompt,
    talker_prompt_length,
)
from omnistage.models.qwen3_omni.random_checkpoint import build_config_dict

CONFIG = Qwen3OmniConfig.from_dict(build_config_dict("tiny"))
VS, VE, IMG, AS, AE, AUD = 151652, 151653, 151655, 151669, 151670, 151675


def test_image_block_uses_the_merged_grid_and_text_resumes_after_its_maximum() -> None:
    ids = [1, 2, VS, *[IMG] * 6, VE, 3]
    pos = prompt_positions(ids, CONFIG.thinker, MultimodalLayout(image_grids=[(1, 4, 6)]))
    block = pos.positions[:, 3:9]
    assert block[0].tolist() == [3.0] * 6  # one time index
    assert block[1].tolist() == [3, 3, 3, 4, 4, 4] and block[2].tolist() == [3, 4, 5, 3, 4, 5]
    assert pos.positions[:, 9].tolist() == [6.0] * 3 and pos.positions[:, 10].tolist() == [7.0] * 3
    assert pos.delta == 8 - len(ids)
    assert pos.decode(len(ids)).flatten().tolist() == [8.0] * 3


def test_audio_is_linear() -> None:
    ids = [1, AS, *[AUD] * 4, AE, 2]
    pos = prompt_positions(ids, CONFIG.thinker, MultimodalLayout(audio_lengths=[4]))
    assert pos.positions.tolist() == [list(map(float, range(len(ids))))] * 3 and pos.delta == 0


@pytest.mark.parametrize(
    ("ids", "layout", "match"),
    [
        ([1, VS, IMG, VE], MultimodalLayout(), "more image blocks than the layout describes"),
        ([1, 2], MultimodalLayout(audio_lengths=[3]), "layout entries without a block"),
        ([1, AS, AUD, AE], MultimodalLayout(audio_lengths=[5]), "runs past the prompt"),
    ],
)
def test_layout_mismatches_are_refused(ids, layout, match) -> None:
    with pytest.raises(ValueError, match=match):
        prompt_positions(ids, CONFIG.thinker, layout)


def test_text_only_tables_equal_plain_rope() -> None:
    """Three equal rows make the interleaved MRoPE the 1-D RoPE."""
    rope = MRotaryEmbedding(16, CONFIG.thinker.text.rope)
    positions = torch.arange(7)
    cos, sin = rope(positions, torch.float32)
    inv = 1.0 / (CONFIG.thinker.text.rope.theta ** (torch.arange(0, 16, 2).float() / 16))
    freqs = positions[:, None].float() * inv
    torch.testing.assert_close(cos, torch.cat((freqs.cos(), freqs.cos()), -1))
    torch.testing.assert_close(sin, torch.cat((-freqs.sin(), freqs.sin()), -1))


@pytest.fixture(scope="module")
def loaded(omni_tiny_checkpoint):
    return load_model(omni_tiny_checkpoint)


def rows_for(ids: list[int], reply: list[int], hidden: int = 64) -> ThinkerRows:
    fed = len(ids) + len(reply) - 1
    return ThinkerRows(
        torch.tensor(ids), torch.tensor(reply), torch.randn(fed, hidden), torch.randn(fed, hidden)
    )


def test_talker_prompt_errors_name_the_problem(loaded) -> None:
    chat = [151644, 872, 198, 5, 151645, 198, 151644, 77091, 198]
    args = (loaded.talker, loaded.thinker.model.embed_tokens, loaded.config)
    with pytest.raises(
        ValueError, match=r"unknown voice 'nobody'; known: \['aiden', 'chelsie', 'ethan'\]"
    ):
        build_talker_prompt(*args, rows_for(chat, [7, 8]), "nobody")
    with pytest.raises(ValueError, match="at least two reply tokens"):
        build_talker_prompt(*args, rows_for(chat, [7]), "ethan")
    with pytest.raises(ValueError, match="no <\\|im_start\\|>assistant"):
        build_talker_prompt(*args, rows_for(chat[:6], [7, 8]), "ethan")


def test_talker_prompt_layout(loaded) -> None:
    """User turn rows (system dropped) + the 9-row assistant tail; trailing rows = reply
    tokens after the first, then tts_eos."""
    chat = [
        151644,
        8948,
        198,
        9,
        151645,
        198,
        151644,
        872,
        198,
        5,
        6,
        151645,
        198,
        151644,
        77091,
        198,
    ]
    with torch.no_grad():
        prompt = build_talker_prompt(loaded.talker, loaded.thinker.model.embed_tokens, loaded.config,
                                     rows_for(chat, [7, 8, 9, 10]), "Chelsie")  # fmt: skip
    user_rows = 7  # <|im_start|> user \n 5 6 <|im_end|> \n
    assert prompt.prefill.shape == (user_rows + 9, 32)
    assert talker_prompt_length(torch.tensor(chat), loaded.config) == user_rows + 9  # what the boundary counts
    assert prompt.step_rows.shape == (3, 32)  # tokens 8 and 9 (10 was never fed), then tts_eos
    assert prompt.positions.positions.shape == (3, user_rows + 9) and prompt.positions.delta == 0
