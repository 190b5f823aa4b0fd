"""Qwen3-TTS request side: capabilities derived from config.json, the request builder's
rules, reference audio decoding, the text-proportional frame cap and sampling resolution.

Requests go through what the server does: parse -> validate against the capabilities ->
build. Checkpoints are the tiny random checkpoints' config.json / generation_config.json
(real ids; no weights: nothing here loads them).
"""

from __future__ import annotations

import base64
import io
import json
import math
from pathlib import Path

import av
import numpy as np
import pytest

from omnistage.checkpoint.text_tokenizer import write_text_tokenizer
from omnistage.core.errors import PayloadTooLargeError, RequestValidationError
from omnistage.models.qwen3_tts.capabilities import (
    MAX_INPUT_CHARS,
    MAX_MODEL_LEN,
    Qwen3TTSModelFacts,
    qwen3_tts_capabilities,
)
from omnistage.models.qwen3_tts.modeling.config import (
    GenerationConfig,
    load_config,
    load_generation_config,
)
from omnistage.models.qwen3_tts.modeling.prompt import TargetIds
from omnistage.models.qwen3_tts.payload_types import Qwen3TTSRequest, SamplingOverrides
from omnistage.models.qwen3_tts.random_checkpoint import (
    GENERATION_CONFIG,
    LANGUAGES,
    SPEAKERS,
    build_config_dict,
)
from omnistage.models.qwen3_tts.request_builders import (
    Qwen3TTSSpeechRequest,
    RequestLimits,
    build_qwen3_tts_request,
    load_request_limits,
    max_frames_for_text,
    resolve_sampling,
)
from omnistage.serve.media import MediaPolicy, ReferenceCache
from omnistage.serve.protocol import parse_speech_request, validate_speech_request

INLINE = MediaPolicy()


def write_checkpoint(root: Path, model_type: str, size: str = "1b7") -> Path:
    """config.json (tiny geometry, real ids, ``tts_model_size`` = ``size``),
    generation_config.json and the text tokenizer of a ``model_type`` checkpoint."""
    config = build_config_dict("tiny", model_type) | {"tts_model_size": size}
    path = root / f"{model_type}-{size}"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    write_text_tokenizer(path, config["im_start_token_id"] - 1)
    return path


LIMITS: dict[Qwen3TTSModelFacts, RequestLimits] = {}
"""The request limits of each checkpoint :func:`facts_of` read (the default max_model_len)."""


def facts_of(path: Path) -> Qwen3TTSModelFacts:
    facts = Qwen3TTSModelFacts.from_config(load_config(path))
    LIMITS[facts] = load_request_limits(path, MAX_MODEL_LEN)
    return facts


@pytest.fixture
def checkpoint(tmp_path):
    def make(model_type: str, size: str = "1b7") -> Qwen3TTSModelFacts:
        return facts_of(write_checkpoint(tmp_path, model_type, size))

    return make


def build(facts: Qwen3TTSModelFacts, body: dict, media: MediaPolicy = INLINE) -> Qwen3TTSRequest:
    """The server's path: parse, validate against the capabilities, build."""
    caps = qwen3_tts_capabilities(facts, ("qwen3-tts",))
    request = validate_speech_request(parse_speech_request(body, Qwen3TTSSpeechRequest), caps)
    return build_qwen3_tts_request(request, facts, media, LIMITS[facts])


def rejects(param: str, facts: Qwen3TTSModelFacts, body: dict, media: MediaPolicy = INLINE):
    with pytest.raises(RequestValidationError) as info:
        build(facts, body, media)
    assert info.value.param == param, str(info.value)
    assert info.value.http_status == 400
    return info.value


def encode(channels: np.ndarray, rate: int, fmt: str) -> bytes:
    """Encode float PCM ``[C, N]`` into a file of ``fmt`` (wav, flac, mp3, ogg=Opus)."""
    container, codec = {
        "wav": ("wav", "pcm_s16le"),
        "flac": ("flac", "flac"),
        "mp3": ("mp3", "libmp3lame"),
        "ogg": ("ogg", "libopus"),
    }[fmt]
    layout = "stereo" if channels.shape[0] == 2 else "mono"
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container) as out:
        stream = out.add_stream(codec, rate=rate, layout=layout)
        frame = av.AudioFrame.from_ndarray(
            np.ascontiguousarray(channels, dtype=np.float32), format="fltp", layout=layout
        )
        frame.sample_rate = rate
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    return buffer.getvalue()


