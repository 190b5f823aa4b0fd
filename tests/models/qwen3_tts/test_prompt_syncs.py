"""Talker prompts are built without waiting for the device, in few ops (issue 15).

The preprocessing stage launches on the CUDA stream the engine's steps are queued on: a
blocking copy there (``torch.tensor(ids, device=cuda)``, a pageable ``.to(cuda)``) waits for
every queued step, and each op holds the GIL the engine's and the vocoder's host loops
need. On the CPU the ops a build dispatches are the ones a CUDA build launches; the GPU
test runs the builds in torch's sync debug mode, which also sees blocking copies."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from omnistage.config.overrides import resolve_config
from omnistage.core.messages import StagePayload
from omnistage.models.qwen3_tts.config import Qwen3TTSPipelineConfig
from omnistage.models.qwen3_tts.modeling.prompt import (
    REF_CODES_CACHE_SIZE,
    PromptBuilder,
    PromptHead,
    PromptTokens,
    TalkerPrompt,
)
from omnistage.models.qwen3_tts.modeling.weights import LoadedCheckpoint, load_checkpoint
from omnistage.models.qwen3_tts.payload_types import (
    EncodedReference,
    Qwen3TTSRequest,
    SamplingOverrides,
    TalkerStart,
)
from omnistage.models.qwen3_tts.stages import head_key
from omnistage.pipeline.stage import build_scheduler
from omnistage.scheduling.base import ItemFailure
from omnistage.scheduling.vocoder import VocoderSetup
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
# the text track (embedding, linear, silu, linear; streaming x_vector projects its first row
# alone, a second time), the x-vector row's add and the cats.
MAX_OPS = {"icl": 27, "x_vector": 24, "custom_voice": 12}


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints) -> dict[str, LoadedCheckpoint]:
    return {t: load_checkpoint(tiny_checkpoints[t]) for t in ("base", "custom_voice", "voice_design")}


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
    """As the preprocessing stage and the live-text feeds share one builder: concurrent builds of more
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_batch_of_prompts_waits_for_nothing_and_equals_the_cpu_prompts(tiny_checkpoints, loaded) -> None:
    """``whole_many`` on CUDA (fp32): no host sync, each prompt the one CUDA builds alone
    and within 1e-5 (relative) of the CPU's."""
    cpu = builder_of(loaded["base"])
    cuda = builder_of(load_checkpoint(tiny_checkpoints["base"], "cuda", torch.float32))
    texts = [TEXT, "Short.", "A longer text than the reference transcript, said slowly and with care."]
    with torch.inference_mode():
        expected = [cpu.whole(cpu.voice_clone_head(X_VECTOR, "english", REF_TEXT, REF_CODES), t) for t in texts]
        heads = [cuda.voice_clone_head(X_VECTOR, "english", REF_TEXT, REF_CODES) for _ in texts]
        items = [(head, *cuda.tokens.target(text)) for head, text in zip(heads, texts, strict=True)]
        cuda.whole_many(items)  # the kept rows made
        with no_host_syncs():
            batch = cuda.whole_many(items)
        alone = [cuda.whole(head, text) for head, text in zip(heads, texts, strict=True)]
    for got, want, same in zip(batch, expected, alone, strict=True):
        assert got.prefill.device.type == "cuda" and got.prefill.shape == want.prefill.shape
        assert float((got.prefill.cpu() - want.prefill).abs().max() / want.prefill.abs().max()) <= 1e-5
        assert_same_prompt(got, same)  # on CUDA too: the batch's prompt is the one built alone


