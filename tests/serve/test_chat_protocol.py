"""The chat contract's pure checks and media loading, model-free: what a chat model's
capabilities refuse (audio from a model without a talker, too many images, image kinds),
and chat media decoded in the decoder worker pool (images to RGB, bad data URIs)."""

from __future__ import annotations

import base64
import io
import struct
import zlib

import numpy as np
import pytest
import soundfile
from PIL import Image

from omnistage.core.errors import PayloadTooLargeError, RequestValidationError
from omnistage.serve.chat_media import ChatImage, ChatText, load_chat_inputs
from omnistage.serve.chat_protocol import (
    MAX_STOP_CHARS,
    ChatCapabilities,
    parse_chat_request,
    validate_chat_request,
)
from omnistage.serve.decoding import shared_pool
from omnistage.serve.media import MediaPolicy

TEXT_ONLY = ChatCapabilities(model_names=("toy",), model_type="toy")
SEEING = ChatCapabilities(model_names=("toy",), model_type="toy", input_modalities=frozenset({"text", "image"}), max_images=2)
HEARING = ChatCapabilities(model_names=("toy",), model_type="toy", input_modalities=frozenset({"text", "audio"}))


def png_uri(width: int = 6, height: int = 4) -> str:
    pixels = np.arange(width * height * 3, dtype=np.uint8).reshape(height, width, 3)
    buffer = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def image_message(*urls: str) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": "Look."}] + [
        {"type": "image_url", "image_url": {"url": url}} for url in urls
    ]}  # fmt: skip


def refused(body: dict, caps: ChatCapabilities, policy: MediaPolicy = MediaPolicy()) -> RequestValidationError:
    with pytest.raises(RequestValidationError) as excinfo:
        req = validate_chat_request(parse_chat_request(body), caps)
        load_chat_inputs(req, caps, policy)
    return excinfo.value


@pytest.mark.parametrize(
    "fields",
    [{"modalities": ["text", "audio"], "audio": {"voice": "x", "format": "wav"}}, {"modalities": ["text", "audio"]},
     {"audio": {"voice": "x", "format": "wav"}}],
)  # fmt: skip
def test_audio_from_a_model_without_a_talker_is_refused_naming_modalities(fields: dict) -> None:
    error = refused({"messages": [{"role": "user", "content": "Hi"}], **fields}, TEXT_ONLY)
    assert error.param == "modalities" and "no audio output" in str(error)


def test_more_images_than_the_model_takes_are_refused_at_the_first_extra_one() -> None:
    assert refused({"messages": [image_message(png_uri(), png_uri(), png_uri())]}, SEEING).param == "messages.0.content.3"


def test_images_are_decoded_to_rgb_in_the_decoder_pool() -> None:
    req = validate_chat_request(parse_chat_request({"messages": [image_message(png_uri(6, 4))]}), SEEING)
    (turn,) = load_chat_inputs(req, SEEING, MediaPolicy())
    text, image = turn.parts
    assert isinstance(text, ChatText) and text.text == "Look."
    assert isinstance(image, ChatImage) and image.rgb.shape == (4, 6, 3)
    np.testing.assert_array_equal(image.rgb.reshape(-1), np.arange(72, dtype=np.uint8))


@pytest.mark.parametrize("space", ["\n", "\r\n", " ", "\t"])  # MIME line breaks, spaces
def test_ascii_whitespace_in_an_images_base64_is_ignored(space: str) -> None:
    header, payload = png_uri(6, 4).split(",", 1)
    broken = header + "," + space.join(payload[i : i + 8] for i in range(0, len(payload), 8))
    req = validate_chat_request(parse_chat_request({"messages": [image_message(broken)]}), SEEING)
    (turn,) = load_chat_inputs(req, SEEING, MediaPolicy())
    np.testing.assert_array_equal(turn.parts[1].rgb.reshape(-1), np.arange(72, dtype=np.uint8))


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("data:image/png;base64,@@@@", "not valid base64"),  # refused by the decoder worker
        ("data:image/png;base64,QUJD=A==", "not valid base64"),  # padding inside: the worker
        ("data:image/png;base64,QUJ", "not valid base64"),  # a length not of 4k: the server
        ("data:image/png;base64,QUJ\u00e9", "not valid base64"),  # not ASCII: the server
        ("data:audio/wav;base64,AAAA", "is not image"),
        ("data:image/png,AAAA", "malformed data URI"),
        ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "could not be decoded as an image"),
        ("https://example.com/cat.png", "URL fetch is disabled"),
        ("/etc/passwd", "must be a data URI"),
    ],
)
def test_bad_image_urls_are_refused_naming_the_url(url: str, message: str) -> None:
    error = refused({"messages": [image_message(url)]}, SEEING)
    assert error.param == "messages.0.content.1.image_url.url" and message in str(error)


