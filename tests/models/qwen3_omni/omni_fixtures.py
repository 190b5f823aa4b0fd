"""Shared helpers of the Qwen3-Omni tests: the reference fixture file written by
``tools/parity/qwen3_omni_reference.py`` and the checkpoint digest it was made from, and a
served tiny checkpoint (``--load-format dummy``) with its OpenAI client."""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np
import openai
import torch
from safetensors import safe_open

from omnistage.models.qwen3_omni.modeling.mrope import MultimodalLayout
from omnistage.models.qwen3_omni.modeling.thinker import EncoderRows
from omnistage.serve.app import ServerSettings, create_app
from omnistage.serve.registry import ModelRegistry
from tests.serve.conftest import RunningServer, run_uvicorn, wait_health

FIXTURE = Path(__file__).parent / "fixtures" / "thinker_talker_reference.safetensors"
SEED = 0  # the seed the fixture's checkpoint was written with
REL_TOL = 1e-4
CASES = ["text", "image", "audio", "video", "image_audio_video", "audio_in_video"]


@dataclass
class ReferenceFixture:
    tensors: dict[str, torch.Tensor]
    meta: dict

    @classmethod
    def load(cls) -> ReferenceFixture:
        with safe_open(str(FIXTURE), framework="pt") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
            meta = json.loads(f.metadata()["meta"])
        return cls(tensors=tensors, meta=meta)

    def case(self, name: str, key: str) -> torch.Tensor:
        return self.tensors[f"{name}.{key}"]


def weights_digest(checkpoint_dir: Path) -> str:
    return hashlib.sha256((checkpoint_dir / "model.safetensors").read_bytes()).hexdigest()


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (both fp32)."""
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    scale = expected.abs().max().clamp_min(1e-12)
    return float((actual.float() - expected.float()).abs().max() / scale)


def layout_of(ref: ReferenceFixture, name: str) -> MultimodalLayout:
    """The case's multimodal layout as stored by the reference script."""
    raw = ref.meta["cases"][name]["layout"]
    return MultimodalLayout(
        image_grids=[tuple(g) for g in raw.get("image_grids", [])],
        video_grids=[tuple(g) for g in raw.get("video_grids", [])],
        video_seconds_per_grid=raw.get("video_seconds_per_grid", []),
        audio_lengths=raw.get("audio_lengths", []),
        use_audio_in_video=raw.get("use_audio_in_video", False),
    )


def encoder_rows(ref: ReferenceFixture, name: str) -> EncoderRows:
    """The encoder rows transformers' encoders gave the case's thinker."""
    t = {k[len(name) + 1 :]: v for k, v in ref.tensors.items() if k.startswith(f"{name}.")}

    def levels(kind: str) -> tuple[torch.Tensor, ...]:
        return tuple(
            t[f"{kind}_deepstack.{i}"]
            for i in range(len([k for k in t if k.startswith(f"{kind}_deepstack.")]))
        )

    return EncoderRows(audio=t.get("audio"), image=t.get("image"), image_deepstack=levels("image"),
                       video=t.get("video"), video_deepstack=levels("video"))  # fmt: skip


def video_file(frames: int, rate: int, with_audio: bool, size: tuple[int, int] = (64, 48)) -> bytes:
    """A tiny MPEG-4 video (``size`` = (width, height), frame i all gray level 8 * i; with a
    440 Hz AAC tone as long as the frames)."""
    width, height = size
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="mp4") as container:
        video = container.add_stream("mpeg4", rate=rate)
        video.width, video.height, video.pix_fmt = width, height, "yuv420p"
        audio = container.add_stream("aac", rate=16000) if with_audio else None
        for i in range(frames):
            pixels = np.full((height, width, 3), (i * 8) % 256, dtype=np.uint8)
            container.mux(video.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(video.encode())
        if audio is not None:
            tone = (
                0.3 * np.sin(2 * np.pi * 440 * np.arange(frames * 16000 // rate) / 16000)
            ).astype(np.float32)
            chunk = av.AudioFrame.from_ndarray(tone[None], format="fltp", layout="mono")
            chunk.sample_rate = 16000
            container.mux(audio.encode(chunk))
            container.mux(audio.encode())
    return buffer.getvalue()


def serve_dummy(checkpoint: Path, variant: str | None = None) -> Iterator[RunningServer]:
    """``omnistage serve --model-path checkpoint [--variant variant] --load-format dummy``
    in this process, once healthy (a fixture's generator)."""
    config = ModelRegistry.discover().resolve(str(checkpoint), variant, "dummy")
    for running in run_uvicorn(create_app(config, ServerSettings(playground=False, data_dir=None))):
        assert wait_health(running.base_url, timeout_s=300).status_code == 200
        yield running


def openai_client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
