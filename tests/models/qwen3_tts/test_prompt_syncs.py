"""Talker prompts are built without waiting for the device, in few ops (issue 15).

The preprocessing workers launch on the CUDA stream the engine's steps are queued on: a
blocking copy there (``torch.tensor(ids, device=cuda)``, a pageable ``.to(cuda)``) waits for
every queued step, and each op holds the GIL the engine's and the vocoder's host loops
need. On the CPU the ops a build dispatches are the ones a CUDA build launches; the GPU
test runs the builds in torch's sync debug mode, which also sees blocking copies."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from omnistage.models.qwen3_tts.modeling.prompt import (
    REF_CODES_CACHE_SIZE,
    PromptBuilder,
    TalkerPrompt,
)
from omnistage.models.qwen3_tts.modeling.weights import LoadedCheckpoint, load_checkpoint
from omnistage.testing.host_syncs import DispatchedOps, no_host_syncs

TEXT = "Hello there, how are you?"
REF_TEXT = "It is a nice day."
REF_FRAMES = 38  # a 3 s reference at 12.5 frames per second

Build = Callable[[PromptBuilder], TalkerPrompt]
X_VECTOR = torch.randn(32, generator=torch.Generator().manual_seed(1))  # the tiny checkpoints' H
REF_CODES = torch.randint(0, 2048, (REF_FRAMES, 16), generator=torch.Generator().manual_seed(2))

# (model type, build) in the served modes' default text modes: voice clone streaming,
# CustomVoice the whole text
BUILDS: dict[str, tuple[str, Build]] = {
    "icl": ("base", lambda b: b.voice_clone(TEXT, X_VECTOR, "english", REF_TEXT, REF_CODES)),
    "x_vector": ("base", lambda b: b.voice_clone(TEXT, X_VECTOR, "auto")),
    "custom_voice": ("custom_voice", lambda b: b.custom_voice(TEXT, "aiden", "english")),
}
# aten ops of a build after the first of its kind, in inference mode as the preprocessing
# stage builds (no-op `to`s and views included), measured with torch 2.13 on the CPU. Before
# the builder kept the rows of the checkpoint's constants and of the reference, and uploaded
# each id list by itself: icl 98, x_vector 50, custom_voice 49. What is left: the ids' upload,
# the text track (embedding, linear, silu, linear; streaming x_vector makes its first row
# alone, a second time), the x-vector row's add and the cats.
MAX_OPS = {"icl": 27, "x_vector": 26, "custom_voice": 12}


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints) -> dict[str, LoadedCheckpoint]:
    return {t: load_checkpoint(tiny_checkpoints[t]) for t in ("base", "custom_voice")}


def builder_of(ck: LoadedCheckpoint) -> PromptBuilder:
    return PromptBuilder(ck.model.talker, ck.config, ck.tokenizer)


def assert_same_prompt(actual: TalkerPrompt, expected: TalkerPrompt) -> None:
    assert torch.equal(actual.prefill, expected.prefill)
    assert torch.equal(actual.step_rows, expected.step_rows)
    assert torch.equal(actual.tts_pad, expected.tts_pad)
    assert (actual.ref_codes is None) == (expected.ref_codes is None)


@pytest.mark.parametrize("kind", list(BUILDS))
def test_a_prompt_is_built_in_few_ops_and_none_waits_for_the_device(loaded, kind: str) -> None:
    model_type, build = BUILDS[kind]
    builder = builder_of(loaded[model_type])
    with torch.inference_mode(), DispatchedOps() as first_ops:
        first = build(builder)  # makes the rows it keeps
    with torch.inference_mode(), DispatchedOps() as ops:
        again = build(builder)
    assert first_ops.host_syncs() == [] and ops.host_syncs() == []
    assert len(ops.names) <= MAX_OPS[kind], ops.names
    assert_same_prompt(again, first)
    assert_same_prompt(first, build(builder_of(loaded[model_type])))  # a fresh builder's


def test_the_icl_reference_rows_are_kept_by_content(loaded) -> None:
    builder = builder_of(loaded["base"])
    with_codes = BUILDS["icl"][1]
    with_codes(builder)
    other = REF_CODES.clone()
    other[0, 1] = (other[0, 1] + 1) % 2048
    changed = builder.voice_clone(TEXT, X_VECTOR, "english", REF_TEXT, other)
    fresh = builder_of(loaded["base"]).voice_clone(TEXT, X_VECTOR, "english", REF_TEXT, other)
    assert_same_prompt(changed, fresh)
    assert not torch.equal(changed.prefill, with_codes(builder).prefill)
    assert changed.ref_codes is other  # the codes given go on to the vocoder, on the host


def test_builds_on_eight_threads_at_once_equal_a_fresh_builders_and_keep_at_most_the_cap(
    loaded,
) -> None:
    """As the preprocessing stage's 8 workers share one builder: concurrent builds of more
    references than the cache keeps (so it evicts while others read it) and of two roles
    (a text's first characters can change its role's last id), each equal to a fresh
    builder's build of the same request."""
    base = loaded["base"]
    references = [
        torch.randint(
            0, 2048, (REF_FRAMES - i % 5, 16), generator=torch.Generator().manual_seed(100 + i)
        )
        for i in range(REF_CODES_CACHE_SIZE + 16)
    ]
    role, ids = builder_of(base).tokens.target(TEXT)
    roles = (role, [*role[:-1], ids[0]])

    def build(builder: PromptBuilder, i: int) -> TalkerPrompt:
        with torch.inference_mode():
            head = builder.voice_clone_head(
                X_VECTOR, "english", REF_TEXT, references[i % len(references)]
            )
            return builder.with_text(head, roles[i % 2], ids, complete=True)

    shared = builder_of(base)
    count = 3 * len(references)
    with ThreadPoolExecutor(8) as pool:
        prompts = list(pool.map(lambda i: build(shared, i), range(count)))
    assert len(shared._references) == REF_CODES_CACHE_SIZE
    for i in range(0, count, 7):
        assert_same_prompt(prompts[i], build(builder_of(base), i))


