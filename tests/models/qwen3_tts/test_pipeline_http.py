"""The Qwen3-TTS pipeline end to end over HTTP (and a live WebSocket session): tiny random checkpoints of each model type
(written once per session, as ``omnistage init-random --size tiny`` does) served on CPU by
a real uvicorn in this process (one server per model type for the module).

Audio is 24 kHz, 1920 samples per codec frame (12.5 Hz). Requests keep ``max_new_tokens``
small so the whole module runs in seconds on 2 cores.

The tiny random speech-tokenizer decoder's audio depends on its codes (random codes: std
~0.07, peak ~0.4; two different code sequences differ by up to ~0.4, far above one int16
step, 3e-5; test_speech_tokenizer_random_init.py pins it), so audio compared within 1 LSB
tells codes apart. The tests also compare the codes themselves, exactly:
the code frames the engine streams to the vocoder are recorded in the server process
under their request id (the ``X-Request-Id`` header), see :func:`record_engine_codes`.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
import soundfile
import torch
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from omnistage.core.errors import RequestAbortedError
from omnistage.core.messages import StreamChunk
from omnistage.models.qwen3_tts.config import Qwen3TTSPipelineConfig
from omnistage.models.qwen3_tts.live_text import FinalTokens
from omnistage.models.qwen3_tts.modeling.generate import TalkerSampling, generate
from omnistage.models.qwen3_tts.modeling.prompt import PromptBuilder, PromptTokens
from omnistage.models.qwen3_tts.modeling.speech_tokenizer.decoder import load_decoder
from omnistage.models.qwen3_tts.modeling.weights import load_checkpoint
from omnistage.models.qwen3_tts.request_builders import Qwen3TTSSpeechRequest
from omnistage.pipeline.timeline import parse_header
from omnistage.scheduling.ar import CodeFrames
from omnistage.serve.app import ServerSettings, create_app
from omnistage.serve.audio import float_to_s16
from omnistage.serve.protocol import validate_speech_request
from omnistage.testing.leaks import assert_no_request_state
from omnistage.testing.metrics import stage_batch_totals
from tests.serve.conftest import RunningServer, run_uvicorn, wait_health

SAMPLE_RATE = 24_000
SAMPLES_PER_FRAME = 1920
FRAMES = 8  # max_new_tokens of most requests
TEXT = "Hello there."
REF_TEXT = "A short reference clip."


# ------------------------------------------------------------------ reference clips
def tone_clip(seconds: float, rate: int = 16_000, channels: int = 2, seed: int = 0) -> np.ndarray:
    """A harmonic 150 Hz tone (4 partials, slow vibrato) plus a little noise, ``[S, channels]``."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * rate)) / rate
    phase = 2 * np.pi * 150 * t + 0.5 * np.sin(2 * np.pi * 5 * t)
    voice = sum(np.sin(k * phase) / k for k in range(1, 5))
    mono = 0.25 * voice / np.abs(voice).max() + 0.01 * rng.standard_normal(len(t))
    return np.stack([mono * (1 - 0.1 * c) for c in range(channels)], axis=1).astype(np.float32)


def wav_data_uri(samples: np.ndarray, rate: int = 16_000) -> str:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format="WAV", subtype="PCM_16")
    return "data:audio/wav;base64," + base64.b64encode(buffer.getvalue()).decode()


REF_AUDIO = wav_data_uri(tone_clip(1.5))  # 1.5 s, 16 kHz stereo

# model type of the server, and the fields that pick the voice, per request case
CASES: dict[str, tuple[str, dict]] = {
    "base_icl": ("base", {"ref_audio": REF_AUDIO, "ref_text": REF_TEXT}),
    "base_x_vector": ("base", {"ref_audio": REF_AUDIO, "x_vector_only_mode": True}),
    "custom_voice": ("custom_voice", {"voice": "aiden"}),
    "voice_design": ("voice_design", {"instructions": "A calm, low voice."}),
}


# ------------------------------------------------------------------ servers
ENGINE_FRAMES: dict[str, list[torch.Tensor]] = {}
"""request id -> the code frames ``[n, 16]`` the vocoder got from the engine (all servers)."""


def record_engine_codes(server: RunningServer) -> None:
    """Record, in :data:`ENGINE_FRAMES`, the code frames the engine streams to the server's
    vocoder stage."""
    scheduler = server.speech.pipeline.host.stages["vocoder"].scheduler
    put = scheduler.put

    def recording_put(message):
        if isinstance(message, StreamChunk) and isinstance(message.data, CodeFrames):
            ENGINE_FRAMES.setdefault(message.request_id, []).append(message.data.codes.cpu())
        put(message)

    scheduler.put = recording_put


