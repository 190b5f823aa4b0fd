"""The Qwen3-Omni thinker and talker each on a CUDA stream of its own (``own_stream``,
docs/engine.md "Own stream"): the reproducer of the hang of commit ``debf0be`` (every engine
thread and the vocoder thread stuck in a CUDA synchronize at concurrency 8). Every wait is
bounded; one that runs out fails the test with every thread's stack (also written straight
to the process's stderr, past pytest's capture, so a run killed while a hung pipeline stops
still shows them).

Engines (the tiny checkpoint's thinker and talker, bf16, graphs captured by this thread
before either runs, as a pipeline's start-up does): each driven by its own thread with all
its requests given at once, so its batches, hence its graph buckets and rounding, are the
same however the two threads interleave; every request must equal the engine run alone,
and the thinker's hidden rows, copied by the talker's thread and dropped at once (the
allocator may then reuse their memory), must equal the rows of the run alone.

Pipeline (the seven stages, several rounds of concurrent spoken replies):

Equality: with one request per engine at a time (``max_num_seqs`` 1) every request runs
alone in each engine, whatever the timing, so its greedy reply and audio do not depend on the
streams; with own streams they must equal the one-stream run's, request by request (text
tokens exactly, audio to 1e-4: code2wav, fp32 without TF32, batches the live streams by
timing). With batching (``max_num_seqs`` 16 at concurrency 16) which requests share a step
depends on timing and a bf16 step's rounding on its batch bucket, so there every request is
checked to end with its text and audio, not against another run."""

from __future__ import annotations

import asyncio
import queue
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from omnistage.core.payloads import AudioChunk
from omnistage.engine.engine import AREngine
from omnistage.engine.sequence import GenerationInput
from omnistage.models.qwen3_omni.config import Qwen3OmniPipelineConfig
from omnistage.models.qwen3_omni.engine_model import TalkerEngineModel, ThinkerEngineModel
from omnistage.models.qwen3_omni.modeling.model import LoadedOmni
from omnistage.models.qwen3_omni.payload_types import (
    ChatText,
    OmniSampling,
    Qwen3OmniRequest,
    TalkerSampling,
)
from omnistage.models.qwen3_omni.processing import ChatMessage, ChatPart
from omnistage.models.qwen3_omni.stages import (
    engine_config,
    loaded_model,
    talker_graph_sampling,
    talker_sampling_params,
    talker_step_rows,
    thinker_graph_sampling,
    thinker_sampling,
)
from omnistage.pipeline.pipeline import Pipeline
from omnistage.testing.waits import thread_stacks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

MAX_TOKENS, MAX_FRAMES = 12, 40
ROUND_TIMEOUT_S = 60.0  # a round of 16 tiny requests takes a few seconds on the H200
CUDA = torch.device("cuda")
ENGINE_REQUESTS, ENGINE_ROUNDS = 8, 3


@pytest.fixture(scope="module")
def model(omni_tiny_checkpoint: Path) -> LoadedOmni:
    """The tiny thinker and talker as the colocated stages load them (shared, fused, bf16)."""
    return loaded_model(str(omni_tiny_checkpoint), CUDA, "dummy", ("thinker", "talker"))


def engines(model: LoadedOmni, own_stream: bool) -> tuple[AREngine, AREngine]:
    """The thinker's and the talker's engines as their stages build them (8 sequences)."""
    assert model.thinker is not None and model.talker is not None
    layers = (0, model.config.talker.accept_hidden_layer)
    thinker = AREngine(ThinkerEngineModel(model.thinker, layers),
                       engine_config(ENGINE_REQUESTS, None, 1024, True, thinker_graph_sampling(model.config.im_end_id),
                                     own_stream=own_stream))  # fmt: skip
    talker = AREngine(TalkerEngineModel(model.talker),
                      engine_config(ENGINE_REQUESTS, None, 1024, True, talker_graph_sampling(model.talker),
                                    talker_step_rows(ENGINE_REQUESTS), own_stream=own_stream))  # fmt: skip
    assert (thinker.stream is not None, talker.stream is not None) == (own_stream, own_stream)
    assert thinker.graphs is not None and talker.graphs is not None
    assert thinker.graphs.capture_stream != talker.graphs.capture_stream
    return thinker, talker


def thinker_requests(model: LoadedOmni) -> list[GenerationInput]:
    """Greedy replies (stopping at ``<|im_end|>`` or 16 tokens) to prompts of 6..13 seeded ids,
    with the hidden rows the talker reads."""
    assert model.thinker is not None
    g = torch.Generator().manual_seed(0)
    vocab = model.thinker.lm_head.weight.shape[0]
    sampling = thinker_sampling(OmniSampling(), model.config.im_end_id)
    return [GenerationInput(torch.randint(0, vocab, (6 + i,), generator=g), sampling, 16, return_hidden=True)
            for i in range(ENGINE_REQUESTS)]  # fmt: skip


