"""A media prompt's way to the thinker: the merge puts the encoders' rows where the
placeholder masks say (images, videos and audio interleaved, deepstack rows in prompt order),
finding them in the host ids; and on CUDA (gpu-marked) the encoder stages and the merge make
no host<->device synchronization. Each one would wait for the engines' steps queued on the
stream they share (issue 17: media prompts at concurrency 64)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from omnistage.core.messages import StagePayload
from omnistage.engine.model_runner import GREEDY
from omnistage.engine.sequence import GenerationInput
from omnistage.models.qwen3_omni.config import Qwen3OmniPipelineConfig
from omnistage.models.qwen3_omni.modeling.model import load_model
from omnistage.models.qwen3_omni.modeling.thinker import EncoderRows, Thinker
from omnistage.models.qwen3_omni.payload_types import OmniSampling, Qwen3OmniRequest
from omnistage.models.qwen3_omni.processing import ChatMessage, ChatPart
from omnistage.models.qwen3_omni.stages import thinker_merge
from omnistage.pipeline.stage import build_scheduler
from omnistage.testing.host_syncs import no_host_syncs


@pytest.fixture(scope="module")
def thinker(omni_tiny_checkpoint: Path) -> Thinker:
    model = load_model(str(omni_tiny_checkpoint), parts=("thinker",))
    assert model.thinker is not None
    return model.thinker


def test_the_merge_puts_the_rows_where_the_placeholder_masks_are(thinker: Thinker) -> None:
    c = thinker.config
    audio, image, video = c.audio_token_id, c.image_token_id, c.video_token_id
    ids = torch.tensor(
        [1, image, image, 2, audio, audio, audio, 3, video, video, video, image, 4, video]
    )
    width = thinker.lm_head.weight.shape[1]
    g = torch.Generator().manual_seed(0)

    def rand(n: int) -> torch.Tensor:
        return torch.randn(n, width, generator=g)

    rows = EncoderRows(audio=rand(3), image=rand(3), image_deepstack=(rand(3), rand(3)),
                       video=rand(4), video_deepstack=(rand(4), rand(4)))  # fmt: skip
    with torch.no_grad():
        embeds, additions = thinker.merge(ids, rows)
        expected = thinker.embed(ids)
    for token, block in ((audio, rows.audio), (image, rows.image), (video, rows.video)):
        expected[ids == token] = block
    assert torch.equal(embeds, expected)
    visual = (ids == image) | (ids == video)
    assert additions is not None and additions.rows.device.type == "cpu"
    assert additions.rows.tolist() == visual.nonzero().flatten().tolist()
    for level in range(2):
        joint = torch.zeros(int(visual.sum()), width)
        joint[ids[visual] == image] = rows.image_deepstack[level]
        joint[ids[visual] == video] = rows.video_deepstack[level]
        assert torch.equal(additions.embeds[level], joint)
    # audio alone adds no hidden rows; the ids must be the host's; counts must match
    heard = torch.tensor([1, audio, audio, 2])
    assert thinker.merge(heard, EncoderRows(audio=rand(2)))[1] is None
    with pytest.raises(ValueError, match="on the host"):
        thinker.merge(heard.to("meta"), EncoderRows(audio=rand(2)))
    with pytest.raises(ValueError, match="2 audio placeholder tokens but 3 audio rows"):
        thinker.merge(heard, EncoderRows(audio=rand(3)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_media_prompts_are_encoded_and_merged_without_a_host_sync(
    omni_tiny_checkpoint: Path,
) -> None:
    config = Qwen3OmniPipelineConfig.for_model_path(str(omni_tiny_checkpoint))
    stages = {s.name: s for s in config.stages}
    assert stages["image_encoder"].device.startswith("cuda")
    prepare, see, hear = (build_scheduler(config, stages[name]).compute for name in
                          ("preprocessing", "image_encoder", "audio_encoder"))  # fmt: skip
    thinker = load_model(
        str(omni_tiny_checkpoint), torch.device("cuda"), parts=("thinker",)
    ).thinker
    picture = Image.fromarray(
        np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    )
    clip = (0.1 * np.random.default_rng(1).standard_normal(16000)).astype(np.float32)
    parts = (
        ChatPart("image", image=picture),
        ChatPart("audio", audio=clip),
        ChatPart("text", text="Both?"),
    )
    request = Qwen3OmniRequest((ChatMessage("user", parts),), False, "ethan", OmniSampling(), 4, 4)
    prompt = StagePayload("r", request, prepare(StagePayload("r", request, None)))
    assert prompt.data.pixel_values.is_pinned()  # made pinned for the CUDA vision encoder
    see([prompt]), hear([prompt])  # the first calls pick their kernels
    with no_host_syncs(), torch.inference_mode():
        seen, heard = see([prompt, prompt])[0], hear([prompt, prompt])[0]
        merged = thinker_merge({"image_encoder": StagePayload("r", request, seen),
                                "audio_encoder": StagePayload("r", request, heard)})  # fmt: skip
        assert merged.vision_rows is not None
        embeds, deepstack = thinker.merge(
            merged.input_ids, replace(merged.vision_rows, audio=merged.audio_rows)
        )
        GenerationInput(embeds, GREEDY, 4, positions=merged.positions, hidden_additions=deepstack)
    assert embeds.is_cuda and deepstack is not None and deepstack.rows.device.type == "cpu"