def tone(seconds: float, rate: int, stereo: bool = True) -> np.ndarray:
    """220 Hz; stereo: left 0.5, right 0.25 amplitude (mono average: 0.375)."""
    s = np.sin(2 * np.pi * 220 * np.arange(round(seconds * rate)) / rate)
    return np.stack([0.5 * s, 0.25 * s]) if stereo else 0.375 * s[None, :]


def data_uri(data: bytes, subtype: str = "wav") -> str:
    return f"data:audio/{subtype};base64," + base64.b64encode(data).decode()


WAV_2S = data_uri(encode(tone(2.0, 16000), 16000, "wav"))


# --------------------------------------------------------------------------- capabilities


def test_custom_voice_capabilities_list_speakers_and_non_dialect_languages(checkpoint):
    caps = qwen3_tts_capabilities(checkpoint("custom_voice"), ("qwen3-tts",))
    assert caps.voices == tuple(SPEAKERS) and caps.default_voice is None
    assert caps.languages == ("auto", *LANGUAGES)
    assert caps.sample_rate == 24000
    assert "instructions" in caps.supported_fields
    assert not {"ref_audio", "ref_text", "references", "x_vector_only_mode"} & caps.supported_fields
    assert {"temperature", "top_k", "top_p", "repetition_penalty", "seed", "max_new_tokens",
            "initial_codec_chunk_frames", "non_streaming_mode"} <= caps.supported_fields  # fmt: skip


def test_base_capabilities_take_reference_audio_and_no_named_voice(checkpoint):
    caps = qwen3_tts_capabilities(checkpoint("base"), ("qwen3-tts",))
    assert caps.voices == () and caps.default_voice is None
    assert {"ref_audio", "ref_text", "references", "x_vector_only_mode"} <= caps.supported_fields
    assert "instructions" not in caps.supported_fields


# --------------------------------------------------------------------------- voices, languages


def test_custom_voice_request_carries_speaker_and_language(checkpoint):
    req = build(
        checkpoint("custom_voice"), {"input": "Hi.", "voice": "vivian", "language": "english"}
    )
    assert (req.voice, req.language) == ("vivian", "english")
    assert req.ref_audio is None and not req.icl and req.instructions is None


def test_the_request_carries_its_texts_token_ids_in_the_prompts_template(checkpoint):
    """The preprocessing stage builds the prompt from these ids (it does not tokenize)."""
    facts = checkpoint("custom_voice")
    req = build(facts, {"input": "Hello there, 12 cats.", "voice": "vivian"})
    template = LIMITS[facts].tokens.tokenizer("<|im_start|>assistant\nHello there, 12 cats.<|im_end|>\n<|im_start|>assistant\n")
    ids = list(template["input_ids"])
    assert req.target_ids == (ids[:3], ids[3:-5]) and req.target_ids.text


def test_voice_and_language_are_case_insensitive_as_on_model_cards(checkpoint):
    req = build(
        checkpoint("custom_voice"), {"input": "Hi.", "voice": "Vivian", "language": "English"}
    )
    assert (req.voice, req.language) == ("vivian", "english")


def test_unknown_speaker_is_refused_listing_speakers(checkpoint):
    err = rejects("voice", checkpoint("custom_voice"), {"input": "Hi.", "voice": "alloy"})
    assert "vivian" in str(err) and "uncle_fu" in str(err)


def test_custom_voice_needs_a_speaker(checkpoint):
    rejects("voice", checkpoint("custom_voice"), {"input": "Hi."})


def test_unsupported_language_is_refused_listing_languages(checkpoint):
    err = rejects(
        "language",
        checkpoint("custom_voice"),
        {"input": "Hi.", "voice": "ryan", "language": "klingon"},
    )
    assert "auto" in str(err) and "english" in str(err)


