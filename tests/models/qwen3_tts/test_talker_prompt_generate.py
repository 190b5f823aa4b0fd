"""Prompt lengths per mode, prompt validation, and the reference generation loop's stopping."""

from __future__ import annotations

import pytest
import torch

from omnistage.models.qwen3_tts.modeling.generate import TalkerSampling, generate
from omnistage.models.qwen3_tts.modeling.prompt import PromptBuilder, TalkerPrompt
from omnistage.models.qwen3_tts.modeling.talker import greedy_sample
from omnistage.models.qwen3_tts.modeling.weights import LoadedCheckpoint, load_checkpoint

TEXT4 = "abcd"  # 4 byte tokens in the tiny tokenizer
REF2 = "ok"  # 2 tokens


@pytest.fixture(scope="module")
def loaded(tiny_checkpoints) -> dict[str, LoadedCheckpoint]:
    return {t: load_checkpoint(p) for t, p in tiny_checkpoints.items()}


def builder(ck: LoadedCheckpoint) -> PromptBuilder:
    return PromptBuilder(ck.model.talker, ck.config, ck.tokenizer)


def test_tiny_tokenizer_gives_the_token_counts_the_lengths_assume(loaded) -> None:
    tok = loaded["base"].tokenizer
    assert len(tok(TEXT4)["input_ids"]) == 4 and len(tok(REF2)["input_ids"]) == 2
    assert len(tok("x")["input_ids"]) == 1


def test_prefill_lengths_match_the_digests_verified_lengths(loaded) -> None:
    """Digest section 4 (4 text tokens, 2 ref tokens, 17 ref frames): ICL 27 (non-streaming
    34), x-vector 9 (+4 trailing), CustomVoice non-streaming 15, VoiceDesign 20. ICL,
    CustomVoice and VoiceDesign use an explicit language (4-id codec prefix), x-vector
    "auto" (3 ids); the VoiceDesign instruct is 1 token (5 template tokens around it)."""
    base, hidden = builder(loaded["base"]), loaded["base"].config.talker.decoder.hidden_size
    x_vector, codes = torch.randn(hidden), torch.randint(0, 2048, (17, 16))
    icl = base.voice_clone(TEXT4, x_vector, "english", ref_text=REF2, ref_codes=codes)
    assert icl.prefill.shape[0] == 27 and icl.ref_codes is not None
    icl_ns = base.voice_clone(TEXT4, x_vector, "english", ref_text=REF2, ref_codes=codes, non_streaming_mode=True)
    assert icl_ns.prefill.shape[0] == 34 and icl_ns.step_rows.shape[0] == 0
    xvec = base.voice_clone(TEXT4, x_vector, "auto")
    assert (xvec.prefill.shape[0], xvec.step_rows.shape[0]) == (9, 4) and xvec.ref_codes is None
    custom = builder(loaded["custom_voice"]).custom_voice(TEXT4, "aiden", "english")
    assert custom.prefill.shape[0] == 15
    design = builder(loaded["voice_design"]).voice_design(TEXT4, "x", "english")
    assert design.prefill.shape[0] == 20


def test_trailing_rows_then_tts_pad_feed_the_decode_steps(loaded) -> None:
    ck = loaded["base"]
    prompt = builder(ck).voice_clone(TEXT4, torch.randn(ck.config.talker.decoder.hidden_size), "auto")
    assert torch.equal(prompt.text_row(3), prompt.step_rows[3])
    assert torch.equal(prompt.text_row(4), prompt.tts_pad) and torch.equal(prompt.text_row(100), prompt.tts_pad)


