"""A fuzz corpus of audio files for the reference-audio decoder (issue 12).

``python -m omnistage.testing.media_corpus OUT_DIR`` writes it (deterministic, ~45 MB,
a few seconds); tests call :func:`write_corpus`. It holds:

- ``grid``: 16-bit WAV, channel counts 1..64 x sample rates 8..96 kHz;
- ``codec``: every audio encoder this PyAV build can open (with one of its own rates,
  formats and layouts), muxed into the first of Matroska, NUT, WAV, CAF, MOV that takes it;
- ``mux``: a tone in every common container PyAV writes (its default audio codec);
- ``cut``: valid files truncated (header only, 10 %, 50 %, all but one byte);
- ``junk``: garbage: random bytes, zeros, container magic numbers before noise;
- ``header``: WAV headers lying about channels, rate, bit depth and sizes.

Each file is a plain ``<group>-<name>.<ext>``; what a decoder must do with each one is
only "answer, never crash": accept it, or refuse it naming the field.
"""

from __future__ import annotations

import argparse
import fractions
import io
import struct
import sys
from collections.abc import Iterator
from pathlib import Path

import av
import numpy as np

__all__ = ["write_corpus"]

CHANNELS = (1, 2, 3, 6, 8, 9, 16, 33, 64)
RATES = (8000, 11025, 16000, 22050, 44100, 48000, 96000)
GRID_SECONDS = 0.6  # over the 0.5 s minimum of a Qwen3-TTS reference
CODEC_SECONDS = 0.7
#: container -> file extension, for the ``mux`` group
CONTAINERS = {
    "wav": "wav", "flac": "flac", "mp3": "mp3", "ogg": "ogg", "opus": "opus", "adts": "aac",
    "mp4": "m4a", "mov": "mov", "matroska": "mka", "webm": "webm", "aiff": "aiff", "au": "au",
    "caf": "caf", "w64": "w64", "wv": "wv", "ac3": "ac3", "mp2": "mp2", "tta": "tta", "asf": "wma",
    "avi": "avi", "nut": "nut", "voc": "voc", "amr": "amr", "g722": "g722", "sox": "sox",
}  # fmt: skip


#: containers tried in turn for each encoder (NUT and Matroska carry almost any codec)
CODEC_CONTAINERS = (
    ("matroska", "mka"),
    ("nut", "nut"),
    ("wav", "wav"),
    ("caf", "caf"),
    ("mov", "mov"),
)


def _tone(seconds: float, rate: int, channels: int) -> np.ndarray:
    """[S, channels] float32: a 220 Hz tone, each channel at its own level."""
    t = np.arange(int(seconds * rate)) / rate
    mono = 0.4 * np.sin(2 * np.pi * 220 * t)
    levels = np.linspace(1.0, 0.2, channels)
    return (mono[:, None] * levels[None, :]).astype(np.float32)


def _wav(samples: np.ndarray, rate: int) -> bytes:
    pcm = (np.clip(samples, -1, 1) * 32767).astype("<i2")
    channels = samples.shape[1]
    header = struct.pack(
        "<4sI4s4sIHHIIHH4sI", b"RIFF", 36 + pcm.nbytes, b"WAVE", b"fmt ", 16, 1, channels,
        rate, rate * channels * 2, channels * 2, 16, b"data", pcm.nbytes,
    )  # fmt: skip
    return header + pcm.tobytes()