def test_dialects_are_not_languages_of_their_own(checkpoint):
    rejects(
        "language",
        checkpoint("custom_voice"),
        {"input": "Hi.", "voice": "eric", "language": "sichuan_dialect"},
    )


@pytest.mark.parametrize("model_type", ["base", "voice_design"])
def test_a_voice_is_ignored_without_speakers(checkpoint, model_type):
    """OpenAI clients always send one (``alloy``): it means nothing to Base or VoiceDesign."""
    body = {"input": "Hi.", "voice": "alloy", "ref_audio": WAV_2S, "ref_text": "hello there"}
    if model_type == "voice_design":
        body = {"input": "Hi.", "voice": "alloy", "instructions": "calm"}
    caps = qwen3_tts_capabilities(checkpoint(model_type), ("qwen3-tts",))
    request = validate_speech_request(parse_speech_request(body, Qwen3TTSSpeechRequest), caps)
    assert request.ignored_fields == ("voice",)
    assert build(checkpoint(model_type), body).voice is None


def test_task_type_must_be_the_checkpoints_own(checkpoint):
    facts = checkpoint("custom_voice")
    assert (
        build(facts, {"input": "Hi.", "voice": "ryan", "task_type": "CustomVoice"}).voice
        == "ryan"
    )
    rejects("task_type", facts, {"input": "Hi.", "voice": "ryan", "task_type": "Base"})


# --------------------------------------------------------------------------- text, instructions


def test_empty_text_is_refused(checkpoint):
    rejects("input", checkpoint("custom_voice"), {"input": "  ", "voice": "ryan"})


def test_text_over_the_cap_is_refused(checkpoint):
    rejects(
        "input", checkpoint("custom_voice"), {"input": "a" * (MAX_INPUT_CHARS + 1), "voice": "ryan"}
    )


def test_voice_design_needs_instructions(checkpoint):
    rejects("instructions", checkpoint("voice_design"), {"input": "Hi."})


def test_voice_design_carries_instructions(checkpoint):
    req = build(checkpoint("voice_design"), {"input": "Hi.", "instructions": "a calm low voice"})
    assert req.instructions == "a calm low voice" and req.voice is None and req.non_streaming_mode


@pytest.mark.parametrize("blank", [" ", "\u200b", " \ufeff\n"])  # format characters are blank too
@pytest.mark.parametrize("model_type", ["voice_design", "custom_voice"])
def test_blank_instructions_are_refused(checkpoint, model_type, blank):
    rejects(
        "instructions",
        checkpoint(model_type),
        {
            "input": "Hi.",
            "voice": "ryan" if model_type == "custom_voice" else None,
            "instructions": blank,
        },
    )


def ignored(facts: Qwen3TTSModelFacts, body: dict) -> tuple[str, ...]:
    caps = qwen3_tts_capabilities(facts, ("qwen3-tts",))
    request = validate_speech_request(parse_speech_request(body, Qwen3TTSSpeechRequest), caps)
    assert build_qwen3_tts_request(request, facts, INLINE, LIMITS[facts]) is not None
    return request.ignored_fields


def test_instructions_on_base_are_ignored_and_named(checkpoint):
    body = {"input": "Hi.", "instructions": "calm", "ref_audio": WAV_2S, "ref_text": "hello there"}
    assert ignored(checkpoint("base"), body) == ("instructions",)
    assert build(checkpoint("base"), body).instructions is None


def test_instructions_on_small_custom_voice_are_named_as_ignored(checkpoint):
    """The reference drops them silently for 0.6B; here the response says so."""
    body = {"input": "Hi.", "voice": "ryan", "instructions": "whisper"}
    assert ignored(checkpoint("custom_voice", "0b6"), body) == ("instructions",)
    assert build(checkpoint("custom_voice", "0b6"), body).instructions is None


def test_instructions_on_large_custom_voice_are_kept(checkpoint):
    assert (
        build(
            checkpoint("custom_voice"), {"input": "Hi.", "voice": "ryan", "instructions": "whisper"}
        ).instructions
        == "whisper"
    )


