"""The Piper pipeline without HTTP: output cap and finish_reason."""

import pytest

from omnistage.core.payloads import AudioChunk, AudioResult
from omnistage.models.piper.payload_types import PhonemizedText
from omnistage.pipeline.pipeline import Pipeline, build_topology
from omnistage.serve.media import MediaPolicy
from omnistage.serve.registry import ModelRegistry
from omnistage.testing.leaks import assert_no_request_state

pytestmark = pytest.mark.anyio


def test_every_edge_is_typed():
    topology = build_topology(ModelRegistry.discover().resolve(None))
    assert [(e.source, e.target, e.kind, e.carries) for e in topology.edges] == [
        ("preprocessing", "synthesis", "next", (PhonemizedText,))
    ]
    assert topology.types["synthesis"].result is AudioResult
    assert topology.types["synthesis"].streams == (AudioChunk,)


async def test_output_is_capped_in_proportion_to_the_text_and_finishes_with_length():
    config = ModelRegistry.discover().resolve(None)
    synthesis = config.stage("synthesis")
    synthesis.factory.args["max_seconds_per_phoneme"] = 0.0001  # cap = the 10 s floor
    text = "This sentence is read very slowly, again and again. " * 6
    request = config.build_request(config.speech_request(input=text, speed=0.25), MediaPolicy())
    async with Pipeline(config) as pipeline:
        result = await pipeline.submit(request, collect=True).result()
        await assert_no_request_state(pipeline)
    samples = sum(len(chunk.data.samples) for chunk in result.chunks)
    assert result.finish_reason == "length"
    assert samples == result.outputs["synthesis"].num_samples == 10 * 22050


async def test_realistic_text_is_not_capped_even_slow():
    """Digits and spelled letters are long per character; speed 0.25 is 4x longer."""
    config = ModelRegistry.discover().resolve(None)
    text = "Call 5551234567 or 5559876543. Account 1234567, 7654321, 2718281. A. B. C. D. E."
    async with Pipeline(config) as pipeline:
        for speed in (1.0, 0.25):
            request = config.build_request(config.speech_request(input=text, speed=speed), MediaPolicy())
            result = await pipeline.submit(request, collect=True).result()
            assert result.finish_reason == "stop", speed
