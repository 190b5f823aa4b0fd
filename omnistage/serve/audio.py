"""Encode model audio (mono float32 PCM) into the API's ``response_format`` s.

Formats: ``wav``, ``pcm`` (raw s16le, no header), ``flac``, ``mp3``, ``opus`` (Ogg Opus),
``aac`` (ADTS). Containers are written by PyAV (FFmpeg); ``pcm`` is plain bytes.

Every format that stores integers gets its samples from :func:`float_to_s16` (clip to
[-1, 1], times 32767, round to nearest), so ``pcm``, ``wav`` and ``flac`` carry the very same
sample values. Lossy codecs get the clipped float samples.

Sample rates: :func:`resample` and the ``output_rate`` of :class:`StreamingAudioEncoder`
use soxr's streaming resampler, which is chunk-independent: a stream resampled chunk by
chunk equals the whole clip resampled at once, sample for sample. Then ``opus`` is always encoded at 48 kHz (Ogg Opus decoders output 48 kHz), the
input is resampled with soxr. ``mp3`` and ``aac`` keep the input rate when the codec
supports it (8-48 kHz, the usual TTS rates all are) and otherwise resample to the next
supported rate above it (or the highest). ``wav``, ``pcm`` and ``flac`` keep the input rate.

Streaming (:class:`StreamingAudioEncoder`): every format streams, i.e. ``push`` returns the
bytes that are final so far and nothing is rewritten later. How soon bytes come out:

- ``pcm``: all samples at once; ``wav``: a header with RIFF/data sizes 0xFFFFFFFF (length
  unknown) with the first samples, then the samples at once;
- ``mp3``: per 576/1152-sample frame, about one frame behind (encoder look-ahead);
- ``aac``: per 1024-sample frame, about two frames behind;
- ``flac``: per block (2304 samples at 22.05 kHz, 4608 at 44.1/48 kHz);
- ``opus``: per Ogg page of about 100 ms of audio (plus soxr and encoder delay).

Measured at 22.05 kHz with 20 ms pushes, the first audio bytes leave after about 80 ms of
input for mp3, 100 ms for aac, 120 ms for flac and 240 ms for opus.

What a stream cannot have that a whole file (:func:`encode_audio`) has: the mp3 gapless
(LAME/Xing) header, so a streamed mp3 decodes with the encoder delay and padding (about
1100 samples at the start, under one frame at the end); and the FLAC total-sample count and
MD5 (left zero, "unknown", as the format allows). ``aac`` (ADTS) has no gapless information
in either form (1024 priming samples at the start, under 1024 padding at the end); Ogg Opus
trims its pre-skip and padding exactly in both.
"""

from __future__ import annotations

import io
from typing import Final

import av
import numpy as np
import soxr

from omnistage.core.errors import RequestValidationError
from omnistage.core.messages import StreamChunk
from omnistage.core.payloads import AudioChunk

__all__ = [
    "FORMATS",
    "OPUS_SAMPLE_RATE",
    "StreamingAudioEncoder",
    "audio_of_chunk",
    "content_type",
    "encode_audio",
    "encoded_rate",
    "float_to_s16",
    "resample",
]

OPUS_SAMPLE_RATE: Final = 48_000

# fmt -> (container format, codec, container options)
_AV_FORMATS: Final[dict[str, tuple[str, str, dict[str, str]]]] = {
    "wav": ("wav", "pcm_s16le", {}),
    "flac": ("flac", "flac", {"metadata_header_padding": "0"}),  # no 8 KiB padding block
    "mp3": ("mp3", "libmp3lame", {}),
    "aac": ("adts", "aac", {}),
    "opus": ("ogg", "libopus", {"page_duration": "100000"}),  # µs of audio per Ogg page
}
_S16_CODECS: Final = frozenset({"pcm_s16le", "flac"})
_CONTENT_TYPES: Final = {
    "wav": "audio/wav",
    "pcm": "audio/pcm",
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg; codecs=opus",
    "aac": "audio/aac",
}
FORMATS: Final = tuple(_CONTENT_TYPES)


def audio_of_chunk(chunk: StreamChunk) -> np.ndarray | None:
    """A stream chunk's samples as mono float32 ``[N]`` on the CPU if it is an
    :class:`~omnistage.core.payloads.AudioChunk`, else None (not audio)."""
    if not isinstance(chunk.data, AudioChunk):
        return None
    return np.asarray(chunk.data.samples, dtype=np.float32).reshape(-1)


