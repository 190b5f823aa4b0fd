"""``POST /v1/chat/completions`` served by ``omnistage serve`` for the tiny random Qwen3-Omni
(``--load-format dummy``), spoken to with the OpenAI SDK: text, text + audio, streamed audio
deltas with usage, system prompts, audio input, the 4xx cases (before any stage runs),
routing (a text-only request never reaches talker or code2wav), the talker's cap in
proportion to the reply, and a client that leaves mid-stream (nothing left behind)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import soundfile
import yaml
from omni_fixtures import openai_client, serve_dummy, video_file, weights_digest
from PIL import Image
from safetensors import safe_open
from typer.testing import CliRunner

from omnistage.cli.main import app as cli
from omnistage.models.qwen3_omni.processing import (
    ChatMessage,
    ChatPart,
    Qwen3OmniProcessor,
    decode_video,
)
from omnistage.models.qwen3_omni.random_checkpoint import write_random_checkpoint
from omnistage.models.qwen3_omni.random_text_tokenizer import (
    give_role_words_their_ids,
    write_text_tokenizer,
)
from omnistage.models.qwen3_omni.stages import talker_frame_cap
from omnistage.testing.leaks import assert_no_request_state
from omnistage.testing.metrics import stage_batch_totals
from tests.serve.conftest import RunningServer

SAMPLES_PER_FRAME, CODE2WAV_TRIM = 1920, 555  # n frames -> n * 1920 - 555 samples at 24 kHz
HELLO = [{"role": "user", "content": "Say something nice."}]
SPEECH = {"modalities": ["text", "audio"], "audio": {"voice": "Ethan", "format": "wav"}}
CHAT_FIXTURE = Path(__file__).parent / "fixtures" / "chat_reference.safetensors"
IM_END = 151645
STAGES = ("preprocessing", "audio_encoder", "thinker", "decode", "talker", "code2wav")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = write_random_checkpoint(tmp_path_factory.mktemp("omni_chat"), "tiny", seed=0)
    write_text_tokenizer(directory)
    give_role_words_their_ids(directory)
    return directory


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[RunningServer]:
    yield from serve_dummy(checkpoint)


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai_client(server)


def batches(server: RunningServer) -> dict[str, float]:
    """Batches each stage computed so far (the server's own metric)."""
    registry = server.app.state.server.metrics.registry
    return {s: stage_batch_totals(registry, s)[0] for s in STAGES}


def assert_nothing_left(server: RunningServer) -> None:
    pipeline = server.app.state.server.pipeline
    asyncio.run_coroutine_threadsafe(assert_no_request_state(pipeline), pipeline.coordinator.loop).result(30)


def wav_clip(seconds: float, rate: int = 16000) -> str:
    """A tone with a little noise as base64 WAV (float samples: decoded exactly)."""
    t = np.arange(int(seconds * rate)) / rate
    noise = np.random.default_rng(0).normal(0, 0.01, t.shape)
    buffer = io.BytesIO()
    soundfile.write(buffer, (0.3 * np.sin(2 * np.pi * 220 * t) + noise).astype(np.float32), rate, format="WAV", subtype="FLOAT")
    return base64.b64encode(buffer.getvalue()).decode()


def png_uri(size: int, height: int | None = None) -> str:
    """A random RGB PNG of ``size`` x ``height`` pixels (``height`` None: square)."""
    pixels = np.random.default_rng(size).integers(0, 256, (height or size, size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def mp4_uri(frames: int, rate: int, with_audio: bool = False, size: tuple[int, int] = (64, 48)) -> str:
    return "data:video/mp4;base64," + base64.b64encode(video_file(frames, rate, with_audio, size)).decode()


def test_models_and_voices_list_the_chat_model_and_its_speakers(server, client, checkpoint) -> None:
    assert [m.id for m in client.models.list().data] == [checkpoint.name, "qwen3-omni"]
    voices = httpx.get(f"{server.base_url}/v1/audio/voices").json()
    assert voices["voices"] == ["chelsie", "ethan", "aiden"] and voices["audio_output"] is True
    assert voices["stream_audio_formats"] == ["pcm16"] and "max_audio_seconds" in voices["fields"]


def test_text_only_chat_never_reaches_the_talker(server, client) -> None:
    before = batches(server)
    reply = client.chat.completions.create(model="qwen3-omni", messages=HELLO, max_tokens=6)
    after = batches(server)
    choice = reply.choices[0]
    assert choice.message.content and choice.message.audio is None
    assert choice.finish_reason == "length"  # random weights never say <|im_end|> in 6 tokens
    assert reply.usage.completion_tokens == reply.usage.completion_tokens_details.text_tokens == 6
    assert reply.usage.completion_tokens_details.audio_tokens == 0
    assert after["thinker"] > before["thinker"] and after["decode"] > before["decode"]
    assert after["talker"] == before["talker"] and after["code2wav"] == before["code2wav"]
    assert_nothing_left(server)


def test_spoken_reply_is_a_wav_of_the_talker_frames_capped_by_the_reply(server, client) -> None:
    reply = client.chat.completions.create(model="qwen3-omni", messages=HELLO, max_tokens=6, **SPEECH)
    message, usage = reply.choices[0].message, reply.usage
    assert message.audio.transcript == message.content and message.content
    samples, rate = soundfile.read(io.BytesIO(base64.b64decode(message.audio.data)), dtype="float32")
    frames = usage.completion_tokens_details.audio_tokens
    assert rate == 24000 and len(samples) == frames * SAMPLES_PER_FRAME - CODE2WAV_TRIM
    # the random talker never samples its EOS: it stops at the reply-proportional cap
    assert frames == talker_frame_cap(6) and reply.choices[0].finish_reason == "length"
    assert usage.completion_tokens == 6 + frames
    assert_nothing_left(server)


def test_streamed_reply_equals_the_whole_reply_and_ends_with_usage(server, client) -> None:
    whole = client.chat.completions.create(
        model="qwen3-omni", messages=HELLO, max_tokens=5, modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "pcm16"},
    )  # fmt: skip
    chunks = list(client.chat.completions.create(
        model="qwen3-omni", messages=HELLO, max_tokens=5, modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "pcm16"}, stream=True, stream_options={"include_usage": True},
    ))  # fmt: skip
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    text = "".join(d.content or "" for d in deltas)
    audio = [d.audio.model_dump() for d in deltas if d.audio is not None]
    pcm = b"".join(base64.b64decode(a["data"]) for a in audio if a.get("data"))
    assert text == whole.choices[0].message.content
    assert len([a for a in audio if a.get("data")]) >= 2  # audio streams in pieces
    # streamed == whole: the same samples; the whole reply's code2wav decodes offline, the
    # stream's in chunks, so a float32 rounding may flip the 16-bit value by one step
    streamed = np.frombuffer(pcm, np.int16).astype(np.int32)
    offline = np.frombuffer(base64.b64decode(whole.choices[0].message.audio.data), np.int16).astype(np.int32)
    assert streamed.shape == offline.shape and np.abs(streamed - offline).max() <= 1
    assert audio[-1]["transcript"] == text and audio[-1]["expires_at"] > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not chunks[-1].choices and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert_nothing_left(server)


def first_audio_observations(server: RunningServer) -> tuple[float, float, dict[str, float]]:
    """The server's TTFA count and sum (s), and the sum (s) of each TTFA phase so far."""
    registry = server.app.state.server.metrics.registry
    phases = {
        sample.labels["phase"]: sample.value for family in registry.collect() for sample in family.samples
        if sample.name == "omnistage_request_phase_seconds_sum"
    }  # fmt: skip
    count = registry.get_sample_value("omnistage_time_to_first_audio_seconds_count") or 0.0
    return count, registry.get_sample_value("omnistage_time_to_first_audio_seconds_sum") or 0.0, phases


def test_a_spoken_reply_records_its_ttfa_decomposed_into_phases(server, client) -> None:
    count, total, phases = first_audio_observations(server)
    client.chat.completions.create(model="qwen3-omni", messages=HELLO, max_tokens=4)
    assert first_audio_observations(server)[:2] == (count, total)  # no audio, no TTFA
    stream = client.chat.completions.create(
        model="qwen3-omni", messages=HELLO, max_tokens=4, modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "pcm16"}, stream=True,
    )  # fmt: skip
    assert any(c.choices and c.choices[0].delta.audio for c in stream)
    after_count, after_total, after_phases = first_audio_observations(server)
    grown = {name: seconds - phases.get(name, 0.0) for name, seconds in after_phases.items()}
    grown = {name: seconds for name, seconds in grown.items() if seconds > 0}
    assert after_count == count + 1
    # one request's phases: from admission through the thinker, talker and code2wav to the byte
    assert {"admitted", "thinker.first_output", "talker.first_output", "code2wav.first_output", "first_byte"} <= set(grown)
    assert sum(grown.values()) == pytest.approx(after_total - total, abs=1e-6)
    assert_nothing_left(server)