@pytest.mark.parametrize(
    ("model_type", "call", "message"),
    [
        ("custom_voice", lambda b: b.custom_voice("hi", "nobody"), "unknown voice 'nobody'"),
        ("custom_voice", lambda b: b.custom_voice("hi", "ryan", language="klingon"), "unknown language 'klingon'"),
        ("custom_voice", lambda b: b.custom_voice("hi", "ryan", language="sichuan_dialect"), "unknown language"),
        ("custom_voice", lambda b: b.custom_voice("", "ryan"), "text is empty"),
        ("voice_design", lambda b: b.voice_design("hi", ""), "needs non-empty instructions"),
        ("voice_design", lambda b: b.custom_voice("hi", "ryan"), "custom_voice prompts need a custom_voice checkpoint"),
        ("base", lambda b: b.voice_clone("hi", torch.zeros(32), ref_text="ok"), "both ref_text and ref_codes"),
        ("base", lambda b: b.voice_clone("hi", torch.zeros(32), ref_text="ok", ref_codes=torch.zeros(3, 8, dtype=torch.int64)), r"\[R >= 1, 16\]"),
        ("base", lambda b: b.voice_clone("hi", torch.zeros(5)), r"x_vector must be \[32\]"),
    ],
)
def test_invalid_prompts_raise_value_errors(loaded, model_type, call, message) -> None:
    with pytest.raises(ValueError, match=message):
        call(builder(loaded[model_type]))


def think_prefix_language(ck: LoadedCheckpoint, prompt: TalkerPrompt) -> int | None:
    """The codec language id in ``prompt``'s think prefix (None: the nothink prefix of
    "auto"). Prompt without instruct: 3 role rows, then ``T(tts_pad) + C(codec id)`` rows of
    ``[think, think_bos, lang, think_eos]`` or ``[nothink, think_bos, think_eos]``."""
    talker, cfg = ck.model.talker, ck.config
    with torch.no_grad():
        codec = prompt.prefill[3:6] - talker.text_embed(torch.tensor([cfg.tts_pad_id]))
        ids = torch.tensor([cfg.talker.codec_think_id, cfg.talker.codec_nothink_id, *cfg.talker.codec_language_id.values()])
        table = talker.codec_embed(ids)
    matches = [int(ids[i]) for i in range(len(ids)) if torch.allclose(codec[0], table[i], atol=1e-5)]
    if matches == [cfg.talker.codec_nothink_id]:
        return None
    assert matches == [cfg.talker.codec_think_id]
    language = [int(ids[i]) for i in range(2, len(ids)) if torch.allclose(codec[2], table[i], atol=1e-5)]
    assert len(language) == 1
    return language[0]


@pytest.mark.parametrize(
    ("speaker", "language", "language_id"),
    [("eric", "chinese", 2062), ("eric", "auto", 2062), ("Eric", "Chinese", 2062), ("dylan", "auto", 2074),
     ("eric", "english", 2050), ("vivian", "chinese", 2055), ("vivian", "auto", None)],
)  # fmt: skip
def test_dialect_speakers_speak_their_dialect_for_chinese_and_auto(loaded, speaker, language, language_id) -> None:
    """Reference qwen-tts ``generate``: a dialect speaker (eric -> sichuan_dialect 2062,
    dylan -> beijing_dialect 2074) puts its dialect's codec id in the think prefix when the
    language is chinese or auto; any other language, and other speakers, keep theirs."""
    ck = loaded["custom_voice"]
    prompt = builder(ck).custom_voice("hi", speaker, language)
    assert think_prefix_language(ck, prompt) == language_id


def test_eos_ends_generation_after_min_new_tokens_and_is_not_returned(tiny_checkpoints) -> None:
    ck = load_checkpoint(tiny_checkpoints["voice_design"])
    talker = ck.model.talker
    with torch.no_grad():
        talker.codec_head.weight[ck.config.talker.codec_eos_id] *= 1000.0  # EOS dominates
    prompt = builder(ck).voice_design("hello", "calm")
    result = generate(talker, prompt, TalkerSampling.greedy(), max_new_frames=10)
    assert result.finish_reason == "stop"
    assert result.codes.shape == (2, 16)  # EOS masked for the first 2 code-0 ids
    assert (result.codes[:, 0] != ck.config.talker.codec_eos_id).all()