def codes_of(response: httpx.Response) -> torch.Tensor:
    """The engine's codes ``[T, 16]`` of the response's request."""
    frames = ENGINE_FRAMES.get(response.headers["x-request-id"], [])
    return torch.cat(frames) if frames else torch.zeros(0, 16, dtype=torch.int64)


@pytest.fixture(scope="module")
def servers(tiny_servable_checkpoints: dict[str, Path]) -> Iterator[dict[str, RunningServer]]:
    """model type -> a running server of that tiny checkpoint (warm-up on, playground off),
    recording its engine codes."""
    running: dict[str, RunningServer] = {}
    generators = []
    try:
        for model_type, path in tiny_servable_checkpoints.items():
            config = Qwen3TTSPipelineConfig.for_model_path(str(path))
            generator = run_uvicorn(create_app(config, ServerSettings(playground=False)))
            generators.append(generator)
            server = next(generator)
            health = wait_health(server.base_url)
            assert health.status_code == 200, health.text
            record_engine_codes(server)
            running[model_type] = server
        yield running
    finally:
        for generator in generators:
            generator.close()


def post(server: RunningServer, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/audio/speech", json=body, timeout=60)


def request_body(case: str, **fields) -> dict:
    """A whole-file request unless ``fields`` say otherwise (a stream has no
    X-Finish-Reason / X-Audio-Frames headers)."""
    _, voice = CASES[case]
    return {"input": TEXT, "seed": 7, "max_new_tokens": FRAMES, "stream": False, **voice, **fields}


def server_of(servers: dict[str, RunningServer], case: str) -> RunningServer:
    return servers[CASES[case][0]]


def pcm(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.frombuffer(response.content, dtype="<i2")


def wav(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    samples, rate = soundfile.read(io.BytesIO(response.content), dtype="int16")
    assert rate == SAMPLE_RATE and samples.ndim == 1
    return samples


def sse_events(response: httpx.Response) -> list[dict]:
    assert response.status_code == 200, response.text
    return [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]


def test_ignored_openai_fields_are_named_in_the_header(servers):
    """An OpenAI client's voice on Base, and speed anywhere, are accepted and named."""
    body = request_body("base_x_vector", response_format="pcm", voice="alloy", speed=1.5)
    response = post(server_of(servers, "base_x_vector"), body)
    assert response.status_code == 200, response.text
    assert response.headers["x-ignored-fields"] == "speed, voice"


def delta_samples(events: list[dict]) -> list[np.ndarray]:
    """The int16 samples of each ``speech.audio.delta`` event."""
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    return [np.frombuffer(base64.b64decode(e["audio"]), dtype="<i2") for e in deltas]


def run_on_server_loop(server: RunningServer, coroutine) -> None:
    """Run ``coroutine`` on the server's event loop (the pipeline lives there) and wait."""
    loop = server.speech.pipeline.coordinator.loop
    asyncio.run_coroutine_threadsafe(coroutine, loop).result(timeout=30)


def kv_blocks(server: RunningServer):
    return server.speech.pipeline.host.stages["tts_engine"].scheduler.engine.kv_blocks


def metric(server: RunningServer, sample: str) -> float:
    """The value of one Prometheus sample line (``name{labels}``) of /metrics; 0 if absent."""
    metrics = httpx.get(f"{server.base_url}/metrics").text
    match = re.search(rf"^{re.escape(sample)} (\S+)$", metrics, re.M)
    return float(match.group(1)) if match else 0.0


def abort_count(server: RunningServer) -> float:
    return metric(server, 'omnistage_requests_total{finish_reason="abort",status="499"}')


def engine_batches(server: RunningServer) -> tuple[float, float]:
    """(batches the tts_engine stage computed, requests in them), so far."""
    return stage_batch_totals(server.app.state.server.metrics.registry, "tts_engine")


# ------------------------------------------------------------------ 1. streaming == whole
@pytest.mark.parametrize("case", list(CASES))
def test_streamed_pcm_equals_whole_wav_within_one_lsb(servers, case):
    """Non-streaming WAV and streaming PCM of the same request and seed are the same audio
    from the same codes: FRAMES x 1920 samples each (finish_reason "length": the frame cap
    was reached), equal within 1 LSB of int16. Not bit-exact: the whole-utterance decode
    and the chunked streaming decode sum in a different fp32 order (the float audio
    differs by < 1e-5), which can flip the rounding of a sample to int16."""
    server = server_of(servers, case)
    whole_response = post(server, request_body(case, response_format="wav"))
    whole = wav(whole_response)
    assert whole_response.headers["x-finish-reason"] == "length"
    assert int(whole_response.headers["x-audio-frames"]) == FRAMES
    assert int(whole_response.headers["x-audio-samples"]) == len(whole) == FRAMES * SAMPLES_PER_FRAME
    streamed_response = post(server, request_body(case, response_format="pcm", stream=True))
    streamed = pcm(streamed_response)
    assert codes_of(whole_response).shape == (FRAMES, 16)
    assert torch.equal(codes_of(streamed_response), codes_of(whole_response))
    assert len(streamed) == len(whole)
    assert np.abs(streamed.astype(np.int32) - whole.astype(np.int32)).max() <= 1
    assert np.abs(whole).max() > 0  # not silence


@pytest.mark.parametrize("case", list(CASES))
def test_same_request_and_seed_twice_gives_identical_bytes(servers, case):
    server = server_of(servers, case)
    body = request_body(case, response_format="pcm")
    first, second = post(server, body), post(server, body)
    assert first.status_code == second.status_code == 200
    assert first.content == second.content
    assert torch.equal(codes_of(first), codes_of(second))


def test_a_reference_sent_again_is_the_cached_clip_and_gives_identical_audio(servers):
    """A clip the server has not seen is loaded and cached once; sent again it is the cache's
    (no decode), and the audio and codes equal the first request's. A refused clip is a 400
    naming ref_audio every time it is sent, and is never cached."""
    server = servers["base"]
    cache = server.speech.settings.media_policy.reference_cache
    body = {**request_body("base_icl", response_format="pcm"), "ref_audio": wav_data_uri(tone_clip(1.5, seed=21))}
    before = len(cache)
    first = post(server, body)
    assert pcm(first).size == FRAMES * SAMPLES_PER_FRAME and len(cache) == before + 1
    second = post(server, body)
    assert second.content == first.content and torch.equal(codes_of(second), codes_of(first))
    assert len(cache) == before + 1
    silent = {**body, "ref_audio": wav_data_uri(np.zeros((24_000, 1), np.float32))}
    for _ in range(2):
        refused = post(server, silent)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "ref_audio"
        assert "silent" in refused.json()["error"]["message"]
    assert len(cache) == before + 1


@pytest.mark.parametrize("case", list(CASES))
def test_a_different_seed_gives_different_codes(servers, case):
    """Compared as codes, exactly (the audio only by its length)."""
    server = server_of(servers, case)
    one = post(server, request_body(case, response_format="pcm", seed=7))
    other = post(server, request_body(case, response_format="pcm", seed=8))
    assert len(pcm(one)) == len(pcm(other)) == FRAMES * SAMPLES_PER_FRAME
    assert codes_of(one).shape == codes_of(other).shape == (FRAMES, 16)
    assert not torch.equal(codes_of(one), codes_of(other))


# ------------------------------------------------------------------ 2. greedy == reference loop
def test_greedy_custom_voice_equals_reference_loop_decoded_offline(servers, tiny_servable_checkpoints):
    """``temperature: 0`` over HTTP equals the unbatched reference loop's greedy codes on
    the same prompt, decoded by the offline speech-tokenizer decoder: the same codes, the
    same frame count, audio within 1 LSB. Both sides: argmax for code 0 and codes 1..15,
    repetition penalty 1.05 (generation_config.json) on code 0, EOS masked for the first
    2 frames, whole text in the prompt (CustomVoice's default non_streaming_mode). The
    speaker is one whose unpenalized greedy codes repeat within the frames, so the penalty
    changes them: a server that dropped it would fail here."""
    frames, speaker = 10, "sohee"
    body = {
        "input": TEXT, "voice": speaker, "temperature": 0, "max_new_tokens": frames, "response_format": "pcm",
        "stream": False,
    }  # fmt: skip
    response = post(servers["custom_voice"], body)
    served = pcm(response)

    path = tiny_servable_checkpoints["custom_voice"]
    checkpoint = load_checkpoint(path, "cpu")
    talker = checkpoint.model.talker
    prompt = PromptBuilder(talker, checkpoint.config, checkpoint.tokenizer).custom_voice(
        TEXT, speaker, "auto", None, non_streaming_mode=True
    )
    penalty = checkpoint.generation.repetition_penalty
    assert penalty == 1.05
    result = generate(talker, prompt, TalkerSampling.greedy(repetition_penalty=penalty), max_new_frames=frames)
    unpenalized = generate(talker, prompt, TalkerSampling.greedy(repetition_penalty=1.0), max_new_frames=frames)
    assert not torch.equal(result.codes, unpenalized.codes)  # the premise: the penalty matters
    with torch.inference_mode():
        audio = load_decoder(path / "speech_tokenizer", "cpu")(result.codes[None])[0]
    expected = float_to_s16(audio.numpy())

    assert torch.equal(codes_of(response), result.codes)
    assert response.headers["x-finish-reason"] == result.finish_reason
    assert int(response.headers["x-audio-frames"]) == result.codes.shape[0]
    assert len(served) == len(expected) == result.codes.shape[0] * SAMPLES_PER_FRAME
    assert np.abs(served.astype(np.int32) - expected.astype(np.int32)).max() <= 1


# ------------------------------------------------------------------ 3. finish_reason
def test_frame_cap_reports_length_in_the_header(servers):
    response = post(servers["custom_voice"], request_body("custom_voice", max_new_tokens=3, response_format="pcm"))
    assert response.status_code == 200
    assert response.headers["x-finish-reason"] == "length"
    assert len(response.content) // 2 == 3 * SAMPLES_PER_FRAME


def test_frame_cap_reports_length_in_the_sse_done_event(servers):
    body = request_body("custom_voice", max_new_tokens=3, stream=True, stream_format="sse", response_format="pcm")
    events = sse_events(post(servers["custom_voice"], body))
    assert events[-1]["type"] == "speech.audio.done"
    assert events[-1]["finish_reason"] == "length"
    assert sum(len(d) for d in delta_samples(events)) == 3 * SAMPLES_PER_FRAME


# ------------------------------------------------------------------ 4. concurrency
def test_concurrent_streams_each_get_their_single_request_codes_and_audio(servers):
    """Six streaming CustomVoice requests (different speakers, seeds, languages, lengths)
    run at once and each gets exactly the codes, and the audio (within 1 LSB), it gets
    alone: batching in the engine and the vocoder does not change any request's result.
    Afterwards no request state is left and every KV block is back in the pool."""
    server = servers["custom_voice"]
    speakers = ["aiden", "sohee", "ryan", "vivian", "serena", "uncle_fu"]
    languages = ["auto", "english", "auto", "chinese", "auto", "german"]
    bodies = [
        {"input": TEXT, "voice": speaker, "language": language, "seed": 100 + i,
         "max_new_tokens": 6 + i, "response_format": "pcm", "stream": True}
        for i, (speaker, language) in enumerate(zip(speakers, languages, strict=True))
    ]
    alone = [post(server, body) for body in bodies]
    batches_before, requests_before = engine_batches(server)
    with ThreadPoolExecutor(len(bodies)) as pool:
        together = list(pool.map(lambda body: post(server, body), bodies))
    batches_after, requests_after = engine_batches(server)
    # the engine did batch requests together (some step held more than one)
    assert requests_after - requests_before > batches_after - batches_before
    for i, (single, batched) in enumerate(zip(alone, together, strict=True)):
        assert torch.equal(codes_of(batched), codes_of(single)), i
        single_audio, batched_audio = pcm(single), pcm(batched)
        assert len(batched_audio) == len(single_audio) == (6 + i) * SAMPLES_PER_FRAME, i
        assert np.abs(batched_audio.astype(np.int32) - single_audio.astype(np.int32)).max() <= 1, i
    run_on_server_loop(server, assert_no_request_state(server.speech.pipeline))
    blocks = kv_blocks(server)
    assert blocks.num_free_blocks == blocks.num_blocks


# ------------------------------------------------------------------ 5. bad inputs
NOT_AUDIO = "data:audio/wav;base64," + base64.b64encode(b"this is not audio" * 20).decode()
X_VECTOR = {"x_vector_only_mode": True}
# (model type, fields, status, param, a word the message must contain)
BAD_INPUTS = [
    pytest.param("custom_voice", {"voice": "nobody"}, 400, "voice", "aiden", id="unknown_speaker"),
    pytest.param("voice_design", {}, 400, "instructions", "instructions", id="voice_design_without_instructions"),
    pytest.param("base", {"ref_audio": NOT_AUDIO, **X_VECTOR}, 400, "ref_audio", "ref_audio", id="undecodable_ref_audio"),
    # MAX_REF_SECONDS is applied as the media policy's duration cap: PayloadTooLargeError
    pytest.param(
        "base", {"ref_audio": wav_data_uri(tone_clip(31.0, channels=1)), **X_VECTOR}, 413, "ref_audio", "30",
        id="ref_audio_longer_than_30_s",
    ),
    pytest.param(
        "custom_voice", {"voice": "aiden", "language": "klingon"}, 400, "language", "english", id="unsupported_language"
    ),
    pytest.param(
        "custom_voice", {"voice": "aiden", "ref_audio": REF_AUDIO}, 400, "ref_audio", "ref_audio",
        id="ref_audio_on_custom_voice",
    ),
    pytest.param(
        "custom_voice", {"voice": "aiden", "initial_codec_chunk_frames": -1}, 400, "initial_codec_chunk_frames",
        "initial_codec_chunk_frames", id="negative_initial_codec_chunk_frames",
    ),
    pytest.param(
        "base", {"ref_audio": REF_AUDIO}, 400, "ref_text", "x_vector_only_mode",
        id="base_without_ref_text_or_x_vector_only_mode",
    ),
]
GOOD_VOICE = {model_type: fields for model_type, fields in CASES.values() if "ref_text" not in fields}


@pytest.mark.parametrize(("model_type", "fields", "status", "param", "mentioned"), BAD_INPUTS)
def test_bad_input_is_a_4xx_naming_the_field_and_serving_goes_on(
    servers, model_type, fields, status, param, mentioned
):
    server = servers[model_type]
    response = post(server, {"input": TEXT, "max_new_tokens": 2, **fields})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert mentioned in error["message"]
    after = post(server, {"input": TEXT, "max_new_tokens": 2, "response_format": "pcm", **GOOD_VOICE[model_type]})
    assert len(pcm(after)) == 2 * SAMPLES_PER_FRAME


def test_unknown_speaker_error_lists_every_speaker(servers):
    message = post(servers["custom_voice"], {"input": TEXT, "voice": "nobody"}).json()["error"]["message"]
    voices = httpx.get(f"{servers['custom_voice'].base_url}/v1/audio/voices").json()["voices"]
    assert len(voices) == 9 and all(v in message for v in voices)


def test_unsupported_language_error_lists_every_language(servers):
    body = {"input": TEXT, "voice": "aiden", "language": "klingon"}
    message = post(servers["custom_voice"], body).json()["error"]["message"]
    languages = httpx.get(f"{servers['custom_voice'].base_url}/v1/audio/voices").json()["languages"]
    assert "auto" in languages and all(language in message for language in languages)


# ------------------------------------------------------------------ 6. abort
def test_client_disconnect_after_first_chunk_leaves_no_state_and_frees_kv_blocks(servers):
    """A streaming client that leaves after its first chunk of a 2000-frame request: the
    request is aborted (counted as 499 "abort"), no stage, relay or coordinator holds it,
    every KV block is free again, and the server goes on serving."""
    server = servers["custom_voice"]
    aborts = abort_count(server)
    body = request_body("custom_voice", max_new_tokens=2000, response_format="pcm", stream=True)
    with httpx.stream("POST", f"{server.base_url}/v1/audio/speech", json=body, timeout=60) as response:
        assert response.status_code == 200
        first = next(response.iter_bytes())
        assert len(first) > 0
    run_on_server_loop(server, assert_no_request_state(server.speech.pipeline))
    blocks = kv_blocks(server)
    assert blocks.num_free_blocks == blocks.num_blocks
    assert abort_count(server) == aborts + 1  # aborted, not run to its 2000 frames
    after = post(server, request_body("custom_voice", max_new_tokens=2, response_format="pcm"))
    assert len(pcm(after)) == 2 * SAMPLES_PER_FRAME


# ------------------------------------------------------------------ 7. first chunk size
def test_default_chunk_plan_sends_one_frame_first(servers):
    """Each SSE delta is one vocoder chunk; the default ramp is 1, 2, 4, then 8 frames."""
    body = request_body("custom_voice", stream=True, stream_format="sse", response_format="pcm")
    events = sse_events(post(servers["custom_voice"], body))
    sizes = [len(d) for d in delta_samples(events)]
    assert sizes[0] == SAMPLES_PER_FRAME
    assert sizes == [n * SAMPLES_PER_FRAME for n in (1, 2, 4, FRAMES - 7)]


def test_initial_codec_chunk_frames_sets_the_first_chunk(servers):
    body = request_body("custom_voice", stream=True, stream_format="sse", response_format="pcm", initial_codec_chunk_frames=4)
    sizes = [len(d) for d in delta_samples(sse_events(post(servers["custom_voice"], body)))]
    assert sizes[0] == 4 * SAMPLES_PER_FRAME
    assert sum(sizes) == FRAMES * SAMPLES_PER_FRAME


# ------------------------------------------------------------------ 8. timeline
def phase_sums(server: RunningServer) -> dict[str, float]:
    """phase -> seconds recorded so far in omnistage_request_phase_seconds."""
    metrics = httpx.get(f"{server.base_url}/metrics").text
    return {
        m[1]: float(m[2])
        for m in re.finditer(
            r'^omnistage_request_phase_seconds_sum\{phase="([^"]+)"\} (\S+)$', metrics, re.M
        )
    }


def test_timeline_marks_are_ordered_and_its_phases_sum_to_the_ttfa(servers):
    """A streamed voice clone: the X-Timeline header lists the pipeline's marks in the
    order the request passes them, and the phases recorded server-side sum to the TTFA the
    server measured (the TTFA histogram's increase), phase by phase from receipt to the
    first byte."""
    server = servers["base"]
    phases_before = phase_sums(server)
    ttfa_before = metric(server, "omnistage_time_to_first_audio_seconds_sum")
    response = post(server, request_body("base_icl", response_format="pcm", stream=True))
    assert len(pcm(response)) == FRAMES * SAMPLES_PER_FRAME
    marks = parse_header(response.headers["x-timeline"])
    names = [name for name, _ in marks]
    assert names == [
        "received", "admitted", "reference_encoder.result", "preprocessing.first_output", "preprocessing.result",
        "tts_engine.prefill", "tts_engine.first_output", "vocoder.first_output",
    ]  # fmt: skip
    offsets = [ms for _, ms in marks]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    phases = {k: v - phases_before.get(k, 0.0) for k, v in phase_sums(server).items()}
    assert set(names[1:]) | {"first_byte"} <= set(phases)
    ttfa = metric(server, "omnistage_time_to_first_audio_seconds_sum") - ttfa_before
    assert ttfa > 0
    assert sum(phases.values()) == pytest.approx(ttfa, abs=1e-6)
    assert all(seconds >= 0 for seconds in phases.values())


ABORT_PHASES = ["admitted", "preprocessing.result", "tts_engine.prefill", "tts_engine.first_output", "vocoder.first_output"]


@pytest.mark.parametrize("phase", ABORT_PHASES)
def test_an_abort_at_any_phase_leaves_no_state_and_frees_every_slot(servers, phase):
    """A voice clone aborted as soon as its timeline reaches ``phase`` (before
    preprocessing, before admission into the engine, during the prefill, after the first
    frame, after the first audio chunk): no stage, relay or coordinator holds it, and the
    KV blocks and vocoder slots are all free again."""
    server = servers["base"]
    speech = server.speech
    body = Qwen3TTSSpeechRequest(**request_body("base_icl", max_new_tokens=400, stream=True, response_format="pcm"))
    model_request = speech.model.build_request(validate_speech_request(body, speech.capabilities), speech.settings.media_policy)

    async def abort_at_phase() -> None:
        pipeline = speech.pipeline
        handle = pipeline.submit(model_request)
        while handle.timeline.at(phase) is None:  # the coordinator records marks on this loop
            assert not handle.finished, f"the request ended before reaching {phase}"
            await asyncio.sleep(0)
        pipeline.abort(handle.request_id)
        with pytest.raises(RequestAbortedError):
            await handle.result()
        await assert_no_request_state(pipeline)

    run_on_server_loop(server, abort_at_phase())
    blocks = kv_blocks(server)
    assert blocks.num_free_blocks == blocks.num_blocks
    arena = speech.pipeline.host.stages["vocoder"].scheduler.decoder
    assert arena.num_free == arena.num_slots


# ------------------------------------------------------------------ WebSocket: live text
# A session's text enters its running generation as it arrives (one request, fed one token
# per frame). Exactness: the engine's codes of a session fed word by word equal those of
# the whole text sent to /v1/audio/speech in streaming text mode with the same seed, and the
# audio is within 1 LSB (the vocoder decodes the same codes in chunks of other sizes when
# frames come at other times). Equal codes also prove that a request whose text had not
# arrived was never fed a pad row in its place: the random talker's codes depend on every
# row it reads.

WORDS = ["Hi ", "you ", "all, ", "good ", "day."]
# ICL: 0.8 s of reference (11 codec rows with bos) and a 3-token transcript, so the
# prefill holds the first 8 tokens of the text (a WebSocket message holds at most 64 KiB)
CLIP = wav_data_uri(tone_clip(0.8, rate=8_000, channels=1), rate=8_000)
VOICES = {"custom_voice": {"voice": "aiden"}, "base": {"ref_audio": CLIP, "ref_text": "Hi."}}
FIELDS = {"seed": 11, "max_new_tokens": 24, "min_new_tokens": 24, "response_format": "pcm"}


@contextmanager
def open_session(server: RunningServer, model_type: str, **fields) -> Iterator[ClientConnection]:
    with connect(server.base_url.replace("http://", "ws://") + "/v1/audio/speech/stream") as ws:
        ws.send(json.dumps({"type": "session.config", **VOICES[model_type], **FIELDS, **fields}))
        started = json.loads(ws.recv(timeout=30))
        assert started["type"] == "session.started", started
        yield ws


def send(ws: ClientConnection, *deltas: str | None) -> None:
    """Text deltas; None is ``input.done``."""
    for delta in deltas:
        ws.send(json.dumps({"type": "input.done"} if delta is None else {"type": "input.text", "text": delta}))


def first_audio(ws: ClientConnection, events: list[dict]) -> bytes:
    """Wait for the session's first binary frame (its JSON events before it go to ``events``)."""
    while not isinstance(message := ws.recv(timeout=60), bytes):
        events.append(json.loads(message))
        assert events[-1]["type"] != "error", events[-1]
    return message


def rest(ws: ClientConnection, events: list[dict]) -> bytes:
    """Everything until the session ends: the binary frames joined (events to ``events``)."""
    audio = []
    while not events or events[-1]["type"] not in ("session.done", "error"):
        message = ws.recv(timeout=60)
        audio.append(message) if isinstance(message, bytes) else events.append(json.loads(message))
    return b"".join(audio)


def whole_text(server: RunningServer, model_type: str, **fields) -> tuple[np.ndarray, list]:
    """The whole text at once over HTTP, in streaming text mode: (samples, engine codes)."""
    body = {"input": "".join(WORDS), **VOICES[model_type], **FIELDS, "non_streaming_mode": False, **fields}
    response = httpx.post(f"{server.base_url}/v1/audio/speech", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return np.frombuffer(response.content, "<i2"), codes(response.headers["x-request-id"])


def codes(request_id: str) -> list:
    return [row for frame in ENGINE_FRAMES.get(request_id, []) for row in frame.tolist()]


def request_id_of(server: RunningServer) -> str:
    """The id of the one request in flight."""
    (request_id,) = server.speech.pipeline.coordinator.requests
    return request_id


def assert_same_audio(live: bytes, whole: np.ndarray) -> None:
    samples = np.frombuffer(live, "<i2").astype(np.int32)
    assert len(samples) == len(whole) > 0
    assert np.abs(samples - whole).max() <= 1


def leak_check(server: RunningServer) -> None:
    pipeline = server.speech.pipeline
    asyncio.run_coroutine_threadsafe(assert_no_request_state(pipeline), pipeline.coordinator.loop).result(timeout=15)


@pytest.mark.parametrize("model_type", list(VOICES))
def test_text_fed_word_by_word_is_the_whole_text_and_audio_starts_before_it_ends(servers, model_type):
    server = servers[model_type]
    whole, whole_codes = whole_text(server, model_type)
    events: list[dict] = []
    with open_session(server, model_type) as ws:
        send(ws, *WORDS[:-1])  # final so far: "Hi you all, good" (ICL's prefill takes 8)
        head = first_audio(ws, events)
        request_id = request_id_of(server)
        send(ws, WORDS[-1], None)  # the last word goes after audio came
        audio = head + rest(ws, events)
    assert events[-1]["type"] == "session.done" and events[-1]["segments"] == 1, events[-1]
    assert codes(request_id) == whole_codes
    assert_same_audio(audio, whole)
    leak_check(server)


def test_the_frame_cap_follows_the_whole_text(servers):
    """Without max_new_tokens the cap is the whole text's, known at input.done."""
    server = servers["custom_voice"]
    whole, whole_codes = whole_text(server, "custom_voice", max_new_tokens=None, min_new_tokens=None)
    events: list[dict] = []
    with open_session(server, "custom_voice", max_new_tokens=None, min_new_tokens=None) as ws:
        send(ws, *WORDS[:2])
        head = first_audio(ws, events)
        request_id = request_id_of(server)
        send(ws, *WORDS[2:], None)
        audio = head + rest(ws, events)
    assert codes(request_id) == whole_codes
    assert_same_audio(audio, whole)


def test_a_request_waiting_for_text_holds_back_no_other(servers):
    """Session A starts, then waits for its text; B runs from start to end meanwhile (its
    frames are batched with A's wait, A leaves the batch); A then finishes as if whole."""
    server = servers["custom_voice"]
    whole, whole_codes = whole_text(server, "custom_voice")
    events_a: list[dict] = []
    with open_session(server, "custom_voice") as a:
        send(a, *WORDS[:2])
        head = first_audio(a, events_a)
        waiting = request_id_of(server)
        events_b: list[dict] = []
        with open_session(server, "custom_voice") as b:
            send(b, *WORDS, None)
            audio_b = rest(b, events_b)
        assert events_b[-1]["type"] == "session.done", events_b[-1]
        assert waiting in server.speech.pipeline.coordinator.requests  # A still waits for text
        send(a, *WORDS[2:], None)
        audio_a = head + rest(a, events_a)
    assert codes(waiting) == whole_codes
    assert_same_audio(audio_a, whole)
    assert_same_audio(audio_b, whole)
    leak_check(server)


def test_a_client_that_leaves_while_its_request_waits_for_text_aborts_it(servers):
    server = servers["custom_voice"]
    with open_session(server, "custom_voice") as ws:
        send(ws, *WORDS[:2])
        first_audio(ws, [])
        request_id = request_id_of(server)
    leak_check(server)  # aborted everywhere: the engine's sequence and the vocoder's slot too
    assert request_id not in server.speech.pipeline.coordinator.requests


@pytest.mark.parametrize("delta", ["\x00", "\udc00"], ids=["nul", "lone_surrogate"])
def test_a_later_delta_the_input_checks_refuse_is_a_400_naming_text(servers, delta):
    """A delta into the running request gets the checks of ``input`` (a lone surrogate
    failed the engine's tokenizer: a 500; a NUL was spoken)."""
    server = servers["custom_voice"]
    events: list[dict] = []
    with open_session(server, "custom_voice") as ws:
        send(ws, *WORDS[:2])
        first_audio(ws, events)
        send(ws, delta)
        rest(ws, events)
    error = events[-1]
    assert error["type"] == "error" and error["error"]["code"] == 400, error
    assert error["error"]["param"] == "text", error
    leak_check(server)


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"non_streaming_mode": True}, "non_streaming_mode"), ({"task_type": "Base"}, "task_type"),
     ({"max_new_tokens": 8193}, "max_new_tokens"), ({"min_new_tokens": 25}, "min_new_tokens"),
     ({"instructions": " "}, "instructions")],
)
def test_the_models_own_checks_refuse_a_session_config_before_any_text(servers, fields, param):
    """session.started means every request of the session would pass the model's request
    builder, not only the framework's checks: a field it refuses is the session's first
    and only answer (closed 1008), and nothing was admitted."""
    server = servers["custom_voice"]
    with connect(server.base_url.replace("http://", "ws://") + "/v1/audio/speech/stream") as ws:
        ws.send(json.dumps({"type": "session.config", **VOICES["custom_voice"], **FIELDS, **fields}))
        error = json.loads(ws.recv(timeout=30))
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=30)
    assert error["type"] == "error" and error["error"]["param"] == param, error
    assert "segment_index" not in error
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
    assert not server.speech.pipeline.coordinator.requests