@pytest.mark.parametrize("model_type", ["custom_voice", "voice_design"])
def test_reference_audio_without_a_base_model_is_refused(checkpoint, model_type):
    body = {
        "input": "Hi.",
        "voice": "ryan" if model_type == "custom_voice" else None,
        "instructions": "calm",
        "ref_audio": WAV_2S,
    }
    rejects("ref_audio", checkpoint(model_type), body)


def test_speed_is_ignored_and_named(checkpoint):
    """No duration control: OpenAI's speed cannot apply (named, not silently dropped)."""
    assert ignored(checkpoint("custom_voice"), {"input": "Hi.", "voice": "ryan", "speed": 1.5}) == ("speed",)


# --------------------------------------------------------------------------- generation params


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", -0.1), ("top_k", -2), ("top_p", 0), ("top_p", 1.01),
     ("repetition_penalty", 0), ("seed", -1), ("seed", 2**31), ("max_new_tokens", 0),
     ("max_new_tokens", 8193), ("initial_codec_chunk_frames", -1),
     ("non_streaming_mode", 1), ("initial_codec_chunk_frames", 1.5),
     # beyond float32, the sampler's dtype: overflow used to fail the engine's whole prefill
     ("temperature", 1e300), ("repetition_penalty", 1e300), ("top_p", 1e-300),
     ("repetition_penalty", 1e-300)],
)  # fmt: skip
def test_out_of_range_generation_params_are_refused(checkpoint, field, value):
    rejects(field, checkpoint("custom_voice"), {"input": "Hi.", "voice": "ryan", field: value})


def test_min_new_tokens_above_max_new_tokens_is_refused(checkpoint):
    body = {"input": "Hi.", "voice": "ryan", "min_new_tokens": 50, "max_new_tokens": 8}
    assert "exceeds max_new_tokens" in str(rejects("min_new_tokens", checkpoint("custom_voice"), body))


def test_min_new_tokens_equal_to_max_new_tokens_fixes_the_length(checkpoint):
    body = {"input": "Hi.", "voice": "ryan", "min_new_tokens": 8, "max_new_tokens": 8}
    assert build(checkpoint("custom_voice"), body).min_new_tokens == 8


def test_unset_sampling_stays_unset(checkpoint):
    req = build(checkpoint("custom_voice"), {"input": "Hi.", "voice": "ryan"})
    assert req.sampling == SamplingOverrides()
    assert req.max_new_tokens is None and req.initial_codec_chunk_frames is None
    assert 0 <= req.seed < 2**31


def test_given_generation_params_are_carried(checkpoint):
    body = {"input": "Hi.", "voice": "ryan", "temperature": 0, "top_k": -1, "top_p": 0.8,
            "repetition_penalty": 1.2, "seed": 2**31 - 1, "max_new_tokens": 8192,
            "initial_codec_chunk_frames": 0, "non_streaming_mode": False, "stream": True}  # fmt: skip
    req = build(checkpoint("custom_voice"), body)
    assert req.sampling == SamplingOverrides(
        temperature=0.0, top_k=0, top_p=0.8, repetition_penalty=1.2
    )
    assert (req.seed, req.max_new_tokens, req.initial_codec_chunk_frames) == (2**31 - 1, 8192, 0)
    assert req.non_streaming_mode is False and req.stream


def test_text_mode_defaults_streaming_for_clone_and_whole_text_otherwise(checkpoint):
    clone = build(
        checkpoint("base"), {"input": "Hi.", "ref_audio": WAV_2S, "ref_text": "hello there"}
    )
    assert clone.non_streaming_mode is False
    assert (
        build(checkpoint("custom_voice"), {"input": "Hi.", "voice": "ryan"}).non_streaming_mode
        is True
    )


# --------------------------------------------------------------------------- voice clone


def test_base_without_reference_audio_is_refused(checkpoint):
    rejects("ref_audio", checkpoint("base"), {"input": "Hi."})


