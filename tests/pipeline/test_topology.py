"""Build-time validation: every misconfiguration fails at start-up, naming the stage."""

import pytest

from omnistage.config.pipeline import FactoryConfig, PipelineConfig, StageConfig
from omnistage.core.errors import PipelineConfigError
from omnistage.pipeline.pipeline import build_topology
from omnistage.testing import toy


def _edit(config: PipelineConfig, stage: str, **changes) -> PipelineConfig:
    data = config.model_dump()
    for s in data["stages"]:
        if s["name"] == stage:
            s.update(changes)
    return PipelineConfig.model_validate(data)


def _fails(config: PipelineConfig, stage: str, text: str) -> None:
    with pytest.raises(PipelineConfigError) as info:
        build_topology(config)
    assert info.value.stage == stage, str(info.value)
    assert text in str(info.value)


def test_valid_topologies_build():
    build_topology(toy.linear_config())
    build_topology(toy.omni_config())


def test_unknown_fields_are_rejected():
    with pytest.raises(ValueError, match="nexts"):
        StageConfig(name="a", factory=FactoryConfig(path="x:y"), nexts=["b"])


def test_next_and_terminal_are_exclusive():
    _fails(_edit(toy.linear_config(), "double", terminal=True), "double", "exactly one")
    _fails(_edit(toy.linear_config(), "accumulate", terminal=False), "accumulate", "exactly one")


def test_unknown_reference_names_stage():
    _fails(_edit(toy.linear_config(), "encode", next=["dubble"]), "encode", "unknown stage 'dubble'")
    _fails(_edit(toy.omni_config(), "thinker", stream_to=["talkr"]), "thinker", "unknown stage 'talkr'")


def test_hooks_only_where_meaningful():
    hook = "omnistage.testing.toy:omni_route_thinker"
    _fails(_edit(toy.linear_config(), "encode", merge_fn=hook), "encode", "need `wait_for`")
    _fails(_edit(toy.linear_config(), "encode", stream_done_to_fn=hook), "encode", "needs `stream_to`")
    _fails(_edit(toy.linear_config(), "encode", can_accept_stream_before_payload=True), "encode", "no stage streams")


def test_fan_in_must_wait_for_all_predecessors():
    _fails(_edit(toy.omni_config(), "thinker", wait_for=["preprocessing", "image_encoder"]), "thinker", "must equal")
    _fails(_edit(toy.omni_config(), "thinker", wait_for=[], wait_for_fn=None, merge_fn=None), "thinker", "several predecessors")


def test_cycle_and_unreachable_stage_are_rejected():
    _fails(_edit(toy.linear_config(), "accumulate", terminal=False, next=["double"], can_accept_stream_before_payload=True),
           "double", "")
    config = toy.linear_config()
    data = config.model_dump()
    data["stages"].append({"name": "orphan", "factory": {"path": "omnistage.testing.toy:tag"}, "terminal": True})
    _fails(PipelineConfig.model_validate(data), "orphan", "unreachable")


def test_unresolvable_hook_names_stage():
    _fails(_edit(toy.omni_config(), "thinker", route_fn="omnistage.testing.toy:nope"), "thinker", "no callable 'nope'")


def test_consistency_check_catches_hooks_that_disagree():
    # The thinker waits for the image encoder even when the request has no image: it would hang.
    bad_wait = _edit(toy.omni_config(), "thinker", wait_for_fn="omnistage.testing.toy:omni_route_preprocessing")
    _fails(bad_wait, "thinker", "must choose from")
    waits_all = _edit(toy.omni_config(), "thinker", wait_for_fn="omnistage.testing.toy:omni_wait_all")
    _fails(waits_all, "thinker", "waits for ['audio_encoder', 'image_encoder', 'preprocessing'] but receives")
    # Terminal set disagrees with the routes for text-only requests.
    data = toy.omni_config().model_dump()
    data["terminal_stages_fn"] = None
    _fails(PipelineConfig.model_validate(data), "code2wav", "terminal_stages_fn gives")
    # The thinker always routes to the talker but only streams to it for audio requests.
    always_talker = _edit(toy.omni_config(), "thinker", route_fn=None)
    with pytest.raises(PipelineConfigError) as info:
        build_topology(always_talker)
    assert info.value.stage in {"thinker", "code2wav"}
    # The thinker streams to the talker for text-only requests, where the talker is never reached.
    streams_always = _edit(toy.omni_config(), "thinker", stream_done_to_fn=None)
    _fails(streams_always, "thinker", "stream targets this request reaches")


INPUT_TEXT = ["omnistage.core.payloads:InputText"]


def test_one_stage_at_most_takes_client_input():
    config = _edit(_edit(toy.linear_config(), "encode", accepts_client_input=INPUT_TEXT), "double", accepts_client_input=INPUT_TEXT)
    _fails(config, "double", "only one stage may take client input")
    topology = build_topology(_edit(toy.linear_config(), "double", accepts_client_input=INPUT_TEXT, can_accept_stream_before_payload=True))
    assert topology.client_input_stage == "double"
    assert build_topology(toy.linear_config()).client_input_stage is None


def test_no_stage_may_be_named_like_the_clients_stream_source():
    _fails(_edit(toy.linear_config(), "accumulate", name="client"), "client", "the client's stream source")
