"""Qwen3-Omni chat inputs: messages with text, audio, images and video -> thinker inputs.

What transformers' ``Qwen3OmniMoeProcessor`` does (the numerical reference), built from
transformers' own parts constructed offline: the ``WhisperFeatureExtractor`` (128 log-mel
bins, 16 kHz, 10 ms hop) and the PIL ``Qwen2VLImageProcessorPil`` (the fast one and the
video processor need torchvision, which does not import beside the local CPU torch), from
the checkpoint's ``preprocessor_config.json`` or :data:`DEFAULT_PREPROCESSOR`. The image
processor gives the sizes and values; the patches are ours, the same floats in fewer
passes (:meth:`Qwen3OmniProcessor._patchify`). Videos are decoded with PyAV, sampled as
Qwen samples them (:func:`decode_video`) and cut into patches in the Qwen2-VL layout
(:meth:`Qwen3OmniProcessor.video_patches`; the layout of the image processor with
``temporal_patch_size`` real frames per patch).

The prompt comes from the checkpoint's chat template (``tokenizer_config.json`` or
``chat_template.jinja``) when it has one, else from :data:`CHAT_TEMPLATE` (ours: the
Qwen3-Omni ChatML layout). Each media item renders one placeholder, which is expanded to
the encoder's output length as the reference does: ``<|audio_pad|>`` x the audio
encoder's tokens (:func:`~.modeling.audio_encoder.output_lengths`), ``<|image_pad|>`` /
``<|video_pad|>`` x ``t * h * w / merge^2``, and for a video with its audio, the video and
audio pads interleaved by time inside ``<|audio_start|> ... <|audio_end|>``.

Bad media raise :class:`~omnistage.core.errors.RequestValidationError` naming the field
(``param``), before any model work.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from transformers import PreTrainedTokenizerBase, Qwen2Tokenizer, WhisperFeatureExtractor

from omnistage.core.errors import RequestValidationError
from omnistage.models.qwen3_omni.modeling.audio_encoder import AudioEncoderConfig, output_lengths
from omnistage.serve.decode_jobs import FrameSampling
from omnistage.serve.media import MediaPolicy, decode_audio, resample
from omnistage.serve.media import decode_video as decode_media_video

SAMPLE_RATE = 16000  # Hz, the feature extractor's input
POSITION_IDS_PER_SECOND = 13  # thinker positions per second of video (config.json)
#: An image's or video frame's longer side is at most this many times its shorter side
#: (transformers' Qwen2-VL ``smart_resize`` raises a ValueError above it).
MAX_ASPECT_RATIO = 200

# Used when a checkpoint has no preprocessor_config.json: the Qwen2.5-Omni layout with
# Qwen3's 16-pixel patches (shared/reference/qwen3-omni.md, section 1).
DEFAULT_PREPROCESSOR = {
    "feature_size": 128, "sampling_rate": SAMPLE_RATE, "hop_length": 160, "n_fft": 400,
    "chunk_length": 300, "padding_value": 0.0, "return_attention_mask": True, "dither": 0.0,
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "min_pixels": 3136, "max_pixels": 12845056,
}  # fmt: skip
_FEATURE_KEYS = ("feature_size", "sampling_rate", "hop_length", "n_fft", "chunk_length",
                 "padding_value", "return_attention_mask", "dither")  # fmt: skip
_IMAGE_KEYS = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std",
               "min_pixels", "max_pixels", "size", "resample", "do_resize", "do_rescale",
               "rescale_factor", "do_normalize", "do_convert_rgb")  # fmt: skip


@dataclass(frozen=True, slots=True)
class VideoSampling:
    """How frames are taken from a video (qwen-omni-utils' defaults, as the reference
    pipeline samples): ``fps`` frames per second, a count in ``[min_frames, max_frames]``
    rounded down to a multiple of ``frame_factor``, frames resized to at most / at least
    ``max_pixels`` / ``min_pixels`` (transformers' Qwen3-Omni video size)."""

    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    frame_factor: int = 2
    min_pixels: int = 128 * 32 * 32
    max_pixels: int = 768 * 32 * 32
    max_decoded_frames: int = 20000  # a bound on decoding work per video


CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{- part['text'] -}}"
    "{%- elif part['type'] == 'audio' -%}{{- '<|audio_start|><|audio_pad|><|audio_end|>' -}}"
    "{%- elif part['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'video' -%}{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
