"""The streaming vocoder scheduler: chunk plan, batching, exactness, lifecycle."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from omnistage.core.messages import Abort, StagePayload, StreamChunk, StreamDone
from omnistage.core.payloads import AudioChunk, AudioResult
from omnistage.engine.vocoder_arena import StreamingDecoderArena
from omnistage.models.qwen3_omni.modeling.code2wav import Code2Wav, Code2WavConfig
from omnistage.models.qwen3_omni.modeling.random_init import CODE2WAV_GAINS, random_state_dict
from omnistage.models.qwen3_tts.modeling.speech_tokenizer.decoder import load_decoder
from omnistage.models.qwen3_tts.modeling.speech_tokenizer.random_init import (
    write_random_speech_tokenizer,
)
from omnistage.scheduling.ar import CodeFrames, GenerationSummary
from omnistage.scheduling.vocoder import ChunkPlan, VocoderScheduler, VocoderSetup

SPF = 4  # the fake decoder's samples per frame
RATE = 24000
TIMEOUT_S = 10.0


class FakeArena:
    """A stateful fake codec: frame k of a stream (left context included) decodes to SPF
    samples of value ``code0 + 10000 * k``, so repeats, drops and leaked left context show."""

    samples_per_frame = SPF

    def __init__(self, num_slots: int = 4) -> None:
        self.positions: dict[int, int] = {}
        self.num_slots = num_slots
        self.calls: list[tuple[int, int]] = []  # (batch, frames) per decode
        self.opens: list[int] = []  # streams per allocate_many call

    @property
    def num_free(self) -> int:
        return self.num_slots - len(self.positions)

    def allocate_many(self, left_contexts: Sequence[torch.Tensor | None]) -> list[int]:
        self.opens.append(len(left_contexts))
        slots = []
        for left_context in left_contexts:
            slot = min(set(range(self.num_slots)) - set(self.positions))
            self.positions[slot] = 0 if left_context is None else left_context.shape[0]
            slots.append(slot)
        return slots

    def free(self, slot: int) -> None:
        self.positions.pop(slot, None)

    def decode(self, slots: Sequence[int], codes: torch.Tensor) -> list[torch.Tensor]:
        self.calls.append((len(slots), codes.shape[1]))
        rows = []
        for slot, frames in zip(slots, codes, strict=True):
            start = self.positions[slot]
            rows.append(_fake_audio(frames, start))
            self.positions[slot] = start + frames.shape[0]
        return [row.float() for row in rows]

    def decode_full(self, items: Sequence[tuple[torch.Tensor, torch.Tensor | None]]) -> list[torch.Tensor]:
        self.calls.append((len(items), -1))
        return [_fake_audio(codes, 0 if left is None else left.shape[0]) for codes, left in items]


def _fake_audio(frames: torch.Tensor, start: int) -> torch.Tensor:
    values = frames[:, 0].double() + 10000.0 * torch.arange(start, start + frames.shape[0])
    return values.repeat_interleave(SPF)


@dataclass
class Outbox:
    streams: dict[str, list[tuple[np.ndarray, dict]]] = field(default_factory=dict)
    results: dict[str, tuple[AudioResult, str]] = field(default_factory=dict)
    failures: dict[str, BaseException] = field(default_factory=dict)
    batches: list[list[str]] = field(default_factory=list)  # request ids of each stream_many
    ended: threading.Condition = field(default_factory=threading.Condition)

    def result(self, request_id, data, finish_reason="stop"):
        with self.ended:
            self.results[request_id] = (data, finish_reason)
            self.ended.notify_all()

    def stream(self, request_id, data):
        assert isinstance(data, AudioChunk)
        self.streams.setdefault(request_id, []).append((data.samples, {"sample_rate": data.sample_rate}))

    def stream_many(self, items):
        self.batches.append([request_id for request_id, _ in items])
        for request_id, data in items:
            self.stream(request_id, data)

    def fail(self, request_id, error):
        with self.ended:
            self.failures[request_id] = error
            self.ended.notify_all()

    def dead(self, error):
        raise AssertionError(f"compute loop died: {error!r}")

    def wait(self, *request_ids: str) -> None:
        with self.ended:
            assert self.ended.wait_for(
                lambda: all(r in self.results or r in self.failures for r in request_ids), TIMEOUT_S
            ), f"requests {request_ids} did not end"

    def audio(self, request_id: str) -> np.ndarray:
        return np.concatenate([pcm for pcm, _ in self.streams.get(request_id, [])] or [np.zeros(0)])


@pytest.fixture
def released() -> list[str]:
    return []


@pytest.fixture
def make(released):
    schedulers: list[VocoderScheduler] = []

    def build(decoder=None, plan: ChunkPlan | None = None, start: bool = True) -> tuple[VocoderScheduler, Outbox]:
        scheduler = VocoderScheduler(decoder or FakeArena(), RATE, plan, release_callback=released.append)
        outbox = Outbox()
        scheduler.bind("vocoder", outbox, expects_stream=True)
        if start:  # else the test queues messages first, so one tick takes them all
            scheduler.start()
        schedulers.append(scheduler)
        return scheduler, outbox

    yield build
    for scheduler in schedulers:
        scheduler.stop()


def _codes(frames: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 2048, (frames, 16), generator=torch.Generator().manual_seed(seed))


def _payload(request_id: str, **fields) -> StagePayload:
    return StagePayload(request_id, None, VocoderSetup(**fields))


def _chunk(request_id: str, codes: torch.Tensor) -> StreamChunk:
    return StreamChunk(request_id, "tts_engine", CodeFrames(codes))


def _settle(scheduler: VocoderScheduler) -> None:
    """Wait until the compute thread drained its inbox (a marker request round-trips)."""
    marker = f"settle-{id(object())}"
    scheduler.put(_payload(marker))
    scheduler.put(StreamDone(marker, "tts_engine"))
    scheduler.outbox.wait(marker)


def test_default_plan_emits_the_first_audio_after_one_frame(make) -> None:
    scheduler, outbox = make()
    scheduler.put(_payload("r"))
    scheduler.put(_chunk("r", _codes(1)))
    _settle(scheduler)
    assert [len(pcm) for pcm, _ in outbox.streams["r"]] == [SPF]
    assert outbox.streams["r"][0][1] == {"sample_rate": RATE}


def test_chunks_follow_the_ramp_and_the_stream_is_exact(make) -> None:
    scheduler, outbox = make()
    codes = _codes(23)
    scheduler.put(_payload("r"))
    for start in range(0, 23, 3):  # frames arrive 3 at a time
        scheduler.put(_chunk("r", codes[start : start + 3]))
    scheduler.put(StreamDone("r", "tts_engine"))
    outbox.wait("r")
    sizes = [len(pcm) // SPF for pcm, _ in outbox.streams["r"]]
    assert sizes[:4] == [1, 2, 4, 8] and sum(sizes) == 23 and all(s <= 8 for s in sizes)
    assert np.array_equal(outbox.audio("r"), _fake_audio(codes, 0).numpy())  # nothing repeated or lost
    result, reason = outbox.results["r"]
    assert result == AudioResult(23 * SPF, RATE, num_frames=23) and reason == "stop"


def test_due_requests_with_the_same_chunk_length_decode_as_one_batch(make) -> None:
    arena = FakeArena(num_slots=4)
    scheduler, outbox = make(arena, start=False)
    for r in "abc":
        scheduler.put(_payload(r))
    scheduler.put(_chunk("a", _codes(1, seed=1)))
    scheduler.put(_chunk("b", _codes(1, seed=2)))
    scheduler.put(_chunk("c", _codes(3, seed=3)))
    scheduler.start()
    _settle(scheduler)
    # a, b and c's first frame: one batch of 1-frame chunks; then c's next 2 frames alone
    assert arena.calls == [(3, 1), (1, 2)]
    assert [len(outbox.audio(r)) for r in "abc"] == [SPF, SPF, 3 * SPF]


def test_the_audio_chunks_of_one_tick_leave_as_one_batch(make) -> None:
    scheduler, outbox = make(FakeArena(num_slots=4), start=False)
    for r in "abc":
        scheduler.put(_payload(r))
        scheduler.put(_chunk(r, _codes(1, seed=ord(r))))
    scheduler.put(StreamDone("a", "tts_engine"))
    scheduler.start()
    outbox.wait("a")
    _settle(scheduler)
    # one message for the three first chunks (a's included, sent before a's result)
    assert outbox.batches[0] == ["a", "b", "c"]
    assert [len(outbox.audio(r)) for r in "abc"] == [SPF] * 3


def test_left_context_is_never_emitted(make) -> None:
    scheduler, outbox = make()
    reference, codes = _codes(5, seed=1), _codes(10, seed=2)
    scheduler.put(_payload("r", left_context=reference))
    scheduler.put(_chunk("r", codes))
    scheduler.put(StreamDone("r", "tts_engine"))
    outbox.wait("r")
    assert np.array_equal(outbox.audio("r"), _fake_audio(codes, 5).numpy())
    assert outbox.results["r"][0].num_frames == 10


def test_chunks_and_stream_done_before_the_payload_wait_for_it(make) -> None:
    scheduler, outbox = make()
    codes = _codes(6)
    scheduler.put(_chunk("r", codes))
    scheduler.put(StreamDone("r", "tts_engine"))
    _settle(scheduler)
    assert "r" not in outbox.streams and "r" not in outbox.results
    scheduler.put(_payload("r"))
    outbox.wait("r")
    assert np.array_equal(outbox.audio("r"), _fake_audio(codes, 0).numpy())


def test_abort_mid_stream_frees_the_slot_and_late_chunks_are_dropped(make, released) -> None:
    arena = FakeArena()
    scheduler, outbox = make(arena)
    scheduler.put(_payload("r"))
    scheduler.put(_chunk("r", _codes(3)))
    scheduler.put(Abort("r"))
    scheduler.put(_chunk("r", _codes(8)))
    scheduler.put(StreamDone("r", "tts_engine"))
    _settle(scheduler)
    assert arena.positions == {} and "r" in released
    assert scheduler.live_requests() == set() and "r" not in outbox.results


def test_a_failed_batch_frees_every_slot(make, released) -> None:
    class Exploding(FakeArena):
        def decode(self, slots, codes):
            raise torch.OutOfMemoryError("boom")

    arena = Exploding()
    scheduler, outbox = make(arena)
    scheduler.put(_payload("r"))
    scheduler.put(_chunk("r", _codes(2)))
    outbox.wait("r")
    assert isinstance(outbox.failures["r"], torch.OutOfMemoryError)
    assert arena.positions == {} and "r" in released and scheduler.live_requests() == set()


def test_a_malformed_chunk_fails_only_its_request(make) -> None:
    scheduler, outbox = make()
    scheduler.put(_payload("bad"))
    scheduler.put(_payload("good"))
    scheduler.put(_chunk("bad", torch.zeros(2, 16)))  # float, not int64 codes
    scheduler.put(_chunk("good", _codes(1)))
    scheduler.put(StreamDone("good", "tts_engine"))
    outbox.wait("bad", "good")
    assert isinstance(outbox.failures["bad"], ValueError)
    assert outbox.results["good"][0].num_frames == 1


def test_non_streaming_requests_get_one_chunk_at_stream_done(make) -> None:
    arena = FakeArena()
    scheduler, outbox = make(arena)
    codes = _codes(13)
    scheduler.put(_payload("r", stream=False, left_context=_codes(2, seed=5)))
    scheduler.put(_chunk("r", codes[:7]))
    scheduler.put(_chunk("r", codes[7:]))
    _settle(scheduler)
    assert "r" not in outbox.streams
    scheduler.put(StreamDone("r", "tts_engine"))
    outbox.wait("r")
    assert len(outbox.streams["r"]) == 1
    assert np.array_equal(outbox.audio("r"), _fake_audio(codes, 2).numpy())
    assert arena.positions == {}  # no slot used


def test_initial_chunk_frames_replaces_the_ramp_and_is_clamped(make) -> None:
    assert [ChunkPlan().size(i, 3) for i in range(3)] == [3, 8, 8]
    assert ChunkPlan().size(0, 50) == 8
    assert [ChunkPlan().size(i) for i in range(5)] == [1, 2, 4, 8, 8]
    with pytest.raises(ValueError):
        ChunkPlan(ramp=(0,))
    scheduler, outbox = make()
    scheduler.put(_payload("r", initial_codec_chunk_frames=100))
    scheduler.put(_chunk("r", _codes(20)))
    scheduler.put(StreamDone("r", "tts_engine"))
    outbox.wait("r")
    assert [len(pcm) // SPF for pcm, _ in outbox.streams["r"]] == [8, 8, 4]


def test_no_initial_chunk_size_means_the_ramp(make) -> None:
    scheduler, outbox = make()
    scheduler.put(_payload("r", initial_codec_chunk_frames=None))
    scheduler.put(_chunk("r", _codes(9)))
    scheduler.put(StreamDone("r", "tts_engine"))
    outbox.wait("r")
    assert [len(pcm) // SPF for pcm, _ in outbox.streams["r"]] == [1, 2, 4, 2]


def test_a_request_waits_for_a_free_slot(make) -> None:
    arena = FakeArena(num_slots=1)
    scheduler, outbox = make(arena)
    scheduler.put(_payload("a"))
    scheduler.put(_payload("b"))
    scheduler.put(_chunk("a", _codes(1)))
    scheduler.put(_chunk("b", _codes(1, seed=3)))
    _settle(scheduler)
    assert "b" not in outbox.streams
    scheduler.put(StreamDone("a", "tts_engine"))
    scheduler.put(StreamDone("b", "tts_engine"))
    outbox.wait("a", "b")
    assert len(outbox.audio("b")) == SPF and arena.positions == {}


def test_a_fully_delivered_waiting_request_finishes_once_a_slot_frees(make) -> None:
    """Everything of "b" (payload, frames, stream-done) arrives while "a" holds the only
    slot; a later message for "a" alone frees the slot, and "b" must then finish on its
    own: no further message for "b" ever comes."""
    arena = FakeArena(num_slots=1)
    scheduler, outbox = make(arena)
    scheduler.put(_payload("a"))
    scheduler.put(_chunk("a", _codes(1)))
    _settle(scheduler)
    for message in (_payload("b"), _chunk("b", _codes(2, seed=3)), StreamDone("b", "tts_engine")):
        scheduler.put(message)
    _settle(scheduler)
    assert "b" not in outbox.results
    scheduler.put(StreamDone("a", "tts_engine"))
    outbox.wait("a", "b")
    assert len(outbox.audio("b")) == 2 * SPF and arena.positions == {}


def test_streamed_audio_from_the_real_codec_equals_its_offline_decode(make, tmp_path: Path) -> None:
    write_random_speech_tokenizer(tmp_path, "tiny", seed=0)
    decoder = load_decoder(tmp_path)
    arena = StreamingDecoderArena(decoder, num_slots=2)
    scheduler, outbox = make(arena)
    codes, reference = _codes(16, seed=4), _codes(3, seed=6)
    scheduler.put(_payload("r", left_context=reference))
    for start in range(0, 16, 5):
        scheduler.put(_chunk("r", codes[start : start + 5]))
    scheduler.put(StreamDone("r", "tts_engine"))
    outbox.wait("r")
    with torch.inference_mode():
        expected = decoder(torch.cat([reference, codes])[None])[0, 3 * 1920 :].numpy()
    streamed = outbox.audio("r")
    assert streamed.dtype == np.float32 and streamed.shape == expected.shape
    assert np.abs(streamed - expected).max() <= 1e-5
    assert arena.num_free == 2


class RecordingArena(StreamingDecoderArena):
    """The real arena, recording its calls in order: ``("open", left context lengths)``
    once :meth:`allocate_many` returned (the left contexts are decoded into the slots'
    state by then), ``("decode", frames)`` per :meth:`decode`."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.events: list[tuple[str, object]] = []

    def allocate_many(self, left_contexts):
        slots = super().allocate_many(left_contexts)
        self.events.append(("open", [0 if c is None else c.shape[0] for c in left_contexts]))
        return slots

    def decode(self, slots, codes):
        self.events.append(("decode", codes.shape[1]))
        return super().decode(slots, codes)


