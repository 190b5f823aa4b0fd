"""Session fixtures of the Qwen3-TTS talker tests: tiny random checkpoints (seed 0) rebuilt
with our writer, and the reference fixture made from the same checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
from talker_fixtures import MODEL_TYPES, SEED, ReferenceFixture

from omnistage.models.qwen3_tts.random_checkpoint import write_model_files, write_random_checkpoint


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """model type -> a tiny checkpoint dir (no speech_tokenizer/: the talker never reads it)."""
    root = tmp_path_factory.mktemp("qwen3_tts_tiny")
    return {t: write_model_files(root / t, "tiny", t, seed=SEED) for t in MODEL_TYPES}


@pytest.fixture(scope="session")
def tiny_servable_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """model type -> a complete tiny checkpoint dir (speech_tokenizer/ included), as
    ``omnistage init-random --size tiny`` writes it: what ``omnistage serve`` loads."""
    root = tmp_path_factory.mktemp("qwen3_tts_servable")
    return {t: write_random_checkpoint(root / t, "tiny", t, seed=SEED) for t in MODEL_TYPES}


@pytest.fixture(scope="session")
def reference() -> ReferenceFixture:
    return ReferenceFixture.load()