def content_type(fmt: str) -> str:
    """The HTTP ``Content-Type`` of ``fmt``.

    Raises:
        RequestValidationError: unknown format (``param="response_format"``).
    """
    _check_format(fmt)
    return _CONTENT_TYPES[fmt]


def float_to_s16(samples: np.ndarray) -> np.ndarray:
    """Float PCM -> int16: clip to [-1, 1], times 32767, round to nearest (ties to even).

    NaN counts as 0. Args: ``samples`` any float array. Returns: int16 array, same shape.
    """
    x = _clean(samples)  # a fresh float32 array: scaled and rounded in place
    x *= 32767.0
    return np.rint(x, out=x).astype(np.int16)


def resample(samples: np.ndarray, sample_rate: int, output_rate: int) -> np.ndarray:
    """A whole clip ``sample_rate`` -> ``output_rate`` Hz with the same soxr stream
    :class:`StreamingAudioEncoder` uses, so a streamed response equals the whole file.

    Args: ``samples`` mono float32 ``[N]``. Returns: float32 ``[M]``, M ~ N * out / in.

    Raises:
        ValueError: ``samples`` is not one-dimensional or a rate is not positive.
    """
    return _OutputResampler(sample_rate, output_rate).push(_as_mono(samples, sample_rate), last=True)


def encode_audio(samples: np.ndarray, sample_rate: int, fmt: str) -> bytes:
    """Encode a whole clip into a complete file of format ``fmt``.

    Args:
        samples: mono PCM, float32 [N], nominally in [-1, 1] (values outside are clipped).
        sample_rate: rate of ``samples`` in Hz (``opus`` is resampled to 48 kHz).
        fmt: one of :data:`FORMATS`.

    Returns:
        The file's bytes (``pcm``: raw s16le samples).

    Raises:
        RequestValidationError: unknown ``fmt`` (``param="response_format"``).
        ValueError: ``samples`` is not one-dimensional or ``sample_rate`` is not positive.
    """
    _check_format(fmt)
    x = _as_mono(samples, sample_rate)
    if fmt == "pcm":
        return float_to_s16(x).astype("<i2", copy=False).tobytes()
    out = io.BytesIO()  # seekable: the muxer completes its headers at the end
    _AvEncoder(fmt, sample_rate, out, streaming=False).encode(x, last=True)
    return out.getvalue()


class _OutputResampler:
    """``sample_rate`` -> ``output_rate`` (soxr's stream; a no-op at equal rates)."""

    def __init__(self, sample_rate: int, output_rate: int | None) -> None:
        self.rate = sample_rate if output_rate is None else output_rate
        _as_mono(np.zeros(0, np.float32), self.rate)
        self._stream = (
            soxr.ResampleStream(sample_rate, self.rate, 1, dtype="float32")
            if self.rate != sample_rate
            else None
        )

    def push(self, samples: np.ndarray, *, last: bool) -> np.ndarray:
        if self._stream is None:
            return samples
        return self._stream.resample_chunk(np.ascontiguousarray(samples), last=last)


class StreamingAudioEncoder:
    """Encode audio chunk by chunk; every call returns the bytes ready to send now.

    The concatenation of all returned bytes is a valid stream of format ``fmt`` (see the
    module docstring for how soon each format emits bytes and what a stream lacks).

    Args:
        fmt: one of :data:`FORMATS`.
        sample_rate: rate of the pushed samples in Hz.
        output_rate: Hz to resample to first (None: ``sample_rate``).

    Raises:
        RequestValidationError: unknown ``fmt`` (``param="response_format"``).
        ValueError: ``sample_rate`` or ``output_rate`` is not positive.
    """

    def __init__(self, fmt: str, sample_rate: int, output_rate: int | None = None) -> None:
        _check_format(fmt)
        _as_mono(np.zeros(0, np.float32), sample_rate)
        self.fmt = fmt
        self.sample_rate = sample_rate
        self._resampler = _OutputResampler(sample_rate, output_rate)
        self._sink = _ChunkSink()
        self._encoder = (
            None
            if fmt == "pcm"
            else _AvEncoder(fmt, self._resampler.rate, self._sink, streaming=True)
        )
        self._finished = False

    def push(self, samples: np.ndarray) -> bytes:
        """Encode mono float32 samples [N]; returns the bytes completed so far (maybe b"").

        Raises:
            ValueError: ``samples`` is not one-dimensional.
            RuntimeError: called after :meth:`finish`.
        """
        x = _as_mono(samples, self.sample_rate)
        self._check_open()
        x = self._resampler.push(x, last=False)
        if self._encoder is None:
            return float_to_s16(x).astype("<i2", copy=False).tobytes()
        self._encoder.encode(x, last=False)
        return self._sink.take()

    def finish(self) -> bytes:
        """Flush the encoder and container; returns the last bytes. Call once.

        Raises:
            RuntimeError: called twice.
        """
        self._check_open()
        self._finished = True
        tail = self._resampler.push(np.zeros(0, np.float32), last=True)
        if self._encoder is None:
            return float_to_s16(tail).astype("<i2", copy=False).tobytes()
        self._encoder.encode(tail, last=True)
        return self._sink.take()

    def _check_open(self) -> None:
        if self._finished:
            raise RuntimeError("StreamingAudioEncoder is finished")


