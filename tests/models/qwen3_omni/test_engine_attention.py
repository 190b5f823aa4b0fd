"""The thinker and talker run through the engine's paged attention backend: a batched
variable-length prefill with 3-D MRoPE positions, then batched decode steps, equal each
request run alone on a dense cache."""

from __future__ import annotations

import pytest
import torch
from omni_fixtures import ReferenceFixture, layout_of

from omnistage.engine.attention import DenseKVCache
from omnistage.engine.kv_cache import PagedKVCache
from omnistage.engine.paged_attention import PagedAttention, paged_decode_reference
from omnistage.models.qwen3_omni.modeling.model import load_model
from omnistage.models.qwen3_omni.modeling.mrope import prompt_positions

BLOCK = 4


@pytest.fixture(scope="module")
def model(omni_tiny_checkpoint):
    return load_model(omni_tiny_checkpoint)


def test_paged_batch_equals_dense_runs(model, omni_reference: ReferenceFixture) -> None:
    """Two prompts of different lengths and position kinds (text; video, whose T positions
    are fractional and whose decode delta is not 0)."""
    thinker, c = model.thinker, model.config.thinker.text
    names = ("text", "video")
    prompts = [omni_reference.case(n, "ids") for n in names]
    positions = [
        prompt_positions(p.tolist(), model.config.thinker, layout_of(omni_reference, n))
        for p, n in zip(prompts, names, strict=True)
    ]
    assert positions[1].delta != 0
    lengths, steps = [p.shape[0] for p in prompts], 3
    blocks = [list(range(1, 1 + 10)), list(range(11, 21))]
    cache = PagedKVCache(c.num_layers, c.num_kv_heads, c.head_dim, num_blocks=22, block_size=BLOCK,
                         dtype=torch.float32, device=torch.device("cpu"))  # fmt: skip
    attn = PagedAttention(cache, paged_decode_reference)

    def slot(i: int, t: int) -> int:
        return blocks[i][t // BLOCK] * BLOCK + t % BLOCK

    with torch.no_grad():
        embeds = torch.cat([thinker.embed(p) for p in prompts])
        pos = torch.cat([p.positions for p in positions], dim=1)
        attn.prepare_prefill(
            torch.tensor([slot(i, t) for i, n in enumerate(lengths) for t in range(n)]), lengths
        )
        hidden = thinker(embeds, pos, attn)
        last = hidden[torch.tensor([lengths[0] - 1, sum(lengths) - 1])]
        dense = [
            DenseKVCache(c.num_layers, 1, n + steps, c.num_kv_heads, c.head_dim) for n in lengths
        ]
        alone = []
        for i, p in enumerate(prompts):
            dense[i].prepare(lengths[i])
            alone.append(thinker(thinker.embed(p), positions[i].positions, dense[i])[-1])
        torch.testing.assert_close(last, torch.stack(alone), rtol=1e-5, atol=1e-5)
        tokens = thinker.logits(last).argmax(-1)
        context = list(lengths)
        for _ in range(steps):
            step_pos = torch.cat([positions[i].decode(context[i]) for i in range(2)], dim=1)
            attn.prepare_decode(torch.tensor([slot(i, context[i]) for i in range(2)]),
                                torch.tensor(blocks), torch.tensor([n + 1 for n in context]))  # fmt: skip
            batched = thinker(thinker.embed(tokens), step_pos, attn)
            for i in range(2):
                dense[i].prepare(1)
                single = thinker(
                    thinker.embed(tokens[i : i + 1]), positions[i].decode(context[i]), dense[i]
                )
                torch.testing.assert_close(batched[i : i + 1], single, rtol=1e-5, atol=1e-5)
                context[i] += 1
            tokens = thinker.logits(batched).argmax(-1)
