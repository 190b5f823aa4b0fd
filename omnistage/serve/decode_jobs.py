"""The messages between the server and its media decoder workers (msgpack via msgspec).

A job is one untrusted media item to decode; each kind of media is one job type, and the
worker answers with that kind's result or with :class:`DecodeRefused`. Only this module
and the standard library are imported by both sides, so a worker stays small (no torch).

Frames on the pipes: a 4-byte big-endian length, then the msgpack body.
"""

from __future__ import annotations

import struct
from typing import Final, Literal

import msgspec

__all__ = [
    "AudioDecodeJob",
    "NotBase64",
    "DecodedImage",
    "ImageDecodeJob",
    "DecodeJob",
    "DecodeRefused",
    "DecodeReply",
    "DecodedAudio",
    "DecodedVideo",
    "VideoDecodeJob",
    "FRAME_HEADER",
    "FrameSampling",
    "decode_frame",
    "encode_frame",
]

FRAME_HEADER: Final = struct.Struct(">I")

#: How a job's ``data`` holds the file: ``"raw"``, its bytes; ``"base64"``, standard padded
#: base64 of them (ASCII, no whitespace), which the worker decodes first (validating the
#: alphabet and the padding, :func:`base64.b64decode` ``validate=True``) and answers
#: :class:`NotBase64` when it does not decode. Inline media are sent as base64: decoding
#: 1.2 MB of it held the server's GIL 2.2-3.5 ms (issue 17).
Encoding = Literal["raw", "base64"]


class AudioDecodeJob(msgspec.Struct, tag="audio", frozen=True):
    """Decode one audio file (any container/codec FFmpeg reads) to mono float32.

    Attributes:
        data: the encoded file's bytes.
        max_duration_s: refuse (``too_large``) audio longer than this, seconds; checked
            while decoding, so a long file stops early.
        memory_bytes: address space the job may add to the worker's (RLIMIT_AS), bytes.
        encoding: how ``data`` holds the file (:data:`Encoding`).
        containers: FFmpeg demuxer names (``av.container.format.name``: ``"wav"``,
            ``"mp3"``, ...) the file must be read by, checked when it is opened, before any
            sample is decoded; empty: any. Another is refused with its name in
            :attr:`DecodeRefused.container` (the request declared another format).
    """

    data: bytes
    max_duration_s: float
    memory_bytes: int
    encoding: Encoding = "raw"
    containers: tuple[str, ...] = ()


class DecodedAudio(msgspec.Struct, tag="audio", frozen=True):
    """Mono audio: ``samples`` little-endian float32 ``[N]`` in [-1, 1] at ``sample_rate`` Hz."""

    samples: bytes
    sample_rate: int


class ImageDecodeJob(msgspec.Struct, tag="image", frozen=True):
    """Decode one image (any format Pillow reads; the first frame of an animation) to RGB.

    Attributes:
        data: the encoded file's bytes.
        max_pixels: refuse (``too_large``) an image of more pixels than this, checked from
            its header before the pixels are decoded (a decompression bomb stops there).
        memory_bytes: address space the job may add to the worker's (RLIMIT_AS), bytes.
        encoding: how ``data`` holds the file (:data:`Encoding`).
    """

    data: bytes
    max_pixels: int
    memory_bytes: int
    encoding: Encoding = "raw"


class DecodedImage(msgspec.Struct, tag="image", frozen=True):
    """``rgb``: ``[height, width, 3]`` uint8, row-major."""

    rgb: bytes
    width: int
    height: int


class FrameSampling(msgspec.Struct, frozen=True):
    """Which frames of a video a :class:`VideoDecodeJob` keeps, and its caps.

    ``count = total / rate * fps`` clamped to ``[ceil(min_frames / frame_factor) *
    frame_factor, floor(min(max_frames, total) / frame_factor) * frame_factor]`` and rounded
    down to a multiple of ``frame_factor`` (at least one multiple), at indices
    ``round(linspace(0, total - 1, count))`` (half to even): Qwen-VL's sampling.

    Attributes:
        fps: frames kept per second of video.
        min_frames, max_frames, frame_factor: the count's bounds and multiple.
        max_frames_decoded: refuse (``too_large``) a video of more frames than this.
        max_duration_s: refuse (``too_large``) a video longer than this (frames / rate), s.
    """

    fps: float
    min_frames: int
    max_frames: int
    frame_factor: int
    max_frames_decoded: int
    max_duration_s: float


class VideoDecodeJob(msgspec.Struct, tag="video", frozen=True):
    """Decode one video's first video stream (any container/codec FFmpeg reads) and keep
    the RGB frames ``sampling`` picks.

    Attributes:
        data: the encoded file's bytes.
        sampling: which frames are kept, and the frame and duration caps.
        max_pixels: refuse (``too_large``) frames of more pixels than this (the stream's
            declared size is checked before decoding, each frame's too).
        memory_bytes: address space the job may add to the worker's (RLIMIT_AS), bytes.
    """

    data: bytes
    sampling: FrameSampling
    max_pixels: int
    memory_bytes: int


class DecodedVideo(msgspec.Struct, tag="video", frozen=True):
    """``frames``: ``[count, height, width, 3]`` uint8 RGB, row-major; ``fps``: frames per
    second of the kept sequence (the stream's rate x count / total)."""

    frames: bytes
    count: int
    width: int
    height: int
    fps: float


class DecodeRefused(msgspec.Struct, tag="refused", frozen=True):
    """The worker could not decode the input (a client error): ``reason`` says why;
    ``too_large`` marks a cap (duration) rather than a malformed input; ``out_of_memory``
    a job that ran out of its memory limit, after which the decoder libraries may be in any
    state (a failed allocation inside FFmpeg or PyAV), so the pool retires that worker;
    ``container`` the FFmpeg demuxer name of a file that is none of an
    :class:`AudioDecodeJob`'s ``containers``."""

    reason: str
    too_large: bool = False
    out_of_memory: bool = False
    container: str = ""


class NotBase64(msgspec.Struct, tag="not_base64", frozen=True):
    """A job's ``data`` was sent as base64 (``encoding="base64"``) and is not valid base64
    (a client error)."""


#: Every job kind.
DecodeJob = AudioDecodeJob | ImageDecodeJob | VideoDecodeJob
#: Every reply kind.
DecodeReply = DecodedAudio | DecodedImage | DecodedVideo | DecodeRefused | NotBase64

_encoder = msgspec.msgpack.Encoder()


def encode_frame(message: DecodeJob | DecodeReply) -> bytearray:
    """One frame: length header + msgpack body (encoded after the header's room: no copy of
    a body of a megabyte or more)."""
    frame = bytearray(FRAME_HEADER.size)
    _encoder.encode_into(message, frame, FRAME_HEADER.size)
    FRAME_HEADER.pack_into(frame, 0, len(frame) - FRAME_HEADER.size)
    return frame


def decode_frame(body: bytes, kind: type) -> DecodeJob | DecodeReply:
    """Decode a frame body as ``kind`` (a job or reply union); raises ``msgspec.DecodeError``."""
    return msgspec.msgpack.decode(body, type=kind)