def test_length_cap_returns_exactly_max_new_frames_with_codes_in_range(loaded) -> None:
    ck = loaded["voice_design"]
    prompt = builder(ck).voice_design("hello", "calm")
    result = generate(ck.model.talker, prompt, TalkerSampling.from_generation_config(ck.generation, seed=5), max_new_frames=6)
    assert result.finish_reason == "length" and result.codes.shape == (6, 16)
    assert (result.codes[:, 0] < 2048).all() and (result.codes >= 0).all() and (result.codes[:, 1:] < 2048).all()
    again = generate(ck.model.talker, prompt, TalkerSampling.from_generation_config(ck.generation, seed=5), max_new_frames=6)
    assert torch.equal(result.codes, again.codes)


def test_batched_frame_completion_equals_one_by_one(loaded) -> None:
    """The building blocks the engine batches: complete_frame and frame_embedding over B=3
    equal the same calls per row."""
    talker = loaded["custom_voice"].model.talker
    hidden = torch.randn(3, talker.config.decoder.hidden_size)
    code0 = torch.tensor([5, 700, 2047])
    with torch.no_grad():
        batched = talker.complete_frame(hidden, code0, greedy_sample, talker.code_predictor.new_cache(3, torch.float32, "cpu"))
        single = torch.cat([
            talker.complete_frame(hidden[i : i + 1], code0[i : i + 1], greedy_sample, talker.code_predictor.new_cache(1, torch.float32, "cpu"))
            for i in range(3)
        ])
        assert torch.equal(batched, single)
        feedback = talker.frame_embedding(batched)
        manual = talker.codec_embed(batched[:, 0]) + sum(
            talker.code_predictor.model.codec_embedding[i - 1](batched[:, i]) for i in range(1, 16)
        )
    torch.testing.assert_close(feedback, manual)


LONG = "The quick brown fox jumps over the lazy dog, twice."
# (model type, builder call, PromptTokens.size arguments besides non_streaming_mode, with the
# text whose ids it takes)
SIZE_CASES = {
    "custom_voice_auto": ("custom_voice", lambda b, ns: b.custom_voice(LONG, "aiden", non_streaming_mode=ns),
                          dict(text=LONG, language_id=None, speaker=True, instructions=None)),
    "custom_voice_dialect": ("custom_voice", lambda b, ns: b.custom_voice(LONG, "eric", "auto", "Slowly.", ns),
                             dict(text=LONG, language_id=2062, speaker=True, instructions="Slowly.")),
    "voice_design": ("voice_design", lambda b, ns: b.voice_design("x", "A calm voice.", "english", ns),
                     dict(text="x", language_id=2050, speaker=False, instructions="A calm voice.")),
    "x_vector": ("base", lambda b, ns: b.voice_clone(LONG, torch.zeros(32), "auto", non_streaming_mode=ns),
                 dict(text=LONG, language_id=None, speaker=True, instructions=None)),
    "icl_more_text": ("base", lambda b, ns: b.voice_clone(LONG, torch.zeros(32), "auto", REF2, torch.zeros(5, 16, dtype=torch.int64), ns),
                      dict(text=LONG, language_id=None, speaker=True, instructions=None, ref_text=REF2, ref_frames=5)),
    "icl_more_codes": ("base", lambda b, ns: b.voice_clone(TEXT4, torch.zeros(32), "english", REF2, torch.zeros(40, 16, dtype=torch.int64), ns),
                       dict(text=TEXT4, language_id=2050, speaker=True, instructions=None, ref_text=REF2, ref_frames=40)),
}  # fmt: skip


@pytest.mark.parametrize("non_streaming_mode", [False, True])
@pytest.mark.parametrize("case", list(SIZE_CASES))
def test_the_size_counted_from_token_ids_is_the_built_prompts(loaded, case, non_streaming_mode) -> None:
    """What the request builder checks against max_model_len before any model work is the
    prompt the preprocessing stage builds."""
    model_type, build, arguments = SIZE_CASES[case]
    prompts = builder(loaded[model_type])
    prompt = build(prompts, non_streaming_mode)
    text_ids = prompts.tokens.target(arguments["text"]).text
    others = {key: value for key, value in arguments.items() if key != "text"}
    size = prompts.tokens.size(text_ids, non_streaming_mode=non_streaming_mode, **others)
    assert (size.prefill, size.step_rows) == (prompt.prefill.shape[0], prompt.step_rows.shape[0])