def talker_requests(model: LoadedOmni) -> list[GenerationInput]:
    """Greedy talker requests of 24 frames from seeded prompts of 10..17 rows, every step row
    given (none waits for one)."""
    assert model.talker is not None
    spec = TalkerEngineModel(model.talker).spec
    code0, predictor = talker_sampling_params(model.talker, TalkerSampling.greedy(), 0)
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(ENGINE_REQUESTS):
        rows = 0.02 * torch.randn(10 + i + 24, spec.hidden_size, generator=g)
        rows = rows.to(CUDA, torch.bfloat16)
        out.append(GenerationInput(rows[: 10 + i], code0, 24, step_rows=rows[10 + i :], pad_embed=rows[0],
                                   predictor_sampling=predictor))  # fmt: skip
    return out


def drive(engine: AREngine, requests: list[GenerationInput], name: str, rows: queue.Queue | None,
          copy_rows: queue.Queue | None, into: dict[str, object]) -> None:  # fmt: skip
    """Run ``requests`` (ids ``name.i``) to their end on ``engine``; the codes go to ``into``
    by id, the hidden rows handed out to ``rows``. After each step it copies the rows found in
    ``copy_rows`` (:func:`copy_rows_in`)."""
    for i, inputs in enumerate(requests):
        engine.add_request(f"{name}.{i}", inputs)
    while engine.has_work():
        for out in engine.step():
            if rows is not None and out.hidden is not None:
                rows.put((out.request_id, out.hidden))
            if out.result is not None:
                into[out.request_id] = out.result.codes
        if copy_rows is not None:
            copy_rows_in(copy_rows, into)


def copy_rows_in(rows: queue.Queue, into: dict[str, object]) -> None:
    """Copy every row tensor waiting in ``rows`` on this thread's stream into ``into`` (a list
    per request id) and drop it at once, as the talker's feed does with the thinker's rows:
    its memory may go back to the allocator before the copy ran on the device."""
    while not rows.empty():
        request_id, hidden = rows.get()
        into.setdefault(f"rows {request_id}", []).append(hidden.clone())
        del hidden


def request(i: int) -> Qwen3OmniRequest:
    """Request ``i``: its own text (distinct prompts, so a mix-up between requests shows),
    greedy thinker and talker."""
    text = f"Say something nice about the number {i}."
    messages = (ChatMessage("user", (ChatPart("text", text=text),)),)
    return Qwen3OmniRequest(messages, True, "ethan", OmniSampling(), MAX_TOKENS, MAX_FRAMES,
                            stream=True, talker_sampling=TalkerSampling.greedy())  # fmt: skip


def config_for(checkpoint: Path, own_stream: bool, max_num_seqs: int) -> Qwen3OmniPipelineConfig:
    config = Qwen3OmniPipelineConfig.for_model_path(str(checkpoint), load_format="dummy")
    for name in ("thinker", "talker"):
        stage = config.stage(name)
        stage.factory.args = {**stage.factory.args, "own_stream": own_stream,
                              "max_num_seqs": max_num_seqs, "max_model_len": 1024}  # fmt: skip
    code2wav = config.stage("code2wav")
    code2wav.factory.args = {**code2wav.factory.args, "num_slots": 16}
    return config


async def one(pipeline: Pipeline, req: Qwen3OmniRequest) -> tuple[torch.Tensor, np.ndarray]:
    """The request's reply token ids and its streamed audio."""
    handle = pipeline.submit(req)
    pieces = [c.data.samples async for c in handle.stream() if isinstance(c.data, AudioChunk)]
    result = await handle.result()
    text: ChatText = result.outputs["decode"]
    return text.token_ids, np.concatenate(pieces) if pieces else np.zeros(0, np.float32)


def serve_rounds(
    config: Qwen3OmniPipelineConfig, concurrency: int, rounds: int
) -> list[tuple[torch.Tensor, np.ndarray]]:
    """``rounds`` rounds of ``concurrency`` requests at once (request ``i`` of each round is
    :func:`request`'s ``i``); fails with the thread stacks when a round does not end within
    :data:`ROUND_TIMEOUT_S`."""

    async def run() -> list[tuple[torch.Tensor, np.ndarray]]:
        outputs: list[tuple[torch.Tensor, np.ndarray]] = []
        async with Pipeline(config) as pipeline:
            for number in range(rounds):
                calls = asyncio.gather(*(one(pipeline, request(i)) for i in range(concurrency)))
                try:
                    outputs += await asyncio.wait_for(calls, ROUND_TIMEOUT_S)
                except TimeoutError:
                    pytest.fail(
                        f"round {number} of {concurrency} requests did not end within "
                        f"{ROUND_TIMEOUT_S:.0f} s; thread stacks:\n{thread_stacks()}"
                    )
        return outputs

    return asyncio.run(run())