def test_system_prompt_image_and_audio_input_are_in_the_prompt(client, checkpoint) -> None:
    system = [{"role": "system", "content": "You are brief."}, *HELLO]
    clip = wav_clip(1.0)
    heard = [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": clip, "format": "wav"}},
        {"type": "text", "text": "What is this?"},
    ]}]  # fmt: skip
    processor = Qwen3OmniProcessor.from_checkpoint(checkpoint)
    samples = soundfile.read(io.BytesIO(base64.b64decode(clip)), dtype="float32")[0]
    expected = {
        "system": processor([ChatMessage("system", (ChatPart("text", text="You are brief."),)),
                             ChatMessage("user", (ChatPart("text", text="Say something nice."),))]),
        "audio": processor([ChatMessage("user", (ChatPart("audio", audio=samples), ChatPart("text", text="What is this?")))]),
    }  # fmt: skip
    image = png_uri(64)
    seen = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "What is this?"}]}]
    pixels = Image.open(io.BytesIO(base64.b64decode(image.split(",", 1)[1]))).convert("RGB")
    expected["image"] = processor([ChatMessage("user", (ChatPart("image", image=pixels), ChatPart("text", text="What is this?")))])
    for name, messages in (("system", system), ("audio", heard), ("image", seen)):
        reply = client.chat.completions.create(model="qwen3-omni", messages=messages, max_tokens=3)
        assert reply.usage.prompt_tokens == expected[name].input_ids.shape[0], name
        assert media_positions(reply.usage) == pads(processor, expected[name].input_ids), name
        assert reply.choices[0].message.content