def test_a_setup_streamed_before_the_frames_decodes_the_left_context_before_the_first_frame(
    make, tmp_path: Path
) -> None:
    """As the Qwen3-TTS pipeline sends it: the preprocessing stage streams the setup (the
    reference codes as left context) before the engine's prefill; the stream opens and its
    left context is decoded on that setup alone, so the first frame only pays its own
    chunk. The audio is still the offline decode of reference + frames."""
    write_random_speech_tokenizer(tmp_path, "tiny", seed=0)
    decoder = load_decoder(tmp_path)
    arena = RecordingArena(decoder, num_slots=2)
    scheduler, outbox = make(arena)
    codes, reference = _codes(7, seed=8), _codes(6, seed=9)
    scheduler.put(StreamChunk("r", "preprocessing", VocoderSetup(left_context=reference)))
    _settle(scheduler)  # the setup was taken: nothing else has arrived yet
    assert arena.events == [("open", [6])] and arena.num_free == 1
    assert [arena.position(slot) for slot in scheduler._slots.values()] == [6]
    for start in range(0, 7, 2):
        scheduler.put(_chunk("r", codes[start : start + 2]))
    scheduler.put(StreamDone("r", "tts_engine"))
    scheduler.put(StagePayload("r", None, GenerationSummary(num_frames=7, num_prompt_tokens=40)))
    outbox.wait("r")
    assert arena.events[0] == ("open", [6]) and {e for e, _ in arena.events[1:]} == {"decode"}
    with torch.inference_mode():
        expected = decoder(torch.cat([reference, codes])[None])[0, 6 * 1920 :].numpy()
    assert np.abs(outbox.audio("r") - expected).max() <= 1e-5
    assert outbox.results["r"][0].num_frames == 7 and arena.num_free == 2


