"""A media decoder worker process: ``python -m omnistage.serve.decode_worker``.

It reads jobs (:mod:`omnistage.serve.decode_jobs`) from stdin and writes one reply per
job to stdout, until stdin closes (the server is gone). Untrusted bytes meet FFmpeg only
here: a codec that crashes or runs away takes this process down, never the server (the
pool in :mod:`omnistage.serve.decoding` kills it at the job's deadline, answers 400 and
starts another). Each job runs under an address-space limit (RLIMIT_AS) of the worker's
own size plus the job's ``memory_bytes``, so an allocation bomb fails here as well.
"""

from __future__ import annotations

import io
import itertools
import os
import resource
import sys

import av
import numpy as np
from PIL import Image

from omnistage.serve.decode_jobs import (
    FRAME_HEADER,
    AudioDecodeJob,
    DecodedAudio,
    DecodedImage,
    DecodeJob,
    DecodeRefused,
    DecodeReply,
    ImageDecodeJob,
    decode_frame,
    encode_frame,
)


class _TooLong(Exception):
    pass


def decode_audio(job: AudioDecodeJob) -> DecodeReply:
    """Decode ``job.data`` to mono float32 at the file's own rate (see :class:`DecodedAudio`).

    Sample formats and layouts are converted by FFmpeg's resampler (libswresample) to
    packed float32, keeping the channels: one data plane whatever the channel count
    (PyAV's planar to_ndarray reads past 8 plane pointers: a segfault, issue 12). The
    channels are then averaged, as the reference front end does (librosa's ``to_mono``):
    swresample's own mono downmix is not used because for layouts without channel
    positions (WAVs without a channel mask) it sums unnormalized (stereo 0.05/0.9 gives
    0.67, above the mean) and it refuses more than 8 such channels.
    """
    try:
        with av.open(io.BytesIO(job.data), "r") as container:
            if not container.streams.audio:
                return DecodeRefused("contains no audio stream")
            chunks, rate = _decode_mono(container, job.max_duration_s)
    except _TooLong:
        return DecodeRefused(
            f"is longer than the limit of {job.max_duration_s} s", too_large=True
        )
    except MemoryError:
        raise
    except Exception as exc:  # untrusted bytes: any decoder failure is a client error
        return DecodeRefused(f"{type(exc).__name__}: {exc}")
    if not chunks or not rate:
        return DecodeRefused("contains no audio samples")
    samples = np.concatenate(chunks).astype("<f4", copy=False)
    if len(samples) == 0:
        return DecodeRefused("contains no audio samples")
    return DecodedAudio(samples.tobytes(), int(rate))


def _decode_mono(container, max_duration_s: float) -> tuple[list[np.ndarray], int]:
    to_float = av.AudioResampler(format="flt")
    chunks: list[np.ndarray] = []
    total, rate = 0, 0
    frames = container.decode(container.streams.audio[0])
    for frame in itertools.chain(frames, [None]):  # None flushes the converter
        for out in to_float.resample(frame):
            rate = out.sample_rate
            interleaved = out.to_ndarray().reshape(out.samples, out.layout.nb_channels)
            chunks.append(interleaved.mean(axis=1, dtype=np.float32))
            total += out.samples
            if total > max_duration_s * rate:
                raise _TooLong
    return chunks, rate


def decode_image(job: ImageDecodeJob) -> DecodeReply:
    """Decode ``job.data`` to RGB (see :class:`DecodedImage`); the pixel cap is checked on
    the header's size before any pixel is decoded."""
    try:
        with Image.open(io.BytesIO(job.data)) as image:
            width, height = image.size
            if width * height > job.max_pixels:
                return DecodeRefused(
                    f"is {width}x{height} pixels; the limit is {job.max_pixels} pixels", too_large=True
                )
            rgb = np.asarray(image.convert("RGB"), dtype=np.uint8)
    except MemoryError:
        raise
    except Exception as exc:  # untrusted bytes: any decoder failure is a client error
        return DecodeRefused(f"{type(exc).__name__}: {exc}")
    if rgb.size == 0:
        return DecodeRefused("has no pixels")
    return DecodedImage(np.ascontiguousarray(rgb).tobytes(), int(rgb.shape[1]), int(rgb.shape[0]))


_DECODERS = {AudioDecodeJob: decode_audio, ImageDecodeJob: decode_image}


def _address_space_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def run_job(job: DecodeJob) -> DecodeReply:
    """Run one job under its memory limit (the soft RLIMIT_AS, restored afterwards)."""
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _address_space_bytes() + job.memory_bytes
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        return _DECODERS[type(job)](job)
    except MemoryError:
        return DecodeRefused(
            f"needs more than the {job.memory_bytes} bytes of memory a decode may use"
        )
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (hard, hard))


def _read_exactly(stream, size: int) -> bytes | None:
    data = stream.read(size)
    return data if len(data) == size else None


def main() -> None:
    """Serve jobs from stdin until it closes."""
    jobs, replies = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but replies may reach the reply pipe
    while (header := _read_exactly(jobs, FRAME_HEADER.size)) is not None:
        body = _read_exactly(jobs, FRAME_HEADER.unpack(header)[0])
        if body is None:
            return
        reply = run_job(decode_frame(body, DecodeJob))
        replies.write(encode_frame(reply))
        replies.flush()


if __name__ == "__main__":
    main()