"""Ours, used when the checkpoint has no chat template: the Qwen3-Omni ChatML layout (no
default system prompt), one placeholder per media item between its start/end tokens."""

_PADS = {"audio": "<|audio_pad|>", "image": "<|image_pad|>", "video": "<|video_pad|>"}
_PAD_PATTERN = re.compile("|".join(re.escape(p) for p in _PADS.values()))


# ----------------------------------------------------------------------------- media


@dataclass(frozen=True, slots=True)
class DecodedVideo:
    """Frames sampled from a video.

    Attributes:
        frames: ``[T, H, W, 3]`` uint8 RGB, ``T`` a multiple of ``frame_factor``.
        fps: frames per second of the sampled sequence (the video's rate x the kept share).
        audio: the video's audio track as mono float32 ``[N]`` at 16 kHz, when asked for.
    """

    frames: np.ndarray
    fps: float
    audio: np.ndarray | None = None


def decode_image(data: bytes, param: str) -> Image.Image:
    """Decode image bytes (any format PIL reads) to RGB.

    Raises:
        RequestValidationError: undecodable bytes, naming ``param``.
    """
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise RequestValidationError(
            f"{param} could not be decoded as an image ({exc})", param=param
        ) from None


def decode_video(
    data: bytes,
    param: str,
    sampling: VideoSampling = VideoSampling(),
    with_audio: bool = False,
    policy: MediaPolicy = MediaPolicy(),
    max_duration_s: float | None = None,
) -> DecodedVideo:
    """Decode a video in the decoder worker pool (:func:`omnistage.serve.media.decode_video`)
    and sample its frames as Qwen does: ``n = total / video_fps * fps`` frames, clamped to
    ``[min_frames, min(max_frames, total)]`` and rounded down to a multiple of
    ``frame_factor``, at indices ``round(linspace(0, total - 1, n))``.

    Args:
        data: the file's bytes (any container FFmpeg reads).
        param: the request field, named in errors.
        sampling: frame rate and bounds.
        with_audio: also decode the audio track, resampled to 16 kHz mono.
        policy: the media policy (pixel, memory and time limits of the decode; its
            duration cap applies to the audio track).
        max_duration_s: the video's duration cap, seconds (None: ``policy.max_duration_s``).

    Raises:
        RequestValidationError: no video stream, undecodable data, fewer frames than
            ``frame_factor``, or no audio track when ``with_audio``.
        PayloadTooLargeError: more than ``sampling.max_decoded_frames`` frames, longer
            than the duration cap, frames above ``policy.max_image_pixels``.
    """
    limits = FrameSampling(
        sampling.fps, sampling.min_frames, sampling.max_frames, sampling.frame_factor, sampling.max_decoded_frames,
        policy.max_duration_s if max_duration_s is None else max_duration_s,
    )  # fmt: skip
    video = decode_media_video(data, policy, param, limits)
    audio = None
    if with_audio:
        track = decode_audio(data, policy, param)
        audio = resample(track.samples, track.sample_rate, SAMPLE_RATE)
    return DecodedVideo(video.frames, video.fps, audio)


# ----------------------------------------------------------------------------- features


@dataclass(frozen=True, slots=True)
class ChatPart:
    """One item of a message's content: ``text`` for ``kind == "text"``; ``audio`` mono
    float32 ``[N]`` at 16 kHz; ``image`` RGB; ``video`` sampled frames (its ``audio`` used
    when ``use_audio`` is set). ``param`` names the request field for errors."""

    kind: Literal["text", "audio", "image", "video"]
    text: str = ""
    audio: np.ndarray | None = None
    image: Image.Image | None = None
    video: DecodedVideo | None = None
    use_audio: bool = False
    param: str = "messages"


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """A message: ``role`` system / user / assistant and its parts in order."""

    role: Literal["system", "user", "assistant"]
    parts: tuple[ChatPart, ...]