def test_streams_starting_in_the_same_tick_open_as_one_batch(make) -> None:
    arena = FakeArena(num_slots=4)
    scheduler, outbox = make(arena, start=False)
    for request_id in "abc":
        scheduler.put(_payload(request_id, left_context=_codes(3)))
        scheduler.put(_chunk(request_id, _codes(1, seed=ord(request_id))))
        scheduler.put(StreamDone(request_id, "tts_engine"))
    scheduler.start()
    outbox.wait("a", "b", "c")
    assert arena.opens == [3]
    for request_id in "abc":
        assert np.array_equal(outbox.audio(request_id), _fake_audio(_codes(1, seed=ord(request_id)), 3).numpy())


def test_batched_opens_with_the_real_codec_stream_exactly_and_aborts_at_every_phase_leak_nothing(
    make, released, tmp_path: Path
) -> None:
    """Five clones of one voice arrive in one tick: four open as one batch (one decode of
    the reference, three cached copies), the fifth waits for a slot. Then one is aborted
    while waiting, one after its open but before any frame, one mid-stream; the other two
    stream exactly their offline decode, and every slot and every request's state is gone."""
    write_random_speech_tokenizer(tmp_path, "tiny", seed=0)
    decoder = load_decoder(tmp_path)
    arena = StreamingDecoderArena(decoder, num_slots=4)
    scheduler, outbox = make(arena, start=False)
    reference = _codes(4, seed=7)
    utterances = {r: _codes(9, seed=10 + i) for i, r in enumerate("abcde")}
    for request_id in "abcde":
        scheduler.put(_payload(request_id, left_context=reference))
    scheduler.start()
    _settle(scheduler)
    assert arena.num_free == 0 and "e" in scheduler._waiting
    assert len(arena._contexts) == 1  # the reference was decoded once
    for aborted in "eb":  # waiting for a slot; opened, no frame yet
        scheduler.put(Abort(aborted))
        _settle(scheduler)
    for request_id in "acd":
        scheduler.put(_chunk(request_id, utterances[request_id][:3]))
    _settle(scheduler)
    scheduler.put(Abort("c"))  # mid-stream
    for request_id in "ad":
        scheduler.put(_chunk(request_id, utterances[request_id][3:]))
        scheduler.put(StreamDone(request_id, "tts_engine"))
    outbox.wait("a", "d")
    _settle(scheduler)
    with torch.inference_mode():
        for request_id in "ad":
            expected = decoder(torch.cat([reference, utterances[request_id]])[None])[0, 4 * 1920 :].numpy()
            assert np.abs(outbox.audio(request_id) - expected).max() <= 1e-5
    assert set("bce") <= set(released) and not {"b", "c", "e"} & set(outbox.results)
    assert arena.num_free == 4 and scheduler.live_requests() == set() and not scheduler._waiting