def media_positions(usage) -> tuple[int, int]:
    """``usage.prompt_tokens_details``' audio and image counts."""
    details = usage.prompt_tokens_details
    return details.audio_tokens, details.image_tokens


def pads(processor: Qwen3OmniProcessor, input_ids) -> tuple[int, int]:
    """The processor's prompt's audio pads and image + video pads."""
    ids, pad = input_ids.tolist(), processor.tokenizer.convert_tokens_to_ids
    return ids.count(pad("<|audio_pad|>")), ids.count(pad("<|image_pad|>")) + ids.count(pad("<|video_pad|>"))


@pytest.mark.parametrize("with_audio", [False, True])
def test_video_input_is_in_the_prompt_as_the_processor_samples_it(server, client, checkpoint, with_audio) -> None:
    uri = mp4_uri(8, 4, with_audio)
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": uri}}, {"type": "text", "text": "What happens?"}]}]
    processor = Qwen3OmniProcessor.from_checkpoint(checkpoint)
    video = decode_video(base64.b64decode(uri.split(",", 1)[1]), "video", processor.video, with_audio=with_audio)
    assert video.frames.shape == (4, 48, 64, 3)  # 2 s at 2 fps
    expected = processor([ChatMessage("user", (ChatPart("video", video=video, use_audio=with_audio), ChatPart("text", text="What happens?")))])
    before = batches(server)
    reply = client.chat.completions.create(
        model="qwen3-omni", messages=messages, max_tokens=2, extra_body={"use_audio_in_video": True} if with_audio else None
    )
    assert reply.usage.prompt_tokens == expected.input_ids.shape[0]
    audio, vision = media_positions(reply.usage)
    assert (audio, vision) == pads(processor, expected.input_ids) and vision > 0 and (audio > 0) == with_audio
    assert reply.choices[0].message.content
    assert (batches(server)["audio_encoder"] > before["audio_encoder"]) == with_audio
    assert_nothing_left(server)


def _error(excinfo: pytest.ExceptionInfo) -> tuple[int, str | None]:
    exc = excinfo.value
    return exc.status_code, exc.body["param"]