@dataclass(frozen=True)
class ThinkerInputs:
    """What the thinker and its encoders take for one prompt.

    Attributes:
        input_ids: ``[L]`` int64, media pads expanded.
        audio_features: ``[128, sum(audio_frames)]`` float32 log-mel frames of every audio
            (message audios and video audio tracks, in prompt order), or None.
        audio_frames: ``[A]`` int64 mel frames per audio.
        pixel_values: ``[sum(t*h*w), C*T*P*P]`` float32 image patches, or None.
        image_grid_thw: ``[I, 3]`` int64.
        pixel_values_videos: video patches, or None; ``video_grid_thw`` ``[V, 3]`` int64.
        video_second_per_grid: ``[V]`` float32 seconds per temporal patch.
        use_audio_in_video: per video, whether its audio track is in the prompt.
    """

    input_ids: torch.Tensor
    audio_features: torch.Tensor | None = None
    audio_frames: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor = field(
        default_factory=lambda: torch.zeros(0, 3, dtype=torch.int64)
    )
    pixel_values_videos: torch.Tensor | None = None
    video_grid_thw: torch.Tensor = field(
        default_factory=lambda: torch.zeros(0, 3, dtype=torch.int64)
    )
    video_second_per_grid: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    use_audio_in_video: tuple[bool, ...] = ()


