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
from PIL import Image

from omnistage.core.errors import PayloadTooLargeError, RequestValidationError
from omnistage.serve.chat_media import ChatImage, ChatText, load_chat_inputs
from omnistage.serve.chat_protocol import (
    MAX_STOP_CHARS,
    ChatCapabilities,
    parse_chat_request,
    validate_chat_request,
)
from omnistage.serve.media import MediaPolicy

TEXT_ONLY = ChatCapabilities(model_names=("toy",), model_type="toy")
SEEING = ChatCapabilities(model_names=("toy",), model_type="toy", input_modalities=frozenset({"text", "image"}), max_images=2)


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


@pytest.mark.parametrize("space", ["\n", "\r\n", " ", "\t", "\x1c"])  # what str.split() removes
def test_whitespace_in_an_images_base64_is_ignored(space: str) -> None:
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


def test_image_content_a_model_does_not_take_is_refused() -> None:
    error = refused({"messages": [image_message(png_uri())]}, TEXT_ONLY)
    assert error.param == "messages.0.content.1" and "does not take image input" in str(error)


def test_max_tokens_and_max_completion_tokens_must_agree() -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "max_completion_tokens": 4}
    assert refused(body, TEXT_ONLY).param == "max_completion_tokens"
    body["max_completion_tokens"] = 3
    assert parse_chat_request(body).completion_cap == 3


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
