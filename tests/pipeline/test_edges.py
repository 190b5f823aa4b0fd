"""Typed stage edges: what every edge carries is checked when the topology is built, and
a stage that sends something else fails its request, naming the stage and both types."""

import pytest
import torch

from omnistage.config.pipeline import PipelineConfig
from omnistage.core.errors import PipelineConfigError, StageFailureError
from omnistage.pipeline.pipeline import Pipeline, build_topology
from omnistage.testing import toy
from omnistage.testing.leaks import assert_no_request_state

TENSOR, INT, STR, OBJECT = "torch:Tensor", "builtins:int", "builtins:str", "builtins:object"

pytestmark = pytest.mark.anyio


def _edit(config: PipelineConfig, **changes: dict) -> PipelineConfig:
    data = config.model_dump()
    for stage in data["stages"]:
        stage.update(changes.get(stage["name"], {}))
    return PipelineConfig.model_validate(data)


def _typed_linear(**changes: dict) -> PipelineConfig:
    """encode -> double ~> accumulate, every edge typed as the toy stages really behave."""
    typed = {
        "encode": {"result_type": TENSOR},
        "double": {"payload_type": TENSOR, "result_type": INT, "stream_types": [TENSOR]},
        "accumulate": {"payload_type": INT, "accepts_stream_types": [TENSOR], "result_type": INT},
    }
    for name, fields in changes.items():
        typed[name] = {**typed[name], **fields}
    return _edit(toy.linear_config(), **typed)


def _fails(config: PipelineConfig, stage: str, text: str) -> None:
    with pytest.raises(PipelineConfigError) as info:
        build_topology(config)
    assert info.value.stage == stage, str(info.value)
    assert text in str(info.value), str(info.value)


def test_the_topology_lists_what_each_edge_carries():
    edges = {(e.source, e.target, e.kind): e.carries for e in build_topology(_typed_linear()).edges}
    assert edges == {
        ("encode", "double", "next"): (torch.Tensor,),
        ("double", "accumulate", "next"): (int,),
        ("double", "accumulate", "stream"): (torch.Tensor,),
    }
    untyped = build_topology(toy.linear_config()).edges
    assert untyped and all(e.carries == () for e in untyped)


def test_a_next_edge_whose_types_disagree_is_rejected():
    _fails(_typed_linear(double={"payload_type": STR}), "double", "carries torch.Tensor, but 'double' takes builtins.str")


def test_a_subclass_satisfies_the_declared_type():
    build_topology(_typed_linear(double={"payload_type": OBJECT}))


def test_a_half_typed_edge_is_rejected():
    _fails(_typed_linear(double={"payload_type": None}), "double", "half typed: only 'encode' declares result_type")
    _fails(_typed_linear(accumulate={"accepts_stream_types": []}), "accumulate", "only 'double' declares stream_types")


def test_a_stream_item_the_target_does_not_accept_is_rejected():
    _fails(_typed_linear(double={"stream_types": [TENSOR, STR]}), "accumulate", "carries builtins.str")


def test_a_path_that_is_no_class_is_rejected():
    _fails(_typed_linear(encode={"result_type": "omnistage.testing.toy:encode"}), "encode", "is not a class")


def test_a_typed_fan_in_needs_merge_fn_to_return_its_payload_type():
    build_topology(_edit(toy.omni_config(), thinker={"payload_type": TENSOR}))
    _fails(_edit(toy.omni_config(), thinker={"payload_type": STR}), "thinker", "merge_fn must annotate its return")


async def test_a_stage_whose_result_is_not_its_declared_type_fails_the_request():
    config = _typed_linear(encode={"result_type": OBJECT}, double={"payload_type": OBJECT, "result_type": STR},
                           accumulate={"payload_type": STR})
    async with Pipeline(config) as pipeline:
        with pytest.raises(StageFailureError) as info:
            await pipeline.submit(toy.ToyRequest("abc")).result()
        assert info.value.stage == "double" and "result is int, but it declares builtins.str" in str(info.value)
        await assert_no_request_state(pipeline)


async def test_a_stage_streaming_an_undeclared_item_fails_the_request():
    config = _typed_linear(double={"stream_types": [STR]}, accumulate={"accepts_stream_types": [STR]})
    async with Pipeline(config) as pipeline:
        with pytest.raises(StageFailureError, match="stream item is Tensor, but it declares builtins.str"):
            await pipeline.submit(toy.ToyRequest("abc")).result()
        await assert_no_request_state(pipeline)


async def test_typed_edges_pass_what_they_declare():
    async with Pipeline(_typed_linear()) as pipeline:
        result = await pipeline.submit(toy.ToyRequest("hello")).result()
        assert result.outputs["accumulate"] == toy.expected_linear("hello")[1]
        await assert_no_request_state(pipeline)


async def test_a_request_that_is_no_pipeline_request_is_refused_at_submission():
    async with Pipeline(_typed_linear()) as pipeline:
        with pytest.raises(TypeError, match="must be a PipelineRequest, got dict"):
            pipeline.submit({"text": "hello"})
        await assert_no_request_state(pipeline)
        result = await pipeline.submit(toy.ToyRequest("hello")).result()
        assert result.outputs["accumulate"] == toy.expected_linear("hello")[1]
