"""The talker starts without waiting for the device: building its request from the thinker's
rows (``TalkerFeed``) and launching its prefill make no host<->device synchronization. On the
CUDA stream the thinker shares, each one waits for the thinker's step queued there (issue 17:
about 20 of them were 219 ms of the talker's prefill launch at concurrency 1). torch's sync
debug mode ``"error"`` raises at the first one; it sees blocking copies, ``.item()`` /
``.tolist()`` / ``.cpu()`` and ``nonzero``, not an event's wait (the engine's wait for a
step's frames)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage.core.messages import StreamChunk
from omnistage.engine.engine import AREngine
from omnistage.engine.sequence import GenerationInput
from omnistage.models.qwen3_omni.engine_model import TalkerEngineModel
from omnistage.models.qwen3_omni.modeling.model import LoadedOmni, load_model
from omnistage.models.qwen3_omni.modeling.mrope import MultimodalLayout
from omnistage.models.qwen3_omni.payload_types import AudioSetup, TalkerSampling
from omnistage.models.qwen3_omni.stages import (
    TalkerFeed,
    engine_config,
    talker_graph_sampling,
    talker_sampling_params,
    talker_step_rows,
)
from omnistage.scheduling.ar import FrameWithHidden
from omnistage.testing.host_syncs import no_host_syncs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CUDA = torch.device("cuda")
# <|im_start|>user\n 5 6 <|im_end|>\n<|im_start|>assistant\n: 7 user rows in the talker prompt
CHAT = [151644, 872, 198, 5, 6, 151645, 198, 151644, 77091, 198]


@pytest.fixture(scope="module")
def loaded(omni_tiny_checkpoint: Path) -> LoadedOmni:
    # bf16, as served: the talker's MoE takes its grouped path (the loop reads counts back)
    return load_model(str(omni_tiny_checkpoint), CUDA, torch.bfloat16)


def test_the_talker_request_is_built_without_a_host_sync(loaded: LoadedOmni) -> None:
    assert loaded.talker is not None and loaded.thinker is not None
    feed = TalkerFeed(loaded, loaded.thinker.model.embed_tokens, start_tokens=2)
    width = loaded.talker.config.thinker_hidden_size

    def rows(n: int) -> torch.Tensor:  # layer-0 and accept_hidden_layer rows, as the thinker sends
        return torch.randn(n, 2, width, device=CUDA, dtype=torch.bfloat16)

    setup = AudioSetup(prompt_ids=torch.tensor(CHAT), layout=MultimodalLayout(), voice="ethan",
                       sampling=TalkerSampling(), seed=0, max_frames=40)  # fmt: skip
    items = [
        setup,
        FrameWithHidden(torch.tensor([[7]]), rows(len(CHAT))),
        FrameWithHidden(torch.tensor([[8]]), rows(1)),
    ]
    with no_host_syncs():
        feeds = [feed.on_chunk(StreamChunk("r", "thinker", item)) for item in items]
    start = feeds[-1].start
    assert start is not None and start.prompt.is_cuda
    assert start.prompt.shape == (7 + 9, loaded.talker.config.text.hidden_size)


def test_the_talker_prefill_is_launched_without_a_host_sync(loaded: LoadedOmni) -> None:
    talker = loaded.talker
    assert talker is not None
    model = TalkerEngineModel(talker)
    config = engine_config(
        2, 32 << 20, 512, True, talker_graph_sampling(talker), talker_step_rows(2)
    )
    engine = AREngine(model, config)
    code0, predictor = talker_sampling_params(talker, TalkerSampling(), 0)
    prompt = 0.02 * torch.randn(12, model.spec.hidden_size, device=CUDA, dtype=torch.bfloat16)

    def request() -> GenerationInput:
        return GenerationInput(
            prompt, code0, 8, step_rows=prompt[:0], pad_embed=prompt[0], more_rows=True,
            positions=torch.arange(12).expand(3, -1).contiguous(), predictor_sampling=predictor,
        )  # fmt: skip

    engine.add_request("warm-up", request())
    engine.step()  # the first prefill picks its attention kernel (a probe that reads back)
    engine.add_request("r", request())  # the warm-up request waits for its next step row
    with no_host_syncs():
        outputs = engine.step()
    assert [out.request_id for out in outputs] == ["r"]