def test_reference_with_transcript_is_an_icl_clone(checkpoint):
    req = build(
        checkpoint("base"), {"input": "Hi.", "ref_audio": WAV_2S, "ref_text": "hello there"}
    )
    assert req.icl and not req.x_vector_only and req.ref_text == "hello there"
    assert req.ref_audio.dtype == np.float32 and req.ref_audio.shape == (48000,)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"ref_audio": WAV_2S, "references": [{"audio": WAV_2S}]}, "references"),
        ({"ref_text": "words"}, "ref_text"),
        ({"x_vector_only_mode": True}, "x_vector_only_mode"),
        ({"ref_audio": WAV_2S, "ref_text": "x" * (MAX_INPUT_CHARS + 1)}, "ref_text"),
        ({"references": [{"audio": WAV_2S, "text": "x" * (MAX_INPUT_CHARS + 1)}]}, "references.0.text"),
    ],
)
def test_inconsistent_reference_fields_are_refused(checkpoint, body, param):
    rejects(param, checkpoint("base"), {"input": "Hi.", **body})


def test_reference_without_transcript_needs_x_vector_only_mode(checkpoint):
    err = rejects("ref_text", checkpoint("base"), {"input": "Hi.", "ref_audio": WAV_2S})
    assert "x_vector_only_mode" in str(err)


def test_x_vector_only_mode_clones_without_transcript(checkpoint):
    req = build(
        checkpoint("base"), {"input": "Hi.", "ref_audio": WAV_2S, "x_vector_only_mode": True}
    )
    assert req.x_vector_only and not req.icl and req.ref_text is None and req.ref_audio is not None


def test_transcript_in_x_vector_only_mode_is_refused_not_dropped(checkpoint):
    body = {"input": "Hi.", "ref_audio": WAV_2S, "ref_text": "hello", "x_vector_only_mode": True}
    rejects("ref_text", checkpoint("base"), body)


def test_blank_transcript_is_refused(checkpoint):
    rejects("ref_text", checkpoint("base"), {"input": "Hi.", "ref_audio": WAV_2S, "ref_text": " "})


def test_one_reference_in_references_is_a_clone(checkpoint):
    req = build(
        checkpoint("base"), {"input": "Hi.", "references": [{"audio": WAV_2S, "text": "hello"}]}
    )
    assert req.icl and req.ref_text == "hello" and req.ref_audio.shape == (48000,)


def test_several_references_are_refused(checkpoint):
    body = {
        "input": "Hi.",
        "references": [{"audio": WAV_2S, "text": "a"}, {"audio": WAV_2S, "text": "b"}],
    }
    rejects("references", checkpoint("base"), body)


def test_reference_errors_name_the_references_item(checkpoint):
    rejects(
        "references.0.text", checkpoint("base"), {"input": "Hi.", "references": [{"audio": WAV_2S}]}
    )
    bad = base64.b64encode(b"not audio at all" * 16).decode()
    body = {"input": "Hi.", "references": [{"audio": bad}], "x_vector_only_mode": True}
    rejects("references.0.audio", checkpoint("base"), body)


# --------------------------------------------------------------------------- reference audio


@pytest.mark.parametrize(
    ("fmt", "rate", "stereo", "lossy"),
    [("wav", 16000, True, False), ("wav", 44100, True, False), ("flac", 16000, True, False),
     ("flac", 44100, False, False), ("mp3", 16000, True, True), ("mp3", 44100, True, True),
     ("ogg", 16000, True, True), ("ogg", 48000, False, True)],
)  # fmt: skip
def test_reference_audio_decodes_to_24khz_mono(checkpoint, fmt, rate, stereo, lossy):
    uri = data_uri(encode(tone(1.5, rate, stereo), rate, fmt), fmt)
    req = build(checkpoint("base"), {"input": "Hi.", "ref_audio": uri, "x_vector_only_mode": True})
    samples = req.ref_audio
    assert samples.dtype == np.float32 and samples.ndim == 1
    assert abs(len(samples) - 36000) <= 1  # 1.5 s at 24 kHz, +-1 sample of resampler rounding
    rms = float(np.sqrt(np.mean(samples[2400:-2400] ** 2)))  # channel average: 0.375 peak
    assert rms == pytest.approx(0.375 / math.sqrt(2), rel=0.1 if lossy else 1e-3)


