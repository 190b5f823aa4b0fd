"""The media decoder pool: a worker that dies, hangs or runs out of memory fails only its
own job (a 400 naming the field), is replaced, and never takes the server process down."""

from __future__ import annotations

import base64
import fcntl
import io
import logging
import os
import signal
import threading
import time

import av
import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from omnistage.core.errors import RequestValidationError
from omnistage.serve.decode_jobs import (
    AudioDecodeJob,
    DecodedAudio,
    DecodedImage,
    DecodedVideo,
    DecodeRefused,
    FrameSampling,
    ImageDecodeJob,
    NotBase64,
    VideoDecodeJob,
)
from omnistage.serve.decoding import (
    PIPE_BYTES,
    DecoderCrashed,
    DecoderPool,
    DecoderTimeout,
    request_id_var,
    shared_pool,
)
from omnistage.serve.media import MediaPolicy, load_reference_audio
from omnistage.testing.waits import wait_until

RATE = 16000


def wav(seconds: float = 0.5, channels: int = 1) -> bytes:
    t = np.arange(int(seconds * RATE)) / RATE
    mono = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    buf = io.BytesIO()
    sf.write(buf, np.tile(mono[:, None], (1, channels)), RATE, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def job(data: bytes, memory_bytes: int = 256 << 20) -> AudioDecodeJob:
    return AudioDecodeJob(data, max_duration_s=60.0, memory_bytes=memory_bytes)


@pytest.fixture
def pool():
    pool = DecoderPool(size=1)
    yield pool
    pool.close()


def test_a_job_decodes_to_mono_float32(pool):
    reply = pool.run(job(wav(channels=3)), timeout_s=30)
    assert isinstance(reply, DecodedAudio) and reply.sample_rate == RATE
    samples = np.frombuffer(reply.samples, "<f4")
    assert samples.shape == (RATE // 2,) and 0.49 < np.abs(samples).max() < 0.51


def test_a_grown_pool_runs_more_workers_and_never_shrinks(pool):
    pool.grow(3)
    pool.start()
    assert pool.size == 3 and len(pool.pids) == 3
    pool.grow(2)
    assert pool.size == 3 and len(pool.pids) == 3
    with pytest.raises(ValueError, match="at least one worker"):
        pool.grow(0)
    replies = []
    threads = [threading.Thread(target=lambda: replies.append(pool.run(job(wav()), timeout_s=30))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(replies) == 3 and all(isinstance(r, DecodedAudio) for r in replies)
    assert len(pool.pids) == 3


def test_a_media_policy_sizes_the_shared_pool():
    load_reference_audio(base64.b64encode(wav()).decode(), MediaPolicy(decode_workers=5), "ref_audio")
    assert shared_pool().size >= 5


def test_garbage_is_refused_by_the_worker_not_crashing_it(pool):
    reply = pool.run(job(b"\x00garbage" * 100), timeout_s=30)
    assert isinstance(reply, DecodeRefused) and not reply.too_large
    assert isinstance(pool.run(job(wav()), timeout_s=30), DecodedAudio)


def test_a_worker_killed_mid_job_fails_only_that_job_and_is_replaced(pool, caplog):
    pool.start()
    (pid,) = pool.pids
    os.kill(pid, signal.SIGSTOP)  # holds the job in flight until the kill below
    outcome: list[BaseException] = []

    def decode() -> None:
        token = request_id_var.set("req-killed")
        try:
            pool.run(job(wav()), timeout_s=30)
        except DecoderCrashed as exc:
            outcome.append(exc)
        finally:
            request_id_var.reset(token)

    with caplog.at_level(logging.ERROR, logger="omnistage.serve.decoding"):
        thread = threading.Thread(target=decode)
        thread.start()
        wait_until(lambda: pool.jobs_in_flight == 1)
        os.kill(pid, signal.SIGKILL)
        thread.join(30)
    assert len(outcome) == 1 and "SIGKILL" in str(outcome[0])
    assert "req-killed" in caplog.text and str(pid) in caplog.text
    assert isinstance(pool.run(job(wav()), timeout_s=30), DecodedAudio)
    assert pool.pids and pool.pids != [pid]


def test_a_job_past_its_deadline_kills_the_worker(pool):
    pool.start()
    (pid,) = pool.pids
    os.kill(pid, signal.SIGSTOP)  # a decoder that never answers
    started = time.monotonic()
    with pytest.raises(DecoderTimeout):
        pool.run(job(wav()), timeout_s=0.3)
    assert time.monotonic() - started < 5
    wait_until(lambda: pid not in pool.pids)
    assert isinstance(pool.run(job(wav()), timeout_s=30), DecodedAudio)


def test_a_job_over_its_memory_limit_is_refused_and_its_worker_retired(pool):
    """Refused, and the worker replaced: an allocation that failed inside FFmpeg or PyAV may
    leave them broken (the next job on that worker was seen to segfault), so the next job
    runs on a new worker and decodes."""
    # 50 s at 16 kHz: 3.2 MB of float32 samples per copy, well over the 1 MiB the job may add
    # (a 10 s clip's 0.64 MB could fit in what the worker's heap had free once the decoder's
    # stream analysis stopped reading the whole file: decode_worker.AUDIO_PROBE_BYTES)
    reply = pool.run(job(wav(seconds=50.0), memory_bytes=1 << 20), timeout_s=30)
    assert isinstance(reply, DecodeRefused) and reply.out_of_memory and not reply.too_large
    assert pool.pids == []
    assert isinstance(pool.run(job(wav()), timeout_s=30), DecodedAudio)
    assert len(pool.pids) == 1


def test_a_worker_that_died_idle_is_replaced_without_failing_the_job(pool):
    pool.start()
    (pid,) = pool.pids
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: pid not in pool.pids)
    assert isinstance(pool.run(job(wav()), timeout_s=30), DecodedAudio)


def test_load_reference_audio_turns_a_timeout_into_a_400_naming_the_field():
    data = base64.b64encode(wav(seconds=0.37)).decode()  # a clip no other test decodes (cache)
    with pytest.raises(RequestValidationError) as err:
        load_reference_audio(data, MediaPolicy(decode_timeout_s=1e-6), "speaker_audio")
    assert err.value.http_status == 400 and err.value.param == "speaker_audio"
    assert "could not be decoded" in str(err.value)


def mp4(frames: int, rate: int, width: int = 64, height: int = 48) -> bytes:
    """A video whose frame ``i`` is all gray level ``16 * i``."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            pixels = np.full((height, width, 3), 16 * i, dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())
    return buffer.getvalue()


def video_job(data: bytes, max_pixels: int = 1 << 20, **caps) -> VideoDecodeJob:
    fields = {"fps": 2.0, "min_frames": 4, "max_frames": 768, "frame_factor": 2, "max_frames_decoded": 1000,
              "max_duration_s": 60.0, **caps}  # fmt: skip
    return VideoDecodeJob(data, FrameSampling(**fields), max_pixels, memory_bytes=256 << 20)


def test_a_video_job_keeps_the_sampled_frames_and_refuses_over_its_caps(pool):
    reply = pool.run(video_job(mp4(12, 2)), timeout_s=30)  # 6 s at 2 fps: every frame kept
    assert isinstance(reply, DecodedVideo) and (reply.count, reply.height, reply.width) == (12, 48, 64)
    assert reply.fps == pytest.approx(2.0)
    frames = np.frombuffer(reply.frames, np.uint8).reshape(12, 48, 64, 3)
    assert np.all(np.diff(frames[:, 24, 32, 0].astype(int)) > 8)  # in order, one per frame
    halved = pool.run(video_job(mp4(12, 4)), timeout_s=30)  # 3 s at 4 fps: 6 of 12 frames
    assert isinstance(halved, DecodedVideo) and halved.count == 6 and halved.fps == pytest.approx(2.0)
    for caps, reason in (({"max_frames_decoded": 10}, "more than 10 video frames"),
                         ({"max_duration_s": 5.0}, "longer than the limit of 5 s"),
                         ({"max_pixels": 64 * 47}, "64x48 pixel frames")):  # fmt: skip
        refused = pool.run(video_job(mp4(12, 2), **caps), timeout_s=30)
        assert isinstance(refused, DecodeRefused) and refused.too_large and reason in refused.reason
    garbage = pool.run(video_job(b"\x00garbage" * 100), timeout_s=30)
    assert isinstance(garbage, DecodeRefused) and not garbage.too_large


def png(width: int, height: int, seed: int = 0) -> bytes:
    """A PNG of random pixels (incompressible: about ``width x height x 3`` bytes)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def test_a_workers_pipes_hold_a_640x480_image_job_and_its_rgb_reply(pool):
    pool.start()
    (pid,) = pool.pids
    for fd, flags in ((0, os.O_WRONLY), (1, os.O_RDONLY)):  # the worker's stdin and stdout pipes
        pipe = os.open(f"/proc/{pid}/fd/{fd}", flags | os.O_NONBLOCK)
        try:
            assert fcntl.fcntl(pipe, fcntl.F_GETPIPE_SZ) == PIPE_BYTES
        finally:
            os.close(pipe)
    assert len(png(640, 480)) < PIPE_BYTES and 640 * 480 * 3 < PIPE_BYTES


@pytest.mark.parametrize("width, height", [(640, 480), (1280, 960)])  # the second: 3.7 MB each way
def test_an_image_job_larger_or_smaller_than_the_pipe_comes_back_whole(pool, width, height):
    data = png(width, height, seed=width)
    reply = pool.run(ImageDecodeJob(data, max_pixels=1 << 25, memory_bytes=256 << 20), timeout_s=30)
    assert isinstance(reply, DecodedImage) and (reply.width, reply.height) == (width, height)
    expected = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    np.testing.assert_array_equal(np.frombuffer(reply.rgb, np.uint8).reshape(height, width, 3), expected)


def test_a_job_sent_as_base64_is_decoded_from_it_in_the_worker(pool):
    data = png(64, 48)
    raw = pool.run(ImageDecodeJob(data, max_pixels=1 << 20, memory_bytes=256 << 20), timeout_s=30)
    sent = pool.run(ImageDecodeJob(base64.b64encode(data), 1 << 20, 256 << 20, encoding="base64"), timeout_s=30)
    assert isinstance(sent, DecodedImage) and sent == raw
    clip = pool.run(AudioDecodeJob(base64.b64encode(wav()), 60.0, 256 << 20, encoding="base64"), timeout_s=30)
    assert isinstance(clip, DecodedAudio) and clip == pool.run(job(wav()), timeout_s=30)
    for text in (b"@@@@", b"QUJD=A==", b"QUJ"):
        assert pool.run(ImageDecodeJob(text, 1 << 20, 256 << 20, encoding="base64"), timeout_s=30) == NotBase64()