def _encode(container_format: str, codec_name: str | None, rate: int, layout: str | None) -> bytes:
    """A tone encoded by PyAV; raises whatever PyAV raises for an unusable combination."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container_format) as container:
        if codec_name is None:
            codec_name = container.default_audio_codec
        codec = av.Codec(codec_name, "w")
        rate = _supported(codec.audio_rates, rate)
        stream = container.add_stream(codec_name, rate=rate)
        if layout is not None:
            stream.layout = layout
        formats = [f.name for f in codec.audio_formats or ()]
        if formats:
            stream.format = "fltp" if "fltp" in formats else formats[0]
        stream.codec_context.options = {"strict": "experimental"}  # opus, ... too
        samples = _tone(CODEC_SECONDS, rate, stream.layout.nb_channels).T.copy()
        frame_size = stream.codec_context.frame_size or 1024
        for start in range(0, samples.shape[1], frame_size):
            chunk = np.ascontiguousarray(samples[:, start : start + frame_size])
            frame = av.AudioFrame.from_ndarray(
                chunk.T.reshape(1, -1).copy(), format="flt", layout=stream.layout.name
            )
            frame.sample_rate, frame.pts = rate, start
            frame.time_base = fractions.Fraction(1, rate)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode(None):
            container.mux(packet)
    return buffer.getvalue()


def _supported(rates, wanted: int) -> int:
    if not rates:
        return wanted
    return min(rates, key=lambda r: abs(r - wanted))


def _grid() -> Iterator[tuple[str, bytes]]:
    for channels in CHANNELS:
        for rate in RATES:
            yield f"grid-{channels}ch-{rate}hz.wav", _wav(_tone(GRID_SECONDS, rate, channels), rate)


def _codecs() -> Iterator[tuple[str, bytes]]:
    for name in sorted(av.codecs_available):
        try:
            codec = av.Codec(name, "w")
        except (ValueError, av.FFmpegError):
            continue  # a decoder only
        if codec.type != "audio":
            continue
        encoded = _first_that_works(
            (
                (fmt, ext, layout)
                for fmt, ext in CODEC_CONTAINERS
                for layout in ("stereo", "mono", None)
            ),
            lambda fmt, ext, layout, name=name: (ext, _encode(fmt, name, 16000, layout)),
        )
        if encoded is not None:
            yield f"codec-{name}.{encoded[0]}", encoded[1]


def _first_that_works(options, make):
    """``make(*option)`` for the first option PyAV accepts (None if it takes none)."""
    for option in options:
        try:
            return make(*option)
        except (ValueError, av.FFmpegError, TypeError, NotImplementedError):
            continue  # this encoder cannot take this layout, or the container this codec
    return None


def _containers() -> Iterator[tuple[str, bytes]]:
    for fmt, ext in CONTAINERS.items():
        data = _first_that_works(
            [("stereo",), ("mono",)], lambda layout, fmt=fmt: _encode(fmt, None, 44100, layout)
        )
        if data is not None:
            yield f"mux-{fmt}.{ext}", data


def _cuts(valid: dict[str, bytes]) -> Iterator[tuple[str, bytes]]:
    for name in ("mux-wav.wav", "mux-flac.flac", "mux-mp3.mp3", "mux-ogg.ogg", "mux-mp4.m4a"):
        data = valid.get(name)
        if data is None:
            continue
        stem = name.removeprefix("mux-")
        for label, size in (("header", 44), ("10pct", len(data) // 10), ("half", len(data) // 2), ("last", len(data) - 1)):  # fmt: skip
            yield f"cut-{label}-{stem}", data[:size]


def _junk() -> Iterator[tuple[str, bytes]]:
    rng = np.random.default_rng(12)
    noise = rng.integers(0, 256, 64 * 1024, dtype=np.uint8).tobytes()
    yield "junk-random.bin", noise
    yield "junk-zeros.bin", bytes(64 * 1024)
    yield "junk-one-byte.bin", b"\x00"
    for magic, ext in ((b"RIFF\xff\xff\xff\xffWAVE", "wav"), (b"fLaC", "flac"), (b"OggS\x00\x02", "ogg"),
                       (b"ID3\x04\x00\x00\x00\x00\x00\x00", "mp3"), (b"\x00\x00\x00\x20ftypM4A ", "m4a"),
                       (b"\x1aE\xdf\xa3", "mka"), (b"\xff\xf1", "aac")):  # fmt: skip
        yield f"junk-magic.{ext}", magic + noise


def _lying_wav(
    channels: int, rate: int, bits: int, data_size: int, riff_size: int | None = None
) -> bytes:
    block = max(channels * bits // 8, 0) & 0xFFFF
    body = struct.pack(
        "<4sI4s4sIHHIIHH4sI", b"RIFF", riff_size if riff_size is not None else 0xFFFFFFFF, b"WAVE",
        b"fmt ", 16, 1, channels & 0xFFFF, rate & 0xFFFFFFFF, (rate * block) & 0xFFFFFFFF, block,
        bits & 0xFFFF, b"data", data_size & 0xFFFFFFFF,
    )  # fmt: skip
    return body + bytes(4096)


def _headers() -> Iterator[tuple[str, bytes]]:
    yield "header-65535ch.wav", _lying_wav(65535, 16000, 16, 4096)
    yield "header-0ch.wav", _lying_wav(0, 16000, 16, 4096)
    yield "header-rate-4ghz.wav", _lying_wav(1, 0xFFFFFFFF, 16, 4096)
    yield "header-rate-0.wav", _lying_wav(1, 0, 16, 4096)
    yield "header-rate-1hz.wav", _lying_wav(1, 1, 16, 4096)
    yield "header-bits-0.wav", _lying_wav(1, 16000, 0, 4096)
    yield "header-bits-65535.wav", _lying_wav(1, 16000, 65535, 4096)
    yield "header-data-4gb.wav", _lying_wav(2, 16000, 16, 0xFFFFFFFF)
    yield "header-riff-tiny.wav", _lying_wav(2, 16000, 16, 4096, riff_size=4)
    chunk = struct.pack("<4sI", b"LIST", 0xFFFFFFF0)
    yield "header-huge-chunk.wav", b"RIFF\xff\xff\xff\xffWAVE" + chunk + bytes(1024)


def write_corpus(out_dir: Path) -> list[Path]:
    """Write the corpus into ``out_dir`` (created); returns the files, sorted by name."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files: dict[str, bytes] = {}
    for group in (_grid(), _codecs(), _containers()):
        files.update(group)
    files.update(_cuts(files))
    files.update(_junk())
    files.update(_headers())
    paths = []
    for name, data in sorted(files.items()):
        path = out_dir / name
        path.write_bytes(data)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    paths = write_corpus(args.out_dir)
    groups: dict[str, int] = {}
    for path in paths:
        groups[path.name.split("-")[0]] = groups.get(path.name.split("-")[0], 0) + 1
    print(f"{len(paths)} files in {args.out_dir}: {groups}", file=sys.stderr)


if __name__ == "__main__":
    main()