def test_undecodable_reference_is_refused(checkpoint):
    bad = data_uri(b"RIFF\x00\x00\x00\x00WAVEjunk" + bytes(range(256)) * 8)
    err = rejects(
        "ref_audio",
        checkpoint("base"),
        {"input": "Hi.", "ref_audio": bad, "x_vector_only_mode": True},
    )
    assert "decoded" in str(err)


def test_reference_over_30_s_is_too_large(checkpoint):
    long = data_uri(encode(tone(31.0, 8000, stereo=False), 8000, "flac"), "flac")
    with pytest.raises(PayloadTooLargeError) as info:
        build(checkpoint("base"), {"input": "Hi.", "ref_audio": long, "x_vector_only_mode": True})
    assert info.value.param == "ref_audio" and "30.0 s" in str(info.value)


def test_reference_cap_follows_a_stricter_media_policy(checkpoint):
    with pytest.raises(PayloadTooLargeError, match="1.0 s"):
        build(checkpoint("base"), {"input": "Hi.", "ref_audio": WAV_2S, "x_vector_only_mode": True},
              MediaPolicy(max_duration_s=1.0))  # fmt: skip


def test_reference_under_half_a_second_is_refused(checkpoint):
    short = data_uri(encode(tone(0.4, 16000), 16000, "wav"))
    rejects(
        "ref_audio",
        checkpoint("base"),
        {"input": "Hi.", "ref_audio": short, "x_vector_only_mode": True},
    )


def test_silent_reference_is_refused(checkpoint):
    silent = data_uri(encode(np.zeros((2, 32000)), 16000, "wav"))
    err = rejects(
        "ref_audio",
        checkpoint("base"),
        {"input": "Hi.", "ref_audio": silent, "x_vector_only_mode": True},
    )
    assert "silent" in str(err)


def test_a_reference_sent_again_is_the_cached_clip_with_its_key(checkpoint):
    """The server's media policy caches the loaded clip by content: a repeated reference
    is the very same 24 kHz samples (equal to a fresh load's) and the same key, which the
    reference encoder's cache uses; another clip has another key."""
    facts, policy = checkpoint("base"), MediaPolicy()
    body = {"input": "Hi.", "ref_audio": WAV_2S, "ref_text": "hello there"}
    first, again = build(facts, body, policy), build(facts, body, policy)
    assert again.ref_audio is first.ref_audio and not first.ref_audio.flags.writeable
    assert again.ref_key == first.ref_key and len(first.ref_key) == 64
    fresh = build(facts, body, MediaPolicy())  # its own, empty cache: decoded anew
    np.testing.assert_array_equal(fresh.ref_audio, first.ref_audio)
    assert fresh.ref_key == first.ref_key  # the key is of the content, not of the cache
    other = build(facts, {**body, "ref_audio": data_uri(encode(tone(2.0, 16000, stereo=False), 16000, "wav"))}, policy)
    assert other.ref_key != first.ref_key and len(policy.reference_cache) == 2


@pytest.mark.parametrize(
    ("audio", "message"),
    [(data_uri(encode(np.zeros((2, 32000)), 16000, "wav")), "silent"),
     (data_uri(encode(tone(0.4, 16000), 16000, "wav")), "at least 0.5 s"),
     (data_uri(b"RIFF\x00\x00\x00\x00WAVEjunk" + bytes(range(256)) * 8), "could not be decoded")],
)  # fmt: skip
def test_a_refused_reference_is_a_400_every_time_it_is_sent(checkpoint, audio, message):
    facts, policy = checkpoint("base"), MediaPolicy()
    for _ in range(3):
        err = rejects("ref_audio", facts, {"input": "Hi.", "ref_audio": audio, "x_vector_only_mode": True}, policy)
        assert message in str(err)
    assert len(policy.reference_cache) == 0


