"""The Piper pipeline without HTTP: output cap and finish_reason."""

import pytest

from omnistage.config.registry import ModelRegistry
from omnistage.pipeline.pipeline import Pipeline
from omnistage.serve.media import MediaPolicy
from omnistage.serve.protocol import SpeechRequest
from omnistage.testing.leaks import assert_no_request_state

pytestmark = pytest.mark.anyio


async def test_output_is_capped_in_proportion_to_the_text_and_finishes_with_length():
    config = ModelRegistry.discover().resolve(None)
    synthesis = config.stage("synthesis")
    synthesis.factory.args["max_seconds_per_char"] = 0.001  # cap = the 10 s floor
    text = "This sentence is read very slowly, again and again. " * 6
    request = config.build_request(SpeechRequest(input=text, speed=0.25), MediaPolicy())
    async with Pipeline(config) as pipeline:
        result = await pipeline.submit(request, collect=True).result()
        await assert_no_request_state(pipeline)
    samples = sum(len(chunk.data) for chunk in result.chunks)
    assert result.finish_reason == "length"
    assert samples == result.outputs["synthesis"].num_samples == 10 * 22050
