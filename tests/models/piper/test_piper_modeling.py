"""Piper model code against the bundled en_US-joe-medium voice (CPU, ~10 s on 2 cores)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from piper.const import BOS, EOS, PAD

from omnistage.core.errors import RequestValidationError
from omnistage.models.piper.modeling import (
    PiperPhonemizer,
    PiperSynthesizer,
    SynthesisItem,
    change_speed,
    check_speed,
    default_voice_path,
    load_voice_spec,
    normalize_text,
    split_sentences,
)

SENTENCES = [
    "Hello world, this is a test.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Doctor Smith paid five dollars for three apples, didn't he?",
]
# Measured: batched vs alone differ by at most 1.3e-4 (last samples of padded items, where
# the decoder sees its neighbours' padding) and ~4e-5 elsewhere; 1e-3 leaves 8x headroom.
BATCH_ATOL = 1e-3


@pytest.fixture(scope="module")
def spec():
    return load_voice_spec(default_voice_path())


@pytest.fixture(scope="module")
def phonemizer(spec):
    return PiperPhonemizer(spec)


@pytest.fixture(scope="module")
def synthesizer(spec):
    return PiperSynthesizer.load(spec, intra_op_threads=2)


def _item(ids, length_scale=1.0, noise=0.0, noise_w=0.0, speaker_id=None):
    return SynthesisItem(ids, noise, length_scale, noise_w, speaker_id)


class _CountingSession:
    """Delegates to an onnxruntime session and records the batch size of every run."""

    def __init__(self, session):
        self._session = session
        self.batch_sizes: list[int] = []

    def get_outputs(self):
        return self._session.get_outputs()

    def run(self, names, feeds, run_options=None):
        self.batch_sizes.append(feeds["input"].shape[0])
        return self._session.run(names, feeds, run_options)


# ------------------------------------------------------------------------------ voice spec


def test_default_voice_spec_matches_its_json(spec):
    raw = json.loads(spec.config_path.read_text(encoding="utf-8"))
    assert spec.onnx_path == default_voice_path() and spec.onnx_path.suffix == ".onnx"
    assert spec.sample_rate == raw["audio"]["sample_rate"]
    assert spec.num_speakers == raw["num_speakers"]
    assert spec.espeak_voice == raw["espeak"]["voice"]
    assert spec.language == raw["language"]["code"]
    assert (spec.noise_scale, spec.length_scale, spec.noise_w) == (
        raw["inference"]["noise_scale"],
        raw["inference"]["length_scale"],
        raw["inference"]["noise_w"],
    )


def test_missing_config_is_named(tmp_path):
    model = tmp_path / "voice.onnx"
    model.write_bytes(b"not a model")
    with pytest.raises(FileNotFoundError, match=re.escape("voice.onnx.json")):
        load_voice_spec(model)
    with pytest.raises(FileNotFoundError, match="absent.onnx"):
        load_voice_spec(tmp_path / "absent.onnx")


def test_invalid_config_is_a_value_error(tmp_path):
    model = tmp_path / "voice.onnx"
    model.write_bytes(b"")
    (tmp_path / "voice.onnx.json").write_text('{"num_symbols": 1}')
    with pytest.raises(ValueError, match="voice.onnx.json"):
        load_voice_spec(model)


def test_multi_speaker_names_are_ordered_by_id(tmp_path, spec):
    raw = json.loads(spec.config_path.read_text(encoding="utf-8"))
    raw.update(num_speakers=3, speaker_id_map={"c": 2, "a": 0, "b": 1})
    model = tmp_path / "multi.onnx"
    model.write_bytes(b"")  # load_voice_spec reads only the config
    (tmp_path / "multi.onnx.json").write_text(json.dumps(raw))
    multi = load_voice_spec(model)
    assert multi.speaker_names == ("a", "b", "c") and multi.num_speakers == 3


# ------------------------------------------------------------------------------ phonemizer


def test_phoneme_ids_follow_piper_layout(spec, phonemizer):
    id_map = spec.config.phoneme_id_map
    ids = phonemizer.phonemize("Hello world.")
    assert ids[0] == id_map[BOS][0] and ids[-1] == id_map[EOS][0]
    assert len(ids) % 2 == 1 and set(ids[1:-1:2]) == {id_map[PAD][0]}
    assert all(0 <= i < spec.config.num_symbols for i in ids)
    assert phonemizer.phonemize("Hello world.") == ids
    assert phonemizer.phonemize("Goodbye world.") != ids


def test_phonemize_joins_espeak_sentences_with_a_space(spec, phonemizer):
    hello, world = phonemizer.phonemize("Hello."), phonemizer.phonemize("World.")
    space, pad = spec.config.phoneme_id_map[" "][0], spec.config.phoneme_id_map[PAD][0]
    assert phonemizer.phonemize("Hello. World.") == hello[:-1] + [space, pad] + world[2:]


def test_phonemize_without_speech_is_rejected(phonemizer):
    with pytest.raises(RequestValidationError) as info:
        phonemizer.phonemize("...")
    assert info.value.param == "input"


# ----------------------------------------------------------------------------- synthesizer


def test_zero_noise_is_deterministic(phonemizer, synthesizer):
    item = _item(phonemizer.phonemize(SENTENCES[0]))
    alone, again = (synthesizer.synthesize_batch([item])[0] for _ in range(2))
    assert alone.dtype == np.float32 and alone.ndim == 1
    assert np.array_equal(alone, again)
    pair, pair_again = (synthesizer.synthesize_batch([item, item]) for _ in range(2))
    assert all(np.array_equal(a, b) for a, b in zip(pair, pair_again, strict=True))


@pytest.mark.parametrize("arena", ["grow", "off"])
def test_every_memory_arena_setting_gives_the_same_audio(phonemizer, synthesizer, spec, arena):
    item = _item(phonemizer.phonemize(SENTENCES[0]))  # zero noise: deterministic
    other = PiperSynthesizer.load(spec, intra_op_threads=2, memory_arena=arena)
    assert np.array_equal(
        other.synthesize_batch([item])[0], synthesizer.synthesize_batch([item])[0]
    )
    with pytest.raises(ValueError, match="memory_arena"):
        PiperSynthesizer.load(spec, memory_arena="sometimes")


def test_batch_equals_single_in_one_call(phonemizer, synthesizer, spec):
    items = [_item(phonemizer.phonemize(s)) for s in SENTENCES]
    alone = [synthesizer.synthesize_batch([item])[0] for item in items]
    counting = _CountingSession(synthesizer.session)
    batched = PiperSynthesizer(spec, counting).synthesize_batch(items)
    assert counting.batch_sizes == [3]
    assert len({len(a) for a in alone}) == 3  # really different lengths: padding is exercised
    for single, together in zip(alone, batched, strict=True):
        assert together.shape == single.shape
        assert np.max(np.abs(together - single)) < BATCH_ATOL


def test_items_are_grouped_by_scales(phonemizer, synthesizer, spec):
    ids = [phonemizer.phonemize(s) for s in SENTENCES]
    items = [_item(ids[0]), _item(ids[1], 0.8), _item(ids[2]), _item(ids[0], 0.8)]
    counting = _CountingSession(synthesizer.session)
    waves = PiperSynthesizer(spec, counting).synthesize_batch(items)
    assert sorted(counting.batch_sizes) == [2, 2]
    for item, wave in zip(items, waves, strict=True):
        assert np.max(np.abs(synthesizer.synthesize_batch([item])[0] - wave)) < BATCH_ATOL
    assert len(waves[3]) < len(waves[0])  # same text, faster


def test_audio_is_speech_like(phonemizer, synthesizer, spec):
    for sentence in SENTENCES:
        wave = synthesizer.synthesize_batch([_item(phonemizer.phonemize(sentence))])[0]
        assert np.sqrt(np.mean(wave**2)) > 0.02  # measured ~0.058 (peak ~0.5)
        assert np.max(np.abs(wave)) <= 1.0
        ms_per_char = 1000 * len(wave) / spec.sample_rate / len(sentence)
        assert 40 < ms_per_char < 150  # measured 55-71 ms/char


@pytest.mark.parametrize("speed", [0.25, 0.5, 0.8, 1.25, 2.0, 4.0])
def test_change_speed_scales_duration_as_one_over_speed(phonemizer, synthesizer, spec, speed):
    normal = synthesizer.synthesize_batch([_item(phonemizer.phonemize(SENTENCES[1]), spec.length_scale)])[0]
    stretched = change_speed(normal, spec.sample_rate, speed)
    assert abs(len(stretched) - len(normal) / speed) <= 1
    assert stretched.dtype == np.float32
    # the stretch keeps the energy of the speech (no silence, no clipping)
    rms = float(np.sqrt(np.mean(stretched**2)))
    assert 0.5 < rms / float(np.sqrt(np.mean(normal**2))) < 2.0 and np.max(np.abs(stretched)) <= 1.0


def test_speed_one_is_the_voice_itself(spec):
    wave = np.linspace(-0.5, 0.5, 1000, dtype=np.float32)
    assert change_speed(wave, spec.sample_rate, 1.0) is wave


def test_noise_changes_output(phonemizer, synthesizer, spec):
    item = _item(phonemizer.phonemize(SENTENCES[0]), noise=spec.noise_scale)
    first, second = (synthesizer.synthesize_batch([item])[0] for _ in range(2))
    assert first.shape != second.shape or not np.array_equal(first, second)


def test_invalid_speaker_and_speed_are_rejected(phonemizer, synthesizer):
    item = _item(phonemizer.phonemize("Hi."), speaker_id=1)
    with pytest.raises(RequestValidationError) as info:
        synthesizer.synthesize_batch([item])
    assert info.value.param == "voice"
    for speed in (0.0, 0.1, 5.0, float("nan")):
        with pytest.raises(RequestValidationError, match="speed"):
            check_speed(speed)


@pytest.mark.parametrize(
    "kwargs", [dict(ids=[]), dict(ids=[1, 2], length_scale=0.0), dict(ids=[1], noise=-1.0)]
)
def test_synthesis_item_validates(kwargs):
    with pytest.raises(ValueError):
        _item(**kwargs)


def test_empty_batch(synthesizer):
    assert synthesizer.synthesize_batch([]) == []


# ----------------------------------------------------------------------------------- text


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("  Hello \t  world.\n\n\n  Next  ", "Hello world.\nNext"),
        ("It was $5.50, $0.99 and $1.", "It was 5 dollars 50 cents, 99 cents and 1 dollar."),
        ("€20 or £3.01 or $2.5 million", "20 euros or 3 pounds 1 penny or 2.5 million dollars"),
        ("Dr. Smith met Mr. Jones.", "Doctor Smith met Mister Jones."),
        ("I love St. Louis.", "I love Saint Louis."),
        ("We live on Main St. Louis said so.", "We live on Main St. Louis said so."),
        ("Sammy Davis Jr. sang.", "Sammy Davis Junior sang."),
        ("No. 5 and #1", "number 5 and number 1"),
        ("At 10:00, 9:00 pm and 3:05.", "At 10 o'clock, 9 pm and 3 oh 5."),
        ("The 1990s and '80s.", "The 19 nineties and eighties."),
        ("In 1990, since 1905 and 25% of 1,000.", "In 19 90, since 19 oh 5 and 25% of 1,000."),
        ("3.14 and the 21st", "3.14 and the 21st"),
    ],
)
def test_normalize_text(raw, expected):
    assert normalize_text(raw) == expected


def test_split_sentences_on_marks_not_abbreviations():
    text = (
        "Dr. Smith came at 3:30 p.m. on Jan. 5. Pi is 3.14! Really? Yes; e.g. the U.S. "
        'agreed: "fine." J. R. R. Tolkien wrote.\nNew line'
    )
    assert split_sentences(text) == [
        "Dr. Smith came at 3:30 p.m. on Jan. 5.",
        "Pi is 3.14!",
        "Really?",
        "Yes;",
        "e.g. the U.S. agreed:",
        '"fine."',
        "J. R. R. Tolkien wrote.",
        "New line",
    ]


def test_long_sentences_split_at_commas_then_spaces():
    clauses = ", ".join(["one two three"] * 20)
    pieces = split_sentences(clauses, max_chars=50)
    assert all(p.endswith(",") for p in pieces[:-1]) and len(pieces) > 1
    words = split_sentences("word " * 40, max_chars=23)
    assert all(p == "word word word word" for p in words[:-1])


@pytest.mark.parametrize("text", ["", "   \n\t", "... !?"])
def test_split_rejects_empty(text):
    with pytest.raises(RequestValidationError) as info:
        split_sentences(text)
    assert info.value.param == "input"


@settings(max_examples=200, deadline=None)
@given(
    st.text(alphabet="ab1 .,!?;:\n'", min_size=1, max_size=300).filter(
        lambda t: re.search(r"\w", t)
    ),
    st.integers(min_value=1, max_value=60),
)
def test_split_keeps_every_word_character_within_limit(text, max_chars):
    pieces = split_sentences(text, max_chars=max_chars)
    assert all(0 < len(p) <= max_chars and p == p.strip() for p in pieces)
    assert re.sub(r"\W", "", "".join(pieces)) == re.sub(r"\W", "", text)