def test_a_reference_is_cached_only_with_reference_cache_room(checkpoint):
    facts, policy = checkpoint("base"), MediaPolicy(reference_cache=ReferenceCache(0))
    body = {"input": "Hi.", "ref_audio": WAV_2S, "x_vector_only_mode": True}
    first, again = build(facts, body, policy), build(facts, body, policy)
    assert again.ref_audio is not first.ref_audio and again.ref_key == first.ref_key
    np.testing.assert_array_equal(again.ref_audio, first.ref_audio)


def test_reference_transcript_ids_are_memoized_as_tokenized(checkpoint, tmp_path):
    checkpoint("base")
    tokens = load_request_limits(tmp_path / "base-1b7", MAX_MODEL_LEN).tokens
    text = "Hello there, 你好."
    expected = list(tokens.tokenizer(f"<|im_start|>assistant\n{text}<|im_end|>\n")["input_ids"])[3:-2]
    first = tokens.ref_text(text)
    first.append(-1)  # a caller's list is its own
    assert tokens.ref_text(text) == expected and tokens.ref_text(text) is not first


def test_a_request_with_ref_audio_has_its_key():
    with pytest.raises(ValueError, match="ref_key"):
        Qwen3TTSRequest(
            text="Hi.", target_ids=TargetIds([151644, 77091, 198], [13048, 13]), model_type="base", language="auto", voice=None, instructions=None,
            ref_audio=np.zeros(24000, np.float32), ref_key=None, ref_text=None, x_vector_only=True,
            non_streaming_mode=False, sampling=SamplingOverrides(), seed=0, max_new_tokens=None,
            min_new_tokens=2, frame_cap=25, initial_codec_chunk_frames=None, stream=False,
        )  # fmt: skip


# --------------------------------------------------------------------------- frame cap


def test_frame_cap_formula_examples():
    assert max_frames_for_text("Hello.") == math.ceil(12.5 * (2.0 + 6 * 0.2))  # 40
    assert max_frames_for_text("你好世界") == math.ceil(12.5 * (2.0 + 4 * 0.5))  # 50
    assert max_frames_for_text("in 2024") == math.ceil(12.5 * (2.0 + 2 * 0.2 + 4 * 0.4))
    assert max_frames_for_text("   ") == 25


@pytest.mark.parametrize(
    ("text", "normal_chars_per_s"),
    [("The quick brown fox jumps over the lazy dog. " * 20, 14.0),
     ("今天天气很好，我们一起去公园散步吧。" * 20, 4.5),
     ("こんにちは、今日はいい天気ですね。" * 20, 7.0)],
)  # fmt: skip
def test_frame_cap_is_at_least_twice_a_normal_reading(text, normal_chars_per_s):
    normal_frames = 12.5 * len(text) / normal_chars_per_s
    assert max_frames_for_text(text) >= 2 * normal_frames


def test_frame_cap_is_clamped_to_the_limit():
    assert max_frames_for_text("字" * MAX_INPUT_CHARS) == 8192
    assert max_frames_for_text("Hello there.", limit=10) == 10


def test_request_frame_cap_follows_its_text(checkpoint):
    facts = checkpoint("custom_voice")
    short = build(facts, {"input": "Hi.", "voice": "ryan"})
    long = build(facts, {"input": "Hi. " * 100, "voice": "ryan"})
    assert short.frame_cap == max_frames_for_text("Hi.") < long.frame_cap


# --------------------------------------------------------------------------- sampling


@pytest.fixture
def defaults(tmp_path) -> GenerationConfig:
    return load_generation_config(write_checkpoint(tmp_path, "base"))


def test_unset_sampling_takes_generation_config(checkpoint, defaults):
    facts = checkpoint("custom_voice")
    req = build(facts, {"input": "Hi.", "voice": "ryan", "seed": 7})
    s = resolve_sampling(req, defaults, facts)
    assert (s.talker.temperature, s.talker.top_k, s.talker.top_p, s.talker.repetition_penalty) == (
        0.9,
        50,
        1.0,
        1.05,
    )
    assert (
        s.code_predictor.temperature,
        s.code_predictor.top_k,
        s.code_predictor.repetition_penalty,
    ) == (0.9, 50, 1.0)
    assert s.talker.seed == s.code_predictor.seed == 7
    assert s.max_new_tokens == req.frame_cap