@pytest.mark.parametrize("payload", ["@@@@", "QUJ", "QUJ\u00e9"])  # the worker's; the server's
def test_an_image_urls_bad_base64_is_not_answered_with_audio_advice(payload: str) -> None:
    error = refused({"messages": [image_message("data:image/png;base64," + payload)]}, SEEING)
    assert "not valid base64" in str(error) and "audio" not in str(error)


def test_inline_images_are_capped_by_their_decoded_size_read_from_the_base64() -> None:
    five = "data:image/png;base64," + base64.b64encode(b"five!").decode()  # "Zml2ZSE=": 5 bytes
    with pytest.raises(PayloadTooLargeError) as excinfo:
        load_chat_inputs(validate_chat_request(parse_chat_request({"messages": [image_message(five)]}), SEEING),
                         SEEING, MediaPolicy(max_bytes=4))  # fmt: skip
    assert excinfo.value.param == "messages.0.content.1.image_url.url" and "5 bytes" in str(excinfo.value)
    error = refused({"messages": [image_message(five)]}, SEEING, MediaPolicy(max_bytes=5))  # within the cap
    assert "could not be decoded as an image" in str(error)


def test_an_image_above_the_pixel_cap_is_too_large() -> None:
    with pytest.raises(PayloadTooLargeError) as excinfo:
        req = validate_chat_request(parse_chat_request({"messages": [image_message(png_uri(64, 64))]}), SEEING)
        load_chat_inputs(req, SEEING, MediaPolicy(max_image_pixels=1000))
    assert excinfo.value.param == "messages.0.content.1.image_url.url"


def test_a_png_declaring_more_pixels_than_pillows_bomb_limit_is_too_large_not_undecodable() -> None:
    """A 20000x20000 header (Pillow's own DecompressionBombError starts at 2 x 89.5 M pixels)
    is refused by the pixel cap on its header, a 413, like any image above the cap; and a
    policy whose cap is above Pillow's limit lets such an image through to the decode."""
    raw = base64.b64decode(png_uri(2, 2).partition(",")[2])
    header = b"IHDR" + struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0)
    crc = struct.pack(">I", zlib.crc32(header))
    bomb = raw[:8] + struct.pack(">I", 13) + header + crc + raw[33:]
    uri = "data:image/png;base64," + base64.b64encode(bomb).decode()
    req = validate_chat_request(parse_chat_request({"messages": [image_message(uri)]}), SEEING)
    with pytest.raises(PayloadTooLargeError) as excinfo:
        load_chat_inputs(req, SEEING, MediaPolicy())
    assert excinfo.value.param == "messages.0.content.1.image_url.url"
    assert "20000x20000 pixels" in str(excinfo.value)
    big_cap = MediaPolicy(max_image_pixels=1 << 30)
    error = refused({"messages": [image_message(uri)]}, SEEING, big_cap)
    assert "DecompressionBomb" not in str(error)  # past the header: the truncated pixel data


@pytest.mark.parametrize("char", ["\u00a0", "\u2028", "\u200b", "\x0b", "\x1c", "-"])
def test_a_character_outside_base64_is_refused_naming_the_field_and_its_position(char: str) -> None:
    """Unicode whitespace (``str.split()`` dropped it silently), a zero-width space, ASCII
    control characters and URL-safe base64's ``-``: a 400 naming the field and where the
    character is in it, in an image's data URI and in an audio clip's plain base64."""
    header, payload = png_uri(6, 4).split(",", 1)
    at = len(header) + 1 + 8
    url = " " + header + "," + payload[:8] + "\n" + payload[8:16] + char + payload[16:]  # after a line break
    error = refused({"messages": [image_message(url)]}, SEEING)
    assert error.param == "messages.0.content.1.image_url.url"
    assert f"character {1 + at + 9} is U+{ord(char):04X}" in str(error), str(error)
    clip = wav_base64()
    data = clip[:12] + char + clip[12:]
    error = refused({"messages": [audio_message(data, "wav")]}, HEARING)
    assert error.param == "messages.0.content.0.input_audio.data"
    assert f"character 12 is U+{ord(char):04X}" in str(error) and "not valid base64" in str(error)


