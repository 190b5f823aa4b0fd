"""A media decoder worker process: ``python -m omnistage.serve.decode_worker``.

It reads jobs (:mod:`omnistage.serve.decode_jobs`) from stdin and writes one reply per
job to stdout, until stdin closes (the server is gone). Untrusted bytes meet FFmpeg only
here: a codec that crashes or runs away takes this process down, never the server (the
pool in :mod:`omnistage.serve.decoding` kills it at the job's deadline, answers 400 and
starts another). Each job runs under an address-space limit (RLIMIT_AS) of the worker's
own size plus the job's ``memory_bytes``, so an allocation bomb fails here as well.
"""

from __future__ import annotations

import base64
import binascii
import io
import itertools
import math
import os
import resource
import sys

import av
import msgspec
import numpy as np
from PIL import Image

from omnistage.serve.decode_jobs import (
    FRAME_HEADER,
    AudioDecodeJob,
    DecodedAudio,
    DecodedImage,
    DecodedVideo,
    DecodeJob,
    DecodeRefused,
    DecodeReply,
    ImageDecodeJob,
    NotBase64,
    VideoDecodeJob,
    decode_frame,
    encode_frame,
)

#: Pillow's own decompression-bomb limit is off: each job's ``max_pixels`` is the cap,
#: checked on the header's size (:func:`decode_image`). Pillow's refused any image above
#: 2 x 89.5 M pixels before that check (a 400 "could not be decoded" for what is a 413), and
#: would refuse images a policy with a larger cap allows.
Image.MAX_IMAGE_PIXELS = None


class _TooLong(Exception):
    pass


#: Bytes FFmpeg's stream analysis (``avformat_find_stream_info``, the ``probesize`` option)
#: may read when an audio file is opened, instead of FFmpeg's default 5,000,000. The first
#: audio stream's frames carry their own rate and layout, so nothing of what that analysis
#: would add is used; and for PCM WAV it read the whole file: 5.3 of the 5.5 ms a 3 s 24 kHz
#: clip took to open and decode on the CPU host (0.25 ms at 4096; ``benchmarks/host_cost.py
#: --prepare``, fresh data URI). The container's format is still probed on FFmpeg's own
#: budget (``formatprobesize``). Every file of the decoder's fuzz corpus decodes to the same
#: samples as with the default (``tests/serve/test_media_fuzz.py``).
AUDIO_PROBE_BYTES = 4096


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
        options = {"probesize": str(AUDIO_PROBE_BYTES)}
        with av.open(io.BytesIO(job.data), "r", container_options=options) as container:
            name = container.format.name
            if job.containers and name not in job.containers:
                return DecodeRefused(f"is a {container.format.long_name} file ({name})", container=name)
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
            # a mono frame is its own mean (the same float32 values, without the reduction)
            chunks.append(interleaved[:, 0] if interleaved.shape[1] == 1 else interleaved.mean(axis=1, dtype=np.float32))
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
            converted = image.convert("RGB")
            image.close()  # frees the decoded pixels before the RGB bytes are made
            rgb = converted.tobytes()
            del converted
    except MemoryError:
        raise
    except Exception as exc:  # untrusted bytes: any decoder failure is a client error
        return DecodeRefused(f"{type(exc).__name__}: {exc}")
    if not rgb:
        return DecodeRefused("has no pixels")
    return DecodedImage(rgb, width, height)


def decode_video(job: VideoDecodeJob) -> DecodeReply:
    """Decode ``job.data``'s first video stream and keep the frames the job samples (see
    :class:`~omnistage.serve.decode_jobs.FrameSampling`): two passes, counting then keeping only the sampled frames as
    RGB, so memory is bounded by the kept frames, not by the video's length."""
    try:
        total, rate = _video_frames(job, keep=None)[1:]
        sampling = job.sampling
        factor = sampling.frame_factor
        if total < factor:
            return DecodeRefused(f"has {total} video frame(s); at least {factor} are needed")
        low = math.ceil(sampling.min_frames / factor) * factor
        high = math.floor(min(sampling.max_frames, total) / factor) * factor
        count = max(factor, math.floor(min(max(total / rate * sampling.fps, low), high, total) / factor) * factor)
        index = np.round(np.linspace(0, total - 1, count)).astype(np.int64).tolist()
        kept = _video_frames(job, keep=set(index))[0]
    except _Refused as refused:
        return refused.reply
    except MemoryError:
        raise
    except Exception as exc:  # untrusted bytes: any decoder failure is a client error
        return DecodeRefused(f"{type(exc).__name__}: {exc}")
    frames = np.ascontiguousarray(np.stack([kept[i] for i in index]), dtype=np.uint8)
    return DecodedVideo(frames.tobytes(), count, int(frames.shape[2]), int(frames.shape[1]), count / total * rate)


class _Refused(Exception):
    def __init__(self, reply: DecodeRefused) -> None:
        self.reply = reply


def _video_frames(job: VideoDecodeJob, keep: set[int] | None) -> tuple[dict[int, np.ndarray], int, float]:
    """``(RGB frames at the indices in keep, frames in the stream, frame rate)``; raises
    :class:`_Refused` on a cap or a stream without video or frame rate."""
    frames: dict[int, np.ndarray] = {}
    count = 0
    with av.open(io.BytesIO(job.data), "r") as container:
        if not container.streams.video:
            raise _Refused(DecodeRefused("contains no video stream"))
        stream = container.streams.video[0]
        rate = float(stream.average_rate or stream.guessed_rate or 0)
        if rate <= 0:
            raise _Refused(DecodeRefused("declares no frame rate"))
        width, height = stream.codec_context.width, stream.codec_context.height
        if width * height > job.max_pixels:
            raise _Refused(DecodeRefused(
                f"has {width}x{height} pixel frames; the limit is {job.max_pixels} pixels", too_large=True
            ))  # fmt: skip
        for frame in container.decode(stream):
            if count == job.sampling.max_frames_decoded:
                raise _Refused(DecodeRefused(f"has more than {job.sampling.max_frames_decoded} video frames", too_large=True))
            if count + 1 > job.sampling.max_duration_s * rate:
                raise _Refused(DecodeRefused(f"is longer than the limit of {job.sampling.max_duration_s:g} s", too_large=True))
            if frame.width * frame.height > job.max_pixels:
                raise _Refused(DecodeRefused(
                    f"has {frame.width}x{frame.height} pixel frames; the limit is {job.max_pixels} pixels", too_large=True
                ))  # fmt: skip
            if keep is not None and count in keep:
                frames[count] = frame.to_ndarray(format="rgb24")
            count += 1
    return frames, count, rate


_DECODERS = {AudioDecodeJob: decode_audio, ImageDecodeJob: decode_image, VideoDecodeJob: decode_video}


def _address_space_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def run_job(job: DecodeJob) -> DecodeReply:
    """Run one job under its memory limit (the soft RLIMIT_AS, restored afterwards); a job
    sent as base64 is decoded from it first (:class:`NotBase64` when it does not decode)."""
    if isinstance(job, AudioDecodeJob | ImageDecodeJob) and job.encoding == "base64":
        try:
            job = msgspec.structs.replace(job, data=base64.b64decode(job.data, validate=True), encoding="raw")
        except (binascii.Error, ValueError):
            return NotBase64()
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _address_space_bytes() + job.memory_bytes
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        return _DECODERS[type(job)](job)
    except MemoryError:
        reason = f"needs more than the {job.memory_bytes} bytes of memory a decode may use"
        return DecodeRefused(reason, out_of_memory=True)
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
