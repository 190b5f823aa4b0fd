"""Session fixtures of the Qwen3-Omni tests: the tiny seed-0 random checkpoint rebuilt with our
writer, and the transformers reference fixture made from the same checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
from omni_fixtures import SEED, ReferenceFixture

from omnistage.models.qwen3_omni.random_checkpoint import write_random_checkpoint


@pytest.fixture(scope="session")
def omni_tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(tmp_path_factory.mktemp("qwen3_omni_tiny"), "tiny", seed=SEED)


@pytest.fixture(scope="session")
def omni_reference() -> ReferenceFixture:
    return ReferenceFixture.load()