def test_an_image_at_the_pixel_cap_decodes_and_one_pixel_more_is_too_large() -> None:
    """The default caps agree (they did not: a 6000x5000 PNG within the 32 Mi pixel cap ran
    out of the 256 MiB every decode had, a 400, and its worker was retired): an image of
    exactly ``max_image_pixels`` decodes, on the same worker, and one of a pixel more is the
    pixel cap's 413. The PNGs are solid 16-bit RGBA, 0.27 MB each, made row by row; the
    worker peaks at 369 MiB resident, this test's process at ~+250 MiB (the 96 MiB RGB
    reply, read and decoded; measured by the suite's RSS report, 2026-12-02)."""
    policy = MediaPolicy()
    assert 8192 * 4096 == policy.max_image_pixels and 8283 * 4051 == policy.max_image_pixels + 1
    pool = shared_pool(policy.decode_workers)
    req = validate_chat_request(parse_chat_request({"messages": [image_message(solid_png_uri(8192, 4096))]}), SEEING)
    (turn,) = load_chat_inputs(req, SEEING, policy)
    assert turn.parts[1].rgb.shape == (4096, 8192, 3) and int(turn.parts[1].rgb[-1, -1, 0]) == 0x7F
    live = pool.pids
    del turn, req
    with pytest.raises(PayloadTooLargeError) as excinfo:
        req = validate_chat_request(parse_chat_request({"messages": [image_message(solid_png_uri(8283, 4051))]}), SEEING)
        load_chat_inputs(req, SEEING, policy)
    assert excinfo.value.param == "messages.0.content.1.image_url.url"
    assert f"8283x4051 pixels; the limit is {policy.max_image_pixels} pixels" in str(excinfo.value)
    assert pool.pids == live  # no worker retired, none replaced