def test_a_batch_of_prompts_equals_them_one_by_one_from_one_upload_and_lookup(loaded) -> None:
    """``whole_many`` (the preprocessing stage's batch): every mode's prompt exactly as
    ``whole`` builds it alone (the projection runs per segment as there), texts of one and
    two tokens included, the batch's ids in one lookup, and no wait for the device."""
    base, custom, design = (builder_of(loaded[t]) for t in ("base", "custom_voice", "voice_design"))
    texts = [TEXT, "Short.", "A longer text than the reference transcript, said slowly and with care.", "H", "Hi x"]
    with torch.inference_mode():
        heads = {
            base: [
                base.voice_clone_head(X_VECTOR, "english", REF_TEXT, REF_CODES),
                base.voice_clone_head(X_VECTOR, "english", REF_TEXT, REF_CODES, non_streaming_mode=True),
                base.voice_clone_head(X_VECTOR, "auto"),
                base.voice_clone_head(X_VECTOR, "auto", non_streaming_mode=True),
            ],
            custom: [
                custom.custom_voice_head("aiden", "english", non_streaming_mode=False),
                custom.custom_voice_head("aiden", "english"),
                custom.custom_voice_head("aiden", "auto", "Speak slowly.", non_streaming_mode=False),
                custom.custom_voice_head("aiden", "auto", "Speak slowly."),
            ],
            design: [
                design.voice_design_head("A calm low voice.", "english", non_streaming_mode=False),
                design.voice_design_head("A calm low voice.", "auto"),
            ],
        }
        for builder, modes in heads.items():
            pairs = [(head, text) for head in modes for text in texts]
            assert any(len(builder.tokens.target(t)[1]) == 1 for _, t in pairs)  # ids[1:] empty
            alone = [builder.whole(head, text) for head, text in pairs]
            items = [(head, *builder.tokens.target(text)) for head, text in pairs]
            with DispatchedOps() as ops:
                batch = builder.whole_many(items)
            assert ops.host_syncs() == []
            segments = sum(len(builder.text_segments(head, ids)) for head, _, ids in items)
            assert ops.names.count("aten.embedding.default") == 1  # one lookup for the batch
            assert ops.names.count("aten.linear.default") == 2 * segments  # the projection, per segment
            for got, expected in zip(batch, alone, strict=True):
                assert_same_prompt(got, expected)


def test_bad_batches_and_bad_text_rows_raise(loaded) -> None:
    builder = builder_of(loaded["custom_voice"])
    with torch.inference_mode():
        head = builder.custom_voice_head("aiden", "english", non_streaming_mode=False)
        role_ids, ids = builder.tokens.target(TEXT)
        with pytest.raises(ValueError, match="text is empty"):
            builder.whole_many([(head, role_ids, ids), (head, role_ids, [])])
        with pytest.raises(ValueError, match="text is empty"):
            builder.whole(head, "")
        rows = [builder.text_rows(ids[:1]), builder.text_rows(ids[2:])]
        with pytest.raises(ValueError, match=rf"segments of \[1, {len(ids) - 1}\] ids, got \[1, {len(ids) - 2}\]"):
            builder.with_text(head, role_ids, ids, complete=True, text=rows)


class _Outbox:
    """Records what a stage streams."""

    def __init__(self) -> None:
        self.streamed: list[tuple[str, object]] = []

    def stream(self, request_id: str, data: object) -> None:
        self.streamed.append((request_id, data))


def test_the_preprocessing_stage_builds_a_batch_and_a_bad_request_fails_alone(tiny_servable_checkpoints, monkeypatch) -> None:
    """The stage's batch: each good request gets its prompt (exactly as built alone), a
    live one its head, each its vocoder setup first; one the builder rejects (an unknown
    language, an empty text: the request builder refuses both before admission) an
    :class:`ItemFailure` of its own, and the others go on."""
    path = tiny_servable_checkpoints["custom_voice"]
    defaults = Qwen3TTSPipelineConfig.for_model_path(str(path))
    config = resolve_config(defaults, None, [("preprocessing.device", "cpu")]).config
    scheduler = build_scheduler(config, config.stage("preprocessing"))
    outbox = _Outbox()
    scheduler.bind("preprocessing", outbox, expects_stream=False)
    builder = builder_of(load_checkpoint(path))

    def request(text: str, language: str, more_text: bool = False) -> Qwen3TTSRequest:
        return Qwen3TTSRequest(
            text=text, target_ids=builder.tokens.target(text), model_type="custom_voice", language=language, voice="aiden", instructions=None,
            ref_audio=None, ref_key=None, ref_text=None, x_vector_only=False, non_streaming_mode=more_text is False,
            sampling=SamplingOverrides(), seed=0, max_new_tokens=None, min_new_tokens=2, frame_cap=40,
            initial_codec_chunk_frames=None, stream=True, more_text=more_text,
        )  # fmt: skip

    requests = {
        "a": request(TEXT, "english"),
        "bad language": request(TEXT, "klingon"),
        "live": request("Hello", "english", more_text=True),
        "empty": request("", "english"),
        "c": request("Short.", "auto"),
    }
    with monkeypatch.context() as patch:  # the stage builds from the request's ids: it tokenizes no target text
        patch.setattr(PromptTokens, "target", lambda self, text: pytest.fail(f"the stage tokenized {text!r}"))
        batch = [StagePayload(rid, r, None) for rid, r in requests.items()]
        outputs = dict(zip(requests, scheduler.compute(batch), strict=True))
    assert isinstance(outputs["bad language"], ItemFailure) and "klingon" in str(outputs["bad language"].error)
    assert isinstance(outputs["empty"], ItemFailure) and "no tokens" in str(outputs["empty"].error)
    assert [rid for rid, _ in outbox.streamed] == ["live", "a", "c"]  # the live one before the prompts are built
    live = outputs["live"]
    assert isinstance(live, TalkerStart) and live.live is not None and live.live.text == "Hello"
    for rid, setup in outbox.streamed[1:]:
        output = outputs[rid]
        assert isinstance(output, TalkerStart) and output.whole is not None
        with torch.inference_mode():
            head = builder.custom_voice_head("aiden", requests[rid].language, non_streaming_mode=True)
            alone = builder.whole(head, requests[rid].text)
        assert torch.equal(output.whole.prompt, alone.prefill)
        assert isinstance(setup, VocoderSetup) and setup.input_tokens == alone.prefill.shape[0] + alone.step_rows.shape[0]