def test_streamed_audio_from_qwen3_omni_code2wav_equals_its_offline_decode(make) -> None:
    tiny = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 2, "decoder_dim": 32}  # fmt: skip
    code2wav = Code2Wav(Code2WavConfig.from_hf(tiny))
    code2wav.load_state_dict(random_state_dict(code2wav, 0, CODE2WAV_GAINS))
    arena = StreamingDecoderArena(code2wav.eval(), num_slots=2)
    scheduler, outbox = make(arena)
    codes = _codes(19, seed=5)
    scheduler.put(_payload("streamed"))
    scheduler.put(_payload("whole", stream=False))
    for start in range(0, 19, 6):
        scheduler.put(_chunk("streamed", codes[start : start + 6]))
        scheduler.put(_chunk("whole", codes[start : start + 6]))
    for request_id in ("streamed", "whole"):
        scheduler.put(StreamDone(request_id, "talker"))
    outbox.wait("streamed", "whole")
    with torch.inference_mode():
        expected = code2wav(codes[None])[0].numpy()
    pieces = [len(pcm) for pcm, _ in outbox.streams["streamed"]]
    assert pieces == [1920 - 555, 2 * 1920, 4 * 1920, 8 * 1920, 4 * 1920]  # ramp 1, 2, 4, 8, rest
    for request_id in ("streamed", "whole"):
        audio = outbox.audio(request_id)
        assert audio.shape == expected.shape == (19 * 1920 - 555,)
        assert np.abs(audio - expected).max() <= 1e-5
        assert outbox.results[request_id][0].num_samples == 19 * 1920 - 555
    assert arena.num_free == 2
