import pytest

from omnistage.pipeline.pipeline import Pipeline
from omnistage.testing import toy

# Placements every runtime suite runs under: all stages in the server process, and the
# stages spread over spawned processes (tensors and control messages cross processes).
LINEAR_PROCESSES = {"encode": "pre", "double": "engine", "accumulate": "vocoder"}
OMNI_PROCESSES = {
    "image_encoder": "encoders",
    "audio_encoder": "encoders",
    "thinker": "llm",
    "talker": "llm",
    "code2wav": "vocoder",
}


@pytest.fixture(params=["in_process", "multi_process"])
def placement(request):
    return request.param


def linear_pipeline(placement: str, **overrides) -> Pipeline:
    process = LINEAR_PROCESSES if placement == "multi_process" else None
    return Pipeline(toy.linear_config(process, **overrides))


def omni_pipeline(placement: str, **overrides) -> Pipeline:
    process = OMNI_PROCESSES if placement == "multi_process" else None
    return Pipeline(toy.omni_config(process, **overrides))