class _ChunkSink:
    """Write-only, non-seekable file object for PyAV: collects bytes until taken."""

    def __init__(self) -> None:
        self._chunks: list[bytes] = []

    def write(self, data) -> int:
        self._chunks.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out = b"".join(self._chunks)
        self._chunks.clear()
        return out


class _AvEncoder:
    """One PyAV output container with one mono audio stream, fed float32 chunks."""

    def __init__(self, fmt: str, sample_rate: int, sink, *, streaming: bool) -> None:
        container_format, codec, options = _AV_FORMATS[fmt]
        self.rate = encoded_rate(fmt, sample_rate)
        self._resampler = (
            soxr.ResampleStream(sample_rate, self.rate, 1, dtype="float32")
            if self.rate != sample_rate
            else None
        )
        options = {**options, "fflags": "+bitexact"}  # no encoder-version tags
        if streaming:
            options["flush_packets"] = "1"  # hand every packet to the sink at once
        self._container = av.open(sink, "w", format=container_format, container_options=options)
        self._stream = self._container.add_stream(codec, rate=self.rate, layout="mono")
        self._container.start_encoding()  # header now: an empty clip is still a valid file
        self._s16 = codec in _S16_CODECS

    def encode(self, samples: np.ndarray, *, last: bool) -> None:
        if self._resampler is not None:
            samples = self._resampler.resample_chunk(samples, last=last)
        if len(samples):
            data = float_to_s16(samples) if self._s16 else _clean(samples)
            frame = av.AudioFrame.from_ndarray(
                np.ascontiguousarray(data[None, :]),
                format="s16" if self._s16 else "flt",
                layout="mono",
            )
            frame.sample_rate = self.rate
            self._mux(frame)
        if last:
            self._mux(None)
            self._container.close()

    def _mux(self, frame: av.AudioFrame | None) -> None:
        for packet in self._stream.encode(frame):
            self._container.mux(packet)


def encoded_rate(fmt: str, rate: int) -> int:
    """Hz of the audio a ``fmt`` file holds when it is made from samples at ``rate`` Hz:
    ``opus`` 48 kHz; ``mp3`` and ``aac`` ``rate`` where the codec takes it, else its next
    supported rate above (or its highest); ``wav``, ``pcm`` and ``flac`` ``rate``.

    Raises:
        RequestValidationError: unknown ``fmt`` (``param="response_format"``).
    """
    _check_format(fmt)
    if fmt == "opus":
        return OPUS_SAMPLE_RATE
    if fmt == "pcm":
        return rate
    rates = av.codec.Codec(_AV_FORMATS[fmt][1], "w").audio_rates
    if not rates or rate in rates:
        return rate
    higher = [r for r in rates if r > rate]
    return min(higher) if higher else max(rates)


def _clean(samples: np.ndarray) -> np.ndarray:
    """float32 copy with NaN -> 0 and values clipped to [-1, 1] (+-inf to +-1).

    ``np.clip`` keeps NaN, hence the masked write; it is a third of the cost of
    ``np.nan_to_num`` + clip per streamed chunk, with the same result."""
    x = np.clip(np.asarray(samples, dtype=np.float32), -1.0, 1.0)
    np.copyto(x, 0.0, where=np.isnan(x))
    return x


def _as_mono(samples: np.ndarray, sample_rate: int) -> np.ndarray:
    x = np.asarray(samples, dtype=np.float32)
    if x.ndim != 1:
        raise ValueError(f"expected mono samples of shape [N], got shape {x.shape}")
    if not isinstance(sample_rate, int | np.integer) or sample_rate <= 0:
        raise ValueError(f"sample_rate must be a positive int (Hz), got {sample_rate!r}")
    return x


def _check_format(fmt: str) -> None:
    if fmt not in _CONTENT_TYPES:
        raise RequestValidationError(
            f"unsupported response_format {fmt!r}; supported: {', '.join(FORMATS)}",
            param="response_format",
        )