@pytest.mark.parametrize("head_cache_mib", [64.0, 0.0])
def test_a_known_voices_head_is_kept_for_the_same_encoded_reference(tiny_servable_checkpoints, head_cache_mib) -> None:
    """The preprocessing stage keeps a voice's prompt head by :func:`head_key`: a request
    with a known key and the very :class:`EncodedReference` the head was built from (a
    reference encoder cache hit) gets the kept head; the same key with another encoding (a
    clip encoded again), a new key, or the same clip in the other clone mode, gets a head
    of its own. Every prompt is the one built alone from the request's own encoding. With
    ``head_cache_mib`` 0 nothing is kept."""
    path = tiny_servable_checkpoints["base"]
    defaults = Qwen3TTSPipelineConfig.for_model_path(str(path))
    overrides = [("preprocessing.device", "cpu"), ("preprocessing.factory.args.head_cache_mib", str(head_cache_mib))]
    config = resolve_config(defaults, None, overrides).config
    scheduler = build_scheduler(config, config.stage("preprocessing"))
    scheduler.bind("preprocessing", _Outbox(), expects_stream=False)
    builder = builder_of(load_checkpoint(path))
    hidden = builder.config.talker.decoder.hidden_size
    generator = torch.Generator().manual_seed(0)

    def reference() -> EncodedReference:
        codes = torch.randint(0, 2048, (12, 16), generator=generator)
        return EncodedReference(torch.randn(hidden, generator=generator), codes)

    def request(key: str, icl: bool = True, live: bool = False) -> Qwen3TTSRequest:
        return Qwen3TTSRequest(
            text=TEXT, target_ids=builder.tokens.target(TEXT), model_type="base", language="english", voice=None, instructions=None,
            ref_audio=np.zeros(2400, dtype=np.float32), ref_key=key, ref_text="A reference." if icl else None,
            x_vector_only=not icl, non_streaming_mode=False, sampling=SamplingOverrides(), seed=0,
            max_new_tokens=None, min_new_tokens=2, frame_cap=40, initial_codec_chunk_frames=None, stream=True,
            more_text=live,
        )  # fmt: skip

    def start(req: Qwen3TTSRequest, ref: EncodedReference) -> TalkerStart:
        (output,) = scheduler.compute([StagePayload("r", req, ref)])
        assert isinstance(output, TalkerStart)
        return output

    def head(req: Qwen3TTSRequest, ref: EncodedReference) -> PromptHead:
        output = start(req, ref)
        assert output.live is not None
        return output.live.head

    def alone(req: Qwen3TTSRequest, ref: EncodedReference) -> torch.Tensor:
        with torch.inference_mode():
            codes = ref.ref_codes if req.icl else None
            return builder.whole(builder.voice_clone_head(ref.x_vector, "english", req.ref_text, codes), req.text).prefill

    first, again, other = reference(), reference(), reference()
    kept = head(request("k1", live=True), first)
    assert (head(request("k1", live=True), first) is kept) == bool(head_cache_mib)
    assert head(request("k1", live=True), again) is not kept
    assert head(request("k2", live=True), other) is not kept
    assert head(request("k1", icl=False, live=True), first) is not kept
    assert head_key(request("k1", icl=False)) != head_key(request("k1"))
    for key, ref, icl in (("k1", first, True), ("k1", again, True), ("k1", first, False), ("k2", other, True)):
        whole = start(request(key, icl), ref).whole
        assert whole is not None and torch.equal(whole.prompt, alone(request(key, icl), ref))
