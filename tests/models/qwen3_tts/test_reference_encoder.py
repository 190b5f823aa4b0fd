"""The reference_encoder stage: voice-clone clips of concurrent requests batched by the
stock batching scheduler, cached by their content keys (the request builder's); a failing
batch fails its requests only."""

import hashlib
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from omnistage.core.messages import StagePayload
from omnistage.core.request import PipelineRequest
from omnistage.models.qwen3_tts.stages import ReferenceEncoder, reference_scheduler


class FakeCodecEncoder:
    """Codes = the first 16 samples' rounded values, per clip; counts batched calls."""

    def __init__(self, fail: bool = False) -> None:
        self.batches: list[int] = []
        self.fail = fail

    def parameters(self):
        yield torch.zeros(1)

    def encode_batch(self, clips):
        self.batches.append(len(clips))
        if self.fail:
            raise RuntimeError("encoder broke")
        return [(c[:16] * 100).round().long()[None, :] for c in clips]


class FakeSpeakerEncoder:
    def __init__(self) -> None:
        self.calls = 0

    def embed(self, wav):
        self.calls += 1
        return wav[:4].clone()


def clip(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(24000).astype(np.float32)


def key(c: np.ndarray) -> str:
    """A content key of ``c`` (the request builder's is of what the request sent)."""
    return hashlib.sha256(c.tobytes()).hexdigest()


def encode(encoder: ReferenceEncoder, clips: list[np.ndarray]):
    return encoder.encode(clips, [key(c) for c in clips])


@dataclass(frozen=True)
class ClipRequest(PipelineRequest):
    ref_audio: np.ndarray
    ref_key: str


@dataclass
class Outbox:
    results: dict = field(default_factory=dict)
    failures: dict = field(default_factory=dict)
    ended: threading.Condition = field(default_factory=threading.Condition)

    def result(self, request_id, data, finish_reason="stop"):
        with self.ended:
            self.results[request_id] = data
            self.ended.notify_all()

    def fail(self, request_id, error):
        with self.ended:
            self.failures[request_id] = error
            self.ended.notify_all()

    def dead(self, error):
        raise AssertionError(f"compute loop died: {error!r}")

    def wait(self, request_ids, timeout=10.0):
        with self.ended:
            ok = self.ended.wait_for(lambda: all(r in self.results or r in self.failures for r in request_ids), timeout)
        assert ok, f"requests {request_ids} did not end"


def run_stage(encoder: ReferenceEncoder, clips: list[np.ndarray]) -> Outbox:
    """Queue one request per clip, then start the stage: its first tick takes them all."""
    scheduler, outbox = reference_scheduler(encoder, max_batch_size=8, max_batch_wait_ms=0.0), Outbox()
    scheduler.bind("reference_encoder", outbox, expects_stream=False)
    ids = [f"r{i}" for i in range(len(clips))]
    for request_id, c in zip(ids, clips, strict=True):
        scheduler.put(StagePayload(request_id, ClipRequest(c, key(c)), None))
    scheduler.start()
    try:
        outbox.wait(ids)
    finally:
        scheduler.stop()
    return outbox


def expected_codes(c: np.ndarray) -> torch.Tensor:
    return (torch.from_numpy(c[:16]) * 100).round().long()[None, :]


def test_concurrent_clips_are_encoded_in_one_batch_each_getting_its_own_result():
    codec, speaker = FakeCodecEncoder(), FakeSpeakerEncoder()
    clips = [clip(i) for i in range(4)]
    outbox = run_stage(ReferenceEncoder(speaker, codec), clips)
    assert not outbox.failures and codec.batches == [4]
    for i, c in enumerate(clips):
        encoded = outbox.results[f"r{i}"]
        torch.testing.assert_close(encoded.x_vector, torch.from_numpy(c[:4]))
        assert torch.equal(encoded.ref_codes, expected_codes(c))


def test_a_repeated_clip_is_a_cache_hit_and_another_clip_is_not():
    codec, speaker = FakeCodecEncoder(), FakeSpeakerEncoder()
    encoder = ReferenceEncoder(speaker, codec)
    [first] = encode(encoder, [clip(1)])
    [again, other] = encode(encoder, [clip(1).copy(), clip(2)])  # same content, another array
    assert again is first
    assert codec.batches == [1, 1] and speaker.calls == 2
    assert not torch.equal(other.x_vector, first.x_vector)


def test_a_clip_twice_in_one_batch_is_encoded_once():
    codec, speaker = FakeCodecEncoder(), FakeSpeakerEncoder()
    a, b = encode(ReferenceEncoder(speaker, codec), [clip(3), clip(3)])
    assert a is b and codec.batches == [1] and speaker.calls == 1


def test_the_cache_keeps_only_the_most_recent_clips():
    codec, speaker = FakeCodecEncoder(), FakeSpeakerEncoder()
    encoder = ReferenceEncoder(speaker, codec, cache_size=1)
    for seed in (1, 2, 1):
        encode(encoder, [clip(seed)])
    assert codec.batches == [1, 1, 1]


def test_a_cached_clip_batched_with_a_new_one_outlives_an_older_clip():
    """The bound is enforced after the whole batch: with clips 1 and 2 cached (1 the least
    recently used), a batch of 3 (new) then 1 drops 2, not 1."""
    codec, speaker = FakeCodecEncoder(), FakeSpeakerEncoder()
    encoder = ReferenceEncoder(speaker, codec, cache_size=2)
    for seed in (1, 2):
        encode(encoder, [clip(seed)])
    encode(encoder, [clip(3), clip(1)])
    assert codec.batches == [1, 1, 1]
    assert [encoder.cached(key(clip(seed))) for seed in (1, 2, 3)] == [True, False, True]


def test_a_failing_batch_fails_its_requests_and_the_stage_serves_the_next():
    codec = FakeCodecEncoder(fail=True)
    encoder = ReferenceEncoder(FakeSpeakerEncoder(), codec)
    outbox = run_stage(encoder, [clip(i) for i in range(3)])
    assert not outbox.results and len(outbox.failures) == 3
    assert all(isinstance(e, RuntimeError) and "encoder broke" in str(e) for e in outbox.failures.values())
    codec.fail = False
    outbox = run_stage(encoder, [clip(9)])
    assert torch.equal(outbox.results["r0"].ref_codes, expected_codes(clip(9)))


def test_the_cache_is_keyed_by_the_given_content_keys():
    """The request builder's key stands for the clip: the stage does not hash the samples
    again, and a key it has not seen is encoded even for samples it has."""
    codec, speaker = FakeCodecEncoder(), FakeSpeakerEncoder()
    encoder = ReferenceEncoder(speaker, codec)
    [first] = encoder.encode([clip(1)], ["a" * 64])
    [again] = encoder.encode([clip(1)], ["a" * 64])
    [other_key] = encoder.encode([clip(1)], ["b" * 64])
    assert again is first and other_key is not first and codec.batches == [1, 1]


def started_stage(encoder: ReferenceEncoder, max_batch_size: int, max_batch_wait_ms: float):
    scheduler, outbox = reference_scheduler(encoder, max_batch_size, max_batch_wait_ms), Outbox()
    scheduler.bind("reference_encoder", outbox, expects_stream=False)
    scheduler.start()
    return scheduler, outbox


def test_a_cache_hit_is_answered_without_holding_the_batch_open():
    """A batch wait of an hour: a cached clip's request still ends (within the outbox's
    10 s), as nothing is gained by waiting for company for a look-up."""
    codec, speaker = FakeCodecEncoder(), FakeSpeakerEncoder()
    encoder = ReferenceEncoder(speaker, codec)
    encode(encoder, [clip(1)])
    scheduler, outbox = started_stage(encoder, max_batch_size=8, max_batch_wait_ms=3_600_000)
    try:
        scheduler.put(StagePayload("hit", ClipRequest(clip(1), key(clip(1))), None))
        outbox.wait(["hit"])
    finally:
        scheduler.stop()
    assert torch.equal(outbox.results["hit"].ref_codes, expected_codes(clip(1))) and codec.batches == [1]


def test_a_clip_to_encode_holds_the_batch_open_for_another():
    """The same hour-long wait: a clip not in the cache waits for company, and the batch
    closes once full (two clips, one encoder call), not before."""
    codec, speaker = FakeCodecEncoder(), FakeSpeakerEncoder()
    scheduler, outbox = started_stage(ReferenceEncoder(speaker, codec), max_batch_size=2, max_batch_wait_ms=3_600_000)
    try:
        for request_id, seed in (("a", 5), ("b", 6)):
            scheduler.put(StagePayload(request_id, ClipRequest(clip(seed), key(clip(seed))), None))
        outbox.wait(["a", "b"])
    finally:
        scheduler.stop()
    assert codec.batches == [2] and not outbox.failures
