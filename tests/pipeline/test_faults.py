"""The fault-injection hook (``OMNISTAGE_FAULTS``, :mod:`omnistage.scheduling.faults`):
each fault a stage can have (raise, CUDA OOM simulated on CPU, hang past the deadline,
death of its process) surfaces as its typed error, frees every request's state, and
the pipeline serves the next request (after a restart, for a killed process)."""

import asyncio

import pytest
import torch

from omnistage.core.errors import PipelineUnhealthyError, RequestTimeoutError, StageFailureError
from omnistage.pipeline.pipeline import Pipeline
from omnistage.scheduling.faults import FAULTS_ENV, Fault, FaultInjector, parse_faults
from omnistage.testing import toy
from omnistage.testing.leaks import assert_no_request_state

pytestmark = pytest.mark.anyio


def test_the_grammar():
    assert parse_faults("double:raise@3, vocoder:hang=2.5~0.1,engine:kill@1,x:oom~1") == [
        Fault("double", "raise", nth=3),
        Fault("vocoder", "hang", probability=0.1, hang_s=2.5),
        Fault("engine", "kill", nth=1),
        Fault("x", "oom", probability=1.0),
    ]
    for bad in ("double:explode@1", "double:raise", "double:hang@1", "double:raise=2@1"):
        with pytest.raises(ValueError, match=FAULTS_ENV):
            parse_faults(bad)


def test_a_kill_is_refused_for_a_stage_in_the_server_process(monkeypatch):
    monkeypatch.setenv(FAULTS_ENV, "double:kill@1")
    with pytest.raises(ValueError, match="server process"):
        FaultInjector.from_env("double")
    assert FaultInjector.from_env("encode") is None  # names another stage


def test_probabilistic_faults_are_repeatable():
    def fired(seed: str, monkeypatch) -> list[int]:
        monkeypatch.setenv("OMNISTAGE_FAULTS_SEED", seed)
        injector = FaultInjector("s", parse_faults("s:raise~0.3"))
        out = []
        for n in range(50):
            try:
                injector.before_batch()
            except RuntimeError:
                out.append(n)
        return out

    with pytest.MonkeyPatch.context() as mp:
        first, again, other = fired("1", mp), fired("1", mp), fired("2", mp)
    assert first == again and first != other and 5 < len(first) < 30


@pytest.mark.parametrize(
    ("kind", "error"), [("raise", RuntimeError), ("oom", torch.OutOfMemoryError)]
)
async def test_a_raising_stage_fails_its_batch_and_serving_goes_on(monkeypatch, kind, error):
    monkeypatch.setenv(FAULTS_ENV, f"double:{kind}@1")
    async with Pipeline(toy.linear_config()) as pipeline:
        with pytest.raises(StageFailureError, match=error.__name__):
            await pipeline.submit(toy.ToyRequest("abc")).result()
        result = await pipeline.submit(toy.ToyRequest("abc")).result()
        assert result.outputs["accumulate"] == toy.expected_linear("abc")[1]
        await assert_no_request_state(pipeline)


async def test_a_stage_hanging_past_the_deadline_times_the_request_out(monkeypatch):
    monkeypatch.setenv(FAULTS_ENV, "double:hang=1.5@1")
    async with Pipeline(toy.linear_config(request_timeout_s=0.3)) as pipeline:
        with pytest.raises(RequestTimeoutError):
            await asyncio.wait_for(pipeline.submit(toy.ToyRequest("abc")).result(), 5)
        # the next request waits for the hung batch to end, then is served
        result = await pipeline.submit(toy.ToyRequest("abc"), timeout_s=10).result()
        assert result.outputs["accumulate"] == toy.expected_linear("abc")[1]
        await assert_no_request_state(pipeline)


async def test_a_killed_stage_process_fails_its_requests_and_is_restarted(monkeypatch):
    monkeypatch.setenv(FAULTS_ENV, "double:kill@1")
    config = toy.linear_config(
        {"double": "engine"}, process_death_timeout_s=0.4, stage_restart_backoff_s=1.0
    )
    async with Pipeline(config) as pipeline:
        with pytest.raises(PipelineUnhealthyError, match="engine"):
            await asyncio.wait_for(pipeline.submit(toy.ToyRequest("abc")).result(), 10)
        monkeypatch.delenv(FAULTS_ENV)  # the restarted process starts without the fault
        with pytest.raises(PipelineUnhealthyError) as refused:
            pipeline.submit(toy.ToyRequest("abc"))
        assert refused.value.retry_after_s is not None and pipeline.down == {"engine": ["double"]}
        deadline = asyncio.get_running_loop().time() + 60
        while not pipeline.healthy:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.05)
        result = await pipeline.submit(toy.ToyRequest("abc")).result()
        assert result.outputs["accumulate"] == toy.expected_linear("abc")[1]
        await assert_no_request_state(pipeline)


def test_a_replacement_process_gets_the_messages_queued_before_its_stages_existed():
    """A restarted stage process receives what was queued for the dead one as soon as its
    transport starts: those messages are held until its stages are built, then delivered in
    order (an abort before a late payload of the same request, so the payload is dropped)."""
    from omnistage.core.messages import Abort, StagePayload
    from omnistage.pipeline.host import StageHost
    from omnistage.pipeline.transport import Envelope

    class Recorder:
        def __init__(self) -> None:
            self.got: list[object] = []

        def deliver(self, message, source) -> None:
            self.got.append(message)

    host = StageHost(
        "engine", {"double": "engine"}, coordinator_sink=lambda e: None, hold_until_built=True
    )
    host.on_message(Envelope("abort", None, "main", "r1"), "r1")
    host.on_message(Envelope("stage", "double", "encode", "r1"), StagePayload("r1", None, None))
    stage = Recorder()
    host.stages["double"] = stage
    assert stage.got == []
    host.stages_built()
    assert [type(m) for m in stage.got] == [Abort, StagePayload]
    host.on_message(Envelope("abort", None, "main", "r2"), "r2")  # afterwards: at once
    assert stage.got[-1] == Abort("r2")


def test_control_messages_reach_the_control_handler_at_once_by_class():
    """A stage process still building its stages answers control messages (a stop, a
    state query) at once: only stage and abort messages are held; the handler gets the
    typed message itself, and an envelope of an unknown kind does not decode."""
    import msgspec

    from omnistage.pipeline.control import StateQuery, Stop
    from omnistage.pipeline.host import StageHost
    from omnistage.pipeline.transport import Envelope

    host = StageHost("engine", {"double": "engine"}, coordinator_sink=lambda e: None, hold_until_built=True)
    got: list[object] = []
    host.on_control = got.append
    host.on_message(Envelope("control"), StateQuery("t1"))
    host.on_message(Envelope("control"), Stop())
    assert got == [StateQuery("t1"), Stop()]
    with pytest.raises(msgspec.ValidationError, match="Invalid enum value 'state_query'"):
        msgspec.msgpack.decode(msgspec.msgpack.encode(["state_query", "", "", "", {}]), type=Envelope)
