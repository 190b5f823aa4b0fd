"""Qwen3-Omni chat inputs: equal to transformers' Qwen3OmniMoeProcessor (fixture from
tools/parity/qwen3_omni_encoders_reference.py), video sampling and patches, and errors that
name the field."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from encoder_fixtures import load_fixture
from omni_fixtures import video_file
from PIL import Image

from omnistage.core.errors import RequestValidationError
from omnistage.models.qwen3_omni.parity_inputs import chat_media
from omnistage.models.qwen3_omni.processing import (
    ChatMessage,
    ChatPart,
    DecodedVideo,
    Qwen3OmniProcessor,
    VideoSampling,
    decode_image,
    decode_video,
)
from omnistage.models.qwen3_omni.random_text_tokenizer import write_text_tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("omni_tokenizer")
    write_text_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def processor(checkpoint: Path) -> Qwen3OmniProcessor:
    return Qwen3OmniProcessor.from_checkpoint(checkpoint)


def _messages() -> list[ChatMessage]:
    clips, images = chat_media()
    image = [Image.fromarray(i) for i in images]
    return [
        ChatMessage("system", (ChatPart("text", text="You are brief."),)),
        ChatMessage(
            "user",
            (
                ChatPart("audio", audio=clips[0]), ChatPart("image", image=image[0]),
                ChatPart("text", text="Compare these."), ChatPart("audio", audio=clips[1]),
                ChatPart("image", image=image[1]),
            ),
        ),
    ]  # fmt: skip


def test_prompt_and_features_equal_the_transformers_processor(processor) -> None:
    reference = load_fixture("processing.npz")
    out = processor(_messages())
    assert out.input_ids.tolist() == reference["input_ids"].tolist()
    mask = torch.from_numpy(reference["feature_attention_mask"]).bool()
    assert out.audio_frames.tolist() == mask.sum(-1).tolist()
    features = torch.from_numpy(reference["input_features"])
    expected = torch.cat([f[:, m] for f, m in zip(features, mask, strict=True)], dim=1)
    # The same WhisperFeatureExtractor on both sides, but the fixture's numpy FFT may be
    # another release's: float32 log-mels (magnitude ~1) then differ by a few 1e-6 (4.1e-6
    # with numpy 2.4.6), far below what a wrong window, hop or mel filter would move.
    torch.testing.assert_close(out.audio_features, expected, rtol=0, atol=1e-5)
    assert out.image_grid_thw.tolist() == reference["image_grid_thw"].tolist()
    assert list(out.pixel_values.shape) == reference["pixel_values_shape"].tolist()
    torch.testing.assert_close(
        out.pixel_values[:2], torch.from_numpy(reference["pixel_values_head"])
    )
    assert float(out.pixel_values.double().abs().sum()) == pytest.approx(
        float(reference["pixel_values_fingerprint"]), rel=1e-9
    )


@pytest.mark.parametrize("size", [(480, 640), (37, 91), (300, 17), (1000, 700), (64, 64)])
def test_image_patches_equal_the_transformers_image_processor(processor, size) -> None:
    """Ours (the uint8 pixels put in patch order, then one table lookup a value) against
    transformers' Qwen2VLImageProcessorPil on the same images, resized up, down or not at
    all, a grayscale one among them: the same floats, bit for bit."""
    rng = np.random.default_rng(size[0])
    images = [
        Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)),
        Image.fromarray(rng.integers(0, 256, (50, 90), dtype=np.uint8), "L"),
    ]
    reference = processor.image_processor(images=images, return_tensors="pt")
    pixels, grids = processor.image_patches(images)
    assert grids.tolist() == reference["image_grid_thw"].tolist()
    torch.testing.assert_close(pixels, reference["pixel_values"].float(), rtol=0, atol=0)


def test_a_preprocessor_config_without_resize_is_refused(tmp_path: Path) -> None:
    write_text_tokenizer(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"do_resize": False}))
    with pytest.raises(ValueError, match="do_resize false is not supported"):
        Qwen3OmniProcessor.from_checkpoint(tmp_path)


def test_pads_equal_the_encoder_output_lengths(processor) -> None:
    out = processor(_messages())
    ids = out.input_ids.tolist()
    assert ids.count(151675) == 17 + 4  # 1.3 s: 13 + 4 tokens; 0.3 s: 4
    assert ids.count(151655) == int(out.image_grid_thw.prod(-1).sum()) // 4
    assert ids[-3:] == [151644, *processor.tokenizer("assistant\n")["input_ids"]]


def test_video_pads_interleave_audio_by_time_as_transformers(processor) -> None:
    reference = load_fixture("processing.npz")
    pads = processor._video_pads((3, 8, 12), 1.0, 50)
    assert (
        processor.tokenizer(pads, add_special_tokens=False)["input_ids"]
        == reference["video_audio_pads"].tolist()
    )


def test_a_video_of_one_repeated_frame_has_the_image_patches(checkpoint) -> None:
    same_size = VideoSampling(min_pixels=3136, max_pixels=12845056)  # the image processor's
    processor = Qwen3OmniProcessor.from_checkpoint(checkpoint, video=same_size)
    frame = np.asarray(Image.fromarray(chat_media()[1][1]))
    patches, grid = processor.video_patches(DecodedVideo(np.stack([frame, frame]), fps=2.0))
    image, grids = processor.image_patches([Image.fromarray(frame)])
    assert [1, *grid[1:]] == grids[0].tolist() and grid[0] == 1
    torch.testing.assert_close(patches, image, rtol=0, atol=1e-6)


def test_checkpoint_template_and_preprocessor_config_are_used(tmp_path: Path) -> None:
    write_text_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "SYSTEM RULES{% for m in messages %}{% for p in m['content'] %}{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% endif %}{% endfor %}{% endfor %}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({"min_pixels": 128 * 128, "max_pixels": 128 * 128})
    )
    processor = Qwen3OmniProcessor.from_checkpoint(tmp_path)
    image = Image.fromarray(chat_media()[1][0])
    out = processor([ChatMessage("user", (ChatPart("image", image=image),))])
    assert processor.tokenizer.decode(out.input_ids).startswith("SYSTEM RULES<|vision_start|>")
    assert out.image_grid_thw.tolist() == [
        [1, 8, 12]
    ]  # scaled up to >= 128 * 128 pixels (4 x 6 by default)


def test_video_frames_are_sampled_at_the_requested_rate() -> None:
    decoded = decode_video(
        video_file(30, 10, with_audio=True), "video", VideoSampling(fps=2.0), with_audio=True
    )
    assert decoded.frames.shape == (6, 48, 64, 3)  # 3 s at 2 fps
    assert decoded.fps == pytest.approx(2.0)
    assert decoded.frames[0, 0, 0, 0] < decoded.frames[-1, 0, 0, 0]  # spread over the clip
    assert decoded.audio is not None and abs(len(decoded.audio) - 3 * 16000) < 2048
    few = decode_video(video_file(6, 10, with_audio=False), "video", VideoSampling(fps=2.0))
    assert few.frames.shape[0] == 4  # at least min_frames (4) when the video has them


def test_bad_media_name_the_field(processor) -> None:
    with pytest.raises(RequestValidationError) as error:
        decode_image(b"not an image", "messages[1].content[0].image_url")
    assert error.value.param == "messages[1].content[0].image_url"
    with pytest.raises(RequestValidationError, match="could not be decoded as video") as error:
        decode_video(b"not a video", "messages[0].content[2].video_url")
    assert error.value.param == "messages[0].content[2].video_url"
    with pytest.raises(RequestValidationError, match="no audio stream"):
        decode_video(video_file(8, 10, with_audio=False), "video", with_audio=True)
    for samples in (100, 200):  # 200: one mel frame, but under the STFT's reflect padding
        short = ChatPart(
            "audio", audio=np.zeros(samples, np.float32), param="messages[0].content[1].input_audio"
        )
        for count in (processor, processor.prompt_ids):
            with pytest.raises(RequestValidationError, match=r"shorter than 12.6 ms \(201 samples") as error:
                count([ChatMessage("user", (short,))])
            assert error.value.param == "messages[0].content[1].input_audio"
    shortest = ChatPart("audio", audio=np.zeros(201, np.float32))
    assert processor([ChatMessage("user", (shortest,))]).audio_frames.tolist() == [1]


def test_a_video_with_its_audio_puts_both_in_the_prompt(processor) -> None:
    frames = np.stack([np.asarray(Image.fromarray(chat_media()[1][0]))] * 6)
    track = chat_media()[0][0][:16000]  # 1 s: 13 audio tokens
    video = DecodedVideo(frames, fps=2.0, audio=track)
    part = ChatPart("video", video=video, use_audio=True, param="messages[0].content[0]")
    out = processor([ChatMessage("user", (part, ChatPart("text", text="What happens?")))])
    t, h, w = out.video_grid_thw[0].tolist()
    assert (
        t == 3 and out.video_second_per_grid.tolist() == [1.0] and out.use_audio_in_video == (True,)
    )
    assert out.audio_frames.tolist() == [100] and out.audio_features.shape == (128, 100)
    ids = out.input_ids.tolist()
    assert ids.count(151656) == t * h * w // 4 and ids.count(151675) == 13
    start, end = ids.index(151669), ids.index(151670)  # audio start / end around both
    assert ids[start - 1] == 151652 and ids[end + 1] == 151653  # inside vision start / end
    assert set(ids[start + 1 : end]) == {151656, 151675}
    assert processor.tokenizer.decode(ids[start : end + 1]) == processor._video_pads(
        (t, h, w), 1.0, 13
    )


def test_prompt_ids_from_media_sizes_alone_equal_the_processed_prompt(processor) -> None:
    """What the request boundary counts (no feature extracted) is the prompt the
    preprocessing stage makes, for odd audio lengths, odd image sizes and videos with an
    odd frame count, with and without their audio."""
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 255, (5, 45, 70, 3), dtype=np.uint8)
    clip = lambda n: rng.standard_normal(n).astype(np.float32) * 0.1  # noqa: E731
    image = lambda h, w: Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))  # noqa: E731
    cases = [
        _messages(),
        [ChatMessage("user", (ChatPart("audio", audio=clip(16001)), ChatPart("audio", audio=clip(201)),
                              ChatPart("audio", audio=clip(48_037)), ChatPart("text", text="Hm?")))],
        [ChatMessage("user", (ChatPart("image", image=image(37, 91)), ChatPart("image", image=image(300, 17)),
                              ChatPart("text", text="Two.")))],
        [ChatMessage("user", (ChatPart("video", video=DecodedVideo(frames, fps=2.0)),
                              ChatPart("text", text="And?")))],
        [ChatMessage("user", (ChatPart("audio", audio=clip(3_333)),
                              ChatPart("video", video=DecodedVideo(frames, fps=1.5, audio=clip(20_011)), use_audio=True),
                              ChatPart("image", image=image(64, 64)), ChatPart("text", text="All.")))],
    ]  # fmt: skip
    for messages in cases:
        assert processor.prompt_ids(messages) == processor(messages).input_ids.tolist()


def test_the_model_registry_does_not_import_the_image_processor() -> None:
    """Discovering the models (every server does) leaves transformers' image processing out
    of the process (about 80 MiB of RSS in a server that serves another model): only
    building a processor imports it."""
    code = (
        "import sys\n"
        "from omnistage.serve.registry import ModelRegistry\n"
        "ModelRegistry.discover()\n"
        "print('transformers.processing_utils' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False", out.stderr