def test_live_text_rows_wait_for_nothing(loaded) -> None:
    builder = builder_of(loaded["custom_voice"])
    _, ids = builder.tokens.target(TEXT)
    with torch.inference_mode(), DispatchedOps() as ops:
        rows = builder.text_rows(ids[2:5])
    assert ops.host_syncs() == [] and rows.shape == (3, builder.config.talker.decoder.hidden_size)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", list(BUILDS))
def test_cuda_builds_wait_for_nothing_and_equal_the_cpu_prompt(
    tiny_checkpoints, loaded, kind: str
) -> None:
    """fp32 on CUDA (relative error 1e-5 of the CPU's prompt: summation order) and bf16, as
    served; first builds (the kept rows made) and second ones."""
    model_type, build = BUILDS[kind]
    expected = build(builder_of(loaded[model_type]))
    for dtype in (torch.float32, torch.bfloat16):
        builder = builder_of(load_checkpoint(tiny_checkpoints[model_type], "cuda", dtype))
        with torch.inference_mode(), no_host_syncs():
            first, again = build(builder), build(builder)
            live_rows = builder.text_rows(builder.tokens.target(TEXT)[1])
        assert_same_prompt(again, first)
        assert live_rows.device.type == "cuda"
        if first.ref_codes is not None:
            assert first.ref_codes.device.type == "cpu"  # the vocoder hashes them without a wait
        if dtype == torch.float32:
            for got, want in (
                (first.prefill, expected.prefill),
                (first.step_rows, expected.step_rows),
            ):
                assert got.shape == want.shape
                if want.numel():
                    assert float((got.cpu() - want).abs().max() / want.abs().max()) <= 1e-5