def run_alone(model: LoadedOmni, thinker: AREngine, talker: AREngine) -> dict[str, object]:
    """Each engine's requests run on this thread, the thinker's then the talker's."""
    got: dict[str, object] = {}
    rows: queue.Queue = queue.Queue()
    drive(thinker, thinker_requests(model), "thinker", rows, None, got)
    drive(talker, talker_requests(model), "talker", None, rows, got)
    copy_rows_in(rows, got)
    return got


def run_together(model: LoadedOmni, thinker: AREngine, talker: AREngine) -> dict[str, object]:
    """The thinker and the talker each on a thread of its own at once, the talker's thread
    copying the thinker's rows as they come (and after its own requests ended, the rest)."""
    got: dict[str, object] = {}
    rows: queue.Queue = queue.Queue()
    failures: list[BaseException] = []
    thinker_done = threading.Event()

    def guarded(run) -> None:
        try:
            run()
        except BaseException as exc:  # noqa: BLE001 -- reported to the test's thread
            failures.append(exc)

    def run_thinker() -> None:
        try:
            drive(thinker, thinker_requests(model), "thinker", rows, None, got)
        finally:
            thinker_done.set()

    def run_talker() -> None:
        drive(talker, talker_requests(model), "talker", None, rows, got)
        assert thinker_done.wait(ROUND_TIMEOUT_S), "the thinker's thread did not end"
        copy_rows_in(rows, got)  # the rows left

    threads = [
        threading.Thread(target=guarded, args=(run,), daemon=True)
        for run in (run_thinker, run_talker)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(ROUND_TIMEOUT_S)
    if any(thread.is_alive() for thread in threads):
        pytest.fail(
            f"the engines' threads did not end within {ROUND_TIMEOUT_S:.0f} s; stacks:\n{thread_stacks()}"
        )
    assert not failures, failures
    return got


def assert_same(got: dict[str, object], alone: dict[str, object], what: str) -> None:
    assert got.keys() == alone.keys(), what
    for key, value in alone.items():
        other = got[key]
        if isinstance(value, list):  # a request's hidden rows, in order
            assert len(other) == len(value) and all(
                torch.equal(a, b) for a, b in zip(other, value, strict=True)
            ), (what, key)
        else:
            assert torch.equal(other, value), (what, key)


def test_thinker_and_talker_engines_on_their_own_streams_equal_them_run_alone(
    model: LoadedOmni,
) -> None:
    one_stream = engines(model, own_stream=False)
    own = engines(model, own_stream=True)  # every graph captured before any engine runs
    alone = run_alone(model, *one_stream)
    assert sum(key.startswith("rows ") for key in alone) == ENGINE_REQUESTS
    for number in range(ENGINE_ROUNDS):
        assert_same(run_together(model, *one_stream), alone, f"one stream, round {number}")
        assert_same(run_together(model, *own), alone, f"own streams, round {number}")


@pytest.fixture
def no_tf32(monkeypatch: pytest.MonkeyPatch) -> None:
    """code2wav (fp32) and the engines' fp32 parts in true fp32, so a batch's size changes
    no rounding beyond fp32's."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)


def test_own_streams_at_concurrency_8_equal_one_stream_request_by_request(
    omni_tiny_checkpoint: Path, no_tf32: None
) -> None:
    one_stream = serve_rounds(config_for(omni_tiny_checkpoint, False, 1), concurrency=8, rounds=2)
    own = serve_rounds(config_for(omni_tiny_checkpoint, True, 1), concurrency=8, rounds=2)
    for index, ((tokens, audio), (own_tokens, own_audio)) in enumerate(
        zip(one_stream, own, strict=True)
    ):
        assert tokens.numel() >= 2 and audio.size > 0, index
        assert torch.equal(own_tokens, tokens), (index, own_tokens.tolist(), tokens.tolist())
        assert own_audio.shape == audio.shape, index
        np.testing.assert_allclose(own_audio, audio, rtol=0, atol=1e-4, err_msg=f"request {index}")


def test_own_streams_with_batching_at_concurrency_16_end_every_request(
    omni_tiny_checkpoint: Path, no_tf32: None
) -> None:
    outputs = serve_rounds(config_for(omni_tiny_checkpoint, True, 16), concurrency=16, rounds=3)
    assert len(outputs) == 48
    for index, (tokens, audio) in enumerate(outputs):
        assert tokens.numel() >= 2 and audio.size > 0 and np.isfinite(audio).all(), index
