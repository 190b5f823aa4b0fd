"""Response audio encoding: every format decodes back to the input, streams match files."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
import soxr
from hypothesis import given, settings
from hypothesis import strategies as st

from omnistage.core.errors import RequestValidationError
from omnistage.serve.audio import (
    FORMATS,
    StreamingAudioEncoder,
    content_type,
    encode_audio,
    float_to_s16,
)

RATE = 22050
TONE = (0.5 * np.sin(2 * np.pi * 440.0 * np.arange(RATE) / RATE)).astype(np.float32)  # 1.0 s

# Measured with PyAV 18 (FFmpeg 8, LAME, libopus) on the 1 s tone at 22050 Hz:
# decoded length = expected + extra, the signal starting ``priming`` samples in.
#   mp3 file:   extra 0     (the LAME/Xing header lets the decoder trim delay and padding)
#   mp3 stream: extra 1566  priming 1105 (576 encoder + 529 decoder delay) + 461 padding
#               (a stream has no gapless header); tolerance: priming + up to one 576 frame
#   aac:        extra 1502  priming 1024 + 478 padding (ADTS has no gapless info, both
#               forms); tolerance: priming + up to one 1024 frame
#   opus:       extra 0     (Ogg Opus pre-skip and end granule trim exactly; at 48 kHz)
# (format, mode) -> (decoded rate, priming, min extra, max extra)
EXPECTED = {
    ("wav", "file"): (RATE, 0, 0, 0),
    ("flac", "file"): (RATE, 0, 0, 0),
    ("mp3", "file"): (RATE, 0, 0, 0),
    ("mp3", "stream"): (RATE, 1105, 1105, 1105 + 576),
    ("aac", "file"): (RATE, 1024, 1024, 1024 + 1023),
    ("opus", "file"): (48000, 0, 0, 0),
}
for _fmt in ("wav", "flac", "aac", "opus"):
    EXPECTED[(_fmt, "stream")] = EXPECTED[(_fmt, "file")]


def decode(data: bytes) -> tuple[np.ndarray, int]:
    """Decode with PyAV -> (first channel [n], rate); integer formats keep their values."""
    with av.open(io.BytesIO(data)) as container:
        frames = [frame.to_ndarray() for frame in container.decode(audio=0)]
        rate = container.streams.audio[0].rate
    if not frames:
        return np.zeros(0, np.float32), rate
    return np.concatenate(frames, axis=1)[0], rate


def stream_encode(fmt: str, samples: np.ndarray, sizes) -> list[bytes]:
    encoder = StreamingAudioEncoder(fmt, RATE)
    parts, start = [], 0
    for size in sizes:
        parts.append(encoder.push(samples[start : start + size]))
        start += size
    parts.append(encoder.push(samples[start:]))
    parts.append(encoder.finish())
    return parts


def best_lag(reference: np.ndarray, decoded: np.ndarray, max_lag: int) -> tuple[int, float]:
    """The lag in [0, max_lag] where ``decoded`` correlates best with ``reference``."""
    scores = [
        np.corrcoef(reference, decoded[lag : lag + len(reference)])[0, 1]
        for lag in range(max_lag + 1)
    ]
    lag = int(np.argmax(scores))
    return lag, float(scores[lag])


@pytest.mark.parametrize(("fmt", "mode"), sorted(EXPECTED))
def test_every_format_decodes_back_to_the_tone(fmt, mode):
    if mode == "file":
        data = encode_audio(TONE, RATE, fmt)
    else:
        data = b"".join(stream_encode(fmt, TONE, [2205] * 9))
    rate, priming, min_extra, max_extra = EXPECTED[(fmt, mode)]
    decoded, decoded_rate = decode(data)
    assert decoded_rate == rate
    expected_len = len(TONE) * rate // RATE
    extra = len(decoded) - expected_len
    assert min_extra <= extra <= max_extra, f"{fmt} {mode}: {len(decoded)} samples"
    if rate != RATE:
        decoded = soxr.resample(decoded, rate, RATE)
    lag, corr = best_lag(TONE, decoded.astype(np.float64), max(0, len(decoded) - len(TONE)))
    assert lag == priming
    assert corr > 0.99


@pytest.mark.parametrize("fmt", ["wav", "flac"])
@pytest.mark.parametrize("mode", ["file", "stream"])
def test_lossless_formats_carry_the_exact_s16_samples(fmt, mode):
    data = (
        encode_audio(TONE, RATE, fmt)
        if mode == "file"
        else b"".join(stream_encode(fmt, TONE, [1000] * 5))
    )
    decoded, _ = decode(data)
    assert decoded.dtype == np.int16
    np.testing.assert_array_equal(decoded, float_to_s16(TONE))


def test_pcm_is_the_s16le_samples():
    data = encode_audio(TONE, RATE, "pcm")
    assert len(data) == 2 * len(TONE)
    np.testing.assert_array_equal(np.frombuffer(data, "<i2"), float_to_s16(TONE))


def test_float_to_s16_clips_scales_and_rounds():
    x = np.array([-2.0, -1.0, -0.5, 0.0, 1e-5, 2e-5, 0.5, 1.0, 3.0, np.nan, np.inf, -np.inf], np.float32)
    expected = [-32767, -32767, -16384, 0, 0, 1, 16384, 32767, 32767, 0, 32767, -32767]
    np.testing.assert_array_equal(float_to_s16(x), np.array(expected, np.int16))


def test_streamed_pcm_and_wav_equal_the_whole_file():
    sizes = [1, 999, 0, 4410, 7]
    pcm_parts = stream_encode("pcm", TONE, sizes)
    assert b"".join(pcm_parts) == encode_audio(TONE, RATE, "pcm")
    assert all(len(p) == 2 * n for p, n in zip(pcm_parts, sizes, strict=False))

    wav_parts = stream_encode("wav", TONE, sizes)
    assert wav_parts[0][:4] == b"RIFF" and len(wav_parts[0]) == 44 + 2  # header + first chunk
    streamed, whole = b"".join(wav_parts), encode_audio(TONE, RATE, "wav")
    data_len = 2 * len(TONE)
    assert len(streamed) == len(whole) == 44 + data_len
    assert streamed[4:8] == streamed[40:44] == b"\xff\xff\xff\xff"  # length unknown
    assert whole[4:8] == (36 + data_len).to_bytes(4, "little")
    assert whole[40:44] == data_len.to_bytes(4, "little")
    mask = [i for i in range(len(whole)) if not (4 <= i < 8 or 40 <= i < 44)]
    assert bytes(streamed[i] for i in mask) == bytes(whole[i] for i in mask)
    assert whole[44:] == encode_audio(TONE, RATE, "pcm")


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=3000), max_size=12))
def test_pcm_stream_is_independent_of_chunking(sizes):
    whole = encode_audio(TONE, RATE, "pcm")
    assert b"".join(stream_encode("pcm", TONE, sizes)) == whole
    wav = b"".join(stream_encode("wav", TONE, sizes))
    assert wav[44:] == whole


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_emits_bytes_before_finish(fmt):
    parts = stream_encode(fmt, TONE, [2205] * 9)  # ten 100 ms pushes, then finish
    before_finish = sum(len(p) for p in parts[:-1])
    assert before_finish > 0.5 * sum(len(p) for p in parts)


def test_unsupported_rates_are_resampled():
    decoded, rate = decode(encode_audio(TONE[:2300], 23000, "mp3"))  # LAME has no 23 kHz
    assert rate == 24000
    decoded, rate = decode(encode_audio(TONE, RATE, "opus"))
    assert rate == 48000 and len(decoded) == 48000


def test_content_types_and_errors():
    assert content_type("mp3") == "audio/mpeg"
    assert content_type("wav") == "audio/wav"
    assert content_type("opus").startswith("audio/ogg")
    assert {content_type(f) for f in FORMATS} >= {"audio/flac", "audio/aac", "audio/pcm"}
    for call in (
        lambda: content_type("ogg"),
        lambda: encode_audio(TONE, RATE, "m4a"),
        lambda: StreamingAudioEncoder("vorbis", RATE),
    ):
        with pytest.raises(RequestValidationError) as err:
            call()
        assert err.value.param == "response_format" and "mp3" in str(err.value)
    with pytest.raises(ValueError, match="shape"):
        encode_audio(np.zeros((2, 10), np.float32), RATE, "wav")
    with pytest.raises(ValueError, match="sample_rate"):
        StreamingAudioEncoder("wav", 0)
    encoder = StreamingAudioEncoder("mp3", RATE)
    encoder.finish()
    with pytest.raises(RuntimeError):
        encoder.push(TONE)


def test_empty_clip_is_a_valid_lossless_file():
    for fmt in ("wav", "flac"):
        decoded, rate = decode(encode_audio(np.zeros(0, np.float32), RATE, fmt))
        assert len(decoded) == 0 and rate == RATE