@pytest.mark.parametrize(
    ("fields", "status", "param"),
    [
        ({"audio": {"voice": "nobody", "format": "wav"}, "modalities": ["text", "audio"]}, 400, "audio.voice"),
        ({"audio": {"voice": "ethan", "format": "mp3"}, "modalities": ["text", "audio"], "stream": True}, 400, "audio.format"),
        ({"audio": {"voice": "ethan", "format": "ogg"}, "modalities": ["text", "audio"]}, 400, "audio.format"),
        ({"modalities": ["text", "audio"]}, 400, "audio"),
        ({"modalities": ["audio"]}, 400, "modalities"),
        ({"max_tokens": 10**6}, 400, "max_tokens"),
        ({"stop": ["."] * 5}, 400, "stop"),
        ({"n": 2}, 400, "n"),
        ({"seed": 2**40}, 400, "seed"),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "!!notbase64", "format": "wav"}}]}]},
         400, "messages.0.content.0.input_audio.data"),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": base64.b64encode(b"not audio at all").decode(), "format": "wav"}}]}]},
         400, "messages.0.content.0.input_audio.data"),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": wav_clip(61.0, 8000), "format": "wav"}}]}]},
         413, "messages.0.content.0.input_audio.data"),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": wav_clip(0.01), "format": "wav"}}] * 5}]},
         400, "messages.0.content.4"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]},
         400, "messages.0.content.0.image_url.url"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:text/plain;base64,AAAA"}}]}]},
         400, "messages.0.content.0.image_url.url"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]}]},
         400, "messages.0.content.0.image_url.url"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_uri(4)}}] * 9}]},
         400, "messages.0.content.8"),
        ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}]}]},
         400, "messages.0.content.0.video_url.url"),
        ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": mp4_uri(61, 1)}}]}]},
         413, "messages.0.content.0.video_url.url"),
        ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": mp4_uri(8, 4)}}]}], "extra_body": {"use_audio_in_video": True}},
         400, "messages.0.content.0.video_url.url"),
        ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": mp4_uri(8, 4)}}] * 2}]},
         400, "messages.0.content.1"),
        # an aspect ratio over 200 (transformers' smart_resize raises a ValueError: was a 500)
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_uri(1, 201)}}]}]},
         400, "messages.0.content.0"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_uri(5000, 2)}}]}]},
         400, "messages.0.content.0"),
        ({"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": mp4_uri(4, 2, size=(3600, 16))}}]}]},
         400, "messages.0.content.0.video_url.url"),
        ({"messages": [{"role": "user", "content": [{"type": "sticker"}]}]}, 400, "messages.0.content.0"),
        ({"messages": [{"role": "assistant", "content": "Hi."}]}, 400, "messages.0.role"),
        ({"frequency_penalty": 1.0}, 400, "frequency_penalty"),
        ({"presence_penalty": 0.5}, 400, "presence_penalty"),
        ({"logprobs": True, "top_logprobs": 2}, 400, "logprobs"),
        ({"store": True}, 400, "store"),
        ({"response_format": {"type": "json_object"}}, 400, "response_format.type"),
        ({"service_tier": "flex"}, 400, "service_tier"),
        ({"metadata": {str(i): "v" for i in range(17)}}, 400, "metadata"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
        ({"messages": [{"role": "user", "content": None}]}, 400, "messages.0.content"),
        ({"messages": [*HELLO, {"role": "assistant", "content": None, "audio": {"id": "audio_1"}}, *HELLO]}, 400, "messages.1.audio"),
    ],
)  # fmt: skip
def test_bad_requests_are_refused_naming_the_field_before_any_stage_runs(server, client, fields, status, param) -> None:
    body = {"model": "qwen3-omni", "messages": HELLO, "max_tokens": 2, **fields}
    before = batches(server)
    with pytest.raises(openai.APIStatusError) as excinfo:
        client.chat.completions.create(**body)
    assert _error(excinfo) == (status, param), excinfo.value.body
    assert excinfo.value.body["type"] == "invalid_request_error"
    assert batches(server) == before
    assert_nothing_left(server)


#: What OpenAI clients send at the values that change nothing (the SDK sends None as null).
OPENAI_DEFAULTS = {
    "n": 1, "frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}, "logprobs": False,
    "top_logprobs": None, "response_format": {"type": "text"}, "store": False, "service_tier": "auto",
    "parallel_tool_calls": True, "metadata": {"app": "omnistage-tests"}, "user": "someone", "stream": False,
}  # fmt: skip


def test_an_openai_client_sending_the_defaults_gets_the_reply_it_gets_without_them(client) -> None:
    plain = client.chat.completions.create(model="qwen3-omni", messages=HELLO, max_tokens=4)
    with_defaults = client.chat.completions.create(model="qwen3-omni", messages=HELLO, max_tokens=4, **OPENAI_DEFAULTS)
    assert with_defaults.choices[0].message.content == plain.choices[0].message.content
    assert with_defaults.usage.model_dump() == plain.usage.model_dump()


