"""ReferenceEncoder: voice-clone clips batched across preprocessing workers, cached by content."""

import threading

import numpy as np
import pytest
import torch

from omnistage.models.qwen3_tts.stages import ReferenceEncoder


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


def encode_concurrently(encoder: ReferenceEncoder, clips: list[np.ndarray]):
    results, errors, start = [None] * len(clips), [None] * len(clips), threading.Barrier(len(clips))

    def work(i):
        start.wait()
        try:
            results[i] = encoder.encode(clips[i])
        except RuntimeError as exc:
            errors[i] = exc

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(clips))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not any(t.is_alive() for t in threads), "a worker hung"
    return results, errors


def test_concurrent_clips_are_encoded_in_one_batch_each_getting_its_own_result():
    codec, speaker = FakeCodecEncoder(), FakeSpeakerEncoder()
    encoder = ReferenceEncoder(speaker, codec, hold_ms=200.0)  # ample for 4 threads to join
    clips = [clip(i) for i in range(4)]
    results, errors = encode_concurrently(encoder, clips)
    assert errors == [None] * 4
    assert codec.batches == [4]
    for c, (x_vector, codes) in zip(clips, results, strict=True):
        torch.testing.assert_close(x_vector, torch.from_numpy(c[:4]))
        assert torch.equal(codes, (torch.from_numpy(c[:16]) * 100).round().long()[None, :])


def test_a_repeated_clip_is_a_cache_hit_and_another_clip_is_not():
    codec, speaker = FakeCodecEncoder(), FakeSpeakerEncoder()
    encoder = ReferenceEncoder(speaker, codec, hold_ms=0.0)
    first = encoder.encode(clip(1))
    again = encoder.encode(clip(1).copy())  # same content, another array
    other = encoder.encode(clip(2))
    assert again is first
    assert codec.batches == [1, 1] and speaker.calls == 2
    assert not torch.equal(other[0], first[0])


def test_the_cache_keeps_only_the_most_recent_clips():
    codec, speaker = FakeCodecEncoder(), FakeSpeakerEncoder()
    encoder = ReferenceEncoder(speaker, codec, hold_ms=0.0, cache_size=1)
    encoder.encode(clip(1))
    encoder.encode(clip(2))
    encoder.encode(clip(1))
    assert codec.batches == [1, 1, 1]


def test_a_failing_batch_fails_every_waiting_request_and_none_hangs():
    encoder = ReferenceEncoder(FakeSpeakerEncoder(), FakeCodecEncoder(fail=True), hold_ms=50.0)
    results, errors = encode_concurrently(encoder, [clip(i) for i in range(3)])
    assert results == [None] * 3
    assert all(isinstance(e, RuntimeError) and "encoder broke" in str(e) for e in errors)
    with pytest.raises(RuntimeError, match="encoder broke"):  # and the next one still runs
        encoder.encode(clip(9))


class UnexpectedlyFailingCodecEncoder(FakeCodecEncoder):
    """Fails its first batch with an error the encoder does not expect (not Runtime/Value)."""

    def encode_batch(self, clips):
        if not self.batches:
            self.batches.append(len(clips))
            raise IndexError("a bug in the encoder")
        return super().encode_batch(clips)


def test_an_unexpected_error_gives_up_the_lead_so_later_clips_do_not_hang():
    encoder = ReferenceEncoder(FakeSpeakerEncoder(), UnexpectedlyFailingCodecEncoder(), hold_ms=0.0)
    with pytest.raises(IndexError):  # the leader's own request sees the real error
        encoder.encode(clip(1))
    results, errors = encode_concurrently(encoder, [clip(2)])  # before: waited for a gone leader
    assert errors == [None] and results[0] is not None