class Qwen3OmniProcessor:
    """Chat messages -> :class:`ThinkerInputs` (see the module docstring).

    Args:
        tokenizer: the checkpoint's text tokenizer.
        preprocessor: ``preprocessor_config.json``'s content (feature extractor and image
            processor fields); missing fields take :data:`DEFAULT_PREPROCESSOR`'s values.
        chat_template: the checkpoint's template, or None for :data:`CHAT_TEMPLATE`.
        audio_config: the audio encoder's config (its chunking decides the pad counts).
        video: frame sampling.
        pin_memory: image and video patches are made in pinned (page-locked) host memory,
            which a CUDA encoder uploads without a copy or a wait (needs CUDA).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        preprocessor: dict | None = None,
        chat_template: str | None = None,
        audio_config: AudioEncoderConfig | None = None,
        video: VideoSampling = VideoSampling(),
        pin_memory: bool = False,
    ) -> None:
        values = {**DEFAULT_PREPROCESSOR, **(preprocessor or {})}
        self.tokenizer = tokenizer
        self.feature_extractor = WhisperFeatureExtractor(
            **{k: values[k] for k in _FEATURE_KEYS if k in values}
        )
        # imported here, not at module level: it pulls in transformers.processing_utils (about
        # 90 MiB and 1 s), which the model registry would otherwise import into every server,
        # whatever model it serves (config -> payload_types -> this module)
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        self.image_processor = Qwen2VLImageProcessorPil(
            **{k: values[k] for k in _IMAGE_KEYS if k in values}
        )
        ip = self.image_processor
        if not ip.do_resize:
            raise ValueError("preprocessor_config.json: do_resize false is not supported (patches need the resize)")
        # every uint8 value's float per channel, by the reference's arithmetic: rescale in
        # float64 cast to float32, then (x - mean) / std in float32
        levels = np.arange(256, dtype=np.float64)
        levels = (levels * ip.rescale_factor if ip.do_rescale else levels).astype(np.float32)
        mean, std = (np.broadcast_to(np.asarray(v, np.float32), (3,)) for v in (ip.image_mean, ip.image_std))
        self._levels = tuple((levels - mean[c]) / std[c] if ip.do_normalize else levels for c in range(3))
        self.chat_template = chat_template or CHAT_TEMPLATE
        self.audio_config = audio_config or AudioEncoderConfig()
        self.video = video
        self.pin_memory = pin_memory
        if self.feature_extractor.sampling_rate != SAMPLE_RATE:
            raise ValueError(
                f"preprocessor_config.json: sampling_rate {self.feature_extractor.sampling_rate} != {SAMPLE_RATE}"
            )

    @classmethod
    def from_checkpoint(
        cls,
        directory: str | Path,
        audio_config: AudioEncoderConfig | None = None,
        video: VideoSampling = VideoSampling(),
        pin_memory: bool = False,
    ) -> Qwen3OmniProcessor:
        """Tokenizer, preprocessor config and chat template from a checkpoint directory
        (``preprocessor_config.json`` and a template optional).

        Raises:
            OSError: the tokenizer files are missing or unreadable.
        """
        directory = Path(directory)
        tokenizer = Qwen2Tokenizer.from_pretrained(str(directory))
        preprocessor_file = directory / "preprocessor_config.json"
        preprocessor = (
            json.loads(preprocessor_file.read_text()) if preprocessor_file.exists() else None
        )
        return cls(tokenizer, preprocessor, tokenizer.chat_template, audio_config, video, pin_memory)

    # -- media -> features

    def audio_features(self, audios: Sequence[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-mel features of the audios of ONE prompt, extracted together as the reference
        does (each is padded to the longest before its frames are cut back):
        ``([128, sum(frames)] float32, frames [A] int64)``."""
        out = self.feature_extractor(
            [np.asarray(a, dtype=np.float32) for a in audios], sampling_rate=SAMPLE_RATE,
            padding=True, truncation=False, return_attention_mask=True, return_tensors="pt",
        )  # fmt: skip
        mask = out["attention_mask"].bool()
        features = torch.cat(
            [f[:, m] for f, m in zip(out["input_features"], mask, strict=True)], dim=1
        )
        return features.float(), mask.sum(-1).to(torch.int64)

    def image_patches(self, images: Sequence[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pixel_values [sum(t*h*w), 1536] float32, image_grid_thw [I, 3] int64)``: what
        transformers' ``Qwen2VLImageProcessorPil`` gives (RGB, resized with PIL to its
        ``smart_resize`` size, rescaled, normalized, cut into patches of
        ``temporal_patch_size`` copies of the image), computed as :meth:`_patchify` does."""
        ip = self.image_processor
        pictures, grids = [], []
        for image in images:
            rgb = image if image.mode == "RGB" else image.convert("RGB")
            h, w = self._resized(rgb.height, rgb.width, ip.size["shortest_edge"], ip.size["longest_edge"])
            pictures.append(np.asarray(rgb if (w, h) == rgb.size else rgb.resize((w, h), ip.resample)))
            grids.append((1, h // ip.patch_size, w // ip.patch_size))
        sizes = [h * w for _, h, w in grids]
        out = self._patch_rows(sum(sizes))
        for picture, rows in zip(pictures, np.split(out.numpy(), np.cumsum(sizes)[:-1]), strict=True):
            self._patchify(picture[None], rows)
        return out, torch.tensor(grids, dtype=torch.int64).reshape(-1, 3)

    def video_patches(self, video: DecodedVideo) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """Patches of one sampled video in the Qwen2-VL layout: ``([t*h*w, 1536] float32,
        (t, h, w))``, ``t = T / temporal_patch_size`` (the last frame repeated to fill);
        frames resized with PIL (bicubic) to :meth:`_video_size`."""
        tp = self.image_processor.temporal_patch_size
        h, w = self._video_size(video)
        frames = np.stack(
            [
                np.asarray(Image.fromarray(f).resize((w, h), Image.Resampling.BICUBIC))
                for f in video.frames
            ]
        )
        if len(frames) % tp:
            frames = np.concatenate([frames, np.repeat(frames[-1:], tp - len(frames) % tp, axis=0)])
        t, gh, gw = self._video_grid(video)
        out = self._patch_rows(t * gh * gw)
        self._patchify(frames, out.numpy())
        return out, (t, gh, gw)

    def _patch_rows(self, count: int) -> torch.Tensor:
        """An empty ``[count, 3 * tp * p * p]`` float32 patch tensor (pinned with ``pin_memory``)."""
        ip = self.image_processor
        width = 3 * ip.temporal_patch_size * ip.patch_size**2
        return torch.empty(count, width, dtype=torch.float32, pin_memory=self.pin_memory)

    def _patchify(self, frames: np.ndarray, out: np.ndarray) -> np.ndarray:
        """``[F, H, W, 3]`` uint8 frames (``F`` a multiple of ``temporal_patch_size``, or 1:
        an image, repeated to fill each patch), ``H`` and ``W`` multiples of patch x merge ->
        their patches written to ``out`` ``[t * H/p * W/p, 3 * tp * p * p]`` float32 (returned)
        in the Qwen2-VL order: merge groups of ``merge^2`` patches, row-major; a patch's values
        by channel, time, row, column. The uint8 frames are put in that order first, then each
        value is looked up in :attr:`_levels` (one float a channel and byte), so every float
        is computed and written once."""
        ip = self.image_processor
        p, tp, m = ip.patch_size, ip.temporal_patch_size, ip.merge_size
        count, height, width, _ = frames.shape
        t, gh, gw = max(1, count // tp), height // p, width // p
        x = frames.reshape(t, count // t, gh // m, m, p, gw // m, m, p, 3).transpose(0, 2, 5, 3, 6, 8, 1, 4, 7)
        x = np.ascontiguousarray(x)  # [t, gh/m, gw/m, m, m, 3, F/t, p, p]
        view = out.reshape(t, gh // m, gw // m, m, m, 3, tp, p, p)
        for channel, levels in enumerate(self._levels):
            view[:, :, :, :, :, channel] = np.take(levels, x[:, :, :, :, :, channel])  # F/t = 1 fills tp
        return out

    def _resized(self, height: int, width: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
        """``(height, width)`` a picture of that size is resized to: transformers' Qwen2-VL
        ``smart_resize`` (multiples of patch x merge, pixels in ``[min_pixels, max_pixels]``)."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            smart_resize,  # see __init__
        )

        ip = self.image_processor
        return smart_resize(
            height, width, factor=ip.patch_size * ip.merge_size, min_pixels=min_pixels, max_pixels=max_pixels
        )

    def _video_size(self, video: DecodedVideo) -> tuple[int, int]:
        """``(height, width)`` the frames are resized to (multiples of patch x merge)."""
        height, width = video.frames.shape[1:3]
        return self._resized(height, width, self.video.min_pixels, self.video.max_pixels)

    def _video_grid(self, video: DecodedVideo) -> tuple[int, int, int]:
        """The video's patch grid ``(t, h, w)``: ``t`` temporal patches (the last frame
        repeated to fill one), ``h`` x ``w`` patches a frame."""
        ip = self.image_processor
        h, w = self._video_size(video)
        t = -(-len(video.frames) // ip.temporal_patch_size)
        return t, h // ip.patch_size, w // ip.patch_size

    # -- messages -> inputs

    def __call__(self, messages: Sequence[ChatMessage]) -> ThinkerInputs:
        """Render the template, extract every item's features and expand its placeholder.

        Raises:
            RequestValidationError: an audio shorter than 12.6 ms (:meth:`_audios`), an image
                or video whose aspect ratio is over :data:`MAX_ASPECT_RATIO`, or a media
                item the chat template did not place, naming the field.
        """
        parts = [p for m in messages for p in m.parts]
        _check_aspect_ratios(parts)
        audios = self._audios(parts)
        features, frames = (
            self.audio_features(audios) if audios else (None, torch.zeros(0, dtype=torch.int64))
        )
        images = [p.image for p in parts if p.kind == "image"]
        pixels, grids = (
            self.image_patches(images) if images else (None, torch.zeros(0, 3, dtype=torch.int64))
        )
        videos = [p for p in parts if p.kind == "video"]
        patches = [self.video_patches(p.video) for p in videos]
        seconds = [self.image_processor.temporal_patch_size / p.video.fps for p in videos]
        ids = self._prompt_ids(
            messages, output_lengths(frames, self.audio_config).tolist(),
            (grids.prod(-1) // self.image_processor.merge_size**2).tolist(), [g for _, g in patches],
        )  # fmt: skip
        return ThinkerInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64),
            audio_features=features,
            audio_frames=frames,
            pixel_values=pixels,
            image_grid_thw=grids,
            pixel_values_videos=torch.cat([x for x, _ in patches]) if patches else None,
            video_grid_thw=torch.tensor([g for _, g in patches], dtype=torch.int64).reshape(-1, 3),
            video_second_per_grid=torch.tensor(seconds, dtype=torch.float32),
            use_audio_in_video=tuple(p.use_audio for p in videos),
        )

    def prompt_ids(self, messages: Sequence[ChatMessage]) -> list[int]:
        """The thinker prompt's ids, ``self(messages).input_ids``, from the template and each
        media item's size alone (audio samples, image and frame pixels, frame count),
        without extracting a feature: what the request boundary counts against the thinker's
        ``max_model_len`` before any model work. Placeholder counts: an audio's mel frames
        are ``min(ceil(samples / hop_length), longest // hop_length)`` (the feature
        extractor's attention mask, the prompt's audios padded to the longest, whose STFT
        keeps ``longest // hop_length`` frames), its tokens :func:`~.modeling.audio_encoder.output_lengths` of them; an image's are the
        image processor's ``get_number_of_image_patches / merge_size**2``; a video's its
        grid's (:meth:`_video_pads`).

        Raises:
            RequestValidationError: as :meth:`__call__`.
        """
        parts = [p for m in messages for p in m.parts]
        _check_aspect_ratios(parts)
        hop, ip = self.feature_extractor.hop_length, self.image_processor
        lengths = [len(a) for a in self._audios(parts)]
        longest = max(lengths, default=0)
        frames = torch.tensor([min(-(-n // hop), longest // hop) for n in lengths], dtype=torch.int64)
        images = [p.image for p in parts if p.kind == "image"]
        image_tokens = [ip.get_number_of_image_patches(i.height, i.width) // ip.merge_size**2 for i in images]
        grids = [self._video_grid(p.video) for p in parts if p.kind == "video"]
        return self._prompt_ids(messages, output_lengths(frames, self.audio_config).tolist(), image_tokens, grids)

    def media_positions(self, prompt_ids: Sequence[int]) -> tuple[int, int]:
        """``(audio, vision)``: how many of a prompt's positions hold audio (its
        ``<|audio_pad|>`` tokens, a video's audio track included) and images or video (its
        ``<|image_pad|>`` and ``<|video_pad|>`` tokens)."""
        pad = self.tokenizer.convert_tokens_to_ids
        vision = {pad(_PADS["image"]), pad(_PADS["video"])}
        audio = pad(_PADS["audio"])
        return sum(i == audio for i in prompt_ids), sum(i in vision for i in prompt_ids)

    def _audios(self, parts: list[ChatPart]) -> list[np.ndarray]:
        """The prompt's audios in order (message audios, video audio tracks asked for).

        Raises: RequestValidationError: one has fewer than ``n_fft // 2 + 1`` samples (201:
        12.6 ms; the STFT's reflect padding of the longest audio needs more samples than
        half a window, and one mel frame needs 10 ms)."""
        least = max(self.feature_extractor.hop_length, self.feature_extractor.n_fft // 2 + 1)
        audios = []
        for part in parts:
            if part.kind == "audio" or (part.kind == "video" and part.use_audio):
                samples = part.audio if part.kind == "audio" else part.video.audio
                if samples is None or len(samples) < least:
                    raise RequestValidationError(
                        f"{part.param}: audio shorter than {1000 * least / SAMPLE_RATE:.1f} ms ({least} samples at 16 kHz)",
                        param=part.param,
                    )
                audios.append(samples)
        return audios

    def _prompt_ids(
        self,
        messages: Sequence[ChatMessage],
        audio_tokens: list[int],
        image_tokens: list[int],
        video_grids: list[tuple[int, int, int]],
    ) -> list[int]:
        """Render the template, expand each item's placeholder by its token count (per
        audio, in prompt order including videos' audio tracks; per image; per video grid)
        and tokenize. Raises: RequestValidationError: a media item the template did not
        place."""
        parts = [p for m in messages for p in m.parts]
        audio, image, video = iter(audio_tokens), iter(image_tokens), iter(video_grids)
        expansions = []
        for part in parts:
            if part.kind == "audio":
                expansions.append(("audio", _PADS["audio"] * next(audio)))
            elif part.kind == "image":
                expansions.append(("image", _PADS["image"] * next(image)))
            elif part.kind == "video":
                seconds = self.image_processor.temporal_patch_size / part.video.fps
                tokens = next(audio) if part.use_audio else None
                expansions.append(("video", self._video_pads(next(video), seconds, tokens)))
        text = self.tokenizer.apply_chat_template(
            [_hf_message(m) for m in messages],
            chat_template=self.chat_template,
            tokenize=False,
            add_generation_prompt=True,
        )
        return self.tokenizer(_expand(text, expansions, parts), add_special_tokens=False)["input_ids"]

    def _video_pads(
        self, grid: tuple[int, int, int], second_per_grid: float, audio_tokens: int | None
    ) -> str:
        """``<|video_pad|>`` x ``t*h*w/merge^2``; with the video's audio, video pads (each
        frame group at ``t * second_per_grid * 13`` positions) and audio pads (one position
        each) merged by position, a video pad first on ties, inside audio start/end."""
        m = self.image_processor.merge_size
        t, h, w = grid
        if audio_tokens is None:
            return _PADS["video"] * (t * h * w // m**2)
        per_group = h * w // m**2
        times = [
            g * second_per_grid * POSITION_IDS_PER_SECOND
            for g in range(t)
            for _ in range(per_group)
        ]
        out, v, a = ["<|audio_start|>"], 0, 0
        while v < len(times) and a < audio_tokens:
            if times[v] <= a:
                out.append(_PADS["video"])
                v += 1
            else:
                out.append(_PADS["audio"])
                a += 1
        out += [_PADS["video"]] * (len(times) - v) + [_PADS["audio"]] * (audio_tokens - a)
        return "".join([*out, "<|audio_end|>"])


def _hf_message(message: ChatMessage) -> dict:
    content = [
        {"type": "text", "text": p.text} if p.kind == "text" else {"type": p.kind}
        for p in message.parts
    ]
    return {"role": message.role, "content": content}


def _expand(text: str, expansions: list[tuple[str, str]], parts: list[ChatPart]) -> str:
    """Replace the template's placeholders, in order, by the items' expanded pads."""
    pieces, at, used = [], 0, 0
    for match in _PAD_PATTERN.finditer(text):
        kind = next(k for k, pad in _PADS.items() if pad == match.group())
        if used == len(expansions) or expansions[used][0] != kind:
            media = [p for p in parts if p.kind != "text"]
            param = media[min(used, len(media) - 1)].param if media else "messages"
            raise RequestValidationError(
                f"the chat template placed a {kind} where the messages have none", param=param
            )
        pieces += [text[at : match.start()], expansions[used][1]]
        at, used = match.end(), used + 1
    if used != len(expansions):
        param = [p for p in parts if p.kind != "text"][used].param
        raise RequestValidationError(
            f"the chat template placed no {expansions[used][0]} for this item", param=param
        )
    return "".join([*pieces, text[at:]])


def _check_aspect_ratios(parts: Sequence[ChatPart]) -> None:
    """Raises: RequestValidationError: an image or video (its frames) with a side more than
    :data:`MAX_ASPECT_RATIO` times the other, naming its field."""
    for part in parts:
        if part.kind == "image" and part.image is not None:
            height, width = part.image.height, part.image.width
        elif part.kind == "video" and part.video is not None:
            height, width = part.video.frames.shape[1:3]
        else:
            continue
        if max(height, width) > MAX_ASPECT_RATIO * min(height, width):
            raise RequestValidationError(
                f"{part.param}: the {part.kind} is {width}x{height} pixels; its longer side may be at most "
                f"{MAX_ASPECT_RATIO} times its shorter side",
                param=part.param,
            )