def test_a_reply_sent_back_as_history_by_the_sdk_is_taken(server, client) -> None:
    """The SDK's reply message object in the next request's messages (it echoes the reply's
    ``audio: null``); an assistant turn with ``content: None`` reads as an empty turn."""
    first = client.chat.completions.create(model="qwen3-omni", messages=HELLO, max_tokens=3)
    again = [{"role": "user", "content": "Again."}]
    echoed = client.chat.completions.create(
        model="qwen3-omni", messages=[*HELLO, first.choices[0].message, *again], max_tokens=3
    )
    as_text = client.chat.completions.create(
        model="qwen3-omni", messages=[*HELLO, {"role": "assistant", "content": first.choices[0].message.content}, *again],
        max_tokens=3,
    )  # fmt: skip
    assert echoed.choices[0].message.content == as_text.choices[0].message.content
    assert echoed.usage.prompt_tokens == as_text.usage.prompt_tokens
    null = client.chat.completions.create(
        model="qwen3-omni", messages=[*HELLO, {"role": "assistant", "content": None}, *again], max_tokens=3
    )
    empty = client.chat.completions.create(
        model="qwen3-omni", messages=[*HELLO, {"role": "assistant", "content": ""}, *again], max_tokens=3
    )
    assert null.usage.prompt_tokens == empty.usage.prompt_tokens < as_text.usage.prompt_tokens
    assert null.choices[0].message.content == empty.choices[0].message.content
    assert_nothing_left(server)


def test_a_client_leaving_while_the_thinker_streams_to_the_talker_leaves_nothing(server) -> None:
    body = {"model": "qwen3-omni", "messages": HELLO, "max_tokens": 200, "stream": True,
            "modalities": ["text", "audio"], "audio": {"voice": "ethan", "format": "pcm16"}}  # fmt: skip
    with httpx.stream("POST", f"{server.base_url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and '"audio"' in line and '"data"' in line:
                break  # the talker speaks while the thinker still writes (200 tokens)
        else:
            pytest.fail("no audio delta came")
        events = json.loads(line[6:])
        assert events["choices"][0]["delta"]["audio"]["data"]
    assert_nothing_left(server)
    registry = server.app.state.server.metrics.registry
    assert registry.get_sample_value("omnistage_requests_total", {"status": "499", "finish_reason": "abort"}) == 1


def test_whole_served_request_equals_transformers_generate(client, checkpoint) -> None:
    """The fixture of tools/parity/qwen3_omni_chat_reference.py: transformers' greedy
    ``generate`` (thinker tokens and the talker's waveform) on the same seed-0 weights."""
    with safe_open(str(CHAT_FIXTURE), framework="pt") as f:
        ref = {name: f.get_tensor(name) for name in f.keys()}
        meta = json.loads(f.metadata()["meta"])
    assert meta["digest"] == weights_digest(checkpoint)
    reply = client.chat.completions.create(
        model="qwen3-omni", messages=meta["messages"], max_tokens=meta["thinker_tokens"],
        modalities=["text", "audio"], audio={"voice": meta["speaker"], "format": "pcm16"},
        extra_body={"max_audio_seconds": meta["talker_frames"] / 12.5},
    )  # fmt: skip
    tokens = ref["tokens"][ref["tokens"] != IM_END]
    tokenizer = Qwen3OmniProcessor.from_checkpoint(checkpoint).tokenizer
    assert reply.usage.prompt_tokens == ref["ids"].shape[0]
    assert reply.usage.completion_tokens_details.text_tokens == tokens.shape[0]
    assert reply.choices[0].message.content == tokenizer.decode(tokens.tolist(), skip_special_tokens=True)
    samples = np.frombuffer(base64.b64decode(reply.choices[0].message.audio.data), np.int16) / 32767.0
    assert reply.usage.completion_tokens_details.audio_tokens == meta["talker_frames"]
    assert samples.shape == ref["waveform"].shape
    np.testing.assert_allclose(samples, ref["waveform"].numpy(), rtol=0, atol=1e-4)  # 16-bit output: 3e-5 a step


def test_load_format_dummy_reaches_the_weighted_stages_from_the_cli(checkpoint) -> None:
    result = CliRunner().invoke(cli, ["config", "resolve", "--model-path", str(checkpoint), "--load-format", "dummy"])
    assert result.exit_code == 0, result.output
    stages = yaml.safe_load(result.stdout)["stages"]
    loads = {s["name"]: s["factory"]["args"].get("load_format") for s in stages}
    assert loads == {"code2wav": "dummy", "preprocessing": None, "audio_encoder": "dummy",
                     "image_encoder": "dummy", "thinker": "dummy", "decode": None, "talker": "dummy"}  # fmt: skip