def test_talker_stops_at_eos_and_never_samples_control_codes(checkpoint, defaults):
    facts = checkpoint("custom_voice")
    talker = resolve_sampling(
        build(facts, {"input": "Hi.", "voice": "ryan"}), defaults, facts
    ).talker
    assert talker.stop_token_ids == (2150,) and talker.min_new_tokens == 2
    assert talker.suppress_ranges == ((2048, 2150), (2151, 3072))


def test_client_sampling_applies_to_both_samplers_but_penalty_to_talker_only(checkpoint, defaults):
    facts = checkpoint("custom_voice")
    body = {
        "input": "Hi.",
        "voice": "ryan",
        "temperature": 0,
        "top_k": 5,
        "top_p": 0.5,
        "repetition_penalty": 1.3,
    }
    s = resolve_sampling(build(facts, body), defaults, facts)
    for params in (s.talker, s.code_predictor):
        assert (params.temperature, params.top_k, params.top_p) == (0.0, 5, 0.5)
    assert s.talker.repetition_penalty == 1.3 and s.code_predictor.repetition_penalty == 1.0


def test_do_sample_false_default_is_greedy(checkpoint, tmp_path):
    path = write_checkpoint(tmp_path, "voice_design")
    (path / "generation_config.json").write_text(
        json.dumps({**GENERATION_CONFIG, "do_sample": False, "subtalker_dosample": False})
    )
    facts = facts_of(path)
    s = resolve_sampling(
        build(facts, {"input": "Hi.", "instructions": "calm"}), load_generation_config(path), facts
    )
    assert s.talker.temperature == 0.0 and s.code_predictor.temperature == 0.0


def test_explicit_max_new_tokens_replaces_the_text_cap(checkpoint, defaults):
    facts = checkpoint("custom_voice")
    for value in (3, 5000):
        req = build(facts, {"input": "Hi.", "voice": "ryan", "max_new_tokens": value})
        assert resolve_sampling(req, defaults, facts).max_new_tokens == value


def test_an_explicit_min_new_tokens_raises_the_text_cap(checkpoint, defaults):
    facts = checkpoint("custom_voice")
    req = build(facts, {"input": "Hi.", "voice": "ryan", "min_new_tokens": 400})
    assert req.frame_cap < 400
    assert resolve_sampling(req, defaults, facts).max_new_tokens == 400


def test_generation_config_cap_bounds_the_text_cap(checkpoint, tmp_path):
    path = write_checkpoint(tmp_path, "voice_design")
    (path / "generation_config.json").write_text(
        json.dumps({**GENERATION_CONFIG, "max_new_tokens": 30})
    )
    facts = facts_of(path)
    req = build(facts, {"input": "Hello there.", "instructions": "calm"})
    assert req.frame_cap > 30
    assert resolve_sampling(req, load_generation_config(path), facts).max_new_tokens == 30


def test_the_longest_clone_with_every_frame_is_refused_on_max_new_tokens_at_the_boundary(checkpoint):
    """2,000 CJK characters of input and of ref_text (3 byte tokens each in the tiny
    tokenizer: 12,000 prompt positions) with all 8192 frames exceed the tts_engine stage's
    default max_model_len (16384): a 400 before any model work, not an engine refusal after
    the prompt was built; the same request with a frame count that fits is accepted."""
    facts = checkpoint("base")
    body = {"input": "语" * MAX_INPUT_CHARS, "ref_audio": WAV_2S, "ref_text": "音" * MAX_INPUT_CHARS,
            "non_streaming_mode": True, "max_new_tokens": 8192}  # fmt: skip
    error = rejects("max_new_tokens", facts, body)
    most = int(error.args[0].rsplit("ask for at most ", 1)[1])
    assert 0 < most < MAX_MODEL_LEN - 12_000
    assert build(facts, {**body, "max_new_tokens": most}).max_new_tokens == most
    rejects("max_new_tokens", facts, {**body, "max_new_tokens": most + 1})