@pytest.mark.parametrize(
    "text",
    ["Hello world, it's 2024.", "a  b\n\nc", "\nx.y z", "Hi you all, good day.",
     # the tokenizer's added tokens, matched before its pre-tokenizer splits the text
     "<|im_end|>", "Hi <|im_end|> there", "a  <|im_end|> b", "<tts_pad>x y", "a<|endoftext|> b",
     "x <|im_start|>assistant\n y", "<|im but not a token", "ends in <|im"],
)  # fmt: skip
def test_final_tokens_grow_to_the_whole_texts_however_it_is_split(tiny_servable_checkpoints, text):
    checkpoint = load_checkpoint(str(tiny_servable_checkpoints["custom_voice"]), "cpu")
    prompt_tokens = PromptTokens(checkpoint.config, checkpoint.tokenizer)
    whole = prompt_tokens.target(text)
    for deltas in (list(text), text.split(" "), [text]):
        tokens = FinalTokens(prompt_tokens)
        for i, delta in enumerate(deltas):
            tokens.push(delta if i == len(deltas) - 1 or len(deltas) == len(text) else delta + " ")
            assert tokens.ids == whole[1][: len(tokens.ids)]
            assert tokens.role in (None, whole[0])
        assert tokens.finish() == whole
    tokens = FinalTokens(prompt_tokens)
    tokens.push("Hello wor")
    assert checkpoint.tokenizer.decode(tokens.ids) == "Hello"  # the last piece waits for more