def solid_png_uri(width: int, height: int) -> str:
    """A solid 16-bit RGBA PNG (every channel 0x7F7F) as a data URI, compressed row by row
    (its pixels are never all in memory)."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    row, deflate = b"\x00" + b"\x7f" * (width * 8), zlib.compressobj(9)
    pixels = b"".join([deflate.compress(row) for _ in range(height)] + [deflate.flush()])
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 16, 6, 0, 0, 0))
    return "data:image/png;base64," + base64.b64encode(png + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")).decode()


def wav_base64(container: str = "WAV") -> str:
    buffer = io.BytesIO()
    soundfile.write(buffer, np.zeros(1600, dtype=np.float32), 16000, format=container)
    return base64.b64encode(buffer.getvalue()).decode()


def audio_message(data: str, fmt: str) -> dict:
    return {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": data, "format": fmt}}]}


@pytest.mark.parametrize("fmt", ["wave", "WAV", "pcm16", "", "m4b"])
def test_an_unknown_input_audio_format_is_refused_naming_it(fmt: str) -> None:
    with pytest.raises(RequestValidationError) as excinfo:
        validate_chat_request(parse_chat_request({"messages": [audio_message(wav_base64(), fmt)]}), HEARING)
    assert excinfo.value.param == "messages.0.content.0.input_audio.format"
    assert f"{fmt!r} is not an audio format" in str(excinfo.value) and "'wav' or 'mp3'" in str(excinfo.value)


@pytest.mark.parametrize(("container", "declared"), [("WAV", "mp3"), ("FLAC", "wav"), ("OGG", "flac"), ("MP3", "wav")])
def test_audio_in_another_container_than_its_declared_format_is_refused(container: str, declared: str) -> None:
    error = refused({"messages": [audio_message(wav_base64(container), declared)]}, HEARING)
    assert error.param == "messages.0.content.0.input_audio.format"
    assert f"is {declared!r}, but messages.0.content.0.input_audio.data is a" in str(error), str(error)
    assert f"({container.lower()})" in str(error) and "checked strictly" in str(error)


@pytest.mark.parametrize(("container", "declared"), [("WAV", "wav"), ("MP3", "mp3"), ("FLAC", "flac"), ("OGG", "ogg")])
def test_audio_in_its_declared_format_decodes(container: str, declared: str) -> None:
    req = validate_chat_request(parse_chat_request({"messages": [audio_message(wav_base64(container), declared)]}), HEARING)
    (turn,) = load_chat_inputs(req, HEARING, MediaPolicy())
    assert turn.parts[0].sample_rate == 16000 and len(turn.parts[0].samples) > 0


def test_image_content_a_model_does_not_take_is_refused() -> None:
    error = refused({"messages": [image_message(png_uri())]}, TEXT_ONLY)
    assert error.param == "messages.0.content.1" and "does not take image input" in str(error)


def test_max_tokens_and_max_completion_tokens_must_agree() -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "max_completion_tokens": 4}
    assert refused(body, TEXT_ONLY).param == "max_completion_tokens"
    body["max_completion_tokens"] = 3
    assert parse_chat_request(body).completion_cap == 3


@pytest.mark.parametrize("stream", [False, None])
def test_stream_options_without_stream_are_refused_as_openai_refuses_them(stream) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "stream_options": {"include_usage": True}}
    if stream is not None:
        body["stream"] = stream
    error = refused(body, TEXT_ONLY)
    assert error.param == "stream_options" and "stream: true" in str(error)
    body["stream"] = True
    assert validate_chat_request(parse_chat_request(body), TEXT_ONLY).stream_options.include_usage


@pytest.mark.parametrize("obfuscation", [False, None])
def test_the_sdks_include_obfuscation_false_is_taken_and_true_refused(obfuscation) -> None:
    """The openai SDK's ``stream_options.include_obfuscation``: false (its bandwidth
    saving) changes nothing here, so it is taken; true asks for padding no chunk has."""
    options = {"include_usage": True, "include_obfuscation": obfuscation}
    body = {"messages": [{"role": "user", "content": "Hi"}], "stream": True, "stream_options": options}
    assert validate_chat_request(parse_chat_request(body), TEXT_ONLY).stream_options.include_usage
    body["stream_options"] = {**options, "include_obfuscation": True}
    assert refused(body, TEXT_ONLY).param == "stream_options.include_obfuscation"


def test_stop_from_a_model_that_does_not_declare_it_is_refused_naming_stop() -> None:
    error = refused({"messages": [{"role": "user", "content": "Hi"}], "stop": "."}, TEXT_ONLY)
    assert error.param == "stop" and "not supported" in str(error)


@pytest.mark.parametrize(
    ("stop", "param"),
    [(["a"] * 5, "stop"), ("", "stop"), (["a", ""], "stop.1"), (3, "stop"), ([None], "stop"),
     ("x" * (MAX_STOP_CHARS + 1), "stop"), (["a", "x" * (MAX_STOP_CHARS + 1)], "stop.1")],
)
def test_bad_stop_values_are_refused_naming_the_field(stop, param) -> None:
    caps = TEXT_ONLY.model_copy(update={"supported_fields": frozenset({"stop"})})
    assert refused({"messages": [{"role": "user", "content": "Hi"}], "stop": stop}, caps).param == param


def test_up_to_four_stop_strings_are_taken() -> None:
    caps = TEXT_ONLY.model_copy(update={"supported_fields": frozenset({"stop"})})
    body = {"messages": [{"role": "user", "content": "Hi"}], "stop": ["a", "b", "c", "d"]}
    assert validate_chat_request(parse_chat_request(body), caps).stop_sequences == ("a", "b", "c", "d")
    body["stop"] = "end"
    assert validate_chat_request(parse_chat_request(body), caps).stop_sequences == ("end",)
    body["stop"] = "x" * MAX_STOP_CHARS
    assert validate_chat_request(parse_chat_request(body), caps).stop_sequences == ("x" * MAX_STOP_CHARS,)


# ----------------------------------------------------------------- OpenAI fields at their defaults
HI = [{"role": "user", "content": "Hi"}]
#: What OpenAI clients send at the values that change nothing (the SDK sends null as null).
OPENAI_DEFAULTS = {
    "n": 1, "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "logprobs": False,
    "top_logprobs": 0, "response_format": {"type": "text"}, "store": False, "service_tier": "auto",
    "parallel_tool_calls": True, "metadata": {"app": "test", "run": "1"}, "user": "someone", "stream": False,
}  # fmt: skip


@pytest.mark.parametrize(("name", "value"), [*OPENAI_DEFAULTS.items(), *[(name, None) for name in OPENAI_DEFAULTS]])
def test_an_openai_field_at_a_value_of_no_effect_is_accepted(name, value) -> None:
    req = validate_chat_request(parse_chat_request({"messages": HI, name: value}), TEXT_ONLY)
    assert req.n == 1 and req.stream is False


def test_all_openai_defaults_together_are_accepted() -> None:
    body = {"messages": HI, **OPENAI_DEFAULTS, "service_tier": "default", "parallel_tool_calls": False}
    validate_chat_request(parse_chat_request(body), TEXT_ONLY)


@pytest.mark.parametrize(
    ("fields", "param", "why"),
    [
        ({"n": 2}, "n", "one choice per request"),
        ({"frequency_penalty": 0.5}, "frequency_penalty", "no presence or frequency penalty"),
        ({"presence_penalty": -1}, "presence_penalty", "no presence or frequency penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty", "less than or equal to 2"),
        ({"logit_bias": {"42": 5}}, "logit_bias", "not supported"),
        ({"logprobs": True}, "logprobs", "not returned"),
        ({"top_logprobs": 3}, "top_logprobs", "not returned"),
        ({"store": True}, "store", "not stored"),
        ({"service_tier": "flex"}, "service_tier", "one processing tier"),
        ({"service_tier": "priority"}, "service_tier", "one processing tier"),
        ({"response_format": {"type": "json_object"}}, "response_format.type", "structured output"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
         "response_format.type", "structured output"),
        ({"response_format": {"type": "yaml"}}, "response_format.type", "'text', 'json_object' or 'json_schema'"),
        ({"metadata": {"k": 1}}, "metadata.k", "valid string"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tool calling is not supported"),
        ({"tool_choice": "none"}, "tool_choice", "tool calling is not supported"),
        ({"reasoning_effort": "low"}, "reasoning_effort", "reasoning-effort"),
    ],
)  # fmt: skip
def test_a_value_this_server_cannot_honour_is_refused_naming_the_field_and_why(fields, param, why) -> None:
    error = refused({"messages": HI, **fields}, TEXT_ONLY)
    assert error.param == param and why in str(error), str(error)


def test_an_unserved_openai_field_left_null_is_unset() -> None:
    validate_chat_request(parse_chat_request({"messages": HI, "tools": None, "tool_choice": None}), TEXT_ONLY)


def test_metadata_is_held_to_openais_limits() -> None:
    at_limits = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    validate_chat_request(parse_chat_request({"messages": HI, "metadata": at_limits}), TEXT_ONLY)
    assert refused({"messages": HI, "metadata": {**at_limits, "extra": ""}}, TEXT_ONLY).param == "metadata"
    assert refused({"messages": HI, "metadata": {"k" * 65: ""}}, TEXT_ONLY).param == "metadata"
    assert refused({"messages": HI, "metadata": {"key": "v" * 513}}, TEXT_ONLY).param == "metadata.key"


def test_an_assistant_message_with_null_content_reads_as_no_text() -> None:
    body = {"messages": [*HI, {"role": "assistant", "content": None}, {"role": "user", "content": "Again"}]}
    req = validate_chat_request(parse_chat_request(body), TEXT_ONLY)
    assert req.messages[1].content == []
    turns = load_chat_inputs(req, TEXT_ONLY, MediaPolicy())
    assert [(t.role, t.parts) for t in turns][1] == ("assistant", ())


@pytest.mark.parametrize("role", ["user", "system", "developer"])
def test_null_content_outside_an_assistant_message_is_refused_naming_it(role) -> None:
    body = {"messages": [{"role": role, "content": None}, *HI]}
    error = refused(body, TEXT_ONLY)
    assert error.param == "messages.0.content" and f"a {role} message needs content" in str(error)


def test_a_spoken_reply_echoed_back_whole_reads_as_its_text() -> None:
    """The SDK's reply message sent back as history: ``content`` is its transcript."""
    reply = {"role": "assistant", "content": "Hello!", "audio": {"id": "audio_1", "data": "AAAA", "expires_at": 1, "transcript": "Hello!"}}
    req = validate_chat_request(parse_chat_request({"messages": [*HI, reply, *HI]}), TEXT_ONLY)
    assert [p.text for p in req.messages[1].content] == ["Hello!"]


@pytest.mark.parametrize(
    ("echo", "param"),
    [
        ({"content": None, "audio": {"id": "audio_1"}}, "messages.1.audio"),  # OpenAI's audio-by-id turn
        ({"content": "x", "tool_calls": [{"id": "c", "type": "function"}]}, "messages.1.tool_calls"),
        ({"content": "x", "function_call": {"name": "f", "arguments": "{}"}}, "messages.1.function_call"),
        ({"content": None, "refusal": "I can't."}, "messages.1.refusal"),
    ],
)
def test_an_assistant_echo_this_server_cannot_honour_is_refused_naming_it(echo, param) -> None:
    body = {"messages": [*HI, {"role": "assistant", **echo}, *HI]}
    assert refused(body, TEXT_ONLY).param == param


def test_empty_assistant_echoes_are_accepted() -> None:
    echo = {"role": "assistant", "content": "x", "audio": None, "refusal": None, "tool_calls": [], "function_call": None}
    validate_chat_request(parse_chat_request({"messages": [*HI, echo, *HI]}), TEXT_ONLY)
